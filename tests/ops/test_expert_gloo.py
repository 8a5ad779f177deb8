"""a2a_gemm / gemm_a2a under gloo with 1, 2 and 4 CPU processes against one dense single-process
computation (every rank's tokens routed by the same counts, per-expert matmuls in fp32, autograd).

`off` is the pure-torch reference (all_to_all_single + per-segment matmuls); `decompose` checks the
plan's parts with cuBLAS-style matmuls; `signal` runs the grouped Triton kernel in the CPU interpreter
over the real plans (a2a_gemm's chunks behind ready flags, gemm_a2a's groups behind counters) with the
real per-group exchanges (batch_isend_irecv here). Forward and backward (input and weight grads)."""
import pytest
import torch

from overlap_tp import OverlapConfig, a2a_gemm, gemm_a2a
from distributed import run_distributed
from problems import SMALL_TILES, assert_each_raises

L, H, N, F = 2, 32, 48, 48   # N, F not multiples of block_n = 32: a tile's W box overhangs into the next expert
CONFIGS = [
    OverlapConfig(method="off"),
    OverlapConfig(method="decompose", groups=2, **SMALL_TILES),
    OverlapConfig(method="signal", groups=2, **SMALL_TILES),
    OverlapConfig(method="signal", groups=3, **SMALL_TILES),
]


def count_matrices(ep):
    """Random counts with zeros, one hot expert, a rank with no tokens and a rank that receives nothing."""
    g = torch.Generator().manual_seed(ep)
    E = ep * L
    random = torch.randint(0, 12, (ep, E), generator=g)
    hot = torch.randint(0, 3, (ep, E), generator=g)
    hot[:, 0] = 37                                       # expert 0 (rank 0) takes most tokens, > 2 row tiles
    empty = torch.randint(0, 9, (ep, E), generator=g)
    empty[ep - 1] = 0                                    # the last rank sends nothing
    if ep > 1:
        empty[:, :L] = 0                                 # rank 0 receives nothing
    return [random, hot, empty]


def routing(counts):
    """Per rank r, its received rows in the contract's order (source rank major, local expert minor) as
    (source rank, row of the source's x, global expert); the source's x is sorted by global expert."""
    ep, E = counts.shape
    starts = torch.cumsum(counts, 1) - counts
    return [[(s, int(starts[s, r * L + l]) + i, r * L + l)
             for s in range(ep) for l in range(L) for i in range(int(counts[s, r * L + l]))] for r in range(ep)]


def dense(counts, seed):
    """Inputs and output gradients of every rank, and the fp32 reference outputs and gradients."""
    ep = counts.shape[0]
    route = routing(counts)
    tokens = counts.sum(1).tolist()
    received = [len(rows) for rows in route]
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    xs, w1, gys = [rand(t, H) for t in tokens], rand(ep * L, N, H), [rand(r, N) for r in received]
    hs, w2, gzs = [rand(r, F) for r in received], rand(ep * L, H, F), [rand(t, H) for t in tokens]
    starts = [sum(tokens[:s]) for s in range(ep)]          # rank s's tokens in the concatenation of all
    rows = [torch.tensor([starts[s] + i for s, i, _ in route[r]], dtype=torch.long) for r in range(ep)]
    experts = [torch.tensor([e for _, _, e in route[r]], dtype=torch.long) for r in range(ep)]
    x32, h32 = [[t.float().requires_grad_() for t in ts] for ts in (xs, hs)]
    w1_32, w2_32 = w1.float().requires_grad_(), w2.float().requires_grad_()
    every_x = torch.cat(x32)
    ys = [torch.einsum("rh,rnh->rn", every_x[rows[r]], w1_32[experts[r]]) for r in range(ep)]
    outs = [torch.einsum("rf,rhf->rh", h32[r], w2_32[experts[r]]) for r in range(ep)]
    zs = torch.zeros(sum(tokens), H).index_add(0, torch.cat(rows), torch.cat(outs)).split(tokens)
    loss = sum((y * gy.float()).sum() for y, gy in zip(ys, gys)) + sum((z * gz.float()).sum() for z, gz in zip(zs, gzs))
    loss.backward()
    ref = dict(y=ys, dx=[x.grad for x in x32], dw1=w1_32.grad, z=zs, dh=[h.grad for h in h32], dw2=w2_32.grad)
    return xs, w1, gys, hs, w2, gzs, ref


def close(got, ref, what):
    assert got.shape == ref.shape, (what, tuple(got.shape), tuple(ref.shape))
    got, ref = got.detach().double(), ref.detach().double()
    error = float((got - ref).norm())
    assert error <= 1e-2 * float(ref.norm()) + 1e-3, (what, error, float(ref.norm()))


def _check(rank, world):
    experts = slice(rank * L, (rank + 1) * L)
    signaled = []   # (counts, x, w1, h, w2, y, z) of the signal runs with groups=2
    for m, counts in enumerate(count_matrices(world)):
        xs, w1, gys, hs, w2, gzs, ref = dense(counts, seed=10 * world + m)
        for config in CONFIGS:
            what = (m, config.method, config.groups)
            x = xs[rank].clone().requires_grad_()
            w = w1[experts].contiguous().requires_grad_()
            y, xr = a2a_gemm(x, counts, w, config=config, return_received=True)
            assert y.dtype == torch.bfloat16 and not xr.requires_grad
            close(y, ref["y"][rank], what + ("y",))
            received = [xs[s][i] for s, i, _ in routing(counts)[rank]]
            assert torch.equal(xr, torch.stack(received) if received else x.new_empty(0, H)), what
            y.backward(gys[rank])
            close(x.grad, ref["dx"][rank], what + ("dx",))
            close(w.grad, ref["dw1"][experts], what + ("dw1",))

            h = hs[rank].clone().requires_grad_()
            w = w2[experts].contiguous().requires_grad_()
            z = gemm_a2a(h, counts, w, config=config)
            close(z, ref["z"][rank], what + ("z",))
            z.backward(gzs[rank])
            close(h.grad, ref["dh"][rank], what + ("dh",))
            close(w.grad, ref["dw2"][experts], what + ("dw2",))
            if config == CONFIGS[2]:
                signaled.append((counts, xs[rank], w1[experts].contiguous(), hs[rank], w2[experts].contiguous(),
                                 y.detach(), z.detach()))
    # again, after every other call moved the counters and flags on by its own plan's tiles: the same bits
    for counts, x, w1, h, w2, y, z in signaled:
        assert torch.equal(a2a_gemm(x, counts, w1, config=CONFIGS[2]), y)
        assert torch.equal(gemm_a2a(h, counts, w2, config=CONFIGS[2]), z)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_expert_ops_match_dense(world):
    run_distributed(world, _check)


def _check_bad_input(rank, world):
    counts = torch.tensor([[3, 1, 2, 0], [1, 2, 0, 4]])
    x = torch.randn(int(counts[rank].sum()), 32).to(torch.bfloat16)
    w = torch.randn(2, 16, 32).to(torch.bfloat16)
    h = torch.randn(int(counts[:, 2 * rank:2 * rank + 2].sum()), 16).to(torch.bfloat16)
    w2 = torch.randn(2, 32, 16).to(torch.bfloat16)
    signal = OverlapConfig(method="signal", **SMALL_TILES)
    cases = [
        (lambda: a2a_gemm(x, counts.int(), w), "CPU int64"),
        (lambda: a2a_gemm(x, counts[:1], w), "EP group has 2 ranks"),
        (lambda: a2a_gemm(x, torch.zeros(2, 3, dtype=torch.int64), w), "multiple of ep"),
        (lambda: a2a_gemm(x, -counts, w), "negative"),
        (lambda: a2a_gemm(x[1:], counts, w), "rows but counts gives"),
        (lambda: a2a_gemm(x, counts, w[:1]), "experts"),
        (lambda: a2a_gemm(x, counts, w[..., :16].contiguous()), "inner dimensions"),
        (lambda: a2a_gemm(x, counts, w[0]), "2-D input and w"),
        (lambda: a2a_gemm(x.float(), counts, w.float()), "bf16 or fp16"),
        (lambda: a2a_gemm(x, counts, w.half()), "bf16 or fp16"),
        (lambda: a2a_gemm(x, counts, torch.cat([w, w], 1)[:, ::2]), "row-major"),
        (lambda: gemm_a2a(h[1:], counts, w2), "rows but counts gives"),
        (lambda: gemm_a2a(h, counts, w2[:, :, :8].contiguous()), "inner dimensions"),
        (lambda: a2a_gemm(x, counts, w, config=OverlapConfig(method="signal", transport="p2p")),
         "transport='p2p' needs CUDA tensors"),
        (lambda: a2a_gemm(x, counts, w, config=OverlapConfig(method="decompose", transport="p2p")),
         "transport='p2p' needs CUDA tensors"),
        (lambda: gemm_a2a(h, counts, w2, config=OverlapConfig(method="decompose", transport="p2p")),
         "transport='p2p' needs CUDA tensors"),
        (lambda: gemm_a2a(h, counts, w2, config=OverlapConfig(method="signal", groups=(1, 2))), "parts per peer"),
        (lambda: gemm_a2a(torch.randn(len(h), 12).to(torch.bfloat16), counts, torch.randn(2, 32, 12).to(torch.bfloat16),
                          config=signal), "multiple of 8"),
        (lambda: a2a_gemm(x, counts, w, device_counts=counts), "device_counts must be a contiguous CUDA int64"),
        (lambda: gemm_a2a(h, counts, w2, device_counts=counts.int()), "device_counts must be a contiguous CUDA"),
    ]
    assert_each_raises(cases)
    with pytest.warns(UserWarning, match="method='auto' runs 'off'"):
        got = a2a_gemm(x, counts, w)
    assert torch.equal(got, a2a_gemm(x, counts, w, config=OverlapConfig(method="off")))


def test_bad_input_is_named():
    run_distributed(2, _check_bad_input)


def _check_routing_agreement(rank, world):
    from overlap_tp.ops import comm
    from overlap_tp.ops.expert import _agreed_ops, _agreed_routings
    _agreed_ops.clear()
    _agreed_routings.clear()
    group = comm.resolve_ep_group(None)
    counts = torch.tensor([[3, 1, 2, 2], [1, 3, 2, 2]])
    seen = counts.clone()
    if rank == 1:
        seen[0] = torch.tensor([1, 3, 2, 2])     # rank 1 thinks rank 0 routes otherwise: same totals everywhere
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(8, 32, generator=gen).to(torch.bfloat16)
    w1 = torch.randn(2, 16, 32, generator=gen).to(torch.bfloat16)
    w2 = torch.randn(2, 32, 16, generator=gen).to(torch.bfloat16)
    for config in CONFIGS:
        with pytest.raises(ValueError, match=r"disagree on counts \(rank 0: counts=\[\[3, 1, 2, 2\], \[1, 3, 2, 2\]\]; "
                                             r"rank 1: counts=\[\[1, 3, 2, 2\], \[1, 3, 2, 2\]\]\)"):
            a2a_gemm(x, seen, w1, config=config)

    def step(counts, **kwargs):
        """One forward + backward of both ops with these counts; returns how many agreements it ran."""
        before = comm._agreements.get(group, 0)
        xg, a, b = x.clone().requires_grad_(), w1.clone().requires_grad_(), w2.clone().requires_grad_()
        y = a2a_gemm(xg, counts, a, config=CONFIGS[2], **kwargs)
        z = gemm_a2a(y[:, :16].contiguous(), counts, b, config=CONFIGS[2], **kwargs)
        z.sum().backward()
        return comm._agreements.get(group, 0) - before

    # a2a_gemm [N=16, K=32] was agreed above, and each backward runs the other op on the same sizes (gemm_a2a's
    # dgrad is a2a_gemm with w2's transpose: [16, 32]): gemm_a2a [32, 16] once, then one agreement per routing
    assert step(counts) == 1 + 1
    assert step(counts) == 0                      # the same routing again: agreed already
    other = torch.tensor([[2, 2, 2, 2], [2, 2, 3, 1]])
    assert step(other) == 1                       # a new routing: one agreement for the step's four calls
    assert step(torch.tensor([[4, 0, 2, 2], [2, 2, 1, 3]]), counts_agreed=True) == 0


def test_ranks_that_disagree_on_counts_get_a_clear_error_and_a_routing_is_agreed_once():
    run_distributed(2, _check_routing_agreement)


def _check_backward_states_built_in_forward(rank, world):
    """A new routing's signaled states, each op's and its backward's, are all built during the forward, where the
    host works while the GPU runs the forward's GEMMs; the backward builds none."""
    from overlap_tp.ops import expert
    built = []
    real_init = expert._ExpertState.__init__

    def counting_init(self, kind, *args, **kwargs):
        built.append(kind)
        real_init(self, kind, *args, **kwargs)

    expert._ExpertState.__init__ = counting_init
    try:
        counts = torch.tensor([[5, 0, 9, 3], [2, 7, 1, 4]])[:world] if world == 2 else torch.tensor([[5, 0, 9, 3]])
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(int(counts[rank].sum()), 32, generator=gen).to(torch.bfloat16).requires_grad_()
        experts = counts.shape[1] // world
        # H 32, fc1 N = 2F = 32, F 16: the backward's dispatch (N = F) is a plan of its own; its combine (N = H)
        # is the forward combine's plan (a plan depends on counts and N, not on K)
        w1 = torch.randn(experts, 32, 32, generator=gen).to(torch.bfloat16).requires_grad_()
        w2 = torch.randn(experts, 32, 16, generator=gen).to(torch.bfloat16).requires_grad_()
        y = a2a_gemm(x, counts, w1, config=CONFIGS[2])
        z = gemm_a2a(y[:, :16].contiguous(), counts, w2, config=CONFIGS[2])
        assert sorted(built) == ["a2a_gemm", "a2a_gemm", "gemm_a2a"], built
        z.float().sum().backward()
        assert len(built) == 3, built
    finally:
        expert._ExpertState.__init__ = real_init


@pytest.mark.parametrize("world", [1, 2])
def test_backward_states_are_built_in_the_forward(world):
    run_distributed(world, _check_backward_states_built_in_forward)


def _check_one_rank_moves_nothing(rank, world):
    """With one rank there is nothing to exchange: a2a_gemm's received rows are x itself (every method: no
    all_to_all copy, no local-block copy), and the results still match the off path, gradients included."""
    counts = torch.tensor([[5, 0, 9, 3]])
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(17, H, generator=gen).to(torch.bfloat16)
    w1 = torch.randn(4, N, H, generator=gen).to(torch.bfloat16)
    results = []
    for config in CONFIGS[:3]:
        xg, wg = x.clone().requires_grad_(), w1.clone().requires_grad_()
        y, xr = a2a_gemm(xg, counts, wg, config=config, return_received=True)
        assert xr.data_ptr() == xg.data_ptr(), config.method
        y.float().square().sum().backward()
        results.append((y.detach().float(), xg.grad.float(), wg.grad.float()))
    for got in results[1:]:
        for g, want in zip(got, results[0]):
            assert torch.allclose(g, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def test_one_rank_moves_nothing():
    run_distributed(1, _check_one_rank_moves_nothing)


def _check_routings_share_the_op(rank, world):
    """A new routing builds its plan and table only: every routing's state of one op (same N, config, group) uses
    the op's one set of synchronisation words, and the results stay right as routings alternate."""
    from overlap_tp.ops import expert
    gen = torch.Generator().manual_seed(5 + rank)
    w1 = torch.randn(L, N, H, generator=gen).to(torch.bfloat16)
    routings = [torch.tensor([[3, 5, 0, 7], [6, 1, 4, 2]]), torch.tensor([[9, 0, 2, 2], [1, 8, 3, 0]])]
    for counts in routings + routings:
        x = torch.randn(int(counts[rank].sum()), H, generator=gen).to(torch.bfloat16)
        got = a2a_gemm(x, counts, w1, config=CONFIGS[2])
        want = a2a_gemm(x, counts, w1, config=CONFIGS[0])
        assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    states = [s for key, s in expert._states.items() if key[0] == "a2a_gemm" and key[3] == N]
    assert len(states) >= 2 and all(s.words is states[0].words for s in states)


def test_routings_share_the_ops_words():
    run_distributed(2, _check_routings_share_the_op)


def _check_routings_with_other_group_counts(rank, world):
    """groups='auto' gives each routing its own number of groups, so a word that is one routing's local-rows counter
    (raised by the GEMM, waited on by no collective) is another's exchange counter. Every combine leaves its counters
    at 0: a count left over would release that exchange before its tiles were stored (on GPUs the MoE
    layer's 200 steps went wrong at the second routing)."""
    from overlap_tp.ops import moe_tile_plan
    moe_tile_plan.TARGET_GROUP_BYTES = 16 * H * 2   # "auto": a group per 16 remote rows of H bf16 columns
    few = torch.tensor([[2, 1, 1, 0], [0, 1, 3, 2]])          # 1 remote row each way: 2 groups, local rows counter 2
    many = torch.tensor([[5, 5, 40, 40], [40, 40, 5, 5]])     # 80 each way: 5 groups, group 2 has tiles
    signal = OverlapConfig(method="signal", groups="auto", **SMALL_TILES)
    assert [moe_tile_plan.parts_per_peer(c, "auto", H * 2) for c in (few, many)] == [2, 5]
    gen = torch.Generator().manual_seed(9 + rank)
    w1, w2 = (torch.randn(L, N, H, generator=gen).to(torch.bfloat16),
              torch.randn(L, H, F, generator=gen).to(torch.bfloat16))

    def step(x, counts, dz, config):
        """dispatch + fc1, fc2 + combine, forward and backward: the four expert calls of a training step"""
        leaves = [t.detach().requires_grad_() for t in (x, w1, w2)]
        z = gemm_a2a(a2a_gemm(leaves[0], counts, leaves[1], config=config), counts, leaves[2], config=config)
        return (z.detach(),) + torch.autograd.grad(z, leaves, dz)

    for counts in (few, many, few, many):
        x, dz = (torch.randn(int(counts[rank].sum()), H, generator=gen).to(torch.bfloat16) for _ in range(2))
        for got, want, what in zip(step(x, counts, dz, signal), step(x, counts, dz, CONFIGS[0]), ("z", "dx", "dw1", "dw2")):
            assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.abs().max())), what


def test_routings_with_other_group_counts_leave_no_count_behind():
    run_distributed(2, _check_routings_with_other_group_counts)


def _check_peers_connected_before_the_first_exchange(rank, world):
    """Every MoE exchange goes through collectives whose peers were connected first (comm.exchange_collectives:
    NCCL connects send/receive peers at their first exchange and waits for the device there, which hung beside a
    spinning GEMM on GPUs): each op and method that exchanges calls connect_peers before exchanging."""
    from overlap_tp.ops import comm
    events = []

    class Recording(comm.TorchCollectives):
        def connect_peers(self):
            events.append("connect")

        def exchange(self, sends, recvs, stream=None):
            events.append("exchange")
            return super().exchange(sends, recvs, stream)

    made = comm.collectives
    comm.collectives = lambda group, device, max_ctas: Recording(made(group, device, max_ctas).group)
    try:
        counts = torch.tensor([[3, 5, 0, 7], [6, 1, 4, 2]])
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(int(counts[rank].sum()), H, generator=gen).to(torch.bfloat16)
        w1 = torch.randn(L, N, H, generator=gen).to(torch.bfloat16)
        h = torch.randn(int(counts[:, rank * L:(rank + 1) * L].sum()), F, generator=gen).to(torch.bfloat16)
        w2 = torch.randn(L, H, F, generator=gen).to(torch.bfloat16)
        for config in CONFIGS[1:]:   # decompose and signal exchange through the collectives (off: all_to_all)
            for op, inp, w in ((a2a_gemm, x, w1), (gemm_a2a, h, w2)):
                events.clear()
                op(inp, counts, w, config=config)
                assert "exchange" in events, (op.__name__, config.method)
                assert events[0] == "connect", (op.__name__, config.method, events[:3])
    finally:
        comm.collectives = made


def test_moe_exchanges_connect_their_peers_first():
    run_distributed(2, _check_peers_connected_before_the_first_exchange)
