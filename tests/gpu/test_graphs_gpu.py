"""Every overlapped op captured in a CUDA graph and replayed (run on the device: `pytest -m gpu tests/gpu`).

Per op, method and transport, at t = gpu_world(): the plan is built and run eagerly once, then one call on
static input buffers is captured with torch.cuda.graph; 200 replays follow, each with fresh random inputs
copied into the static buffers, and every replay's output must equal, bit for bit, the eager call of the
same plan on the same inputs (the same kernels, plans and collectives). Then the same with one rank held
0.5 s on the GPU before its replay (a late peer must not break the protocol or hang). A capture of a shape
whose plan was never built is a clear error, and the op still runs eagerly after it. A replayed wait that can
never be satisfied (a lost counter signal; a peer that never replays) ends its process within
OVERLAP_TP_WATCHDOG_S with exit code 70 and a message naming the op and the wait.
"""
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from gpu_checks import gpu_world, run_two_ranks
from overlap_tp import OverlapConfig, a2a_gemm, ag_gemm, gemm_a2a, gemm_ar, gemm_rs

pytestmark = pytest.mark.gpu

REPLAYS = 200
CASES = [   # (op, config)
    ("rs", OverlapConfig(method="signal", transport="nccl")),
    ("rs", OverlapConfig(method="signal", transport="nccl", schedule="tile_exact", groups=4)),
    ("rs", OverlapConfig(method="signal", transport="nccl", groups=3, comm_sms=0)),
    ("rs", OverlapConfig(method="signal", transport="p2p", comm_sms=0, rs_transfer="epilogue")),
    ("rs", OverlapConfig(method="signal", transport="p2p", comm_sms=0, rs_transfer="copy")),   # copy-engine pushes
    ("rs", OverlapConfig(method="signal", transport="p2p", comm_sms=0, rs_transfer="copy", groups=3)),
    ("rs", OverlapConfig(method="decompose", transport="nccl", chunks=4)),
    ("rs", OverlapConfig(method="decompose", transport="p2p")),
    ("rs", OverlapConfig(method="decompose", transport="p2p", rs_transfer="copy")),   # cuBLAS regions, then pushes
    ("rs", OverlapConfig(method="off")),
    ("ar", OverlapConfig(method="signal", transport="nccl", groups=2)),
    ("ar", OverlapConfig(method="decompose", transport="nccl", chunks=2)),
    ("ar", OverlapConfig(method="off")),
    ("ag", OverlapConfig(method="signal", transport="p2p", comm_sms=0)),
    ("ag", OverlapConfig(method="signal", transport="p2p", comm_sms=0, groups=4)),
    ("ag", OverlapConfig(method="signal", transport="p2p", comm_sms=0, groups=4, copy_lanes=2)),
    ("ag", OverlapConfig(method="signal", transport="p2p", comm_sms=16, groups=4)),   # the SM pulls
    ("ag", OverlapConfig(method="signal", transport="nccl", groups=2, comm_sms=16)),
    ("ag", OverlapConfig(method="decompose", transport="nccl", chunks=2)),
    ("ag", OverlapConfig(method="decompose", transport="p2p", chunks=2)),
    ("ag", OverlapConfig(method="signal", transport="p2p", comm_sms=0, chunk_by="peer")),   # one peer per chunk
    ("ag", OverlapConfig(method="decompose", transport="p2p", chunks=1, chunk_by="peer")),
    ("ag", OverlapConfig(method="off")),
]
M, K, N = 4096, 2048, 4096   # l8b.proj.s4096-like; ag: M rows gathered from M/t per rank


def _operands(op, world, seed):
    torch.manual_seed(seed)
    rows = M // world if op == "ag" else M
    return (torch.randn(rows, K, device="cuda", dtype=torch.bfloat16),
            torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5)


def _run(op):
    return {"rs": gemm_rs, "ar": gemm_ar, "ag": ag_gemm}[op]


def _check_replays(rank, world):
    group = dist.group.WORLD
    for op, config in CASES:
        run = _run(op)
        a_static, w_static = _operands(op, world, 11 + rank)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):        # eager warm-up: builds the plan, compiles the kernels
            for _ in range(3):
                run(a_static, w_static, group, config=config)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_static = run(a_static, w_static, group, config=config)
        for replay in range(REPLAYS):
            a, w = _operands(op, world, 1000 * replay + 7 * rank + 1)
            if replay == REPLAYS - 1 and rank == 1:
                torch.cuda._sleep(int(0.5 * 1.9e9))   # ~0.5 s at ~1.9 GHz: a late peer
            a_static.copy_(a)
            w_static.copy_(w)
            graph.replay()
            expected = run(a, w, group, config=config)
            torch.cuda.synchronize()
            assert torch.equal(out_static, expected), (op, config, replay)
        del graph
        torch.cuda.synchronize()
        dist.barrier()


def test_every_op_replays_bitwise_equal_to_eager():
    run_distributed(gpu_world(), _check_replays, backend="nccl")


def _check_unbuilt_capture(rank, world):
    group = dist.group.WORLD
    config = OverlapConfig(method="signal", transport="nccl")
    a, w = _operands("rs", world, 3 + rank)
    a = a[:2048].contiguous()             # a shape no plan was built for
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="during CUDA graph capture"):
        with torch.cuda.graph(graph):
            gemm_rs(a, w, group, config=config)
    torch.cuda.synchronize()
    got = gemm_rs(a, w, group, config=config)       # still runs eagerly afterwards
    ref = gemm_rs(a, w, group, config=OverlapConfig(method="off"))
    torch.cuda.synchronize()
    assert float((got.float() - ref.float()).norm() / ref.float().norm()) < 1e-2


def test_capture_of_an_unbuilt_plan_is_a_clear_error():
    run_distributed(gpu_world(), _check_unbuilt_capture, backend="nccl")


def _check_expert_replays(rank, world):
    """a2a_gemm / gemm_a2a with static routing (the same counts every step: capacity factor with padding)
    captured and replayed, each replay equal to the eager call."""
    group = dist.group.WORLD
    experts, hidden, ffn = 2 * world, 1024, 2048
    config = OverlapConfig(method="signal", transport="nccl", groups=2, comm_sms=4)
    counts = torch.full((world, experts), 256, dtype=torch.int64)
    tokens = int(counts[rank].sum())
    rows = int(counts[:, rank * experts // world:(rank + 1) * experts // world].sum())
    torch.manual_seed(5 + rank)
    x_static = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(experts // world, ffn, hidden, device="cuda", dtype=torch.bfloat16) / hidden ** 0.5
    h_static = torch.randn(rows, ffn, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(experts // world, hidden, ffn, device="cuda", dtype=torch.bfloat16) / ffn ** 0.5
    with torch.no_grad():
        for _ in range(2):
            a2a_gemm(x_static, counts, w1, group, config=config)
            gemm_a2a(h_static, counts, w2, group, config=config)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_static = a2a_gemm(x_static, counts, w1, group, config=config)
            z_static = gemm_a2a(h_static, counts, w2, group, config=config)
        for replay in range(50):
            x, h = torch.randn_like(x_static), torch.randn_like(h_static)
            x_static.copy_(x)
            h_static.copy_(h)
            graph.replay()
            y = a2a_gemm(x, counts, w1, group, config=config)
            z = gemm_a2a(h, counts, w2, group, config=config)
            torch.cuda.synchronize()
            assert torch.equal(y_static, y) and torch.equal(z_static, z), replay


def test_expert_ops_with_static_routing_replay_bitwise_equal():
    run_distributed(gpu_world(), _check_expert_replays, backend="nccl")


def _ended_by_the_watchdog(script):
    """Run `script` in a fresh process with a 2 s watchdog: the watchdog must end it (exit 70) within a minute,
    before it prints NOT REACHED. Returns its stderr."""
    env = dict(os.environ, OVERLAP_TP_WATCHDOG_S="2")
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 70, result.stderr[-2000:]
    assert "NOT REACHED" not in result.stdout
    assert time.monotonic() - started < 60
    return result.stderr


def test_a_replayed_wait_that_never_passes_ends_the_process():
    """A captured counter wait whose counter nothing raises: the deadline kernel reports it to the watchdog,
    which ends the process naming the plan and the counter."""
    script = textwrap.dedent("""
        import torch
        from overlap_tp.ops.comm import CounterWaits, comm_engine
        engine = comm_engine(torch.device("cuda", 0))
        engine.prepare_graph_waits()
        counters = torch.zeros(2, dtype=torch.int32, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            current = engine.current()
            engine.fork(current, True)
            engine.wait_counter(CounterWaits(counters, (0, 5)), 1, True, "test op")    # nothing will ever raise counter 1
            engine.join(current, True)
        graph.replay()
        torch.cuda.synchronize()
        print("NOT REACHED")
    """)
    stderr = _ended_by_the_watchdog(script)
    assert ("overlap_tp watchdog: test op waited 2 s for tile counter 1 to reach 5 (its GEMM's tiles of group 1) "
            "in a CUDA graph replay and saw 0") in stderr, stderr[-2000:]


def test_a_replay_that_never_completes_ends_the_process():
    """A graph whose stream wait-value nothing satisfies (what a replayed NCCL kernel or the copy-engine handshake
    waiting for a dead peer looks like: no deadline kernel inside): the replay is watched whole, and the watchdog
    ends the process naming it."""
    script = textwrap.dedent("""
        import torch
        from overlap_tp.ops import memops, watchdog
        watchdog.watch_graph_replays()
        watchdog.watch_graph_replays()            # idempotent
        word = torch.zeros(1, dtype=torch.int32, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            memops.wait_value(torch.cuda.current_stream().cuda_stream, word.data_ptr(), 1)   # never raised
        graph.replay()
        torch.cuda.synchronize()
        print("NOT REACHED")
    """)
    stderr = _ended_by_the_watchdog(script)
    assert "overlap_tp watchdog: a CUDA graph replay (torch.cuda.CUDAGraph at 0x" in stderr, stderr[-2000:]
    assert "did not complete within 2 s" in stderr


_PEER_NEVER_REPLAYS = textwrap.dedent("""
    import os, sys, time
    import torch
    import torch.distributed as dist
    from overlap_tp import OverlapConfig, ag_gemm, gemm_rs
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    sm_pulls = os.environ["PEER_TEST_OP"] == "ag-sm-pulls"   # else gemm_rs over p2p
    config = OverlapConfig(method="signal", transport="p2p", comm_sms=16 if sm_pulls else 0)
    op = ag_gemm if sm_pulls else gemm_rs
    torch.manual_seed(rank)
    a = torch.randn(2048 if sm_pulls else 4096, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16) / 64
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):        # eager: builds the plan, compiles the kernels
        for _ in range(3):
            op(a, w, config=config)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op(a, w, config=config)
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 1:                        # alive, but never replays: rank 0's wait for its signal never passes
        time.sleep(120)
        os._exit(0)
    print(f"REPLAY AT {time.time()}", flush=True)
    graph.replay()
    torch.cuda.synchronize()
    print("NOT REACHED", flush=True)
    os._exit(0)
""")


@pytest.mark.parametrize("op, waited_for", [
    ("rs-p2p", "gemm_rs(M=4096, N=4096, K=2048, t=2, signal/p2p) waited 5 s for rank 1's"),
    # the READY spin inside the SM pull kernel (kernels/peer_copy.py), beside a GEMM spinning on its flags
    ("ag-sm-pulls", "ag_gemm(M=2048, N=4096, K=2048, t=2, signal/p2p) waited 5 s for every peer's READY signal "
                    "(group of 2, the SM pulls)"),
])
def test_a_peer_that_never_replays_ends_the_waiting_rank(op, waited_for):
    """An op captured on two ranks; only rank 0 replays. Its wait for rank 1's signal must end the process within
    OVERLAP_TP_WATCHDOG_S (5 s) plus the kernel's report, exit code 70, with a message naming the op, the transport
    and the signal, instead of hanging forever: gemm_rs over the p2p transport (a deadline wait kernel), ag_gemm with
    its pulls on SMs (the pull kernel's own READY spin)."""
    gpu_world()   # skips below 2 GPUs
    returncode, out, err, ended = run_two_ranks(_PEER_NEVER_REPLAYS, dict(os.environ, OVERLAP_TP_WATCHDOG_S="5",
                                                                          PEER_TEST_OP=op))
    assert "REPLAY AT" in out, err[-3000:]
    replayed = float(out.split("REPLAY AT ")[1].split()[0])
    assert returncode == 70, err[-3000:]
    assert f"overlap_tp watchdog: {waited_for}" in err, err[-3000:]
    assert "in a CUDA graph replay" in err
    assert "NOT REACHED" not in out
    assert ended - replayed < 20, ended - replayed


SPLIT_CONFIGS = [OverlapConfig(method="signal", transport="p2p", comm_sms=0, groups=4),
                 OverlapConfig(method="signal", transport="nccl", groups=2, comm_sms=16)]


def _split_plans(group, world, config):
    """Two AllGather+GEMM plans of one shape, one per half of a token split; on the p2p transport each with a
    gathered buffer of its own (the shape's shared one holds one call at a time)."""
    from overlap_tp.ops.ag_gemm import AgGemm, OwnGather
    device = torch.device("cuda", torch.cuda.current_device())
    m = M // world
    return [AgGemm(group, m, N, K, torch.bfloat16, device, config,
                   gather=OwnGather(group, m, K, torch.bfloat16, device).buffer if config.transport == "p2p" else None)
            for _ in range(2)]


def _split(plans, shards, w):
    """The token split's order: both halves' transfers issued, then half A's GEMM and work that reads it, then half
    B's GEMM (whose transfers ran beside A's)."""
    started = [plan.start(shard) for plan, shard in zip(plans, shards)]
    out_a = plans[0].finish(started[0], w)
    between = out_a * 2   # half A's consumer, issued before half B's GEMM
    out_b = plans[1].finish(started[1], w)
    return out_a, between, out_b


def _check_split_replays(rank, world):
    group = dist.group.WORLD
    for config in SPLIT_CONFIGS:
        plans = _split_plans(group, world, config)
        shards = [_operands("ag", world, 21 + 2 * rank + h)[0] for h in range(2)]
        w = _operands("ag", world, 5)[1]
        out_a, between, out_b = _split(plans, shards, w)   # eager: bit for bit each plan's own call
        assert torch.equal(out_a, plans[0](shards[0], w)) and torch.equal(out_b, plans[1](shards[1], w)), config
        assert torch.equal(between, out_a * 2), config
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = _split(plans, shards, w)
        for replay in range(REPLAYS // 4):
            fresh = [_operands("ag", world, 1000 * replay + 7 * rank + h)[0] for h in range(2)]
            if replay == REPLAYS // 4 - 1 and rank == 1:
                torch.cuda._sleep(int(0.5 * 1.9e9))   # a late peer
            for shard, new in zip(shards, fresh):
                shard.copy_(new)
            graph.replay()
            expected = [plans[h](fresh[h], w) for h in range(2)]
            torch.cuda.synchronize()
            assert torch.equal(static[0], expected[0]) and torch.equal(static[2], expected[1]), (config, replay)
            assert torch.equal(static[1], expected[0] * 2), (config, replay)
        del graph, static
        torch.cuda.synchronize()
        dist.barrier()


def test_split_allgather_gemm_replays_bitwise_equal_to_its_call():
    """AgGemm.start()/finish() (the token split's building block), two halves in flight: eager and 50 graph replays
    with fresh inputs, each bit for bit the plans' own calls; the last replay with a late peer."""
    run_distributed(gpu_world(), _check_split_replays, backend="nccl")
