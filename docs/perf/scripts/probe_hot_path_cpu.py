# The op plans' per-call Python on a CPU (no GPU): host microseconds per call of a prebuilt plan and of the functional
# API (issue 20), the plans' own code running its CUDA (eager) path, with everything below Python stubbed:
#   - the driver (memops: stream waits/writes, batched memory operations, events, copy-engine copies) and NCCL
#     (the raw communicator's library) by Python no-ops returning 0 (ctypes on the driver costs ~1 us a call on the
#     GPU hosts; counted);
#   - the Triton launches: DirectKernel's C launcher and its TMA encode (kernel.tma's cache runs as on the GPU), the
#     JIT's first launch of a variant;
#   - cuBLAS (torch.mm / addmm / matmul return `out` without computing: ~30-40 us each on the GPU hosts);
#   - torch.cuda.is_current_stream_capturing -> False, torch._C._cuda_getCurrentRawStream -> 7, symmetric memory
#     (CPU buffers; peers' addresses made up: nothing is read through them), the device properties.
# The plan is built through its own constructor on a CPU device that reports type 'cuda' (FakeCuda) after OpPlan's
# checks, so its CUDA-path state (engine, signals, launchers, watchdog event) is built; tensors stay on the CPU, so
# the calls' torch.empty are CPU allocations. Not exercised: check_call's TMA alignment check (gated on CUDA tensors, or
# since 2026-11 on the device OpPlan was built for: the CPU here), and the decompose methods' joins in
# reduction.joined() (gated on a.device.type). overlap_tp and its kernels/ are imported from this script's tree.
# Per case: us per call (the best and the median of --reps runs of --calls calls), the stubbed calls per call (driver,
# NCCL, kernel launches, cuBLAS), and the Python function calls per call (cProfile's count, builtins included: the
# measure that does not depend on the host's speed; --profile prints the top functions by own time).
# Both ranks run the same calls at t = 2 (spawned here, gloo; rank 0 prints); the calls never communicate.
#   python docs/perf/scripts/probe_hot_path_cpu.py [--t 1|2] [--calls 2000] [--reps 7] [--profile] [--names]
#                                                   [--label TEXT]
import argparse, contextlib, cProfile, ctypes, os, pstats, statistics, sys, tempfile, time
from types import SimpleNamespace

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--t", type=int, default=1)
parser.add_argument("--calls", type=int, default=2000)
parser.add_argument("--reps", type=int, default=7)
parser.add_argument("--profile", action="store_true")
parser.add_argument("--names", action="store_true", help="also the stubbed driver / NCCL entry points per plan call")
parser.add_argument("--label", default="")
parser.add_argument("--only", default="", help="comma-separated case names")
ARGS = parser.parse_args()

CPU = torch.device("cpu")
COUNT = {"driver": 0}
NAMES = {}   # entry point -> calls, while counted() runs (the timed runs count nothing by name)
COUNTING = [False]


def _ok(*args):
    COUNT["driver"] += 1
    return 0


class FakeLib:
    """libcuda and libnccl: every entry point a no-op returning success (counted; by name inside counted())."""

    def __getattr__(self, name):
        def entry(*args):   # one Python call per driver call, as _ok: the count of Python calls stays comparable
            COUNT["driver"] += 1
            if COUNTING[0]:
                NAMES[name] = NAMES[name] + 1 if name in NAMES else 1
            return 0
        setattr(self, name, entry)
        return entry


class FakeCuda:
    """The plan's device: 'cuda' to the plan's code, equal to the CPU device its tensors are on."""
    type, index = "cuda", None

    def __eq__(self, other):
        return other is self or other == CPU

    def __ne__(self, other):
        return not self.__eq__(other)

    def __hash__(self):
        return hash("FakeCuda")

    def __repr__(self):
        return "cuda(fake)"


FAKE = FakeCuda()


def _cpu(kwargs):
    if isinstance(kwargs.get("device"), FakeCuda):
        kwargs["device"] = CPU
    return kwargs


@contextlib.contextmanager
def building():
    """Plan builds: tensors asked for on FakeCuda made on the CPU."""
    saved = {name: getattr(torch, name) for name in ("zeros", "empty", "tensor", "ones", "full")}
    saved_to = torch.Tensor.to
    for name, fn in saved.items():
        setattr(torch, name, lambda *a, _fn=fn, **k: _fn(*a, **_cpu(k)))
    torch.Tensor.to = lambda self, *a, **k: (self if a and isinstance(a[0], FakeCuda)
                                             else saved_to(self, *a, **_cpu(k)))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch, name, fn)
        torch.Tensor.to = saved_to


def install():
    from overlap_tp.kernels import launch, peer_copy, signaled_gemm, sum_slots
    from overlap_tp.ops import comm, common, memops, nccl, watchdog
    from torch.distributed import _symmetric_memory as symm_mem

    memops._lib = FakeLib()
    nccl._lib = FakeLib()
    torch.cuda.is_current_stream_capturing = lambda: False
    torch._C._cuda_getCurrentRawStream = lambda index: 7

    class Stream:   # the comm engine's stream (a CPU build's torch.cuda.Stream has no priority_range)
        cuda_stream = 9

        def __init__(self, *args, **kwargs):
            pass

        @staticmethod
        def priority_range():
            return 0, -1
    torch.cuda.Stream = Stream
    torch.cuda.synchronize = lambda *a, **k: None
    watchdog.prepare_graph_waits = lambda device: None
    watchdog.watch_graph_replays = lambda: None
    common.device_properties = lambda device: SimpleNamespace(multi_processor_count=132, major=9)

    class Kernel(launch.DirectKernel):
        """DirectKernel's own tma() and __call__, the C launcher and the descriptor encode stubbed."""

        def __init__(self, compiled=None):
            self.compiled, self.function, self.packed, self.direct = compiled, None, None, True
            meta = {"swizzle": 0, "elem_size": 2, "elem_type": 0, "block_size": [64, 64]}
            self._tma_meta, self._launch, self._flags = [meta, meta], _ok, (False, False)
            self._fill, self._dtype_to_host, self._descriptors = (lambda *a: object()), {0: 0}, {}

    signaled_gemm.DirectKernel = sum_slots.DirectKernel = peer_copy.DirectKernel = Kernel
    signaled_gemm._jit_launch = lambda grid, args, options: _ok()
    jit = type("Jit", (), {"__getitem__": lambda self, grid: lambda *a, **k: _ok()})()
    sum_slots.sum_slots_kernel = peer_copy.signaled_pull_kernel = jit
    watchdog.watchdog().open_mailbox(torch.zeros(1, dtype=torch.int64))   # the SM pulls' deadline (no pinned memory)

    def mm(*args, out=None, **kwargs):
        COUNT["driver"] += 1
        return out if out is not None else args[0]
    torch.mm = torch.addmm = torch.matmul = mm

    class Handle:
        def __init__(self, buf, group):
            rank, t = dist.get_rank(group), dist.get_world_size(group)
            # peers' addresses: 2**32 apart (aligned as the checks want; never dereferenced)
            self.buffer_ptrs = [buf.data_ptr() + (p - rank) * 2 ** 32 for p in range(t)]
            self.buf = buf

        def barrier(self, channel=0):
            pass

        def get_buffer(self, rank, shape, dtype, offset=0):
            return torch.empty(shape, dtype=dtype)

    symm_mem.empty = lambda *shape, dtype=None, device=None: torch.empty(*shape, dtype=dtype)
    symm_mem.rendezvous = Handle

    engine = comm.CommEngine.__new__(comm.CommEngine)
    engine.device, engine.stream, engine.raw, engine._lanes = FAKE, object(), 11, {}
    engine._events = {False: (memops.Event(), memops.Event()), True: (memops.Event(), memops.Event())}
    comm._engines[("cuda", None)] = engine

    communicators = {}

    def collectives(group, device, max_ctas):
        if (group, max_ctas) not in communicators:
            c = nccl.Communicator.__new__(nccl.Communicator)
            c.comm, c.rank, c.world, c.device_index = ctypes.c_void_p(), dist.get_rank(group), \
                dist.get_world_size(group), None
            c._reduce_scatter, c._all_reduce = _ok, _ok
            communicators[group, max_ctas] = c
        return communicators[group, max_ctas]
    comm.collectives = collectives

    original = common.OpPlan.__init__

    def plan_init(self, *args, **kwargs):
        """OpPlan's checks and config on the CPU, then the CUDA path's device and watched event."""
        original(self, *args, **kwargs)
        self.device = FAKE
        self.watched = watchdog.Watched(self.describe(self.config), event=memops.Event())
        self.watched.progress_word(torch.zeros(1, dtype=torch.int32))   # no pinned memory
    common.OpPlan.__init__ = plan_init


def cases():
    from overlap_tp import OverlapConfig
    p2p = OverlapConfig(method="signal", transport="p2p", comm_sms=0)
    nccl = OverlapConfig(method="signal")
    cublas_p2p = OverlapConfig(method="decompose", transport="p2p", comm_sms=0)
    # (name, op, M, N, K, config): probe_host_t1.py's cases, at shapes small enough for CPU allocations (the plans'
    # per-call work does not grow with the shape: groups and chunks come from the config)
    return [("rs p2p", "rs", 1024, 512, 64, p2p), ("rs nccl", "rs", 1024, 512, 64, nccl),
            ("ag p2p", "ag", 1024, 384, 64, p2p), ("ag nccl", "ag", 1024, 384, 64, nccl),
            ("ar nccl", "ar", 1024, 512, 64, nccl), ("rs cublas-p2p", "rs", 1024, 512, 64, cublas_p2p),
            ("ag cublas-p2p", "ag", 1024, 384, 64, cublas_p2p),
            ("ag p2p by-peer", "ag", 1024, 384, 64, OverlapConfig(method="signal", transport="p2p", comm_sms=0,
                                                                   chunk_by="peer")),
            # the pulls on 16 SMs: one kernel launch with the handshakes inside (session 34)
            ("ag p2p sm16", "ag", 1024, 384, 64, OverlapConfig(method="signal", transport="p2p", comm_sms=16)),
            # the ReduceScatter's partials pushed by the copy engines (rs_transfer 'copy', the default at t > 2)
            ("rs p2p copy", "rs", 1024, 512, 64, OverlapConfig(method="signal", transport="p2p", comm_sms=0,
                                                                rs_transfer="copy"))]


def per_call_us(fn, a, w, calls, reps):
    """(best, median) over `reps` runs of `calls` calls back to back, us per call."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(a, w)
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return min(times), statistics.median(times)


def counted(fn, a, w, calls=50):
    COUNT["driver"] = 0
    NAMES.clear()
    COUNTING[0] = True
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn(a, w)
    pr.disable()
    COUNTING[0] = False
    stats = pstats.Stats(pr)
    return COUNT["driver"] / calls, stats.total_calls / calls, stats


def main(rank, world, init_file):
    if "overlap_tp.kernels" not in sys.modules:   # a spawned rank
        this_tree()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    install()
    from overlap_tp import ag_gemm, gemm_ar, gemm_rs
    from overlap_tp.ops.ag_gemm import AgGemm
    from overlap_tp.ops.gemm_ar import GemmAR
    from overlap_tp.ops.gemm_rs import GemmRS
    plans, apis = {"rs": GemmRS, "ag": AgGemm, "ar": GemmAR}, {"rs": gemm_rs, "ag": ag_gemm, "ar": gemm_ar}
    group = dist.group.WORLD
    only = [name.strip() for name in ARGS.only.split(",") if name.strip()]
    for name, op, m, n, k, config in cases():
        if only and name not in only:
            continue
        rows = m // world if op == "ag" else m
        a = torch.randn(rows, k, dtype=torch.bfloat16)
        w = torch.randn(n, k, dtype=torch.bfloat16)
        with building():
            plan = plans[op](group, rows, n, k, torch.bfloat16, CPU, config)
            api = apis[op]
            api(a, w, group, config=config)   # builds the cached plan
        variants = {"plan": lambda a, w: plan(a, w), "api": lambda a, w: api(a, w, group, config=config)}
        row = [f"{ARGS.label}t={world} {name:14s}"]
        for vname, fn in variants.items():
            for _ in range(50):
                fn(a, w)
            best, median = per_call_us(fn, a, w, ARGS.calls, ARGS.reps)
            driver, pycalls, stats = counted(fn, a, w)
            row.append(f"{vname} {best:5.1f} us (median {median:5.1f}; stubbed calls {driver:4.1f}, "
                       f"python calls {pycalls:4.0f})")
            if ARGS.names and vname == "plan" and rank == 0:
                print(f"--- {name} plan: driver / NCCL entry points per call: "
                      + ", ".join(f"{entry} {n / 50:g}" for entry, n in sorted(NAMES.items())), flush=True)
            if ARGS.profile and vname == "plan" and rank == 0:
                print(f"--- {name} plan: per call of the op, under cProfile: own us, with callees us, calls")
                rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:24]
                for (file, line, func), (calls, _, own, total, _) in rows:
                    where = func if file == "~" else f"{os.path.relpath(file)}:{line}({func})"
                    print(f"    {own / 50 * 1e6:6.2f} {total / 50 * 1e6:7.2f} {calls / 50:5.1f}  {where}")
        if rank == 0:
            print("  ".join(row), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def this_tree():
    """Import overlap_tp from the tree this script is in, its kernels/ folder as overlap_tp.kernels (an editable
    install of another checkout would otherwise supply that subpackage: setup.py's package_dir)."""
    import importlib.util
    root = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
    sys.path.insert(0, root)
    spec = importlib.util.spec_from_file_location("overlap_tp.kernels", os.path.join(root, "kernels", "__init__.py"),
                                                  submodule_search_locations=[os.path.join(root, "kernels")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["overlap_tp.kernels"] = module
    spec.loader.exec_module(module)


if __name__ == "__main__":
    this_tree()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    init = tempfile.mktemp(prefix="probe_hot_path_")
    if ARGS.t == 1:
        main(0, 1, init)
    else:
        import torch.multiprocessing as mp
        mp.spawn(main, args=(ARGS.t, init), nprocs=ARGS.t)
