"""gemm_rs / gemm_ar under gloo with 2 and 4 CPU processes against one dense single-process product.

Every method runs here: `off` (the pure-torch reference), `decompose` (chunk addressing) and `signal`
(the Triton kernel in the CPU interpreter plus the real per-group collectives), for both schedules.
"""
import pytest
import torch
import torch.distributed as dist

from overlap_tp import OverlapConfig, gemm_ar, gemm_rs
from distributed import run_distributed
from problems import SMALL_TILES, assert_each_raises, dense_problem, rel_error

CONFIGS = [
    OverlapConfig(method="off"),
    OverlapConfig(method="decompose", chunks=3),
    OverlapConfig(method="signal", schedule="row_slice", groups=3, **SMALL_TILES),
    OverlapConfig(method="signal", schedule="row_slice", groups="auto", **SMALL_TILES),
    OverlapConfig(method="signal", schedule="tile_exact", groups=2, **SMALL_TILES),
]
SHAPES = [(64, 64, 32), (96, 96, 64)]   # (M, N, K); K is split over the ranks


def _check_ops(rank, world):
    for m, n, k in SHAPES:
        for bias in (False, True):
            a, w, b = dense_problem(m, n, k, seed=m + n + k + bias, bias=bias)
            ref = a.double() @ w.double().t() + (b.double() if bias else 0)
            shard = slice(rank * k // world, (rank + 1) * k // world)
            a_k, w_k = a[:, shard].contiguous(), w[:, shard].contiguous()
            rows = slice(rank * m // world, (rank + 1) * m // world)
            for config in CONFIGS:
                if config.schedule == "tile_exact" and (m // world) % 16:
                    continue
                got = gemm_rs(a_k, w_k, bias=b, config=config)
                assert got.shape == (m // world, n) and got.dtype == torch.bfloat16
                assert rel_error(got, ref[rows]) < 1e-2, (config, m, n, k, bias)
                if bias:   # async_op returns a Pending whose wait() gives the same bits
                    assert torch.equal(gemm_rs(a_k, w_k, bias=b, config=config, async_op=True).wait(), got)
                got = gemm_ar(a_k, w_k, bias=b, config=config)
                assert got.shape == (m, n)
                assert rel_error(got, ref) < 1e-2, (config, m, n, k, bias)
                if bias:
                    pending = gemm_ar(a_k, w_k, bias=b, config=config, async_op=True)
                    assert torch.equal(pending.wait(), got)
                    with pytest.raises(RuntimeError, match="called twice"):
                        pending.wait()
    # repeated calls reuse a plan's counters: every call must still see exactly its own tiles
    a, w, _ = dense_problem(64, 64, 32, seed=1, bias=False)
    shard = slice(rank * 32 // world, (rank + 1) * 32 // world)
    first = gemm_rs(a[:, shard].contiguous(), w[:, shard].contiguous(), config=CONFIGS[2])
    rows = slice(rank * 64 // world, (rank + 1) * 64 // world)
    assert rel_error(first, (a.double() @ w.double().t())[rows]) < 1e-2
    for _ in range(3):
        assert torch.equal(gemm_rs(a[:, shard].contiguous(), w[:, shard].contiguous(), config=CONFIGS[2]), first)
    # a plan resolves rs_transfer 'auto' for its group (rs_transfer_for: NCCL's collectives are the epilogue's case)
    from overlap_tp.ops.gemm_rs import GemmRS
    plan = GemmRS(dist.group.WORLD, 64, 64, 32 // world, torch.bfloat16, "cpu", CONFIGS[2])
    assert CONFIGS[2].rs_transfer is None and plan.config.rs_transfer == "epilogue"


@pytest.mark.parametrize("world", [2, 4])
def test_ops_match_dense(world):
    run_distributed(world, _check_ops)


def _check_bad_input(rank, world):
    a = torch.randn(64, 32).to(torch.bfloat16)
    w = torch.randn(48, 32).to(torch.bfloat16)
    cases = [
        (lambda: gemm_rs(a[:63], w), "not divisible by the group size"),
        (lambda: gemm_rs(a, w[:, :16].contiguous()), "inner dimensions"),
        (lambda: gemm_rs(a.float(), w.float()), "bf16 or fp16"),
        (lambda: gemm_rs(a, w.half()), "bf16 or fp16"),
        (lambda: gemm_rs(a.t(), w[:, :32]), "inner dimensions|contiguous"),
        (lambda: gemm_rs(torch.randn(64, 64).to(torch.bfloat16)[:, :36], torch.randn(48, 36).to(torch.bfloat16)),
         "contiguous"),
        (lambda: gemm_rs(torch.randn(64, 12).to(torch.bfloat16), torch.randn(48, 12).to(torch.bfloat16),
                         config=OverlapConfig(method="signal")), "multiple of 8"),
        (lambda: gemm_rs(a, w, bias=torch.zeros(47, dtype=torch.bfloat16)), "bias"),
        (lambda: gemm_rs(a[:4 * world + 2 * world], w, config=OverlapConfig(method="signal", schedule="tile_exact",
                                                                             **SMALL_TILES)),
         "tile_exact"),
        (lambda: gemm_rs(a, w, config=OverlapConfig(method="signal", groups=(1, 1, 1), **SMALL_TILES)), "sum to"),
        (lambda: gemm_rs(a, w, config=OverlapConfig(method="signal", transport="p2p")), "needs CUDA tensors"),
        (lambda: gemm_rs(a, w, config=OverlapConfig(method="decompose", transport="p2p")), "needs CUDA tensors"),
        (lambda: gemm_ar(a, w, config=OverlapConfig(method="signal", transport="p2p")), "needs CUDA tensors"),
        (lambda: gemm_ar(a, w, config=OverlapConfig(method="decompose", transport="p2p")), "needs CUDA tensors"),
        (lambda: gemm_ar(a[:63].contiguous(), w, config=OverlapConfig(method="signal", transport="p2p")),
         "reduces rows in t regions: M=63 is not divisible"),
    ]
    assert_each_raises(cases)
    # method='auto' (the default config) runs the named 'off' path on CPU, with a warning saying why. Its
    # result is checked against the dense product of the whole problem, computed here in fp64: comparing
    # with config=off would compare that path with itself.
    m, n, k_local = 64, 48, 32
    a_full, w_full, _ = dense_problem(m, n, k_local * world, seed=11, bias=False)
    shard, rows = slice(rank * k_local, (rank + 1) * k_local), slice(rank * m // world, (rank + 1) * m // world)
    dense = a_full.double() @ w_full.double().t()
    a_k, w_k = a_full[:, shard].contiguous(), w_full[:, shard].contiguous()
    with pytest.warns(UserWarning, match="method='auto' runs 'off'"):
        got = gemm_rs(a_k, w_k)
    assert got.shape == (m // world, n) and rel_error(got, dense[rows]) < 1e-2
    with pytest.warns(UserWarning, match="method='auto' runs 'off'"):
        got = gemm_ar(a_k, w_k)
    assert got.shape == (m, n) and rel_error(got, dense) < 1e-2


def test_bad_input_is_named():
    run_distributed(2, _check_bad_input)


def test_needs_an_initialized_group():
    assert not dist.is_initialized()
    a = torch.randn(8, 8).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="not initialized"):
        gemm_rs(a, a)
