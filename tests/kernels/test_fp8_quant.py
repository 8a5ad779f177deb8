"""The FP8 quantizers: their references' rules and scale layouts, and the Triton kernels (in the CPU interpreter)
against the references at many shapes with fresh data."""
import pytest
import torch
import torch.nn.functional as F

from overlap_tp.kernels import fp8_quant as Q

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _meta(t):
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def test_scales_from_amax_follow_the_stated_rules():
    amax = torch.tensor([0.0, 1.0, 448.0, 3.0, 1e-38, float("inf")])
    qs, ds = Q.scales_from_amax_reference(amax, E4M3)
    assert qs[0] == 1 and ds[0] == 1                           # all-zero block
    assert qs[1] == 448 and ds[1] == torch.tensor(1 / 448).float()
    assert qs[2] == 1 and ds[2] == 1
    assert qs[3] == torch.tensor(448 / 3).float()               # one fp32 rounding of the quotient
    assert qs[4] == Q.FLT_MAX                                  # tiny amax: clamped, finite
    assert qs[5].isnan() and ds[5].isnan()                      # non-finite block: NaN scales
    qs, _ = Q.scales_from_amax_reference(torch.tensor([2.0]), E5M2)
    assert qs[0] == 57344 / 2


def test_non_finite_and_zero_blocks():
    x = torch.randn(2, 256)
    x[0, 5] = float("nan")
    x[1, 128:] = 0
    q = Q.quantize_1x128_reference(x)
    ds = q.ds.t()   # [R, C/128]
    assert ds[0, 0].isnan() and q.q[0, :128].float().isnan().all()
    assert torch.isfinite(ds[0, 1]) and not q.q[0, 128:].float().isnan().any()
    assert ds[1, 1] == 1 and (q.q[1, 128:].float() == 0).all()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scaling", ["tensorwise", "1x128", "128x128"])
def test_dequantized_references_are_within_the_format_rounding(fmt, scaling):
    """|q * ds - x| <= half an fp8 ulp of the block's scaled value (relative 2**-4 for e4m3, 2**-3 for e5m2, where
    the scaled value is normal), or the subnormal step where it is not."""
    gen = torch.Generator().manual_seed(11)
    dtype = Q.FORMATS[fmt]
    x = (torch.randn(200, 384, generator=gen) * torch.rand(200, 1, generator=gen) * 10).to(torch.bfloat16)
    ref = {"tensorwise": Q.quantize_tensorwise_reference, "1x128": Q.quantize_1x128_reference,
           "128x128": Q.quantize_128x128_reference}[scaling](x, fmt)
    back = Q.dequantize_reference(ref)
    mant = {E4M3: 3, E5M2: 2}[dtype]
    subnormal_step = Q.FP8_MIN_NORMAL[dtype] * 2.0 ** -mant
    # the block's dequant scale of each element
    ds = Q.dequantize_reference(Q.ScaledFp8(torch.ones_like(ref.q), ref.ds, ref.scaling))
    bound = torch.maximum(x.double().abs() * 2.0 ** -(mant + 1), ds.abs() * subnormal_step / 2)
    assert ((back - x.double()).abs() <= bound * (1 + 1e-12) + 1e-300).all()


def test_scale_layouts_are_the_ones_scaled_mm_takes():
    """torch.nn.functional.scaled_mm's own size / stride checks (its meta kernel) accept our scale views for
    1x128 x 128x128 and 1x128 x 1x128 and tensorwise, and (torch < 2.14, whose meta kernel checks the scales'
    shapes) refuse a transposed layout."""
    st = F.ScalingType
    m, n, k = 256, 384, 640
    a = Q.quantize_1x128_reference(torch.randn(m, k))
    w = Q.quantize_128x128_reference(torch.randn(n, k))
    wg = Q.quantize_1x128_reference(torch.randn(n, k))
    sa = _meta(Q.scale_view_1x128(a.ds))
    out = F.scaled_mm(_meta(a.q), _meta(w.q).t(), sa, st.BlockWise1x128, _meta(Q.scale_view_128x128(w.ds)),
                      st.BlockWise128x128, output_dtype=torch.bfloat16)
    assert out.shape == (m, n)
    out = F.scaled_mm(_meta(a.q), _meta(wg.q).t(), sa, st.BlockWise1x128, _meta(Q.scale_view_1x128(wg.ds)),
                      st.BlockWise1x128, output_dtype=torch.bfloat16)
    assert out.shape == (m, n)
    ta, tw = Q.quantize_tensorwise_reference(torch.randn(m, k)), Q.quantize_tensorwise_reference(torch.randn(n, k))
    out = F.scaled_mm(_meta(ta.q), _meta(tw.q).t(), _meta(ta.ds.reshape(())), st.TensorWise,
                      _meta(tw.ds.reshape(())), st.TensorWise, output_dtype=torch.bfloat16)
    assert out.shape == (m, n)
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 14):   # torch 2.14's meta kernel no longer
        with pytest.raises(RuntimeError):                                      # checks the scales' shapes
            F.scaled_mm(_meta(a.q), _meta(w.q).t(), _meta(a.ds), st.BlockWise1x128,
                        _meta(Q.scale_view_128x128(w.ds)), st.BlockWise128x128, output_dtype=torch.bfloat16)


def test_blockwise_needs_whole_k_blocks():
    with pytest.raises(ValueError, match="multiple of 128"):
        Q.quantize_1x128_reference(torch.randn(4, 200))
    with pytest.raises(ValueError, match="multiple of 128"):
        Q.quantize_1x128(torch.randn(4, 200))
    with pytest.raises(ValueError, match="unknown FP8 format"):
        Q.quantize_tensorwise_reference(torch.randn(4, 128), "e3m4")


def _assert_fp8_equal(got, ref):
    """Bit-equal, NaN where the reference is NaN (the kernels write the interpreter's q through an exact rounding to
    the fp8 grid: kernels/fp8_quant.py, _interpreted_cast)."""
    nan = ref.float().isnan()
    assert torch.equal(got.float().isnan(), nan)
    same = got.view(torch.uint8) == ref.view(torch.uint8)
    assert same[~nan].all(), int((~same[~nan]).sum())


def _data(r, c, gen, dtype=torch.bfloat16):
    scale = torch.exp(torch.randn(r, 1, generator=gen) * 2)
    return (torch.randn(r, c, generator=gen) * scale).to(dtype)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("r,c", [(1, 128), (77, 256), (128, 384), (130, 128)])
def test_1x128_kernels_equal_the_reference(fmt, r, c):
    gen = torch.Generator().manual_seed(r * 1000 + c)
    for _ in range(2):   # fresh data each round
        x = _data(r, c, gen)
        got, ref = Q.quantize_1x128(x, fmt), Q.quantize_1x128_reference(x, fmt)
        assert got.ds.shape == ref.ds.shape == (c // 128, r)
        assert torch.equal(got.ds, ref.ds)
        _assert_fp8_equal(got.q, ref.q)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("r,c", [(128, 64), (256, 200), (384, 128)])
def test_transpose_quantize_equals_the_reference_of_the_transpose(fmt, r, c):
    gen = torch.Generator().manual_seed(r + c)
    x = _data(r, c, gen)
    got = Q.quantize_1x128_transposed(x, fmt)
    ref = Q.quantize_1x128_reference(x.t().contiguous(), fmt)
    assert got.q.shape == (c, r) and got.ds.shape == ref.ds.shape == (r // 128, c)
    assert torch.equal(got.ds, ref.ds)
    _assert_fp8_equal(got.q, ref.q)


@pytest.mark.parametrize("r,c", [(128, 128), (200, 256), (384, 640)])
def test_128x128_kernel_and_its_transpose_equal_the_references(r, c):
    gen = torch.Generator().manual_seed(r * 7 + c)
    w = _data(r, c, gen)
    got = Q.quantize_128x128(w)
    ref = Q.quantize_128x128_reference(w)
    assert torch.equal(got.ds, ref.ds)
    _assert_fp8_equal(got.q, ref.q)
    if r % 128 == 0:
        fwd, bwd = Q.quantize_128x128(w, transposed=True)
        ref_t = Q.quantize_128x128_reference(w.t().contiguous())
        assert torch.equal(fwd.q.view(torch.uint8), got.q.view(torch.uint8))
        assert torch.equal(bwd.ds, ref_t.ds)
        _assert_fp8_equal(bwd.q, ref_t.q)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("r,c", [(1, 16), (70, 96), (128, 256)])
def test_tensorwise_kernels_equal_the_reference(fmt, r, c):
    gen = torch.Generator().manual_seed(r + 3 * c)
    x = _data(r, c, gen)
    ref = Q.quantize_tensorwise_reference(x, fmt)
    got, got_t = Q.quantize_tensorwise(x, fmt, transposed=True)
    assert torch.equal(got.ds, ref.ds) and torch.equal(got_t.ds, ref.ds)
    _assert_fp8_equal(got.q, ref.q)
    _assert_fp8_equal(got_t.q, ref.q.t())
    alone = Q.quantize_tensorwise_transposed(x, fmt)   # x.T's q without x's
    assert torch.equal(alone.ds, ref.ds)
    _assert_fp8_equal(alone.q, ref.q.t())
    # a known amax skips the first pass and gives the same result
    amax = x.float().abs().amax().reshape(1)
    known = Q.quantize_tensorwise(x, fmt, amax=amax)
    assert torch.equal(known.q.view(torch.uint8), got.q.view(torch.uint8)) and torch.equal(known.ds, got.ds)


def test_kernels_keep_nan_and_zero_blocks():
    x = torch.randn(128, 256).to(torch.bfloat16)
    x[3, 7] = float("nan")
    x[5, 128:] = 0
    got, ref = Q.quantize_1x128(x), Q.quantize_1x128_reference(x)
    assert torch.equal(got.ds.isnan(), ref.ds.isnan())
    assert torch.equal(got.ds.nan_to_num(-1), ref.ds.nan_to_num(-1))
    _assert_fp8_equal(got.q, ref.q)
    got, ref = Q.quantize_tensorwise(x), Q.quantize_tensorwise_reference(x)
    assert got.ds.isnan().all() and ref.ds.isnan().all() and got.q.float().isnan().all()
