"""ag_gemm, gemm_rs and gemm_ar with FP8 operands (ScaledFp8, both scalings) under gloo with 2 and 4 CPU processes
(ag_gemm also 1: a gathered operand of one shard),
against the float64 product of the dequantized operands (every rank quantizes its own shard, as a layer would: its own
tensorwise scale, its own 1x128 blocks; the reference dequantizes each rank's operands with that rank's scales).

`off` is the reference strategy (on CPU: the float64 product of the dequantized operands, rounded once); `signal`
runs the FP8 signaled GEMM in the Triton interpreter over the real plans with the real transfers (the gathered rows
as bytes and the scales ahead of the first chunk; the per-group bf16 reduce-scatters and all-reduces).

Tolerances, per element, with P_r = rank r's float64 partial product (gemm_rs / gemm_ar: over its K shard; ag_gemm:
one rank's whole K), P = sum_r P_r, ref = P + bias and S = sum_k |a_ik| |w_jk| of the dequantized operands:
    |out - ref| <= 2**-7 (|ref| + |P| + sum_r |P_r| + |bias|) + 2**-15 S
- 2**-7 |x| per bf16 rounding of a value x (2**-8 for round-to-nearest; the interpreter's conversion may truncate):
  each partial once (gemm_rs / gemm_ar; one rank's product for ag_gemm), with the bias where an epilogue adds it
  (signal: the owning rank's partial, P_r + bias), the reduction's sum once (gloo sums in fp32 and rounds once), the
  bias's addition once where it is added to the bf16 product (off);
- 2**-15 S: the fp32 accumulation of exact products (an fp8 x fp8 product is exact in fp32) over K <= 512, at most
  K * 2**-24 * S; blockwise adds one fp32 rounding per 128 of K with the scales, inside the same bound.
A wrong scale, block, shard or row errs by the size of the element itself (about S / sqrt(K), far above the bound)."""
import pytest
import torch
import torch.distributed as dist

from overlap_tp import OverlapConfig, ag_gemm, gemm_ar, gemm_rs
from overlap_tp.kernels import fp8_quant as Q
from overlap_tp.ops import ag_gemm as ag, gemm_ar as ar, gemm_rs as rs
from overlap_tp.ops.plan_base import cached_plan, operand_plan_args
from distributed import run_distributed
from problems import assert_each_raises

RECIPES = {"tensorwise": (Q.quantize_tensorwise_reference, Q.quantize_tensorwise_reference),
           "blockwise": (Q.quantize_1x128_reference, Q.quantize_128x128_reference)}
FP8_TILES = dict(block_m=16, block_n=32, block_k=128)   # small tiles for the interpreter; blockwise needs block_k 128
CONFIGS = [OverlapConfig(method="off"),
           OverlapConfig(method="signal", groups=2, **FP8_TILES),
           OverlapConfig(method="signal", groups="auto", **FP8_TILES)]
TENSORWISE_K32 = OverlapConfig(method="signal", groups=3, block_m=16, block_n=32, block_k=32)   # tensorwise only


def _data(seed, rows, n, k, bias):
    """bf16 x[rows, k] whose rows differ in magnitude (so ranks' amaxes and blocks' scales differ), w[n, k], bias[n]."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=g) * torch.exp(torch.randn(rows, 1, generator=g))).to(torch.bfloat16)
    w = (0.05 * torch.randn(n, k, generator=g)).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    return x, w, b


def _assert_close(got, ref, product, partials, s, what):
    assert not got.isnan().any(), (what, "an output element was never written")
    bias = (ref - product).abs()
    bound = 2 ** -7 * (ref.abs() + product.abs() + sum(p.abs() for p in partials) + bias) + 2 ** -15 * s
    err = (got.double() - ref).abs()
    assert (err <= bound).all(), (what, int((err > bound).sum()), float((err - bound).max()))


def _ag_case(t, m, n, k, recipe, bias, seed):
    """Every rank's shard quantized on its own, w quantized, bias; the reference and its terms."""
    qa, qw = RECIPES[recipe]
    x, w, b = _data(seed, t * m, n, k, bias)
    shards = [qa(s.contiguous()) for s in x.chunk(t)]
    w8 = qw(w)
    dw = Q.dequantize_reference(w8)
    da = torch.cat([Q.dequantize_reference(s) for s in shards])
    product = da @ dw.t()
    ref = product + (b.double() if bias else 0)
    return shards, w8, b, ref, product, da.abs() @ dw.abs().t()


def _check_ag(rank, world):
    for m, n, k in ((16, 64, 256), (17, 48, 128)):   # 17: odd rows per rank (the shards end inside a tile)
        for recipe in RECIPES:
            configs = CONFIGS + ([TENSORWISE_K32] if recipe == "tensorwise" else [])
            for bias in (False, True):
                for call, config in enumerate(configs):   # fresh operands (and scales) every call
                    shards, w8, b, ref, product, s = _ag_case(world, m, n, k, recipe, bias, seed=97 * m + 7 * call + bias)
                    what = (recipe, m, n, k, bias, config)
                    out, gathered = ag_gemm(shards[rank], w8, bias=b, config=config, return_gathered=True)
                    assert out.shape == (world * m, n) and out.dtype == torch.bfloat16, what
                    _assert_close(out, ref, product, [product], s, what)
                    # the gathered input: every rank's rows and its own scales, stacked (fp8_quant's gathered layout)
                    assert gathered.scaling == shards[0].scaling and Q.shard_count(gathered) == world, what
                    assert torch.equal(gathered.q.view(torch.uint8), torch.cat([x.q for x in shards]).view(torch.uint8))
                    stack = torch.cat if recipe == "tensorwise" else torch.stack
                    assert torch.equal(gathered.ds, stack([x.ds for x in shards])), what
                    del gathered
                    # a repeated call (the flags lowered, the epoch on): the same bits
                    assert torch.equal(ag_gemm(shards[rank], w8, bias=b, config=config), out), what
    # the plan is the FP8 strategy's, named so, and a bf16 call of the same shape gets a plan of its own
    shards, w8, b, *_ = _ag_case(world, 16, 64, 256, "blockwise", True, seed=1)
    plan = ag.ag_gemm_plan(shards[rank], w8, config=CONFIGS[1])
    assert type(plan) is ag.AgGemmSignaledNcclFp8
    assert plan.describe() == (f"ag_gemm(M=16, N=64, K=256, t={world}, signal/nccl, fp8 e4m3 1x128 x e4m3 128x128)")
    assert plan.config.block_k == 128 and plan.config.num_warps == 4   # FP8_TILES' blockwise where the config leaves it
    assert type(ag.ag_gemm_plan(shards[rank], w8, config=CONFIGS[0])) is ag.AgGemmOffFp8
    x, w, _ = _data(3, world * 16, 64, 256, False)
    bf16 = ag_gemm(x.chunk(world)[rank].contiguous(), w, config=CONFIGS[1])
    assert bf16.shape == (world * 16, 64)
    assert type(ag.ag_gemm_plan(x.chunk(world)[rank].contiguous(), w, config=CONFIGS[1])) is ag.AgGemmSignaledNccl


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ag_gemm_fp8_matches_the_dequantized_reference(world):
    run_distributed(world, _check_ag)


def _reduction_case(t, m, n, k_local, recipe, bias, seed):
    """Every rank's K shard of a and w quantized on its own; the reference (bias once) and its terms."""
    qa, qw = RECIPES[recipe]
    x, w, b = _data(seed, m, n, t * k_local, bias)
    a8 = [qa(p.contiguous()) for p in x.chunk(t, dim=1)]
    w8 = [qw(p.contiguous()) for p in w.chunk(t, dim=1)]
    da = [Q.dequantize_reference(p) for p in a8]
    dw = [Q.dequantize_reference(p) for p in w8]
    partials = [a @ v.t() for a, v in zip(da, dw)]
    product = sum(partials)
    s = sum(a.abs() @ v.abs().t() for a, v in zip(da, dw))
    return a8, w8, b, product + (b.double() if bias else 0), product, partials, s


def _check_reductions(rank, world):
    configs = CONFIGS + [OverlapConfig(method="signal", schedule="tile_exact", groups=2, **FP8_TILES)]
    for m_local, n, k_local in ((16, 64, 128), (17, 48, 256)):
        m = world * m_local
        rows = slice(rank * m_local, (rank + 1) * m_local)
        for recipe in RECIPES:
            for bias in (False, True):
                for call, config in enumerate(configs):
                    if config.schedule == "tile_exact" and m_local % 16:
                        continue
                    a8, w8, b, ref, product, partials, s = _reduction_case(world, m, n, k_local, recipe, bias,
                                                                           seed=31 * m + 5 * call + bias)
                    what = (recipe, m, n, k_local, bias, config)
                    got = gemm_rs(a8[rank], w8[rank], bias=b, config=config)
                    assert got.shape == (m_local, n) and got.dtype == torch.bfloat16, what
                    _assert_close(got, ref[rows], product[rows], [p[rows] for p in partials], s[rows], what)
                    assert torch.equal(gemm_rs(a8[rank], w8[rank], bias=b, config=config), got), what
                    pending = gemm_rs(a8[rank], w8[rank], bias=b, config=config, async_op=True)
                    assert torch.equal(pending.wait(), got), what
                    got = gemm_ar(a8[rank], w8[rank], bias=b, config=config)
                    assert got.shape == (m, n), what
                    _assert_close(got, ref, product, partials, s, what)
    # gemm_ar needs no M divisible by t: an odd M
    a8, w8, b, ref, product, partials, s = _reduction_case(world, 45, 48, 128, "blockwise", True, seed=4)
    for config in CONFIGS:
        _assert_close(gemm_ar(a8[rank], w8[rank], bias=b, config=config), ref, product, partials, s, ("M=45", config))
    # the plans are the FP8 strategies'
    a8, w8, *_ = _reduction_case(world, 16 * world, 48, 128, "tensorwise", False, seed=5)
    for op, config, strategy in ((rs.GemmRS, CONFIGS[0], rs.GemmRSOffFp8), (rs.GemmRS, CONFIGS[1], rs.GemmRSSignaledNcclFp8),
                                 (ar.GemmAR, CONFIGS[0], ar.GemmAROffFp8), (ar.GemmAR, CONFIGS[1], ar.GemmARSignaledNcclFp8)):
        m, n, k, dtype, device, fp8 = operand_plan_args(a8[rank], w8[rank])
        assert type(cached_plan(op, dist.group.WORLD, m, n, k, dtype, device, config, fp8=fp8)) is strategy


@pytest.mark.parametrize("world", [2, 4])
def test_gemm_rs_and_gemm_ar_fp8_match_the_dequantized_reference(world):
    run_distributed(world, _check_reductions)


def _check_split(rank, world):
    """ag_gemm's start()/finish() with FP8 operands: two plans' transfers issued before either GEMM, each half bit for
    bit the plan's own call; a bf16 shard is refused."""
    config = CONFIGS[1]
    cases = [_ag_case(world, 16, 64, 256, recipe, True, seed=60 + h) for h, recipe in enumerate(RECIPES)]
    plans = [ag.AgGemm(None, 16, 64, 256, torch.bfloat16, "cpu", config,
                       fp8=operand_plan_args(shards[rank], w8)[5]) for shards, w8, *_ in cases]
    started = [plan.start(shards[rank]) for plan, (shards, *_) in zip(plans, cases)]
    for plan, begun, (shards, w8, b, *_) in zip(plans, started, cases):
        out = plan.finish(begun, w8, b)
        assert torch.equal(out, plan(shards[rank], w8, b))
    with pytest.raises(ValueError, match="a must be a ScaledFp8"):
        plans[0].start(torch.zeros(16, 256, dtype=torch.bfloat16))


def test_split_start_finish_with_fp8_operands():
    run_distributed(2, _check_split)


def _check_errors(rank, world):
    shards, w8, b, *_ = _ag_case(world, 16, 64, 256, "blockwise", True, seed=8)
    a8 = shards[rank]
    t8 = Q.quantize_tensorwise_reference(torch.randn(16, 256))
    tw8 = Q.quantize_tensorwise_reference(torch.randn(64, 256))
    signal = CONFIGS[1]
    assert_each_raises([
        (lambda: ag_gemm(a8, torch.randn(64, 256).to(torch.bfloat16)), "ScaledFp8"),
        (lambda: gemm_rs(a8.q, w8), "ScaledFp8"),
        (lambda: ag_gemm(a8, tw8), r"unsupported scaling pair \('1x128', 'tensorwise'\)"),
        (lambda: ag_gemm(a8, w8, bias=b.float()), "the bias is torch.bfloat16"),
        (lambda: ag_gemm(Q.ScaledFp8(a8.q, a8.ds.view(1, 2, 16).repeat(2, 1, 1)[:, :, :8].contiguous(), "1x128"), w8),
         "scales must be its own"),
        (lambda: ag_gemm(a8, w8, config=OverlapConfig(method="decompose")),
         "method='decompose' .* has no FP8 strategy; use method='signal'"),
        (lambda: gemm_rs(a8, w8, config=OverlapConfig(method="decompose", chunks=2)), "no FP8 strategy"),
        (lambda: gemm_ar(a8, w8, config=OverlapConfig(method="decompose")), "no FP8 strategy"),
        (lambda: ag_gemm(a8, w8, config=OverlapConfig(method="signal", block_m=16, block_n=32, block_k=64)),
         "needs block_k=128, the config has block_k=64"),
        (lambda: ag_gemm(Q.quantize_tensorwise_reference(torch.randn(16, 40)),
                         Q.quantize_tensorwise_reference(torch.randn(64, 40)), config=signal),
         "K=40 is not a multiple of 16"),
        (lambda: ag_gemm(a8, w8, config=OverlapConfig(method="signal", transport="p2p")), "needs CUDA tensors"),
        (lambda: gemm_rs(a8, w8, config=OverlapConfig(method="signal", transport="p2p")), "needs CUDA tensors"),
    ])
    # a plan called with other operands than it was built for
    plan = ag.ag_gemm_plan(a8, w8, config=signal)
    assert_each_raises([
        (lambda: plan(t8, tw8), "the plan was built for a\\[16, 256\\] ds\\(2, 16\\)"),
        (lambda: plan(a8, Q.quantize_128x128_reference(torch.randn(64, 256), "e5m2")), "the plan was built for"),
        (lambda: plan(a8, w8, torch.zeros(63, dtype=torch.bfloat16)), "bias"),
    ])
    # the off strategy on CPU with method 'auto': the resolver's warning, the off strategy's result
    with pytest.warns(UserWarning, match="method='auto' runs 'off'"):
        got = ag_gemm(a8, w8, bias=b)
    assert torch.equal(got, ag_gemm(a8, w8, bias=b, config=CONFIGS[0]))
    # ranks that pass other scalings disagree on fp8, by name
    mine = (a8, w8) if rank == 0 else (t8, tw8)
    with pytest.raises(ValueError, match="disagree on fp8"):
        gemm_rs(*mine, config=OverlapConfig(method="off"))


def test_fp8_misuse_is_named():
    run_distributed(2, _check_errors)
