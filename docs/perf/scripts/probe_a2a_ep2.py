# Where a2a_gemm's signal path loses 1.2 ms at EP 2 over NVLink (session 13: ours 7.19 ms, sequential 5.88, the
# grouped signaled GEMM alone 5.99, the all-to-all alone 0.31; gemm_a2a is at 1.05x). Uniform routing, 8192
# tokens per rank, Mixtral-like fc1 (H 4096 -> 2 x 14336), 4 local experts of 8, top 2. Per method (off, signal):
#   eager:        ms per call of 20 back-to-back calls (what bench moe times);
#   GPU only:     the same 20 calls queued behind a 100 ms sleep kernel (host time hidden unless the host syncs),
#                 with the host's own ms per call and whether it stalled;
#   profile:      3 calls under torch.profiler: the top CUDA kernels and the trace ($OUT/a2a_<method>_rank0.json.gz).
#   torchrun --nproc-per-node 2 docs/perf/scripts/probe_a2a_ep2.py
import os, statistics, time
import torch, torch.distributed as dist
from overlap_tp import OverlapConfig, a2a_gemm
from overlap_tp.bench.moe import routing_counts
from overlap_tp.ops.moe_tile_plan import layout
from overlap_tp.tune.timing import sleep_cycles_per_ms

rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
group, ep = dist.group.WORLD, dist.get_world_size()
counts = routing_counts(8192, 8, ep, "uniform", 2)
lay = layout(counts, rank)
x = torch.randn(lay.tokens, 4096, device="cuda", dtype=torch.bfloat16)
w = torch.randn(lay.experts, 2 * 14336, 4096, device="cuda", dtype=torch.bfloat16) / 64
cycles = sleep_cycles_per_ms()
out_dir = os.environ.get("OUT", "/tmp")


def calls(config, n):
    for _ in range(n):
        a2a_gemm(x, counts, w, group, config=config)


for label, config in (("off", OverlapConfig(method="off")), ("signal", OverlapConfig(method="signal"))):
    calls(config, 3); torch.cuda.synchronize(); dist.barrier()
    eager, gpu, host = [], [], []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); calls(config, 20); b.record(); torch.cuda.synchronize()
        eager.append(a.elapsed_time(b) / 20)
        dist.barrier()
        torch.cuda._sleep(int(100 * cycles))
        a.record(); t0 = time.perf_counter(); calls(config, 20); t1 = time.perf_counter(); b.record()
        torch.cuda.synchronize()
        gpu.append(a.elapsed_time(b) / 20); host.append((t1 - t0) * 1e3 / 20)
        dist.barrier()
    print(f"rank {rank} {label}: eager {statistics.median(eager):.3f} ms/call, GPU only {statistics.median(gpu):.3f}, "
          f"host {statistics.median(host):.3f} ms/call (x20 = {20 * statistics.median(host):.1f} ms vs the 100 ms "
          f"sleep: {'STALLED' if 20 * statistics.median(host) > 95 else 'hidden'})", flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        calls(config, 3); torch.cuda.synchronize()
    if rank == 0:
        prof.export_chrome_trace(f"{out_dir}/a2a_{label}_rank0.json")
        os.system(f"gzip -f {out_dir}/a2a_{label}_rank0.json")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60), flush=True)
    dist.barrier()
dist.destroy_process_group()
