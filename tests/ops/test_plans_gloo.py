"""The two-phase ops (plans) under gloo: a plan built once and called equals the functional API; the ranks'
agreement is checked when a plan is built (a mismatch is a clear error on every rank, not a hang or a wrong
result); degenerate inputs (M = 0, meta tensors) get a result or a clear error; the functional API's plan
cache is bounded."""
import pytest
import torch

from overlap_tp import OverlapConfig, ag_gemm, gemm_ar, gemm_rs
from overlap_tp.ops import plan_base
from overlap_tp.ops.ag_gemm import AgGemm
from overlap_tp.ops.gemm_ar import GemmAR
from overlap_tp.ops.gemm_rs import GemmRS
from distributed import run_distributed
from problems import SMALL_TILES, dense_problem

SIGNAL = OverlapConfig(method="signal", groups=2, **SMALL_TILES)
OFF = OverlapConfig(method="off")


def _check_plans_equal_functional(rank, world):
    a, w, b = dense_problem(64, 48, 32, seed=5, bias=True)
    shard = slice(rank * 32 // world, (rank + 1) * 32 // world)
    a_k, w_k = a[:, shard].contiguous(), w[:, shard].contiguous()
    a_rows = a[rank * 64 // world:(rank + 1) * 64 // world].contiguous()
    for config in (SIGNAL, OFF, OverlapConfig(method="decompose", chunks=2)):
        rs = GemmRS(None, 64, 48, 16, torch.bfloat16, "cpu", config)
        ar = GemmAR(None, 64, 48, 16, torch.bfloat16, "cpu", config)
        ag = AgGemm(None, 64 // world, 48, 32, torch.bfloat16, "cpu", config)
        for _ in range(2):   # a plan is reusable: the second call equals the first
            assert torch.equal(rs(a_k, w_k, b), gemm_rs(a_k, w_k, bias=b, config=config))
            assert torch.equal(ar(a_k, w_k, b), gemm_ar(a_k, w_k, bias=b, config=config))
            assert torch.equal(ag(a_rows, w, b), ag_gemm(a_rows, w, bias=b, config=config))
        with pytest.raises(ValueError, match="the plan was built for"):
            rs(a_k[:32].contiguous(), w_k)


def test_a_plan_equals_the_functional_api():
    run_distributed(2, _check_plans_equal_functional)


def _check_disagreement(rank, world):
    a, w, _ = dense_problem(64, 48, 32, seed=1, bias=False)
    m = 64 if rank == 0 else 32                   # rank 1 passes other rows
    with pytest.raises(ValueError, match=r"disagree on m \(rank 0: m=64; rank 1: m=32\)"):
        gemm_rs(a[:m, :16].contiguous(), w[:, :16].contiguous(), config=SIGNAL)
    rows = 32 if rank == 0 else 16                # ag_gemm with 32 rows on rank 0, 16 on rank 1
    with pytest.raises(ValueError, match="disagree on m"):
        ag_gemm(a[:rows].contiguous(), w, config=SIGNAL)
    config = SIGNAL if rank == 0 else OFF         # configs differ
    with pytest.raises(ValueError, match="disagree on config"):
        gemm_ar(a[:, :16].contiguous(), w[:, :16].contiguous(), config=config)


def test_ranks_that_disagree_get_a_clear_error_on_every_rank():
    run_distributed(2, _check_disagreement)


def _check_degenerate(rank, world):
    a, w, _ = dense_problem(64, 48, 32, seed=2, bias=False)
    empty = a[:0].contiguous()
    for run in (gemm_rs, gemm_ar):
        with pytest.warns(UserWarning, match="empty operand"):
            got = run(empty, w, config=SIGNAL)
        assert got.shape[0] == 0 and got.shape[1] == 48
        assert torch.equal(got, run(empty, w, config=OFF))
    got = ag_gemm(empty, w, config=SIGNAL)
    assert got.shape == (0, 48)
    meta_a, meta_w = torch.empty(64, 32, device="meta", dtype=torch.bfloat16), torch.empty(48, 32, device="meta",
                                                                                               dtype=torch.bfloat16)
    for run in (gemm_rs, gemm_ar, ag_gemm):
        with pytest.raises(ValueError, match="meta tensors"):
            run(meta_a, meta_w, config=SIGNAL)


def test_degenerate_inputs_give_a_result_or_a_clear_error():
    run_distributed(2, _check_degenerate)


def _check_cache_bound(rank, world, limit):
    plan_base.MAX_CACHED_PLANS = limit
    plan_base.clear_plans()
    a, w, _ = dense_problem(64, 48, 16, seed=3, bias=False)
    for rows in range(2, 2 * (limit + 3), 2):    # shapes that change every call
        gemm_rs(a[:rows].contiguous(), w, config=OFF)
    assert len(plan_base._plans) == limit


def test_the_plan_cache_is_bounded():
    run_distributed(2, _check_cache_bound, 4)


def _check_plan_instances(rank, world):
    """instance=1 is a second plan of the same arguments, cached as the first is; the same result; an instance is an
    int >= 0; each instance's comm engine is its own."""
    from overlap_tp.ops import comm
    from overlap_tp.ops.ag_gemm import ag_gemm_plan
    from overlap_tp.ops.gemm_rs import GemmRS
    plan_base.clear_plans()
    a, w, _ = dense_problem(64, 48, 16, seed=5, bias=False)
    group = comm.resolve_group(None)

    def plan(instance):
        return plan_base.cached_plan(GemmRS, group, 64, 48, 16, a.dtype, a.device, SIGNAL, instance)
    first, second = plan(0), plan(1)
    assert first is not second and plan(0) is first and plan(1) is second and second.instance == 1
    assert torch.equal(gemm_rs(a, w, config=SIGNAL, instance=1), gemm_rs(a, w, config=SIGNAL))
    assert ag_gemm_plan(a[:32].contiguous(), w, config=SIGNAL, instance=1) is not ag_gemm_plan(a[:32].contiguous(), w,
                                                                                               config=SIGNAL)
    with pytest.raises(ValueError, match="instance=-1"):
        plan(-1)
    device = torch.device("cpu")
    assert comm.comm_engine(device, 1) is not comm.comm_engine(device) and comm.comm_engine(device, 1) is \
        comm.comm_engine(device, 1)


def test_a_second_plan_instance_is_its_own_plan():
    run_distributed(2, _check_plan_instances)


def _check_absent_peer(rank, world):
    """One rank never calls the op: the other's plan build ends within OVERLAP_TP_WATCHDOG_S with an error
    naming the missing rank, instead of hanging."""
    import os
    import time
    os.environ["OVERLAP_TP_WATCHDOG_S"] = "2"
    a, w, _ = dense_problem(64, 48, 16, seed=4, bias=False)
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] of the group did not reach this op within 2 s"):
            gemm_rs(a, w, config=SIGNAL)
        assert time.monotonic() - start < 30
    else:
        time.sleep(5)   # alive (the store stays up) but never calling the op


def test_a_peer_that_never_calls_is_a_clear_error_not_a_hang():
    run_distributed(2, _check_absent_peer)


def test_a_deferred_sum_into_a_wrong_output_is_a_clear_error_and_stays_to_run():
    """DeferredSum.into checks the caller's output (the sum's launch does not) before it runs the second half: a wrong
    shape, dtype or layout is a ValueError and the deferred sum is still there to run."""
    from types import SimpleNamespace
    from overlap_tp.ops.p2p_reduction import DeferredSum
    ran = []
    op = SimpleNamespace(m_local=4, n=8, buf=torch.empty(2 * 4, 8, dtype=torch.bfloat16),
                         finish_sum=lambda out: ran.append(out))
    deferred = DeferredSum(op)
    for wrong in (torch.empty(4, 9, dtype=torch.bfloat16), torch.empty(4, 8, dtype=torch.float32),
                  torch.empty(8, 4, dtype=torch.bfloat16).t()):
        with pytest.raises(ValueError, match=r"contiguous \[4, 8\] torch.bfloat16"):
            deferred.into(wrong)
    assert not deferred.done and not ran
    out = torch.empty(4, 8, dtype=torch.bfloat16)
    assert deferred.into(out) is out and ran == [out] and deferred.done
