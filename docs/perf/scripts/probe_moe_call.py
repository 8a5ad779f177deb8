# Wall-clock host time of each piece of one a2a_gemm / gemm_a2a call with a cached routing, on ONE GPU (EP = 1),
# the GPU busy behind a sleep: the expert ops' functions wrapped with timers (cProfile's attribution was not
# trustworthy on these hosts). torchrun --nproc-per-node 1 docs/perf/scripts/probe_moe_call.py
import functools, statistics, time
from collections import defaultdict
import torch, torch.distributed as dist
from overlap_tp import OverlapConfig, a2a_gemm, gemm_a2a
from overlap_tp.bench.moe import routing_counts
from overlap_tp.ops import comm, expert
from overlap_tp.tune.timing import sleep_cycles_per_ms

torch.cuda.set_device(0)
dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
dev, signal = torch.device("cuda", 0), OverlapConfig(method="signal")
spent = defaultdict(list)


def timed(module, name):
    fn = getattr(module, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name].append((time.perf_counter() - t0) * 1e6)
    setattr(module, name, wrapper)


for name in ("routing", "check_counts", "layout", "check_inputs", "resolve_method", "agree_routing", "_dispatch_state",
             "_combine_state", "_dispatch_signaled", "_combine_signaled", "dispatch_gemm", "gemm_combine",
             "_staging_rows", "parts_per_peer", "_state", "expert_mm"):
    timed(expert, name)
timed(comm, "collectives")
w1 = (torch.randn(4, 28672, 4096, device=dev) / 64).bfloat16()
w2 = (torch.randn(4, 4096, 14336, device=dev) / 64).bfloat16()
counts = routing_counts(8192, 4, 1, "zipf")
x = torch.randn(int(counts.sum()), 4096, device=dev).bfloat16()
h = torch.randn(int(counts.sum()), 14336, device=dev).bfloat16()
for _ in range(2):
    a2a_gemm(x, counts, w1, config=signal)
    gemm_a2a(h, counts, w2, config=signal)
torch.cuda.synchronize()
spent.clear()
total = defaultdict(list)
cycles = sleep_cycles_per_ms()
for _ in range(20):
    torch.cuda._sleep(int(40 * cycles))
    for op, args in (("a2a_gemm", (x, counts, w1)), ("gemm_a2a", (h, counts, w2))):
        t0 = time.perf_counter()
        (a2a_gemm if op == "a2a_gemm" else gemm_a2a)(*args, config=signal)
        total[op].append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
print("per call, median us: " + ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in total.items()))
for name, values in sorted(spent.items(), key=lambda kv: -statistics.median(kv[1]) * len(kv[1])):
    print(f"  {name:20s} {statistics.median(values):7.0f} us x {len(values) // 20} per pair of calls")
dist.destroy_process_group()
