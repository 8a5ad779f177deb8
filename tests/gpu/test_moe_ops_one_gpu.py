"""a2a_gemm / gemm_a2a on ONE GPU (EP = 1, a one-rank NCCL group): the compiled grouped signaled GEMM over
every local expert against `off` (per-expert cuBLAS), forward and backward, and a routing that changes every
call queued without a host synchronisation (the plan's tables go to the GPU from pinned memory). The
exchanges themselves need two GPUs: tests/gpu/test_moe_ops_gpu.py.
Run: `pytest -m gpu tests/gpu/test_moe_ops_one_gpu.py`."""
import pytest
import torch

from distributed import run_distributed
from gpu_checks import poison_allocator, rel_error
from overlap_tp import OverlapConfig, a2a_gemm, gemm_a2a
from overlap_tp.bench.moe import routing_counts

pytestmark = pytest.mark.gpu

SIGNAL, OFF = OverlapConfig(method="signal", comm_sms=16, groups="auto"), OverlapConfig(method="off")


def fwd_bwd(op, inp, counts, w, grad, config):
    inp, w = inp.detach().requires_grad_(), w.detach().requires_grad_()
    out = op(inp, counts, w, config=config)
    return (out.detach(),) + torch.autograd.grad(out, (inp, w), grad)


def _check_against_off(rank, world, tokens, hidden, ffn, experts, routing):
    poison_allocator()
    counts = routing_counts(tokens, experts, 1, routing)
    rows = int(counts.sum())
    gen = torch.Generator(device="cuda").manual_seed(tokens + experts)
    x = torch.randn(rows, hidden, device="cuda", generator=gen).bfloat16()
    w1 = (torch.randn(experts, 2 * ffn, hidden, device="cuda", generator=gen) / hidden ** 0.5).bfloat16()
    h = torch.randn(rows, ffn, device="cuda", generator=gen).bfloat16()
    w2 = (torch.randn(experts, hidden, ffn, device="cuda", generator=gen) / ffn ** 0.5).bfloat16()
    for op, inp, w, n in ((a2a_gemm, x, w1, 2 * ffn), (gemm_a2a, h, w2, hidden)):
        grad = torch.randn(rows, n, device="cuda", generator=gen).bfloat16()
        want = fwd_bwd(op, inp, counts, w, grad, OFF)
        got = fwd_bwd(op, inp, counts, w, grad, SIGNAL)
        for name, g, r in zip(("out", "input grad", "weight grad"), got, want):
            assert not g.isnan().any(), (op.__name__, name)
            assert rel_error(g, r.float()) < 1e-2, (op.__name__, name, rel_error(g, r.float()))


@pytest.mark.parametrize("tokens, hidden, ffn, experts, routing", [
    (8192, 4096, 14336, 4, "uniform"),     # the per-rank GEMMs of Mixtral-like experts at EP 2 (4 of 8 local)
    (8192, 4096, 14336, 4, "zipf"),
    (3000, 1024, 1000, 12, "zipf"),        # N, F not multiples of the tile; experts with few or no rows
])
def test_grouped_signaled_gemm_matches_per_expert_cublas(tokens, hidden, ffn, experts, routing):
    run_distributed(1, _check_against_off, tokens, hidden, ffn, experts, routing, backend="nccl")


def _check_no_sync(rank, world):
    hidden, ffn, experts = 1024, 1024, 4
    gen = torch.Generator(device="cuda").manual_seed(0)
    w1 = (torch.randn(experts, 2 * ffn, hidden, device="cuda", generator=gen) / 32).bfloat16().requires_grad_()
    w2 = (torch.randn(experts, hidden, ffn, device="cuda", generator=gen) / 32).bfloat16().requires_grad_()
    routings = [routing_counts(2048, experts, 1, "zipf", seed=s) for s in range(6)]

    def step(counts):
        x = torch.randn(int(counts.sum()), hidden, device="cuda", generator=gen).bfloat16().requires_grad_()
        y = a2a_gemm(x, counts, w1, config=SIGNAL)
        z = gemm_a2a(y[:, :ffn].contiguous(), counts, w2, config=SIGNAL)
        z.float().square().mean().backward()
        return z

    step(routings[0])   # the first call builds what every later one reuses (communicator, compiled kernels)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for counts in routings[1:]:     # a new routing every step: new plans, built and queued without a sync
            step(counts)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_a_new_routing_every_step_never_synchronizes_the_host():
    run_distributed(1, _check_no_sync, backend="nccl")


def test_pinned_staging_never_overwrites_a_table_still_being_copied():
    """100 different tables staged back to back while the GPU sleeps (every copy still pending): each arrives
    intact, so no slot was rewritten before its copy ran; then, with the copies done, the slots are reused."""
    from overlap_tp.ops.expert import PinnedStaging
    from overlap_tp.tune.timing import sleep_cycles_per_ms
    staging = PinnedStaging()
    tables = [torch.randint(-2 ** 31, 2 ** 31 - 1, (1000 + 37 * i, 9), dtype=torch.int32) for i in range(100)]
    torch.cuda._sleep(int(200 * sleep_cycles_per_ms()))
    on_gpu = [staging.to_device(t, torch.device("cuda")) for t in tables]
    torch.cuda.synchronize()
    for t, g in zip(tables, on_gpu):
        assert torch.equal(g.cpu(), t)
    slots = len(staging.slots)
    assert slots > 1                                   # copies were in flight together
    again = [staging.to_device(t, torch.device("cuda")) for t in tables[:5]]
    torch.cuda.synchronize()
    assert len(staging.slots) == slots                 # reused, none added
    for t, g in zip(tables, again):
        assert torch.equal(g.cpu(), t)


def _check_routings_share_kernels(rank, world):
    from overlap_tp.kernels import signaled_gemm
    jit_launches = []
    jit_launch = signaled_gemm._jit_launch

    def counted(*args):
        jit_launches.append(1)
        return jit_launch(*args)
    signaled_gemm._jit_launch = counted
    hidden, ffn, experts = 1024, 1000, 6
    gen = torch.Generator(device="cuda").manual_seed(1)
    w1 = (torch.randn(experts, 2 * ffn, hidden, device="cuda", generator=gen) / 32).bfloat16()
    routings = [routing_counts(3000, experts, 1, "zipf", seed=s) for s in range(12)]
    x = torch.randn(int(routings[0].sum()), hidden, device="cuda", generator=gen).bfloat16()
    for counts in routings:   # a new plan and SignaledGemm per routing; the compiled kernels shared
        got, want = a2a_gemm(x, counts, w1, config=SIGNAL), a2a_gemm(x, counts, w1, config=OFF)
        assert rel_error(got, want.float()) < 1e-2
    # one JIT launch per distinct specialization (the tile count's divisibility by 16), not one per routing
    assert len(jit_launches) <= 3, len(jit_launches)


def test_new_routings_launch_the_shared_compiled_kernel():
    run_distributed(1, _check_routings_share_kernels, backend="nccl")


def test_dispatch_table_built_on_the_gpu_matches_the_host_table():
    """The compiled dispatch-table kernel (kernels/expert_row_tiles.py) against the host's table, row for row, at
    EP 1 to 8 (the table depends on the counts and the rank only, so one GPU checks every rank's), with segments of
    up to thousands of rows, empty experts and ranks, and 1 to 5 parts per peer."""
    from overlap_tp.kernels.expert_row_tiles import dispatch_row_tiles
    from overlap_tp.ops.moe_tile_plan import dispatch_plan, layout, part_tiles
    gen = torch.Generator().manual_seed(7)
    for ep, experts in ((1, 4), (2, 4), (4, 8), (8, 8), (8, 2)):
        for trial in range(4):
            counts = torch.randint(0, 3000, (ep, ep * experts), generator=gen) * (torch.rand(ep, ep * experts,
                                                                                              generator=gen) > 0.2)
            if trial == 1:
                counts[:, :experts] = 0      # rank 0 receives nothing
            for rank in range(ep):
                for block_m, parts in ((128, 1 + trial), (64, 5 - trial)):
                    lay = layout(counts, rank)
                    want = dispatch_plan(lay, 14336, block_m, 128, parts).tiles
                    got = dispatch_row_tiles(counts.cuda(), rank, experts, parts, block_m,
                                             sum(part_tiles(lay, block_m, parts)[0]), want.n_tiles, want.raster_m)
                    assert torch.equal(got.starts.cpu(), want.starts), (ep, experts, trial, rank, block_m, parts)
                    assert torch.equal(got.rows.cpu(), want.rows), (ep, experts, trial, rank, block_m, parts)


def _check_device_counts(rank, world):
    from overlap_tp.ops import expert
    hidden, ffn, experts = 1024, 1024, 4
    gen = torch.Generator(device="cuda").manual_seed(3)
    w1 = (torch.randn(experts, 2 * ffn, hidden, device="cuda", generator=gen) / 32).bfloat16()
    w2 = (torch.randn(experts, hidden, ffn, device="cuda", generator=gen) / 32).bfloat16()
    copies = []
    host_table_to = expert.host_table_to

    def counted(table, device):
        copies.append(tuple(table.shape))
        return host_table_to(table, device)
    expert.host_table_to = counted
    try:
        for seed in range(4):
            counts = routing_counts(2048, experts, 1, "zipf", seed=50 + seed)
            x = torch.randn(int(counts.sum()), hidden, device="cuda", generator=gen).bfloat16()
            h = torch.randn(int(counts.sum()), ffn, device="cuda", generator=gen).bfloat16()
            gy = torch.randn(int(counts.sum()), 2 * ffn, device="cuda", generator=gen).bfloat16()
            gz = torch.randn(int(counts.sum()), hidden, device="cuda", generator=gen).bfloat16()
            results, copied = [], []
            for device_counts in (None, counts.cuda()):
                expert._states.clear()
                expert._routings.clear()
                copies.clear()
                results.append(fwd_bwd(lambda *a, **k: a2a_gemm(*a, device_counts=device_counts, **k), x, counts, w1,
                                       gy, SIGNAL)
                               + fwd_bwd(lambda *a, **k: gemm_a2a(*a, device_counts=device_counts, **k), h, counts, w2,
                                         gz, SIGNAL))
                copied.append(list(copies))
            for i, (host_path, device_path) in enumerate(zip(*results)):
                assert torch.equal(host_path, device_path), (seed, i)
            # the counts' copy up, once per dispatch state (a2a_gemm's forward, gemm_a2a's backward), is gone
            assert copied[1] == [c for c in copied[0] if c != tuple(counts.shape)], copied
            assert len(copied[1]) == len(copied[0]) - 2, copied
    finally:
        expert.host_table_to = host_table_to


def test_counts_on_the_gpu_build_the_same_dispatch_without_a_copy():
    """a2a_gemm / gemm_a2a given the counts on the GPU too (device_counts, as OverlapMoELayer passes them): the same
    bits forward and backward as with host counts alone, and the dispatch tables built without copying counts up."""
    run_distributed(1, _check_device_counts, backend="nccl")
