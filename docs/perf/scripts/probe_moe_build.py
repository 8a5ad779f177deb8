# Host time of the expert ops' plan build on ONE GPU (EP = 1): a2a_gemm forward with a NEW routing every call,
# queued behind a sleep kernel (the host never waits for the GPU), under cProfile: where the ~0.45 ms that the
# MoE layer's GPU waits after the counts arrive (session 12's trace_gaps) goes.
#   torchrun --nproc-per-node 1 docs/perf/scripts/probe_moe_build.py
import cProfile, io, pstats, statistics, time
import torch, torch.distributed as dist
from overlap_tp import OverlapConfig, a2a_gemm
from overlap_tp.bench.moe import routing_counts
from overlap_tp.tune.timing import sleep_cycles_per_ms

torch.cuda.set_device(0)
dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
dev, signal = torch.device("cuda", 0), OverlapConfig(method="signal")
w = (torch.randn(4, 28672, 4096, device=dev) / 64).bfloat16()
x = torch.randn(16384, 4096, device=dev).bfloat16()
routings = [routing_counts(8192, 4, 1, "zipf", seed=s) for s in range(40)]
a2a_gemm(x, routings[0], w, config=signal)
torch.cuda.synchronize()
cycles = sleep_cycles_per_ms()
times = []
for counts in routings[1:20]:
    torch.cuda._sleep(int(30 * cycles))
    t0 = time.perf_counter()
    a2a_gemm(x, counts, w, config=signal)
    times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
print(f"a2a_gemm host us with a new routing (behind a sleep): median {statistics.median(times):.0f}")
same = []
for _ in range(10):
    torch.cuda._sleep(int(30 * cycles))
    t0 = time.perf_counter()
    a2a_gemm(x, routings[0], w, config=signal)
    same.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
print(f"a2a_gemm host us with the same routing: median {statistics.median(same):.0f}")
from overlap_tp import gemm_a2a
from overlap_tp.ops import moe_tile_plan
from overlap_tp.ops.expert import host_table_to
from overlap_tp.kernels.signaled_gemm import SignaledGemm
from overlap_tp.ops.common import gemm_programs
from overlap_tp.ops.watchdog import Watched


def breakdown(counts_list):
    """The pieces of one new routing's a2a_gemm state, each timed on its own (GPU busy behind a sleep)."""
    parts = {"dispatch_plan": [], "copy": [], "SignaledGemm+words": [], "Watched": []}
    torch.cuda._sleep(int(3000 * cycles))
    for counts in counts_list:
        t0 = time.perf_counter()
        plan = moe_tile_plan.dispatch_plan(counts, 0, 28672, 128, 256, 2)
        t1 = time.perf_counter()
        t2 = time.perf_counter()
        tiles = host_table_to(plan.tiles, dev)   # to the GPU through the pinned staging slots
        t3 = time.perf_counter()
        words = torch.zeros(1, dtype=torch.int32, device=dev)
        SignaledGemm(tiles, gemm_programs(dev, signal), signal, flags=words, wait_target=1)
        t4 = time.perf_counter()
        Watched("probe")
        t5 = time.perf_counter()
        for key, a, b in (("dispatch_plan", t0, t1), ("copy", t2, t3),
                          ("SignaledGemm+words", t3, t4), ("Watched", t4, t5)):
            parts[key].append((b - a) * 1e6)
    torch.cuda.synchronize()
    print("state build pieces, median us: " + ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in parts.items()),
          flush=True)


breakdown(routings[1:21])
breakdown(routings[1:21])   # the same tables again


def profiled(label, calls):
    torch.cuda._sleep(int(2000 * cycles))
    pr = cProfile.Profile()
    pr.enable()
    for call in calls:
        call()
    pr.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("cumulative").print_stats(32)
    print(f"==== {label}: {len(calls)} calls\n" + out.getvalue(), flush=True)


w2 = (torch.randn(4, 4096, 14336, device=dev) / 64).bfloat16()
h = torch.randn(16384, 14336, device=dev).bfloat16()
profiled("a2a_gemm, a new routing each call", [lambda c=c: a2a_gemm(x, c, w, config=signal) for c in routings[20:30]])
profiled("a2a_gemm, the same routing", [lambda: a2a_gemm(x, routings[0], w, config=signal)] * 10)
profiled("gemm_a2a, a new routing each call", [lambda c=c: gemm_a2a(h, c, w2, config=signal) for c in routings[30:40]])
dist.destroy_process_group()
