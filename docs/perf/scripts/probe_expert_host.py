# Host time of the expert ops with a NEW routing every call (dynamic routing: what every training step does), at
# EP = the number of processes (one GPU each), the GPU kept busy behind a sleep so that the host never waits (at EP > 1
# every rank sleeps the same, so no rank waits for a late peer's exchange): the forward of a2a_gemm and of
# gemm_a2a (their backward states are built in the forward, after the GEMM's launch), each piece wall-clock timed,
# and "to launch": from the call to the signaled GEMM's launch, what the GPU waits on after the counts arrive.
# 4 and 32 local experts per rank. Rank 0 prints.
#   torchrun --nproc-per-node {1,2} docs/perf/scripts/probe_expert_host.py
import functools, os, statistics, time
from collections import defaultdict
import torch, torch.distributed as dist
from overlap_tp import OverlapConfig, a2a_gemm, gemm_a2a
from overlap_tp.bench.moe import routing_counts
from overlap_tp.kernels import signaled_gemm
from overlap_tp.kernels.launch import DirectKernel
from overlap_tp.ops import comm, expert, moe_tile_plan
from overlap_tp.tune.timing import sleep_cycles_per_ms

rank = int(os.environ.get("LOCAL_RANK", 0))
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
ep = dist.get_world_size()
dev, signal = torch.device("cuda", rank), OverlapConfig(method="signal")
spent, marks = defaultdict(list), {}


def timed(owner, name, label=None):
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            t1 = time.perf_counter()
            spent[label or name].append((t1 - t0) * 1e6)
            marks.setdefault(label or name, t1)
    setattr(owner, name, wrapper)


for name in ("routing", "check_inputs", "resolve_method", "agree_routing", "_dispatch_state", "_combine_state",
             "dispatch_plan", "combine_plan", "host_table_to", "_dispatch_signaled", "_combine_signaled",
             "dispatch_gemm", "gemm_combine", "_backward_state", "collectives"):
    timed(comm if name == "collectives" else expert, name)
timed(expert._ExpertState, "__init__", "_ExpertState")
timed(signaled_gemm.SignaledGemm, "__call__", "SignaledGemm launch")
for name in ("_plain_args", "specialization_key", "_jit_launch", "_descriptors"):   # the pieces of a new routing's first launch
    timed(signaled_gemm, name, f"  SignaledGemm.{name}")
timed(DirectKernel, "tma", "  DirectKernel.tma")
timed(DirectKernel, "__call__", "  DirectKernel launch")
timed(comm.CommEngine, "transfers_then_gemm")
timed(comm.CommEngine, "gemm_then_collectives")
timed(moe_tile_plan, "received_tiles")
timed(expert, "dispatch_row_tiles", "dispatch table on the GPU")
cycles = sleep_cycles_per_ms()
hidden, ffn = 4096, 14336
for local in (4, 32):
    experts = local * ep
    w1 = (torch.randn(local, 2 * ffn // (local // 4), hidden, device=dev) / 64).bfloat16().requires_grad_()
    w2 = (torch.randn(local, hidden, ffn // (local // 4), device=dev) / 64).bfloat16().requires_grad_()
    routings = [routing_counts(8192, experts, ep, "zipf", seed=s) for s in range(30)]

    def inputs(counts):
        """x [this rank's routed rows, H] and h [the rows it receives, F]."""
        received = int(counts[:, rank * local:(rank + 1) * local].sum())
        return (torch.randn(int(counts[rank].sum()), hidden, device=dev).bfloat16().requires_grad_(),
                torch.randn(received, w2.shape[2], device=dev).bfloat16().requires_grad_())

    for counts in routings[:3]:   # compile
        x, h = inputs(counts)
        a2a_gemm(x, counts, w1, config=signal), gemm_a2a(h, counts, w2, config=signal)
    torch.cuda.synchronize()
    for op, fn, which, w, on_gpu in (("a2a_gemm", a2a_gemm, 0, w1, False), ("gemm_a2a", gemm_a2a, 1, w2, False),
                                     ("a2a_gemm, counts also on the GPU", a2a_gemm, 0, w1, True)):
        spent.clear()
        expert._states.clear()      # every routing new to this pass
        expert._routings.clear()
        total, to_launch = [], []
        for counts in routings[3:]:
            inp = inputs(counts)[which]
            device_counts = counts.to(dev) if on_gpu else None   # OverlapMoELayer has them there already
            torch.cuda.synchronize()
            dist.barrier()
            torch.cuda._sleep(int(20 * cycles))
            marks.clear()
            t0 = time.perf_counter()
            fn(inp, counts, w, config=signal, device_counts=device_counts)
            total.append((time.perf_counter() - t0) * 1e6)
            to_launch.append((marks["SignaledGemm launch"] - t0) * 1e6)
            torch.cuda.synchronize()
        if rank == 0:
            print(f"EP {ep}, L={local} {op} forward, new routing: host median {statistics.median(total):.0f} us, to "
                  f"the GEMM's launch {statistics.median(to_launch):.0f} us", flush=True)
            calls = len(total)
            for name, values in sorted(spent.items(), key=lambda kv: -sum(kv[1])):
                print(f"    {name:22s} {statistics.median(values):7.0f} us x {len(values) / calls:.0f}")
if rank == 0:
    print(f"compiled signaled GEMMs shared by the routings' launchers: {len(signaled_gemm._shared)}")
dist.destroy_process_group()
