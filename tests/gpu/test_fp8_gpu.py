"""FP8 on one GPU: the quantizers bit-equal to their references (the GPU's own fp8 conversion, subnormals, NaN and
zero blocks included), and the FP8 signaled GEMM against the float64 product of the dequantized operands at many
shapes with fresh random data, on the bf16 kernel's plans, with the signal counts checked.

Run: `pytest -m gpu tests/gpu/test_fp8_gpu.py` on one GPU (Hopper: FP8 wgmma)."""
import pytest
import torch

from gpu_checks import poison_allocator
from overlap_tp import OverlapConfig
from overlap_tp.kernels import fp8_quant as Q
from overlap_tp.kernels.fp8_gemm import fp8_gemm_reference, fp8_signaled_gemm
from overlap_tp.ops.plan_base import gemm_programs
from overlap_tp.ops.tile_plan import ag_plan, make_plan
from problems import staged_as_rows

pytestmark = pytest.mark.gpu

# FP8 tiles: 128 x 256 x 128 (the wide tile) and 128 x 128 x 128; blockwise needs block_k = 128
# comm_sms: the grid the dense ops leave NCCL (gemm_programs reads it)
WIDE = OverlapConfig(block_m=128, block_n=256, block_k=128, num_stages=3, num_warps=8, comm_sms=16)
NARROW = OverlapConfig(block_m=128, block_n=128, block_k=128, num_stages=4, num_warps=8, comm_sms=16)
# (M, N, K): layer-like shapes, M not a multiple of the tile, N not a multiple of 256, K of several sizes
SHAPES = [(4096, 3072, 4096), (8192, 1536, 2048), (2000, 1000, 1024), (1040, 4096, 640), (256, 128, 128),
          (3000, 2560, 8192)]
RECIPES = {"tensorwise": (Q.quantize_tensorwise, Q.quantize_tensorwise),
           "1x128x128x128": (Q.quantize_1x128, Q.quantize_128x128),
           "1x128x1x128": (Q.quantize_1x128, Q.quantize_1x128)}


def _needs_fp8():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FP8 wgmma needs compute capability 9.0 (Hopper) or newer")


def _assert_fp8_equal(got, ref):
    nan = ref.float().isnan()
    assert torch.equal(got.float().isnan(), nan)
    same = got.view(torch.uint8) == ref.view(torch.uint8)
    assert same[~nan].all(), f"{int((~same[~nan]).sum())} fp8 values differ"


def _spread(r, c, gen):
    """bf16 data over many binades per row (so every block has values deep in the fp8 subnormal range), with a
    zero block, a NaN and an inf."""
    x = torch.randn(r, c, device="cuda", generator=gen) * torch.exp(4 * torch.randn(r, 1, device="cuda", generator=gen))
    x = x * torch.exp(3 * torch.rand(r, c, device="cuda", generator=gen) - 3)
    x = x.bfloat16()
    x[0, :128] = 0
    if r > 2:
        x[1, 5] = float("nan")
        x[2, c - 1] = float("inf")
    return x


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("r,c", [(8192, 4096), (1000, 640), (128, 128), (4096, 1536)])
def test_quantizers_are_bit_equal_to_their_references(fmt, r, c):
    _needs_fp8()
    gen = torch.Generator(device="cuda").manual_seed(r + c)
    x = _spread(r, c, gen)
    got, ref = Q.quantize_1x128(x, fmt), Q.quantize_1x128_reference(x, fmt)
    assert torch.equal(got.ds.nan_to_num(-1), ref.ds.nan_to_num(-1))
    _assert_fp8_equal(got.q, ref.q)
    if r % 128 == 0:
        got = Q.quantize_1x128_transposed(x, fmt)
        ref = Q.quantize_1x128_reference(x.t().contiguous(), fmt)
        assert torch.equal(got.ds.nan_to_num(-1), ref.ds.nan_to_num(-1))
        _assert_fp8_equal(got.q, ref.q)
    finite = x.nan_to_num(0.0, posinf=0.0)
    ref = Q.quantize_tensorwise_reference(finite, fmt)
    for got, want in zip(Q.quantize_tensorwise(finite, fmt, transposed=True), (ref.q, ref.q.t())):
        assert torch.equal(got.ds, ref.ds)
        _assert_fp8_equal(got.q, want)
    got, ref = Q.quantize_128x128(x, fmt), Q.quantize_128x128_reference(x, fmt)
    assert torch.equal(got.ds.nan_to_num(-1), ref.ds.nan_to_num(-1))
    _assert_fp8_equal(got.q, ref.q)


def _operands(m, n, k, recipe, gen, shard_scales=1):
    qa, qw = RECIPES[recipe]
    x = torch.randn(m, k, device="cuda", generator=gen) * torch.exp(torch.randn(m, 1, device="cuda", generator=gen))
    w = 0.02 * torch.randn(n, k, device="cuda", generator=gen)
    x, w = x.bfloat16(), w.bfloat16()
    if shard_scales > 1:   # a gathered a: each shard quantized on its own, the scales stacked (fp8_quant's layouts)
        shards = [qa(s.contiguous()) for s in x.chunk(shard_scales)]
        stack = torch.cat if recipe == "tensorwise" else torch.stack
        a = Q.ScaledFp8(torch.cat([s.q for s in shards]), stack([s.ds for s in shards]), shards[0].scaling)
    else:
        a = qa(x)
    return a, qw(w)


def assert_fp8_gemm_close(got, a, w, added=None):
    """Per element: the bf16 rounding of the output (2**-8 relative) plus the accumulation's error, at most 2**-9 of
    sum_k |a_ik| |w_jk| (Hopper's FP8 wgmma accumulates with fewer than fp32's bits between promotions: Triton's
    default on sm_90 keeps the tensorwise K loop in the tensor core's accumulator; blockwise promotes every 128
    of K); and the whole product within 2**-8 (Frobenius, relative). A wrong scale, block or row errs by the size
    of the element itself. `added`: what the kernel added to the product (the bias on its rows)."""
    ref = fp8_gemm_reference(a, w)
    if added is not None:
        ref = ref + added.double()
    da, dw = Q.dequantize_reference(a), Q.dequantize_reference(w)
    bound = ref.abs() * 2 ** -8 + 2 ** -9 * (da.abs() @ dw.abs().t())
    err = (got.double() - ref).abs()
    assert not got.isnan().any(), "an output element was never written (NaN-poisoned)"
    assert (err <= bound).all(), f"{int((err > bound).sum())} elements out of bound, worst {float((err - bound).max())}"
    assert float(err.norm() / ref.norm()) < 2 ** -8


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("config", [WIDE, NARROW], ids=["128x256", "128x128"])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_signaled_fp8_gemm_row_slice_matches_the_float64_reference(recipe, config, m, n, k):
    """The GEMM+ReduceScatter staging at t = 2 (row-slice schedule, auto groups): every group's counter reaches its
    tile count per call (twice: the counts go on), the staged product is the reference's, and a second call stores
    the same bits."""
    _needs_fp8()
    if m % 2:
        pytest.skip("M must split into two regions")
    gen = torch.Generator(device="cuda").manual_seed(m * 3 + n * 5 + k)
    a, w = _operands(m, n, k, recipe, gen)
    bias = torch.randn(n, device="cuda", generator=gen).bfloat16()
    plan = make_plan("row_slice", m, n, 2, config.block_m, config.block_n)
    tiles = plan.tiles.cuda()
    counters = torch.zeros(plan.num_groups, dtype=torch.int32, device="cuda")
    programs = gemm_programs(a.q.device, config)
    stored = []
    for calls in (1, 2):
        poison_allocator()
        staging = torch.empty(plan.staging_shape, dtype=torch.bfloat16, device="cuda")
        fp8_signaled_gemm(a, w, staging, tiles, counters, programs, config, bias=bias, bias_rows=(0, m // 2))
        torch.cuda.synchronize()
        assert counters.tolist() == [calls * g for g in plan.group_tiles]
        stored.append(staging.clone())
    bias_on_rows = torch.zeros(m, n, device="cuda", dtype=torch.bfloat16)
    bias_on_rows[: m // 2] = bias
    assert_fp8_gemm_close(staged_as_rows(stored[0], plan), a, w, added=bias_on_rows)
    assert torch.equal(stored[0], stored[1])


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("m,n,k", [(8192, 3072, 4096), (2000, 1000, 1024)])
def test_allgather_plan_with_raised_flags_and_per_rank_scales(recipe, m, n, k):
    """The AllGather+GEMM table at t = 2 (rank 1: its own rows first, then the chunks, each waiting on its ready
    flag, raised before the launch); the gathered a carries each source rank's shard's own scales (tensorwise [2],
    1x128 [2, K/128, M/2]: the scales stacked as an AllGather moves them)."""
    _needs_fp8()
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    a, w = _operands(m, n, k, recipe, gen, shard_scales=2)
    plan = ag_plan(m, n, k, 2, 1, WIDE.block_m, WIDE.block_n, groups=4, elem_bytes=1)
    flags = torch.ones(plan.num_groups, dtype=torch.int32, device="cuda")
    poison_allocator()
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    fp8_signaled_gemm(a, w, out, plan.tiles.cuda(), None, gemm_programs(a.q.device, WIDE), WIDE, flags=flags,
                      wait_target=1)
    assert_fp8_gemm_close(out, a, w)


def test_fresh_data_each_call():
    """Five calls on one plan, each with freshly drawn operands (and scales): each matches its own reference."""
    _needs_fp8()
    gen = torch.Generator(device="cuda").manual_seed(0)
    m, n, k = 4096, 2048, 2048
    plan = make_plan("row_slice", m, n, 1, WIDE.block_m, WIDE.block_n)
    tiles = plan.tiles.cuda()
    for recipe in ("tensorwise", "1x128x128x128", "tensorwise", "1x128x1x128", "1x128x128x128"):
        a, w = _operands(m, n, k, recipe, gen)
        out = torch.full(plan.staging_shape, float("nan"), dtype=torch.bfloat16, device="cuda")
        fp8_signaled_gemm(a, w, out, tiles, None, gemm_programs(a.q.device, WIDE), WIDE)
        assert_fp8_gemm_close(staged_as_rows(out, plan), a, w)


@pytest.mark.parametrize("scaling", ["1x128", "tensorwise"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("rows,hidden", [(4096, 4096), (8192, 8192), (1000, 1536)])
def test_fused_norm_fp8_output_is_bit_equal_to_the_reference_quantizer(scaling, fmt, rows, hidden):
    """The fused add + RMSNorm's FP8 rows and scales equal the reference quantizer applied to the bf16 y it stored,
    bit for bit, and y, the residual and rstd are those of the norm without FP8 output."""
    _needs_fp8()
    from overlap_tp.kernels.fp8_norm import add_rmsnorm_fp8
    from overlap_tp.kernels.fused_add_rmsnorm import empty_forward_outputs, launch_forward
    gen = torch.Generator(device="cuda").manual_seed(rows + hidden)
    x = (3 * torch.randn(rows, hidden, device="cuda", generator=gen)).bfloat16()
    residual = torch.randn(rows, hidden, device="cuda", generator=gen).bfloat16()
    weight = (1 + 0.5 * torch.randn(hidden, device="cuda", generator=gen)).bfloat16()
    bias = (0.5 * torch.randn(hidden, device="cuda", generator=gen)).bfloat16()
    plain = empty_forward_outputs(x, residual, torch.bfloat16)
    launch_forward(x, residual, weight, bias, plain, eps=1e-5)
    out, q = add_rmsnorm_fp8(x, residual, weight, bias, scaling=scaling, fmt=fmt)
    assert torch.equal(out.y, plain.y) and torch.equal(out.residual_out, plain.residual_out)
    assert torch.equal(out.rstd, plain.rstd)
    ref = (Q.quantize_1x128_reference if scaling == "1x128" else Q.quantize_tensorwise_reference)(out.y, fmt)
    assert torch.equal(q.ds, ref.ds)
    _assert_fp8_equal(q.q, ref.q)


def test_scale_layouts_mean_to_cublas_what_they_mean_to_the_reference():
    """torch's scaled_mm (cuBLAS) given our scale views computes the product of our dequantized operands: the layouts
    agree in meaning, not only in shape (the CPU test checks the shapes through the meta kernel)."""
    _needs_fp8()
    import torch.nn.functional as F
    gen = torch.Generator(device="cuda").manual_seed(42)
    m, n, k = 1024, 768, 1280
    cases = [("tensorwise", F.ScalingType.TensorWise, F.ScalingType.TensorWise)]
    if hasattr(F.ScalingType, "BlockWise1x128"):
        cases += [("1x128x128x128", F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128),
                  ("1x128x1x128", F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise1x128)]
    for recipe, recipe_a, recipe_b in cases:
        a, w = _operands(m, n, k, recipe, gen)
        views = {"tensorwise": lambda s: s.reshape(()), "1x128": Q.scale_view_1x128, "128x128": Q.scale_view_128x128}
        try:
            got = F.scaled_mm(a.q, w.q.t(), views[a.scaling](a.ds), recipe_a, views[w.scaling](w.ds), recipe_b,
                              output_dtype=torch.bfloat16)
        except (RuntimeError, ValueError) as error:   # a cuBLAS without this blockwise pair: the layout cannot be checked here
            if recipe == "tensorwise":
                raise
            print(f"{recipe}: scaled_mm unavailable here: {error}")
            continue
        assert_fp8_gemm_close(got, a, w)


def test_captured_fp8_gemm_replays_count_and_store_the_same_bits():
    """The FP8 GEMM with its signal captured in a CUDA graph: each replay raises every group's counter by its tile
    count (a waiter resets them in the ops; here they count on) and stores the bits of the eager call; a replay after
    new operand values are copied into the captured tensors gives the new product."""
    _needs_fp8()
    gen = torch.Generator(device="cuda").manual_seed(3)
    m, n, k = 4096, 2048, 1024
    for recipe in ("tensorwise", "1x128x128x128"):
        a, w = _operands(m, n, k, recipe, gen)
        plan = make_plan("row_slice", m, n, 2, WIDE.block_m, WIDE.block_n)
        tiles = plan.tiles.cuda()
        counters = torch.zeros(plan.num_groups, dtype=torch.int32, device="cuda")
        out = torch.empty(plan.staging_shape, dtype=torch.bfloat16, device="cuda")
        programs = gemm_programs(a.q.device, WIDE)

        def call():
            fp8_signaled_gemm(a, w, out, tiles, counters, programs, WIDE)
        call()
        torch.cuda.synchronize()
        eager = out.clone()
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            call()   # warm on the side stream, as torch.cuda.graph asks
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            call()
        counters.zero_()
        out.fill_(float("nan"))
        for replays in (1, 2, 3):
            graph.replay()
            torch.cuda.synchronize()
            assert counters.tolist() == [replays * g for g in plan.group_tiles]
            assert torch.equal(out, eager)
        fresh_a, fresh_w = _operands(m, n, k, recipe, gen)
        for mine, new in ((a, fresh_a), (w, fresh_w)):
            mine.q.copy_(new.q)
            mine.ds.copy_(new.ds)
        graph.replay()
        torch.cuda.synchronize()
        assert_fp8_gemm_close(staged_as_rows(out, plan), a, w)
