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
