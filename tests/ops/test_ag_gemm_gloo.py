"""ag_gemm under gloo with 2 and 4 CPU processes against one dense single-process product.

`off` is the pure-torch reference; `decompose` checks the chunk addressing; `signal` runs the Triton
kernel in the CPU interpreter over the real plan (local rows first, each peer chunk behind its
ready flag) with the real per-chunk transfers (torch.distributed here)."""
import pytest
import torch

from overlap_tp import OverlapConfig, ag_gemm
from overlap_tp.ops.ag_gemm import AgGemm
from distributed import run_distributed
from problems import SMALL_TILES, assert_each_raises, dense_problem, rel_error

CONFIGS = [
    OverlapConfig(method="off"),
    OverlapConfig(method="decompose", chunks=3),
    OverlapConfig(method="signal", groups=2, **SMALL_TILES),
    OverlapConfig(method="signal", groups="auto", **SMALL_TILES),
]
SHAPES = [(64, 64, 32), (96, 80, 48), (40, 24, 16)]   # (M, N, K); M is split over the ranks


def _check(rank, world):
    for m, n, k in SHAPES:
        if m % world:
            continue
        for bias in (False, True):
            a, w, b = dense_problem(m, n, k, seed=m + n + k + bias, bias=bias)
            ref = a.double() @ w.double().t() + (b.double() if bias else 0)
            shard = a[rank * m // world:(rank + 1) * m // world].contiguous()
            for config in CONFIGS:
                out, gathered = ag_gemm(shard, w, bias=b, config=config, return_gathered=True)
                assert out.shape == (m, n) and out.dtype == torch.bfloat16
                assert torch.equal(gathered, a), (config, m, n, k)
                err = rel_error(out, ref)
                assert err < 1e-2, (config, m, n, k, bias, err)
                assert torch.equal(ag_gemm(shard, w, bias=b, config=config), out), "return_gathered changed out"
    # repeated calls move the ready flags' epoch on: every call must wait for its own chunks
    a, w, _ = dense_problem(64, 64, 32, seed=3, bias=False)
    shard = a[rank * 64 // world:(rank + 1) * 64 // world].contiguous()
    first = ag_gemm(shard, w, config=CONFIGS[2])
    for _ in range(3):
        assert torch.equal(ag_gemm(shard, w, config=CONFIGS[2]), first)
    # a plan resolves chunk_by 'auto' for its group (chunk_by_for: NCCL broadcasts cut by rows at any t)
    plan = AgGemm(None, 64 // world, 64, 32, torch.bfloat16, shard.device, CONFIGS[2])
    assert CONFIGS[2].chunk_by is None and plan.config.chunk_by == "rows"


@pytest.mark.parametrize("world", [2, 4])
def test_ag_gemm_matches_dense(world):
    run_distributed(world, _check)


def _check_bad_input(rank, world):
    a = torch.randn(32, 32).to(torch.bfloat16)
    w = torch.randn(48, 32).to(torch.bfloat16)
    cases = [
        (lambda: ag_gemm(a, w[:, :16].contiguous()), "inner dimensions"),
        (lambda: ag_gemm(a.float(), w.float()), "bf16 or fp16"),
        (lambda: ag_gemm(a.t(), w), "inner dimensions|contiguous"),
        (lambda: ag_gemm(a, w, bias=torch.zeros(47, dtype=torch.bfloat16)), "bias"),
        (lambda: ag_gemm(torch.randn(32, 12).to(torch.bfloat16), torch.randn(48, 12).to(torch.bfloat16),
                         config=OverlapConfig(method="signal")), "multiple of 8"),
        (lambda: ag_gemm(a, w, config=OverlapConfig(method="signal", groups=(1, 1, 1), **SMALL_TILES)), "sum to"),
        (lambda: ag_gemm(a, w, config=OverlapConfig(method="signal", transport="p2p")), "needs CUDA tensors"),
        (lambda: ag_gemm(a, w, config=OverlapConfig(method="signal", transport="p2p", comm_sms=16, copy_lanes=2)),
         "copy_lanes=2 splits the copy engines' pulls; with comm_sms=16 the pulls run on SMs"),
        (lambda: ag_gemm(a, w, config=OverlapConfig(method="decompose", transport="p2p")), "needs CUDA tensors"),
        # one copy per chunk from one peer: the copy engines' pulls only
        (lambda: ag_gemm(a, w, config=OverlapConfig(method="signal", chunk_by="peer", **SMALL_TILES)),
         "chunk_by='peer' .* needs transport='p2p'"),
        (lambda: ag_gemm(a, w, config=OverlapConfig(method="decompose", chunk_by="peer")),
         "chunk_by='peer' .* needs transport='p2p'"),
        (lambda: ag_gemm(a, w, config=OverlapConfig(method="signal", transport="p2p", chunk_by="peer",
                                                    comm_sms=16)), "chunk_by='peer'"),
    ]
    assert_each_raises(cases)
    with pytest.warns(UserWarning, match="method='auto' runs 'off'"):
        got = ag_gemm(a, w)
    assert torch.equal(got, ag_gemm(a, w, config=OverlapConfig(method="off")))


def test_bad_input_is_named():
    run_distributed(2, _check_bad_input)


def _check_split(rank, world):
    """start()/finish(): two plans of one shape, both halves' transfers issued before either GEMM (the token split's
    order), each half bit for bit the plan's own call; the misuses named."""
    from overlap_tp.ops.ag_gemm import AgGemm
    m, n, k = 64, 48, 32
    config = OverlapConfig(method="signal", groups=2, **SMALL_TILES)
    plans = [AgGemm(None, m // world, n, k, torch.bfloat16, "cpu", config) for _ in range(2)]
    for seed in range(2):   # twice: the ready flags lowered by the first finish()es
        problems = [dense_problem(m, n, k, seed=10 * seed + h, bias=True) for h in range(2)]
        shards = [a[rank * m // world:(rank + 1) * m // world].contiguous() for a, _, _ in problems]
        started = [plan.start(shard) for plan, shard in zip(plans, shards)]
        for h, (plan, (a, w, b)) in enumerate(zip(plans, problems)):
            out, gathered = plan.finish(started[h], w, b, return_gathered=True)
            assert torch.equal(gathered, a), (seed, h)
            assert torch.equal(out, plan(shards[h], w, b)), (seed, h)
    a, w, b = problems[0]
    plan = plans[0]
    first = plan.start(shards[0])
    with pytest.raises(RuntimeError, match="has not been finished"):
        plan.start(shards[0])
    with pytest.raises(RuntimeError, match="has not started"):
        plans[1].finish(first, w)
    plan.finish(first, w)
    with pytest.raises(RuntimeError, match="has not started"):
        plan.finish(first, w)
    off = AgGemm(None, m // world, n, k, torch.bfloat16, "cpu", OverlapConfig(method="off"))
    assert_each_raises([
        (lambda: off.start(shards[0]), "split the signaled AllGather"),
        (lambda: plan.start(shards[0][:-1].contiguous()), r"start\(\) with a contiguous"),
    ])


@pytest.mark.parametrize("world", [2, 4])
def test_split_start_finish_matches_the_call(world):
    run_distributed(world, _check_split)
