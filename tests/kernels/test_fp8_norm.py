"""The fused add + RMSNorm's FP8 output (kernels/fp8_norm.py) in the CPU interpreter: bit-equal to the reference
quantizer applied to the y the norm stored, both scalings, with and without a residual, in the tile-exact input
order; y, the residual and rstd unchanged by the FP8 output."""
import pytest
import torch

from overlap_tp.kernels import fp8_quant as Q
from overlap_tp.kernels.fp8_norm import add_rmsnorm_fp8
from overlap_tp.kernels.fused_add_rmsnorm import (NormFp8Out, TileOrder, check_fp8_out, empty_forward_outputs,
                                                  launch_forward)


def _inputs(m, n, gen):
    x = (torch.randn(m, n, generator=gen) * 3).to(torch.bfloat16)
    residual = torch.randn(m, n, generator=gen).to(torch.bfloat16)
    weight = (1 + 0.3 * torch.randn(n, generator=gen)).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    return x, residual, weight, bias


def _equal_bits(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("scaling", ["1x128", "tensorwise"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("m,n,ordered", [(33, 256, False), (32, 384, False), (32, 256, True), (16, 128, False)])
def test_fp8_output_is_the_reference_quantizer_of_the_stored_y(scaling, fmt, m, n, ordered):
    gen = torch.Generator().manual_seed(m * n)
    x, residual, weight, bias = _inputs(m, n, gen)
    order = None
    if ordered:
        slot_of = torch.randperm((m // 16) * (n // 64), generator=gen).to(torch.int32).reshape(m // 16, n // 64)
        order = TileOrder(16, 64, slot_of)
    plain = empty_forward_outputs(x, residual, torch.bfloat16)
    launch_forward(order.apply(x).reshape(m, n) if ordered else x, residual, weight, bias, plain, eps=1e-5,
                   x_order=order)
    out, q = add_rmsnorm_fp8(order.apply(x).reshape(m, n) if ordered else x, residual, weight, bias, scaling=scaling,
                             fmt=fmt, x_order=order)
    assert torch.equal(out.y, plain.y) and torch.equal(out.residual_out, plain.residual_out)
    assert torch.equal(out.rstd, plain.rstd)
    quantize = Q.quantize_1x128_reference if scaling == "1x128" else Q.quantize_tensorwise_reference
    ref = quantize(out.y, fmt)
    assert q.scaling == ref.scaling and torch.equal(q.ds, ref.ds)
    assert _equal_bits(q.q, ref.q)


def test_plain_norm_and_q_out_take_the_gather_buffer():
    gen = torch.Generator().manual_seed(2)
    x, _, weight, _ = _inputs(24, 256, gen)
    for scaling in ("1x128", "tensorwise"):
        buffer = torch.empty(24, 256, dtype=torch.float8_e4m3fn)
        out, q = add_rmsnorm_fp8(x, None, weight, scaling=scaling, q_out=buffer)
        assert q.q.data_ptr() == buffer.data_ptr()
        ref = (Q.quantize_1x128_reference if scaling == "1x128" else Q.quantize_tensorwise_reference)(out.y)
        assert _equal_bits(buffer, ref.q) and torch.equal(q.ds, ref.ds)


def test_bad_fp8_outputs_are_refused():
    y = torch.empty(8, 200, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 128"):
        check_fp8_out(NormFp8Out("1x128", torch.empty(8, 200, dtype=torch.float8_e4m3fn), torch.empty(1, 8)), y)
    y = torch.empty(8, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="scales"):
        check_fp8_out(NormFp8Out("1x128", torch.empty(8, 256, dtype=torch.float8_e4m3fn), torch.empty(8, 2)), y)
    with pytest.raises(ValueError, match="q must"):
        check_fp8_out(NormFp8Out("1x128", torch.empty(8, 256, dtype=torch.bfloat16), torch.empty(2, 8)), y)
    with pytest.raises(ValueError, match="amax"):
        check_fp8_out(NormFp8Out("amax", amax=torch.zeros(2)), y)
    with pytest.raises(ValueError, match="scaling must be"):
        add_rmsnorm_fp8(y, None, torch.ones(256, dtype=torch.bfloat16), scaling="rowwise")


@pytest.mark.parametrize("scaling", ["1x128", "tensorwise"])
def test_the_norms_fp8_copy_travels_on_its_output_and_is_refused_once_stale(scaling):
    """overlap_tp.megatron.norm: rmsnorm / fused_add_rmsnorm with fp8=Fp8Output write the output's FP8 copy in their
    pass; fp8_rows hands it over once, bit-equal to quantizing the output afterwards, and refuses it (None) for
    another format or scaling, after the output was written in place, or on a tensor that carries none."""
    from overlap_tp.megatron.norm import Fp8Output, fp8_rows, fused_add_rmsnorm, rmsnorm
    gen = torch.Generator().manual_seed(7)
    x, residual, weight, bias = _inputs(32, 256, gen)
    x3, residual3 = x.view(16, 2, 256), residual.view(16, 2, 256)   # [s, b, h] as the layers see them
    quantize = Q.quantize_1x128 if scaling == "1x128" else Q.quantize_tensorwise
    plain = rmsnorm(x3, weight, fp8=Fp8Output("e4m3", scaling))
    fused, _ = fused_add_rmsnorm(x3, residual3, weight, bias, fp8=Fp8Output("e4m3", scaling))
    for y in (plain, fused):
        got, want = fp8_rows(y, "e4m3", scaling), quantize(y.reshape(-1, 256), "e4m3")
        assert got.scaling == want.scaling and _equal_bits(got.q, want.q) and torch.equal(got.ds, want.ds)
        assert fp8_rows(y, "e4m3", scaling) is None   # taken once: the output no longer keeps it alive
    assert torch.equal(plain, rmsnorm(x3, weight))   # the FP8 copy changes nothing of the output
    assert fp8_rows(rmsnorm(x3, weight), "e4m3", scaling) is None
    other = "tensorwise" if scaling == "1x128" else "1x128"
    for fmt, wanted in (("e5m2", scaling), ("e4m3", other)):
        assert fp8_rows(rmsnorm(x3, weight, fp8=Fp8Output("e4m3", scaling)), fmt, wanted) is None
    written = rmsnorm(x3, weight, fp8=Fp8Output("e4m3", scaling))
    written.add_(1)
    assert fp8_rows(written, "e4m3", scaling) is None
