"""Every overlapped op captured in a CUDA graph and replayed (run on the device: `pytest -m gpu tests/gpu`).

Per op, method and transport, at t = gpu_world(): the plan is built and run eagerly once, then one call on
static input buffers is captured with torch.cuda.graph; 200 replays follow, each with fresh random inputs
copied into the static buffers, and every replay's output must equal, bit for bit, the eager call of the
same plan on the same inputs (the same kernels, plans and collectives). Then the same with one rank held
0.5 s on the GPU before its replay (a late peer must not break the protocol or hang). A capture of a shape
whose plan was never built is a clear error, and the op still runs eagerly after it.
"""
import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from gpu_checks import gpu_world
from overlap_tp import OverlapConfig, a2a_gemm, ag_gemm, gemm_a2a, gemm_ar, gemm_rs

pytestmark = pytest.mark.gpu

REPLAYS = 200
CASES = [   # (op, config)
    ("rs", OverlapConfig(method="signal")),
    ("rs", OverlapConfig(method="signal", schedule="tile_exact", groups=4)),
    ("rs", OverlapConfig(method="signal", groups=3, comm_sms=0)),
    ("rs", OverlapConfig(method="signal", transport="p2p", comm_sms=0)),
    ("rs", OverlapConfig(method="decompose", chunks=4)),
    ("rs", OverlapConfig(method="off")),
    ("ar", OverlapConfig(method="signal", groups=2)),
    ("ar", OverlapConfig(method="decompose", chunks=2)),
    ("ar", OverlapConfig(method="off")),
    ("ag", OverlapConfig(method="signal", transport="p2p", comm_sms=0)),
    ("ag", OverlapConfig(method="signal", transport="p2p", comm_sms=0, groups=4)),
    ("ag", OverlapConfig(method="signal", groups=2, comm_sms=16)),
    ("ag", OverlapConfig(method="decompose", chunks=2)),
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
    config = OverlapConfig(method="signal")
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
    config = OverlapConfig(method="signal", groups=2, comm_sms=4)
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
