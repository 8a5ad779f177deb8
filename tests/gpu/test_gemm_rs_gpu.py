"""gemm_rs / gemm_ar on all GPUs here with NCCL (t = gpu_world()) (run on the device: `pytest -m gpu tests/gpu`).

Checked per shape, with fresh random inputs and outputs allocated over NaN-poisoned memory:
- relative error against an fp32 reference no worse than the sequential bf16 path's (cuBLAS + NCCL);
- bitwise equal to the same signaled kernel followed by the same collectives run after a full
  device synchronization (overlap must not change a bit);
- both schedules; 200 back-to-back calls without a hang; the watchdog turns a lost signal into an error;
- the raw NCCL communicator equals torch.distributed's collectives bit for bit.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from gpu_checks import gpu_world, poison_allocator, rel_error
from overlap_tp import OverlapConfig, gemm_ar, gemm_rs
from overlap_tp.ops import comm
from overlap_tp.kernels.signaled_gemm import signaled_gemm
from overlap_tp.ops.plan_base import gemm_programs
from overlap_tp.ops.resolve import fill_defaults
from overlap_tp.ops.tile_rule import tile_for_shape
from overlap_tp.ops.collective_reduction import device_plan

pytestmark = pytest.mark.gpu

# BENCHMARKS.md GEMM+RS shapes (K is the per-rank K_local) plus odd ones: M/t not a multiple of 128,
# N not a multiple of 256, a tiny GEMM with fewer tiles than SMs.
BENCH_SHAPES = [(s, k, n) for s in (4096, 8192, 16384)
                for k, n in ((2048, 4096), (7168, 4096), (4096, 8192), (14336, 8192))]
ODD_SHAPES = [(2 * 1000, 1024, 4096), (2 * 520, 512, 1000), (256, 64, 128), (2 * 4096, 4096, 3072 + 64)]


def sequential_signaled(a, w, group, config, op):
    """The same kernel and the same per-group collectives, but the collectives start only after a full
    synchronization: what the overlapped call must equal bit for bit. The tile is the one the op's plan runs
    (tile_for_shape, as OpPlan resolves it): with the default tile instead, tile_exact's groups hold other elements,
    and at t > 2 NCCL's ring all-reduce sums an element in an order that depends on where it falls in the buffer
    (compared against the default tile, gemm_ar 4096x2048x4096 at t = 4 differs on millions of elements)."""
    t = dist.get_world_size(group)
    m, n = a.shape[0], w.shape[0]
    config = fill_defaults(config, "gemm_rs" if op == "rs" else "gemm_ar", a.device, t)   # unset fields as the op's
    config = tile_for_shape(config, m, n, gemm_programs(a.device, config))
    world = t if op == "rs" else 1
    state = device_plan(config.schedule, m, n, world, config, a.element_size(), a.device)
    plan = state.plan
    staging = torch.empty(plan.staging_shape, dtype=a.dtype, device=a.device)
    counters = torch.zeros_like(state.counters)
    signaled_gemm(a, w, staging, state.tiles, counters, gemm_programs(a.device, config), config)
    torch.cuda.synchronize()
    assert counters.tolist() == list(plan.group_tiles)
    coll = comm.collectives(group, a.device, config.comm_sms)
    out = torch.empty(plan.out_shape, dtype=a.dtype, device=a.device)
    for c in plan.collectives:
        if op == "rs":
            coll.reduce_scatter(out[c.dst_lo:c.dst_hi], staging[c.src_lo:c.src_hi])
        else:
            out[c.dst_lo:c.dst_hi] = staging[c.src_lo:c.src_hi]
            coll.all_reduce(out[c.dst_lo:c.dst_hi])
    torch.cuda.synchronize()
    return out if plan.tile_order is None else plan.tile_order.undo(out)


def _check_shapes(rank, world, shapes, op):
    group = dist.group.WORLD
    kind = "gemm_rs" if op == "rs" else "gemm_ar"   # the configs as the op resolves their unset fields
    configs = [fill_defaults(OverlapConfig(method="signal", transport="nccl", schedule=schedule), kind, "cuda", world)
               for schedule in ("row_slice", "tile_exact")]
    for s, k, n in shapes:
        torch.manual_seed(1000 * s + k + n + rank)      # different inputs per rank and per shape
        a = torch.randn(s, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        partial = a.float() @ w.float().t()
        dist.all_reduce(partial, group=group)
        ref = partial[rank * s // world:(rank + 1) * s // world] if op == "rs" else partial
        run = gemm_rs if op == "rs" else gemm_ar
        baseline_error = rel_error(run(a, w, group, config=OverlapConfig(method="off")), ref)
        for config in configs:
            m_local = s // world if op == "rs" else s
            if config.schedule == "tile_exact" and (m_local % config.block_m or n % config.block_n):
                continue
            poison_allocator()
            got = run(a, w, group, config=config)
            torch.cuda.synchronize()
            assert torch.isfinite(got).all(), (op, s, k, n, config.schedule, "unwritten or non-finite output")
            error = rel_error(got, ref)
            assert error <= baseline_error * 1.05 + 1e-4, (op, s, k, n, config.schedule, error, baseline_error)
            sequential = sequential_signaled(a, w, group, config, op)
            if not torch.equal(got, sequential):   # say whether the sequential path agrees with itself (NCCL)
                again = torch.equal(sequential, sequential_signaled(a, w, group, config, op))
                raise AssertionError((op, s, k, n, config.schedule, "elements that differ:",
                                      (got != sequential).sum().item(), "of", got.numel(), "max |diff|:",
                                      (got.float() - sequential.float()).abs().max().item(),
                                      "the sequential path equal to itself run again:", again))
            if op == "rs" and config.schedule == "row_slice":
                # the same kernel's partials summed by epilogue stores + barrier. At t = 2 the fp32 sum
                # rounded once is NCCL's bf16 a + b bit for bit; at t > 2 NCCL rounds after every add,
                # so there the p2p sum is held to the accuracy rule instead.
                # rs_transfer 'copy' (the copy engines push locally stored partials) sums the same partials with
                # the same kernel: bit for bit the epilogue's stores at every t
                by_epilogue = None
                for transfer in ("epilogue", "copy"):
                    p2p = OverlapConfig(method="signal", comm_sms=16, transport="p2p", rs_transfer=transfer)
                    for _ in range(3):   # both receive buffers, reused
                        poison_allocator()
                        summed = run(a, w, group, config=p2p)
                        if world == 2:
                            assert torch.equal(summed, got), (s, k, n, "p2p", transfer)
                        else:
                            assert rel_error(summed, ref) <= baseline_error * 1.05 + 1e-4, (s, k, n, "p2p", transfer)
                        if by_epilogue is None:
                            by_epilogue = summed
                        assert torch.equal(summed, by_epilogue), (s, k, n, "p2p", transfer, "differs from epilogue")
            if op == "ar" and config.schedule == "row_slice":
                # the p2p transport (P2PAllReduce): the p2p ReduceScatter's sum of each region, gathered by the copy
                # engines: at t = 2 NCCL's bf16 a + b bit for bit (as gemm_rs above), at t > 2 the accuracy rule; both
                # transfers and cuBLAS per region, each three times (the buffers reused)
                for p2p in (OverlapConfig(method="signal", comm_sms=16, transport="p2p", rs_transfer="epilogue"),
                            OverlapConfig(method="signal", comm_sms=16, transport="p2p", rs_transfer="copy"),
                            OverlapConfig(method="decompose", transport="p2p")):
                    for _ in range(3):
                        poison_allocator()
                        summed = run(a, w, group, config=p2p)
                        assert torch.isfinite(summed).all(), (s, k, n, "ar p2p", p2p)
                        if world == 2 and p2p.method == "signal":
                            assert torch.equal(summed, got), (s, k, n, "ar p2p", p2p.rs_transfer)
                        else:
                            assert rel_error(summed, ref) <= baseline_error * 1.05 + 1e-4, (s, k, n, "ar p2p", p2p)
        decomposed = run(a, w, group, config=OverlapConfig(method="decompose", transport="nccl", chunks=4))
        assert rel_error(decomposed, ref) <= baseline_error * 1.05 + 1e-4
        if op == "rs":   # cuBLAS per owner's region, stored into its receive slot (RegionGemms): both buffers' turns;
            # and into the local staging matrix, each region pushed by the copy engines (rs_transfer 'copy')
            for transfer in ("epilogue", "copy"):
                for _ in range(3):
                    poison_allocator()
                    regions = run(a, w, group, config=OverlapConfig(method="decompose", transport="p2p",
                                                                    rs_transfer=transfer))
                    assert rel_error(regions, ref) <= baseline_error * 1.05 + 1e-4, (s, k, n, "decompose-p2p", transfer)


@pytest.mark.parametrize("shapes", [BENCH_SHAPES[:4], BENCH_SHAPES[4:8], BENCH_SHAPES[8:], ODD_SHAPES],
                         ids=["s4096", "s8192", "s16384", "odd"])
def test_gemm_rs(shapes):
    run_distributed(gpu_world(), _check_shapes, shapes, "rs", backend="nccl")


def test_gemm_ar():
    run_distributed(gpu_world(), _check_shapes, [(4096, 2048, 4096), (8192, 7168, 4096)] + ODD_SHAPES[1:3], "ar",
                    backend="nccl")


def _check_bias_and_back_to_back(rank, world):
    group = dist.group.WORLD
    torch.manual_seed(rank)
    a = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16) / 2048 ** 0.5
    torch.manual_seed(99)
    bias = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    for schedule in ("row_slice", "tile_exact"):
        config = OverlapConfig(method="signal", transport="nccl", schedule=schedule, groups=4)
        ref = gemm_rs(a, w, group, bias=bias, config=OverlapConfig(method="off"))
        got = gemm_rs(a, w, group, bias=bias, config=config)
        assert rel_error(got, ref.float()) < 1e-2
        outputs = [gemm_rs(a, w, group, config=config) for _ in range(200)]   # no sync in between
        torch.cuda.synchronize()
        assert all(torch.equal(o, outputs[0]) for o in outputs), "results changed across back-to-back calls"
        for transfer in ("copy", "epilogue"):   # the epilogue's list is the one kept for the async check below
            p2p = [gemm_rs(a, w, group, bias=bias,
                           config=OverlapConfig(method="signal", comm_sms=16, transport="p2p", rs_transfer=transfer))
                   for _ in range(200)]
            torch.cuda.synchronize()
            assert all(torch.equal(o, p2p[0]) for o in p2p), f"p2p ({transfer}) results changed across calls"
            assert rel_error(p2p[0], ref.float()) < 1e-2
        # async_op: the sum waits for the peers in Pending.wait(), behind the work queued in between (rank 1
        # held back on the GPU, so rank 0's wait is real); a second call before the wait is refused
        for transfer in ("epilogue", "copy"):
            p2p_config = OverlapConfig(method="signal", comm_sms=16, transport="p2p", rs_transfer=transfer)
            pending = gemm_rs(a, w, group, bias=bias, config=p2p_config, async_op=True)
            if rank == 1:
                torch.cuda._sleep(50_000_000)
            between = a[:, :256] @ w[:256, :256]
            with pytest.raises(RuntimeError, match="before the previous call's result was waited for"):
                gemm_rs(a, w, group, bias=bias, config=p2p_config)
            assert torch.equal(pending.wait(), p2p[0]) and torch.isfinite(between).all(), transfer
        ar = [gemm_ar(a, w, group, config=config) for _ in range(50)]
        torch.cuda.synchronize()
        assert all(torch.equal(o, ar[0]) for o in ar)
    # gemm_ar over p2p with a bias (added once, by each region's owner): 200 calls, no sync in between
    ar_ref = gemm_ar(a, w, group, bias=bias, config=OverlapConfig(method="off"))
    ar_p2p = [gemm_ar(a, w, group, bias=bias, config=OverlapConfig(method="signal", comm_sms=16, transport="p2p"))
              for _ in range(200)]
    torch.cuda.synchronize()
    assert all(torch.equal(o, ar_p2p[0]) for o in ar_p2p), "gemm_ar p2p results changed across calls"
    assert rel_error(ar_p2p[0], ar_ref.float()) < 1e-2


def test_bias_and_200_back_to_back_calls():
    run_distributed(gpu_world(), _check_bias_and_back_to_back, backend="nccl")


def test_watchdog_turns_a_lost_signal_into_an_error(tmp_path):
    """A wait whose counter can never reach its target must end the process with a clear message."""
    script = textwrap.dedent("""
        import torch
        from overlap_tp.ops.comm import CounterWaits, comm_engine
        from overlap_tp.ops.watchdog import Watched
        engine = comm_engine(torch.device("cuda", 0))
        counters = torch.zeros(2, dtype=torch.int32, device="cuda")
        engine.wait_counter(CounterWaits(counters, (0, 5)), 1, False)    # nothing will ever raise counter 1
        Watched("test op", (("counters", counters),)).record(engine.raw)
        torch.cuda.synchronize()
        print("NOT REACHED")
    """)
    env = dict(os.environ, OVERLAP_TP_WATCHDOG_S="2")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 70, result.stderr[-2000:]
    assert "test op did not complete within 2 s" in result.stderr and "counters [0, 0]" in result.stderr
    assert "NOT REACHED" not in result.stdout


def _check_async_op(rank, world):
    """async_op=True: the communication still runs while the caller queues other work (here: a GEMM and a
    NaN fill of freed allocator memory, where a buffer released too early would be handed out); wait()
    then gives the same bits as the synchronous call, for every method and both ops."""
    group = dist.group.WORLD
    torch.manual_seed(7 + rank)
    a = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    other = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    configs = [OverlapConfig(method="off"), OverlapConfig(method="decompose", transport="nccl", chunks=4),
               OverlapConfig(method="signal", transport="nccl", schedule="row_slice"),
               OverlapConfig(method="signal", transport="nccl", schedule="tile_exact"),
               OverlapConfig(method="signal", transport="p2p", comm_sms=0, rs_transfer="epilogue"),
               OverlapConfig(method="signal", transport="p2p", comm_sms=0, rs_transfer="copy"),
               OverlapConfig(method="decompose", transport="p2p"),
               OverlapConfig(method="decompose", transport="p2p", rs_transfer="copy")]
    for config in configs:
        for run in (gemm_rs, gemm_ar):
            expected = run(a, w, group, config=config)
            torch.cuda.synchronize()
            pending = run(a, w, group, config=config, async_op=True)
            busy = other @ other
            poison_allocator()
            got = pending.wait()
            torch.cuda.synchronize()
            assert torch.equal(got, expected), (run.__name__, config)
            del busy


def test_async_op_waits_and_keeps_its_buffers():
    run_distributed(gpu_world(), _check_async_op, backend="nccl")


def _same_sum(ours, theirs, absum, world, dtype):
    """Two NCCL reductions of the same inputs. With 2 ranks a + b is one rounding of a commutative sum:
    bitwise equal. With more, communicators with different CTA limits may pick different algorithms
    (ring / tree, chunking) and so a different summation order: each of the world - 1 additions then
    errs by at most u * sum|x_i| (u: the dtype's unit roundoff), so the two differ by at most
    2 * world * u * sum|x_i|."""
    if world == 2:
        return torch.equal(ours, theirs)
    u = torch.finfo(dtype).eps / 2
    return bool(((ours.float() - theirs.float()).abs() <= 2 * world * u * absum).all())


def _check_raw_nccl_matches_torch(rank, world):
    group = dist.group.WORLD
    torch.manual_seed(rank)
    coll = comm.collectives(group, torch.device("cuda", rank), 16)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(4096, 1000, device="cuda", dtype=dtype)
        absum = x.float().abs()
        dist.all_reduce(absum, group=group)
        rows = 4096 // world
        ours, theirs = (torch.empty(rows, 1000, device="cuda", dtype=dtype) for _ in range(2))
        coll.reduce_scatter(ours, x)
        dist.reduce_scatter_tensor(theirs, x, group=group)
        assert _same_sum(ours, theirs, absum[rank * rows:(rank + 1) * rows], world, dtype), ("reduce_scatter", dtype)
        y, z = x.clone(), x.clone()
        coll.all_reduce(y)
        dist.all_reduce(z, group=group)
        assert _same_sum(y, z, absum, world, dtype), ("all_reduce", dtype)


def test_raw_nccl_matches_torch_distributed():
    run_distributed(gpu_world(), _check_raw_nccl_matches_torch, backend="nccl")


def _check_auto(rank, world, cache_path):
    """method='auto' runs the tuner's pick (measured once, then cached) and still computes the same thing;
    the pick is the same on both ranks and lands in the cache file that a later process reads."""
    from overlap_tp import ag_gemm, tune
    from overlap_tp.tune.cache import TuneCache
    os.environ["OVERLAP_TP_TUNE_CACHE"] = cache_path
    group = dist.group.WORLD
    torch.manual_seed(rank)
    a = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16) / 2048 ** 0.5
    auto, off = OverlapConfig(method="auto"), OverlapConfig(method="off")
    for op, run, x in (("gemm_rs", gemm_rs, a), ("gemm_ar", gemm_ar, a), ("ag_gemm", ag_gemm, a[:4096])):
        ref = run(x, w, group, config=off)
        got = run(x, w, group, config=auto)
        assert rel_error(got, ref.float()) < 1e-2, op
        pick = tune.choose(op, x, w, group, base=auto)   # memo: no new measurement
        picks = [None] * world
        dist.all_gather_object(picks, pick, group=group)
        assert all(p == picks[0] for p in picks), f"{op}: ranks chose differently: {picks}"
        print(f"auto {op}: {pick}", flush=True)
    dist.barrier()
    if rank == 0:
        assert len(TuneCache(cache_path, None).entries()) >= 3


def test_auto_runs_the_tuned_config(tmp_path):
    run_distributed(gpu_world(), _check_auto, str(tmp_path / "tune.json"), backend="nccl")
