"""a2a_gemm / gemm_a2a on all GPUs here with NCCL (t = gpu_world()) (run on the device: `pytest -m gpu tests/gpu/test_moe_ops_gpu.py`).

Mixtral-8x7B-like experts (hidden 4096, ffn 14336, fc1 N = 2 * 14336 for the gated unit, 8 experts, EP = t,
top-2, 8192 tokens per rank) with uniform and Zipf(s = 1.2 over experts) routing and routing where rank 1
receives no token, plus an odd shape (N, F not multiples of 256, 24 experts: 12, 6 or 3 per rank at EP 2, 4, 8). Checked with fresh
random inputs and outputs allocated over NaN-poisoned memory:
- forward output, input grad and weight grad: relative error against an fp32 reference no worse than the
  sequential path's (`off`: NCCL all_to_all_single + cuBLAS), for `signal` (two chunkings) and `decompose`, each also
  over the p2p transport (the copy engines);
- a2a_gemm's signaled output bitwise equal to the same kernel over the same tiles once every row is in
  place (overlap must not change a bit);
- the first exchange of a process beside its GEMM (NCCL's peer connections made before it);
- 200 back-to-back forward calls of each op and 50 forward + backward steps without a sync, a hang or a
  changed bit (watchdog on, 120 s); a late peer (host and GPU) does not hang either op;
- routings with different group counts (groups='auto') alternating, forward + backward against `off`: an op's
  routings share its counter words, so no call may leave a count behind.
"""
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distributed import run_distributed
from gpu_checks import gpu_world, poison_allocator, rel_error
from overlap_tp import OverlapConfig, a2a_gemm, gemm_a2a
from overlap_tp.bench.moe import routing_counts
from overlap_tp.ops.expert import all_to_all_rows, expert_mm, expert_wgrad
from overlap_tp.kernels.signaled_gemm import signaled_gemm
from overlap_tp.ops.moe_tile_plan import dispatch_plan, layout, parts_per_peer
from overlap_tp.ops.plan_base import gemm_programs
from overlap_tp.ops.resolve import fill_defaults

pytestmark = pytest.mark.gpu

CASES = {   # name: (tokens per rank, hidden, ffn, experts, routing)
    "mixtral-uniform": (8192, 4096, 14336, 8, "uniform"),
    "mixtral-zipf": (8192, 4096, 14336, 8, "zipf"),
    "mixtral-rank1-receives-nothing": (8192, 4096, 14336, 8, "rank0_only"),
    "odd": (3000, 1024, 1000, 24, "zipf"),   # 24 experts: a multiple of EP up to 8, 3-12 per rank
}
CONFIGS = {
    "signal": OverlapConfig(method="signal", comm_sms=16, groups="auto"),
    "signal/g2": OverlapConfig(method="signal", groups=2, comm_sms=8),
    "decompose": OverlapConfig(method="decompose", comm_sms=16, groups=4),
    # the copy engines (p2p transport) under the signaled grouped GEMM and under cuBLAS
    "signal-p2p": OverlapConfig(method="signal", transport="p2p", comm_sms=0, groups=2),
    "decompose-p2p": OverlapConfig(method="decompose", transport="p2p", comm_sms=0, groups=2),
}
OFF = OverlapConfig(method="off")


def fwd_bwd(op, inp, counts, w, grad_out, group, config):
    inp, w = inp.detach().requires_grad_(), w.detach().requires_grad_()
    out = op(inp, counts, w, group, config=config)
    return (out.detach(),) + torch.autograd.grad(out, (inp, w), grad_out)


def error(got, ref):
    """Relative error; 0 where the reference is all zero (a rank that receives nothing) and got is too."""
    assert got.shape == ref.shape, (tuple(got.shape), tuple(ref.shape))
    if float(ref.norm()) == 0:
        assert not got.any(), "expected all zeros"
        return 0.0
    return rel_error(got, ref)


def _check_case(rank, world, case):
    group = dist.group.WORLD
    tokens, hidden, ffn, experts, routing = CASES[case]
    counts = routing_counts(tokens, experts, world, routing)
    lay = layout(counts, rank)
    torch.manual_seed(1000 + rank)
    x = torch.randn(lay.tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(lay.experts, 2 * ffn, hidden, device="cuda", dtype=torch.bfloat16) / hidden ** 0.5
    w2 = torch.randn(lay.experts, hidden, ffn, device="cuda", dtype=torch.bfloat16) / ffn ** 0.5
    dy = torch.randn(lay.rows, 2 * ffn, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(lay.rows, ffn, device="cuda", dtype=torch.bfloat16)
    dz = torch.randn(lay.tokens, hidden, device="cuda", dtype=torch.bfloat16)

    # fp32 references: the same routing (NCCL all-to-all of fp32 rows), fp32 matmuls
    _, xr = a2a_gemm(x, counts, w1, group, config=OFF, return_received=True)
    xr32, w1_32, w2_32, dy32, h32, dz32 = (t.float() for t in (xr, w1, w2, dy, h, dz))

    def mm(a, w):
        out = torch.empty(a.shape[0], w.shape[1], device="cuda")
        expert_mm(a, w, lay.segments, (out,))
        return out

    def back(rows):   # received-order rows back to their tokens' ranks
        return all_to_all_rows(rows, lay.tokens, lay.x_splits, lay.xr_splits, group)

    dzr32 = all_to_all_rows(dz32, lay.rows, lay.xr_splits, lay.x_splits, group)
    refs = {
        "a2a_gemm": (mm(xr32, w1_32), back(mm(dy32, w1_32.transpose(1, 2))), expert_wgrad(dy32, xr32, lay)),
        "gemm_a2a": (back(mm(h32, w2_32)), mm(dzr32, w2_32.transpose(1, 2)), expert_wgrad(dzr32, h32, lay)),
    }
    runs = {"a2a_gemm": (a2a_gemm, x, w1, dy), "gemm_a2a": (gemm_a2a, h, w2, dz)}
    for op, (fn, inp, w, grad_out) in runs.items():
        baseline = [error(got, ref) for got, ref in zip(fwd_bwd(fn, inp, counts, w, grad_out, group, OFF), refs[op])]
        for label, config in CONFIGS.items():
            poison_allocator()
            got = fwd_bwd(fn, inp, counts, w, grad_out, group, config)
            torch.cuda.synchronize()
            for name, g, ref, base in zip(("out", "dinput", "dw"), got, refs[op], baseline):
                assert torch.isfinite(g).all(), (case, op, label, name, "unwritten or non-finite")
                err = error(g, ref)
                assert err <= base * 1.05 + 1e-4, (case, op, label, name, err, base)
    for label, config in CONFIGS.items():   # a2a_gemm: overlapped == the same tiles after a full transfer
        if config.method != "signal":
            continue
        y = a2a_gemm(x, counts, w1, group, config=config)
        config = fill_defaults(config, "a2a_gemm", x.device, 1)   # the tile and groups the op resolved
        parts = parts_per_peer(counts, config.groups, hidden * x.element_size())
        plan = dispatch_plan(layout(counts, rank), 2 * ffn, config.block_m, config.block_n, parts)
        after = torch.empty_like(y)
        if plan.num_tiles:
            signaled_gemm(xr, w1, after, plan.tiles.to(torch.Tensor.cuda), None, gemm_programs(x.device, config), config)
        torch.cuda.synchronize()
        assert torch.equal(y, after), (case, label)


@pytest.mark.parametrize("case", list(CASES))
def test_expert_ops(case):
    run_distributed(gpu_world(), _check_case, case, backend="nccl")


def _mixtral_problem(rank, world, routing="zipf"):
    tokens, hidden, ffn, experts, _ = CASES["mixtral-zipf"]
    counts = routing_counts(tokens, experts, world, routing, seed=7)
    lay = layout(counts, rank)
    torch.manual_seed(rank)
    x = torch.randn(lay.tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(lay.experts, 2 * ffn, hidden, device="cuda", dtype=torch.bfloat16) / hidden ** 0.5
    w2 = torch.randn(lay.experts, hidden, ffn, device="cuda", dtype=torch.bfloat16) / ffn ** 0.5
    return counts, x, w1, w2


def _moe_mlp(x, counts, w1, w2, group, config):
    """The experts of a MoE layer: dispatch + fc1, SwiGLU, fc2 + combine."""
    y = a2a_gemm(x, counts, w1, group, config=config)
    gate, up = y.chunk(2, dim=1)
    return gemm_a2a(F.silu(gate) * up, counts, w2, group, config=config)


def _check_back_to_back(rank, world):
    os.environ["OVERLAP_TP_WATCHDOG_S"] = "120"
    group = dist.group.WORLD
    counts, x, w1, w2 = _mixtral_problem(rank, world)
    dz = torch.randn_like(x)
    config = OverlapConfig(method="signal", comm_sms=16, groups="auto")
    first = _moe_mlp(x, counts, w1, w2, group, config)
    assert rel_error(first, _moe_mlp(x, counts, w1, w2, group, OFF).float()) < 2e-2
    changed = torch.zeros((), dtype=torch.int64, device="cuda")
    for _ in range(200):   # no sync in between
        changed += (_moe_mlp(x, counts, w1, w2, group, config) != first).sum()
    torch.cuda.synchronize()
    assert int(changed) == 0, "results changed across back-to-back calls"

    def step():
        leaves = [t.detach().requires_grad_() for t in (x, w1, w2)]
        z = _moe_mlp(leaves[0], counts, leaves[1], leaves[2], group, config)
        return (z.detach(),) + torch.autograd.grad(z, leaves, dz)

    reference = step()
    for _ in range(50):
        changed += sum((a != b).sum() for a, b in zip(step(), reference))
    torch.cuda.synchronize()
    assert int(changed) == 0, "forward/backward results changed across back-to-back steps"


def test_200_back_to_back_calls():
    run_distributed(gpu_world(), _check_back_to_back, backend="nccl")


def _check_routings_with_other_group_counts(rank, world):
    """Two routings whose groups='auto' counts differ (2 and 6 groups per peer at EP 2: the group size target
    lowered to 1 MB for this hidden size), alternating, forward + backward of dispatch + fc1 and fc2 + combine on each, against
    off. The combine's local-rows counter of the 2-group routing is an exchange counter of the 6-group one: left
    counting, it would release that exchange before its tiles were stored (stale rows at the peer, no error)."""
    from overlap_tp.ops import moe_tile_plan
    os.environ["OVERLAP_TP_WATCHDOG_S"] = "120"
    moe_tile_plan.TARGET_GROUP_BYTES = 1 << 20
    group, hidden, ffn = dist.group.WORLD, 1024, 2048
    experts = 2 * world   # two per rank
    routings = []
    for remote in (20, 3000):   # rows each rank sends to each peer's experts: few, many
        counts = torch.full((world, experts), remote // 2, dtype=torch.int64)
        for s in range(world):
            counts[s, 2 * s:2 * s + 2] = 2000   # its own experts
        routings.append(counts)
    few, many = (parts_per_peer(c, "auto", hidden * 2) for c in routings)
    assert few == 2 < many, ("the routings must differ in groups", few, many)   # 2 and 6 at EP 2, 2 and 8 at EP 4
    config = OverlapConfig(method="signal", comm_sms=16, groups="auto")
    gen = torch.Generator(device="cuda").manual_seed(31 + rank)
    w1 = torch.randn(2, 2 * ffn, hidden, device="cuda", dtype=torch.bfloat16, generator=gen) / hidden ** 0.5
    w2 = torch.randn(2, hidden, ffn, device="cuda", dtype=torch.bfloat16, generator=gen) / ffn ** 0.5

    def step(x, counts, dz, config):
        leaves = [t.detach().requires_grad_() for t in (x, w1, w2)]
        z = _moe_mlp(leaves[0], counts, leaves[1], leaves[2], group, config)
        return (z.detach(),) + torch.autograd.grad(z, leaves, dz)

    for i, counts in enumerate(routings * 3):
        x, dz = (torch.randn(int(counts[rank].sum()), hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
                 for _ in range(2))
        for got, want, what in zip(step(x, counts, dz, config), step(x, counts, dz, OFF), ("z", "dx", "dw1", "dw2")):
            assert rel_error(got, want.float()) < 2e-2, f"call {i} rank {rank} {what}"


def test_routings_with_other_group_counts():
    run_distributed(gpu_world(), _check_routings_with_other_group_counts, backend="nccl")


def _check_first_exchange_beside_the_gemm(rank, world):
    """The process's first MoE exchange is a signaled dispatch over NCCL with its GEMM enqueued first (comm_sms > 0):
    NCCL's peer connections are made before it (Communicator.connect_peers). Made inside it, their setup would wait
    for the device while the GEMM's tiles spin on the exchange: a hang at the first iteration."""
    os.environ["OVERLAP_TP_WATCHDOG_S"] = "60"
    group = dist.group.WORLD
    counts, x, w1, w2 = _mixtral_problem(rank, world)
    config = OverlapConfig(method="signal", transport="nccl", comm_sms=8, groups=2)
    got = _moe_mlp(x, counts, w1, w2, group, config)
    torch.cuda.synchronize()
    assert rel_error(got, _moe_mlp(x, counts, w1, w2, group, OFF).float()) < 2e-2


def test_first_exchange_beside_the_gemm():
    run_distributed(gpu_world(), _check_first_exchange_beside_the_gemm, backend="nccl")


def _check_late_peer(rank, world):
    """Rank 1 starts its calls 2 s late (host) and, in a second round, behind ~0.5 s of GPU work: rank 0's
    a2a_gemm GEMM spins on chunks rank 1 has not sent yet (NCCL keeps its comm_sms), its gemm_a2a
    exchanges wait for rank 1's GEMM. Both complete with the right result."""
    os.environ["OVERLAP_TP_WATCHDOG_S"] = "120"
    group = dist.group.WORLD
    counts, x, w1, w2 = _mixtral_problem(rank, world, routing="uniform")
    reference = _moe_mlp(x, counts, w1, w2, group, OFF).float()
    for label, config in CONFIGS.items():
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 1:
            time.sleep(2.0)
        got = _moe_mlp(x, counts, w1, w2, group, config)
        torch.cuda.synchronize()
        assert rel_error(got, reference) < 2e-2, label
        dist.barrier()
        if rank == 1:
            torch.cuda._sleep(1_000_000_000)   # 1e9 GPU clock cycles, ~0.5 s
        got = _moe_mlp(x, counts, w1, w2, group, config)
        torch.cuda.synchronize()
        assert rel_error(got, reference) < 2e-2, label


def test_late_peer_does_not_hang():
    run_distributed(gpu_world(), _check_late_peer, backend="nccl")
