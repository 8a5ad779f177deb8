# Where the host time of one eager GEMM+ReduceScatter call on the p2p transport goes (session 40, issue 20): the
# plan's call and each of its parts, timed in the same interleaved rounds, beside this host's floors.
# Each variant: bursts of 8 calls behind a 40 ms sleep (the GPU never makes the host wait), one burst per variant
# per round, in turn (the hosts' speed drifts within a minute: session 16); the median per call and the median of
# its per-round ratio to a bare torch.mm.
# The parts run on a second plan of the same shape (instance 1) whose signal words nobody waits on, after the first
# plan's call was checked against the sequential result; their sum is compared with the whole call.
# --burst B: B calls per burst (8): the first calls after the host slept in a synchronize run slower (session 40).
#   torchrun --nproc-per-node 2 docs/perf/scripts/probe_host_parts.py [--rounds R] [--burst B]
import gc, os, platform, statistics, sys, time, timeit
import torch, torch.distributed as dist
import triton, triton.language as tl
from overlap_tp import OverlapConfig, gemm_rs
from overlap_tp.kernels.launch import DirectKernel, JitLauncher
from overlap_tp.ops import memops
from overlap_tp.ops.gemm_rs import GemmRS
from overlap_tp.tune.timing import enqueue_us, sleep_cycles_per_ms

dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
torch.cuda.set_device(dev)
dist.init_process_group("nccl", device_id=dev)
group, t, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
ROUNDS = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 30
BURST = int(sys.argv[sys.argv.index("--burst") + 1]) if "--burst" in sys.argv else 8
P2P, OFF = OverlapConfig(method="signal", transport="p2p", comm_sms=0), OverlapConfig(method="off")
M, N, K = 8192, 4096, 2048   # l8b.proj at TP 2, s 8192


@triton.jit
def _noop(x_ptr):
    tl.store(x_ptr, 1)


def burst_samples(fn, burst=BURST, rounds=1):
    cycles, times = sleep_cycles_per_ms(), []
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(40 * cycles))
        t0 = time.perf_counter()
        for _ in range(burst):
            fn()
        times.append((time.perf_counter() - t0) / burst * 1e6)
    torch.cuda.synchronize()
    return times


sets = [(torch.randn(M, K, device=dev, dtype=torch.bfloat16), torch.randn(N, K, device=dev, dtype=torch.bfloat16))
        for _ in range(3)]
a, w = sets[0]
plan = GemmRS(group, M, N, K, torch.bfloat16, dev, P2P)
got, want = plan(a, w), gemm_rs(a, w, group, config=OFF)
err = float((got.float() - want.float()).norm() / want.float().norm())
parts = GemmRS(group, M, N, K, torch.bfloat16, dev, P2P, instance=1).p2p
out = torch.empty(parts.m_local, parts.n, dtype=torch.bfloat16, device=dev)

# the launcher's arguments of the GEMM and the sum as the plan passes them (DirectKernel.__call__ spied once), to
# time the C launcher alone
launches, call = {}, DirectKernel.__call__
DirectKernel.__call__ = lambda self, grid, stream, *args: (launches.setdefault(self.compiled.name,
                                                                              (self, grid, stream, args)),
                                                           call(self, grid, stream, *args))
parts.store(a, w, None)
for _ in range(2):   # the sum's first launch on this plan goes through the JIT
    parts.sum(parts.flat_slots, out, 0)
DirectKernel.__call__ = call
word = torch.ones(1, dtype=torch.int32, device=dev)
batch = memops.MemOps([("write", word.data_ptr(), 1), ("wait", word.data_ptr(), 1)])
stream = torch._C._cuda_getCurrentRawStream(dev.index)
noop = JitLauncher(_noop)
noop[(1,)](word)
tiny = torch.zeros(1, device=dev)


def c_launcher(name):
    kernel, grid, stream, args = launches[name]
    x, y, z = (grid, 1, 1) if type(grid) is int else (tuple(grid) + (1, 1))[:3]
    launch, function, flags, packed = kernel._launch, kernel.function, kernel._flags, kernel.packed
    return lambda: launch(x, y, z, stream, function, *flags, None, None, packed, None, None, None, *args)


names = sorted(launches)
gemm_name = next(n for n in names if "sum" not in n)
sum_name = next(n for n in names if "sum" in n)
i = [0]


def rotating(fn):   # the operands rotate over three sets, as a layer's activations do
    def go():
        i[0] += 1
        a, w = sets[i[0] % 3]
        return fn(a, w)
    return go


variants = {
    "plan": rotating(lambda a, w: plan(a, w)),
    "api": rotating(lambda a, w: gemm_rs(a, w, group, config=P2P)),
    "matmul": rotating(lambda a, w: a @ w.t()),
    "check_call": rotating(lambda a, w: plan.check_call(a, w, None)),
    "empty(out)": lambda: torch.empty(parts.m_local, parts.n, dtype=torch.bfloat16, device=dev),
    "capturing+stream": lambda: (torch.cuda.is_current_stream_capturing(),
                                 torch._C._cuda_getCurrentRawStream(dev.index)),
    "memop batch": lambda: batch.issue(stream),
    "gemm (SignaledGemm)": rotating(lambda a, w: parts.store(a, w, None)),
    "gemm C launcher": c_launcher(gemm_name),
    "sum (SumSlots)": lambda: parts.sum(parts.flat_slots, out, 0),
    "sum C launcher": c_launcher(sum_name),
    "noop JitLauncher": lambda: noop[(1,)](word),
    "torch add_": lambda: tiny.add_(1),
}
# the noop's launch is spied separately (JitLauncher's first call launched it through the JIT)
DirectKernel.__call__ = lambda self, grid, stream, *args: (launches.setdefault(self.compiled.name,
                                                                              (self, grid, stream, args)),
                                                           call(self, grid, stream, *args))
noop[(1,)](word)
DirectKernel.__call__ = call
variants["noop C launcher"] = c_launcher("_noop")
for fn in variants.values():   # warm
    for _ in range(3):
        fn()
torch.cuda.synchronize()
times = {name: [] for name in variants}
for _ in range(ROUNDS):
    for name, fn in variants.items():
        times[name] += burst_samples(fn)
python_loop_us = min(timeit.repeat("sum(range(1000))", number=2000, repeat=5)) / 2000 * 1e6
if rank == 0:
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"burst {BURST}; t = {t}; rel_err {err:.1e}; host: {cpu}, {os.cpu_count()} cpus, Python {platform.python_version()}; "
          f"sum(range(1000)) {python_loop_us:.2f} us; gc thresholds {gc.get_threshold()}")
    print(f"GEMM {gemm_name}: {len(launches[gemm_name][3])} launcher arguments; sum {sum_name}: "
          f"{len(launches[sum_name][3])}")
    print(f"{'variant':<22} {'us/call':>8} {'q1':>7} {'q3':>7} {'x mm':>6}")
    for name, values in times.items():
        q = statistics.quantiles(values, n=4)
        ratio = statistics.median(v / m for v, m in zip(values, times["matmul"]))
        print(f"{name:<22} {statistics.median(values):8.1f} {q[0]:7.1f} {q[2]:7.1f} {ratio:6.2f}")
    parts_sum = sum(statistics.median(times[n]) for n in ("check_call", "empty(out)", "capturing+stream",
                                                           "gemm (SignaledGemm)", "sum (SumSlots)")) + \
        2 * statistics.median(times["memop batch"])
    print(f"parts (check_call + empty + capturing/stream + gemm + sum + 2 memop batches): {parts_sum:.1f} us "
          f"against the plan's {statistics.median(times['plan']):.1f}")

# how the time per call falls along a run of 64 calls behind a sleep: the first calls after the host blocked in a
# synchronize run slower (the H200 hosts are virtual machines)
SEGMENTS = ((0, 1), (1, 8), (8, 16), (16, 32), (32, 64))
decay = {}
for name in ("plan", "matmul", "noop C launcher", "empty(out)"):
    fn, per_segment = variants[name], {seg: [] for seg in SEGMENTS}
    for _ in range(ROUNDS):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(60 * sleep_cycles_per_ms()))
        stamps = [time.perf_counter()]
        for _ in range(64):
            fn()
            stamps.append(time.perf_counter())
        for lo, hi in SEGMENTS:
            per_segment[(lo, hi)].append((stamps[hi] - stamps[lo]) / (hi - lo) * 1e6)
    torch.cuda.synchronize()
    decay[name] = {seg: statistics.median(values) for seg, values in per_segment.items()}
if rank == 0:
    print("us per call along a run of 64 calls behind a sleep, by the calls' positions (median over rounds):")
    print(f"{'variant':<22} " + " ".join(f"{f'[{lo},{hi})':>8}" for lo, hi in SEGMENTS))
    for name, by_segment in decay.items():
        print(f"{name:<22} " + " ".join(f"{by_segment[seg]:8.1f}" for seg in SEGMENTS))
# tune.timing.enqueue_us (what `bench ops --host` reports), each rank's own figure
for name in ("plan", "api", "matmul"):
    fn = variants[name]
    mine = enqueue_us(lambda: fn(), [()], group)
    print(f"rank {rank}: enqueue_us {name} {mine:.1f}", flush=True)
dist.destroy_process_group()
