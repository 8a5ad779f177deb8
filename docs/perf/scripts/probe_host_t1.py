# Host time per call of the op plans on ONE GPU (t = 1: the 2-GPU kinds were withheld in session 12; at t = 2 with
# --nproc-per-node 2, rank 0 prints), while
# the GPU is held busy so the host never waits for it (tune.timing.queued_ms), and a cProfile of the calls; from
# session 19 also the cuBLAS-over-p2p plans (method decompose, transport p2p).
# At t = 1 a plan runs every piece of its t = 2 call except the per-peer driver calls (the p2p GEMM+RS: 2
# batched stream memory operations per call at t = 2 since session 39; the AllGather+GEMM's pulls: 3 + 1 copy per
# peer), whose cost is measured here too (`memop us`), so the t = 2 host time is estimated as the t = 1 time + those.
# The burst figures interleave the variants round by round (the hosts' speed drifts up to 2x within a minute:
# session 16 call 7), each with its median, quartiles and the median of its per-round ratio to a bare cuBLAS call.
# --rounds R: rounds of the interleaved bursts (30). --label TEXT: printed first on every line (A/B of two code
# versions run one after the other: run_s17_one.sh, in git at aa14ff3).
# --only "rs p2p,rs cublas-p2p": those cases only (session 39). --removed: see REMOVED. --burst, --warm: below.
# --unbound: the plan also with its GEMM and sum launched through __call__ (before session 40's launch_checked).
# --eager: the plan also as a twin whose eager calls issue one by one, without ops/replay.py's graphs (session 41).
# --ab: the plan also with its Triton kernels launched through CompiledKernel.run instead of DirectKernels
# (kernels/launch.py), in the same rounds.
#   torchrun --nproc-per-node 1 docs/perf/scripts/probe_host_t1.py [--profile] [--ab]
#   torchrun --nproc-per-node 2 docs/perf/scripts/probe_host_t1.py --one-gpu [--profile]     (t = 2 on ONE GPU)
import cProfile, gc, os, pstats, statistics, sys, time
import torch, torch.distributed as dist
from overlap_tp import OverlapConfig, ag_gemm, gemm_ar, gemm_rs
from overlap_tp.kernels.launch import DirectKernel
from overlap_tp.kernels.signaled_gemm import SignaledGemm
from overlap_tp.kernels.sum_slots import SumSlots
from overlap_tp.ops import memops
from overlap_tp.ops.ag_gemm import AgGemm
from overlap_tp.ops.gemm_ar import GemmAR
from overlap_tp.ops.gemm_rs import GemmRS
from overlap_tp.tune.timing import queued_ms, sleep_cycles_per_ms

# --one-gpu (with --nproc-per-node 2 on a machine with ONE GPU): both ranks on cuda:0, a gloo group, the p2p
# transports' symmetric memory replaced by CUDA IPC (tests/gpu/peers_on_one_gpu.py), the p2p cases only and no `off`
# (gloo has no reduce-scatter): the host's side of a t = 2 call (every peer signal, wait and copy is enqueued), not
# the GPU's (the two contexts time-slice it).
ONE_GPU = "--one-gpu" in sys.argv
dev = torch.device("cuda", 0 if ONE_GPU else int(os.environ.get("LOCAL_RANK", 0)))
torch.cuda.set_device(dev)
if ONE_GPU:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tests", "gpu"))
    from peers_on_one_gpu import install
    install()
    dist.init_process_group("gloo")
else:
    dist.init_process_group("nccl", device_id=dev)
group, t, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
P2P, NCCL, OFF = (OverlapConfig(method="signal", transport="p2p", comm_sms=0), OverlapConfig(method="signal"),
                  OverlapConfig(method="off"))
CUBLAS_P2P = OverlapConfig(method="decompose", transport="p2p", comm_sms=0)   # session 19 (4 chunks, as the flags)
# (op, M, N, K, config): l8b.proj GEMM+RS (p2p, nccl, cuBLAS over p2p), l8b.qkv AllGather+GEMM (p2p, cuBLAS over
# p2p), l8b.proj GEMM+AllReduce at s 8192 (shards at TP 2)
CASES = [("rs", 8192, 4096, 2048, P2P), ("rs", 8192, 4096, 2048, NCCL), ("ag", 8192, 3072, 4096, P2P),
         ("ar", 8192, 4096, 2048, NCCL), ("rs", 8192, 4096, 2048, CUBLAS_P2P), ("ag", 8192, 3072, 4096, CUBLAS_P2P),
         ("ar", 8192, 4096, 2048, P2P)]   # the last: gemm_ar's p2p transport (session 41)
NAMES = {id(P2P): "p2p", id(NCCL): "nccl", id(CUBLAS_P2P): "cublas-p2p"}
if ONE_GPU:
    CASES = [case for case in CASES if case[4].transport == "p2p"]
if "--only" in sys.argv:   # --only "rs p2p,rs cublas-p2p": those cases (op and config name), in this order
    ONLY = sys.argv[sys.argv.index("--only") + 1].split(",")
    CASES = [case for name in ONLY for case in CASES if f"{case[0]} {NAMES.get(id(case[4]))}" == name]
PLAN = {"rs": GemmRS, "ag": AgGemm, "ar": GemmAR}
API = {"rs": gemm_rs, "ag": ag_gemm, "ar": gemm_ar}


def host_us(fn, sets):
    """One call behind a sleep kernel (tune.timing.queued_ms: what `bench ops --host` reports): a cold call."""
    return 1e3 * queued_ms(fn, sets, group, rounds=20)[0]


def burst_us(fn, sets, burst=8, rounds=10):
    """Per call of `burst` calls back to back behind a 40 ms sleep (warm: as a layer's calls follow each other;
    few enough launches that the queue never fills)."""
    return statistics.median(burst_samples(fn, sets, burst, rounds))


# --burst B --warm W (session 40): B timed calls per burst after W untimed ones of the same run (8 and 0 before):
# the first calls after a synchronize run 2-5x slower on the H200 hosts (probe_host_parts.py), and a burst of 8 from a
# cold start was mostly its first call
BURST = int(sys.argv[sys.argv.index("--burst") + 1]) if "--burst" in sys.argv else 8
WARM = int(sys.argv[sys.argv.index("--warm") + 1]) if "--warm" in sys.argv else 0


def burst_samples(fn, sets, burst=BURST, rounds=10):
    cycles, times = sleep_cycles_per_ms(), []
    for r in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(40 * cycles))
        for i in range(WARM):
            fn(*sets[i % len(sets)])
        t0 = time.perf_counter()
        for i in range(burst):
            fn(*sets[i % len(sets)])
        times.append((time.perf_counter() - t0) / burst * 1e6)
    torch.cuda.synchronize()
    return times


_launch_checked = (SignaledGemm.launch_checked, SumSlots.launch_checked)


def unbound(on):
    """--unbound: the plans' launches through SignaledGemm / SumSlots.__call__ (on) or launch_checked (off)."""
    def switch():
        SignaledGemm.launch_checked = SignaledGemm.__call__ if on else _launch_checked[0]
        SumSlots.launch_checked = SumSlots.__call__ if on else _launch_checked[1]
    return switch


ROUNDS = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 30
LABEL = sys.argv[sys.argv.index("--label") + 1] + " " if "--label" in sys.argv else ""


def interleaved(variants, sets, rounds=ROUNDS):
    """{name: (median us, 25th, 75th percentile, median of the per-round ratio to variants['matmul'])}: one burst
    of each variant per round, in turn. A variant is fn or (fn, before): before() runs ahead of its burst."""
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, variant in variants.items():
            fn, before = variant if isinstance(variant, tuple) else (variant, None)
            if before is not None:
                before()
            times[name] += burst_samples(fn, sets, rounds=1)
    out = {}
    for name, values in times.items():
        q = statistics.quantiles(values, n=4)
        ratio = statistics.median(v / m for v, m in zip(values, times["matmul"]))
        out[name] = (statistics.median(values), q[0], q[2], ratio)
    if "plan_removed" in times:   # the per-round difference: what the driver calls removed in session 39 cost
        out["removed_cost"] = statistics.median(r - p for r, p in zip(times["plan_removed"], times["plan"]))
    return out


# --removed: per case, the driver calls session 39 took off its eager path, issued after each call of the plan in an
# extra variant (plan_removed), so the per-round difference to `plan` is their cost on this host: "memop" the SUMMED
# signal's batched write (now the sum kernel's stores), "event" the watchdog's event record (now the sum kernel's
# progress word, or the join's own event)
REMOVED = {"rs p2p": ("memop", "event"), "rs cublas-p2p": ("memop", "event"), "rs nccl": ("event",),
           "ag p2p": ("event",), "ar nccl": ("event",), "ag cublas-p2p": ("event",)}
_removed = {}


def removed_calls(kinds):
    if not _removed:
        scratch = torch.zeros(1, dtype=torch.int32, device=dev)
        batch, event = memops.MemOps([("write", scratch.data_ptr(), 1)]), memops.Event()
        _removed.update(scratch=scratch, memop=lambda: batch.issue(torch._C._cuda_getCurrentRawStream(dev.index)),
                        event=lambda: event.record(torch._C._cuda_getCurrentRawStream(dev.index)))
    return [_removed[kind] for kind in kinds]


def memop_us(n=200):
    """One stream memory operation through ctypes, n back to back behind a sleep (few enough not to fill the
    queue: session 12's first probe queued 2000 and measured the queue draining)."""
    word = torch.ones(1, dtype=torch.int32, device=dev)
    stream = torch.cuda.current_stream().cuda_stream
    out = {}
    calls = [("write_value", lambda: memops.write_value(stream, word.data_ptr(), 1)),
             ("wait_value", lambda: memops.wait_value(stream, word.data_ptr(), 1))]
    if hasattr(memops, "MemOps"):   # a wait and a write in one batched call (session 17 on)
        batch = memops.MemOps([("wait", word.data_ptr(), 1), ("write", word.data_ptr(), 1)])
        calls.append(("batch wait+write", lambda: batch.issue(stream)))
    for name, call in calls:
        out[name] = burst_us(lambda: call(), [()], burst=n, rounds=5)
    return out


def profile(fn, sets, n=60, top=22):
    """cProfile of n calls behind a sleep: per function, its own time and its time with callees, in us per call of
    fn (the profiler inflates both; the ranking is what it shows)."""
    for _ in range(3):
        fn(*sets[0])
    torch.cuda.synchronize()
    torch.cuda._sleep(int(1e9))
    pr = cProfile.Profile()
    pr.enable()
    for i in range(n):
        fn(*sets[i % len(sets)])
    pr.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(pr).stats   # {(file, line, name): (calls, primitive calls, own s, with callees s, callers)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    lines = [f"    {'own us':>7} {'total us':>8} {'calls':>5}  function (per call of the op, {n} calls)"]
    for (file, line, name), (calls, _, own, total, _) in rows:
        where = name if file == "~" else f"{file.split('site-packages/')[-1]}:{line}({name})"
        lines.append(f"    {own / n * 1e6:7.1f} {total / n * 1e6:8.1f} {calls / n:5.1f}  {where}")
    return "\n".join(lines)


memops_us = memop_us()
if rank == 0:
    print(f"{LABEL}t = {t}; memop us (one stream memory operation through ctypes): {memops_us}", flush=True)
for op, m, n, k, ours in CASES:
    rows = m if op != "ag" else m // t   # ag_gemm's operand is this rank's shard
    sets = [(torch.randn(rows, k, device=dev, dtype=torch.bfloat16),
             torch.randn(n, k, device=dev, dtype=torch.bfloat16)) for _ in range(3)]
    plan = PLAN[op](group, rows, n, k, torch.bfloat16, dev, ours)
    got = plan(*sets[0])
    if ONE_GPU:   # against the sequential result computed from every rank's operands (the same seeds: sets differ
        # per rank only through the generator's state, so gather them)
        everyone = [None] * t
        dist.all_gather_object(everyone, [x.cpu() for x in sets[0]], group=group)
        if op == "rs":
            full = sum(a.float() @ w.float().t() for a, w in everyone)
            want = full.chunk(t)[rank]
        else:
            want = torch.cat([a for a, _ in everyone]).float() @ sets[0][1].float().cpu().t()
        err = float((got.float().cpu() - want).norm() / want.norm())
    else:
        want = API[op](*sets[0], group, config=OFF)
        err = float((got.float() - want.float()).norm() / want.float().norm())
    row = {"op": op, "M": m, "N": n, "K": k, "config": NAMES[id(ours)], "rel_err": f"{err:.1e}",
           "host_plan_us": host_us(lambda a, w: plan(a, w), sets),
           "host_api_us": host_us(lambda a, w: API[op](a, w, group, config=ours), sets)}
    if not ONE_GPU:
        row["host_off_us"] = host_us(lambda a, w: API[op](a, w, group, config=OFF), sets)
    row["host_matmul_us"] = host_us(lambda a, w: a @ w.t(), sets)
    kernels = [o for o in gc.get_objects() if isinstance(o, DirectKernel) and o._launch is not None]

    def direct(on):
        def set_all():
            for kernel in kernels:
                kernel.direct = on
        return set_all
    variants = {"plan": (lambda a, w: plan(a, w), direct(True)),
                "api": lambda a, w: API[op](a, w, group, config=ours),
                "matmul": lambda a, w: a @ w.t()}
    if not ONE_GPU:
        variants["off"] = lambda a, w: API[op](a, w, group, config=OFF)
    removed = REMOVED.get(f"{op} {NAMES[id(ours)]}", ())
    if "--removed" in sys.argv and removed:   # the plan, then the driver calls session 39 removed from its path
        extra = removed_calls(removed)
        variants["plan_removed"] = (lambda a, w: (plan(a, w), [issue() for issue in extra]), direct(True))
    if "--unbound" in sys.argv:   # session 40's A/B: the plan with its GEMM and sum launched as before (__call__)
        variants["plan_unbound"] = (lambda a, w: plan(a, w), unbound(True))
        variants["plan"] = (variants["plan"][0], unbound(False))
    if "--eager" in sys.argv:   # session 41's A/B: a twin plan whose eager calls issue one by one (no graph replays)
        os.environ["OVERLAP_TP_EAGER_GRAPHS"] = "0"
        twin = PLAN[op](group, rows, n, k, torch.bfloat16, dev, ours)
        del os.environ["OVERLAP_TP_EAGER_GRAPHS"]
        twin(*sets[0])
        variants["plan_eager"] = lambda a, w: twin(a, w)
    if "--ab" in sys.argv:
        variants["plan_run"] = (lambda a, w: plan(a, w), direct(False))
        variants["matmul"] = (variants["matmul"], direct(True))
    for name, result in interleaved(variants, sets).items():
        if name == "removed_cost":
            row["removed_us"] = f"{result:.1f} ({'+'.join(removed)})"
            continue
        median, q1, q3, ratio = result
        row[f"burst_{name}_us"] = f"{median:.1f} [{q1:.1f}-{q3:.1f}] ({ratio:.2f}x matmul)"
    if rank == 0:
        print(LABEL + " ".join(f"{key}={value:.1f}" if isinstance(value, float) else f"{key}={value}"
                       for key, value in row.items()), flush=True)
    if "--profile" in sys.argv:
        report = profile(lambda a, w: plan(a, w), sets)
        if rank == 0:
            print(report, flush=True)
dist.destroy_process_group()
