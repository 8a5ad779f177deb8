"""The FP8 signaled GEMM in the CPU interpreter: every scaling against the float64 product of the dequantized
operands, on the bf16 kernel's tile plans (reordered staging, ready-flag waits, peer-buffer stores), with the
signal counts checked; and its input contract."""
import pytest
import torch

from overlap_tp import OverlapConfig
from overlap_tp.kernels import fp8_quant as Q
from overlap_tp.kernels.fp8_gemm import check_fp8_operands, fp8_gemm_reference, fp8_signaled_gemm
from overlap_tp.ops.tile_plan import ag_plan, make_plan, p2p_plan
from problems import staged_as_rows

TENSORWISE = OverlapConfig(block_m=16, block_n=32, block_k=32)
BLOCKWISE = OverlapConfig(block_m=16, block_n=32, block_k=128)
RECIPES = {
    "tensorwise": (Q.quantize_tensorwise, Q.quantize_tensorwise, TENSORWISE),
    "1x128x128x128": (Q.quantize_1x128, Q.quantize_128x128, BLOCKWISE),
    "1x128x1x128": (Q.quantize_1x128, Q.quantize_1x128, BLOCKWISE),
}


def _operands(m, n, k, recipe, gen, fmt_a="e4m3"):
    qa, qw, config = RECIPES[recipe]
    a = (torch.randn(m, k, generator=gen) * torch.exp(torch.randn(m, 1, generator=gen))).to(torch.bfloat16)
    # each 128x128 block of w its own power-of-two magnitude: a scale taken from the wrong weight block is far off
    blocks = 2.0 ** torch.randint(-3, 4, (-(-n // 128), -(-k // 128)), generator=gen)
    w = (torch.randn(n, k, generator=gen) * 0.05 * blocks.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k])
    return qa(a, fmt_a), qw(w.to(torch.bfloat16)), config


def _check_close(got, ref, a, w):
    """One bf16 ulp of the output (2**-7 relative: the interpreter's bf16 conversion may truncate) plus the fp32
    accumulation's error, bounded by 2**-20 * (|A| @ |W|.T) per element (the interpreter multiplies fp32 upcasts:
    exact products)."""
    da = Q.dequantize_reference(a)   # a gathered a shard by shard
    bound = ref.abs() * 2 ** -7 + 2 ** -20 * (da.abs() @ Q.dequantize_reference(w).abs().t())
    err = (got.double() - ref).abs()
    assert (err <= bound + 1e-30).all(), float((err - bound).max())


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("m,n,k", [(96, 80, 256), (40, 64, 128), (32, 320, 384)])
def test_row_slice_staging_holds_the_scaled_product_and_counts_each_group(recipe, m, n, k):
    gen = torch.Generator().manual_seed(m + n + k)
    a, w, config = _operands(m, n, k, recipe, gen)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    ref = fp8_gemm_reference(a, w)
    ref[: m // 2] += bias.double()   # the bias on rows [0, m/2) only
    plan = make_plan("row_slice", m, n, 2, config.block_m, config.block_n, groups=3)
    counters = torch.zeros(plan.num_groups, dtype=torch.int32)
    for calls in (1, 2):
        staging = torch.full(plan.staging_shape, float("nan"), dtype=torch.bfloat16)
        fp8_signaled_gemm(a, w, staging, plan.tiles, counters, 3, config, bias=bias, bias_rows=(0, m // 2))
        assert counters.tolist() == [calls * g for g in plan.group_tiles]
        got = staged_as_rows(staging, plan)
        assert not got.isnan().any(), "an output element was never written"
        _check_close(got, ref, a, w)


def gathered(x, t, quantize):
    """x's t row shards quantized each on its own (as their ranks would) and gathered: the rows concatenated, the
    scales stacked (tensorwise [t]; 1x128 [t, K/128, M/t])."""
    shards = [quantize(s.contiguous()) for s in x.chunk(t)]
    ds = torch.cat([s.ds for s in shards]) if shards[0].scaling == "tensorwise" else torch.stack([s.ds for s in shards])
    return Q.ScaledFp8(torch.cat([s.q for s in shards]), ds, shards[0].scaling)


@pytest.mark.parametrize("t, m", [(2, 64), (4, 72)])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_allgather_plan_waits_on_raised_flags_and_per_shard_scales(recipe, t, m):
    """The AllGather+GEMM table (WAIT fields, flags already raised): the standard-order output, the gathered A
    carrying each source rank's own scales (each shard quantized on its own, its amax its own; at M/t = 18 the
    shards' rows end inside a tile), and the same product as the shards' GEMMs one by one."""
    gen = torch.Generator().manual_seed(5 + t)
    n, k = 96, 256
    qa, qw, config = RECIPES[recipe]
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    x[m // 2:] *= 30   # the later shards' amax differs
    w = qw((torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16))
    a = gathered(x, t, qa)
    assert Q.shard_count(a) == t and Q.is_gathered(a)
    assert torch.equal(Q.dequantize_reference(a), torch.cat([Q.dequantize_reference(s) for s in Q.shards(a)]))
    plan = ag_plan(m, n, k, t, 0, config.block_m, config.block_n, groups=2, elem_bytes=1)
    flags = torch.ones(plan.num_groups, dtype=torch.int32)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    fp8_signaled_gemm(a, w, out, plan.tiles, None, 3, config, flags=flags, wait_target=1)
    assert not out.isnan().any()
    _check_close(out, fp8_gemm_reference(a, w), a, w)


def test_p2p_plan_stores_into_every_owners_buffer():
    """Two ranks emulated in one process: each rank's K-shard partial (blockwise, K-split at a 128 boundary) goes
    region by region into the owners' buffers at their offsets; the slot sums are the full product."""
    gen = torch.Generator().manual_seed(9)
    t, m, n, k = 2, 64, 64, 512
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    wf = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    buffers = [torch.full((m, n), float("nan"), dtype=torch.bfloat16) for _ in range(t)]
    ref = 0
    for rank in range(t):
        shard = slice(rank * k // t, (rank + 1) * k // t)
        a, w = Q.quantize_1x128(x[:, shard].contiguous()), Q.quantize_128x128(wf[:, shard].contiguous())
        ref = ref + fp8_gemm_reference(a, w)
        offsets = torch.tensor([(b.data_ptr() - buffers[rank].data_ptr()) // 2 for b in buffers], dtype=torch.int64)
        plan = p2p_plan(m, n, t, rank, BLOCKWISE.block_m, BLOCKWISE.block_n)
        fp8_signaled_gemm(a, w, buffers[rank], plan.tiles, torch.zeros(1, dtype=torch.int32), 3, BLOCKWISE,
                          dst_offsets=offsets)
    for rank in range(t):
        got = buffers[rank].view(t, m // t, n).double().sum(0)
        want = ref[rank * m // t:(rank + 1) * m // t]
        assert float((got - want).norm() / want.norm()) < 2 ** -7


def test_e5m2_gradient_times_e4m3_weight():
    """hybrid: an e5m2 gradient times an e4m3 operand."""
    gen = torch.Generator().manual_seed(13)
    a, w, config = _operands(48, 64, 256, "1x128x128x128", gen, fmt_a="e5m2")
    plan = ag_plan(48, 64, 256, 1, 0, config.block_m, config.block_n)
    out = torch.full((48, 64), float("nan"), dtype=torch.bfloat16)
    fp8_signaled_gemm(a, w, out, plan.tiles, None, 3, config)
    _check_close(out, fp8_gemm_reference(a, w), a, w)


def test_the_contract_is_checked():
    gen = torch.Generator().manual_seed(1)
    a, w, config = _operands(32, 64, 256, "1x128x128x128", gen)
    with pytest.raises(ValueError, match="block_k"):
        check_fp8_operands(a, w, TENSORWISE)
    with pytest.raises(ValueError, match="scaling pair"):
        check_fp8_operands(a, Q.quantize_tensorwise(torch.randn(64, 256)), config)
    with pytest.raises(ValueError, match="K-major"):
        check_fp8_operands(a, Q.ScaledFp8(w.q.t().contiguous().t(), w.ds, w.scaling), config)
    with pytest.raises(ValueError, match="stored"):
        check_fp8_operands(Q.ScaledFp8(a.q, a.ds.t(), a.scaling), w, config)
    with pytest.raises(ValueError, match=r"M % G == 0"):   # 1x128 scales of 3 shards for 32 rows
        check_fp8_operands(Q.ScaledFp8(a.q, a.ds.view(2, 32).repeat(3, 1).view(3, 2, 32)[:, :, :10].contiguous(),
                                       a.scaling), w, config)
    with pytest.raises(ValueError, match="ScaledFp8"):
        check_fp8_operands(a.q, w, config)
    t = Q.quantize_tensorwise(torch.randn(30, 256))
    with pytest.raises(ValueError, match="M % G"):
        check_fp8_operands(Q.ScaledFp8(t.q, torch.ones(4), "tensorwise"), Q.quantize_tensorwise(torch.randn(8, 256)),
                           TENSORWISE)
