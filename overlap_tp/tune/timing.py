"""GPU timing shared by the tuner and the benchmarks: CUDA events around back-to-back calls after a
warm-up and a barrier, each rank's median, the slowest rank's as the result (a step waits for it)."""
import functools
import statistics
import time

import torch
import torch.distributed as dist

# How the tuner times its candidates: "eager" (CUDA events around back-to-back calls: where a call's GPU work is shorter
# than its host time, that measures the host's pace) or "graphs" (replays of a captured CUDA graph: the GPU's time
# alone, which is what a run under Megatron's --cuda-graph-impl executes). overlap_tp's Megatron patch sets it from
# that flag (megatron_patches/apply.py); decisions are cached per regime.
REGIMES = ("eager", "graphs")
_regime = ["eager"]


def set_regime(regime: str):
    if regime not in REGIMES:
        raise ValueError(f"overlap_tp.tune: timing regime {regime!r}: expected one of {REGIMES}")
    _regime[0] = regime


def regime() -> str:
    return _regime[0]


def timed_samples(fn, sets, reps, group, warmup=5, device=None):
    """This rank's times (ms) of `reps` back-to-back fn(*set) calls, after `warmup` calls and a barrier.
    CUDA events on the GPU (device None = cuda); wall clock per call on a CPU device."""
    device = torch.device("cuda") if device is None else device
    for i in range(warmup):
        fn(*sets[i % len(sets)])
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier(group)
    if device.type != "cuda":
        samples = []
        for i in range(reps):
            t0 = time.perf_counter()
            fn(*sets[i % len(sets)])
            samples.append(1e3 * (time.perf_counter() - t0))
        return samples
    return event_times(fn, sets, reps)


def event_times(fn, sets, reps):
    """GPU times (ms, CUDA events) of `reps` back-to-back fn(*set) calls, the sets taken in turn."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        fn(*sets[i % len(sets)])
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def slowest_median(samples, group, device=None):
    """The median of each rank's samples, the largest over the ranks."""
    device = torch.device("cuda") if device is None else device
    median = torch.tensor(statistics.median(samples), dtype=torch.float64, device=device)
    dist.all_reduce(median, op=dist.ReduceOp.MAX, group=group)
    return float(median)


def timed(fn, sets, reps, group, warmup=5, device=None):
    """Median time (ms) of fn(*set) over `reps` back-to-back calls, the slowest rank's; `warmup` calls first."""
    return slowest_median(timed_samples(fn, sets, reps, group, warmup, device), group, device)


class SleepAhead:
    """The sleep kernel ahead of each timed run of queued_ms and enqueue_us, so that the host never waits for the GPU
    while it enqueues the run: 4x the first run's host time (that run unslept and redone), doubled for a run whose
    host time reached 80% of it (redone), the same on every rank (the slowest rank's: with sleeps of different
    lengths the first collective would also wait out their difference; every rank redoes the same runs)."""

    def __init__(self, group, device=None):
        self.group, self.ms = group, None
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
        self.cycles_per_ms = sleep_cycles_per_ms()

    def start(self):
        """Before a run: the GPU idle, the ranks together, then the sleep (once sized)."""
        torch.cuda.synchronize()
        dist.barrier(self.group)
        if self.ms is not None:
            torch.cuda._sleep(int(self.ms * self.cycles_per_ms))

    def redo(self, host_ms: float) -> bool:
        """After a run that took the host `host_ms`: whether it must be redone on every rank (the first run, or one
        the sleep did not cover on some rank), the sleep resized if so."""
        late = torch.tensor([float(self.ms is None or host_ms > 0.8 * self.ms), host_ms], device=self.device)
        dist.all_reduce(late, op=dist.ReduceOp.MAX, group=self.group)
        if float(late[0]):
            self.ms = 4 * float(late[1]) if self.ms is None else 2 * max(self.ms, float(late[1]))
            return True
        return False


def queued_ms(fn, sets, group, rounds=5):
    """(host_ms, gpu_ms) of one fn(*set) on the GPU: the host's enqueue time, and the GPU's time with
    every launch already queued. A sleep kernel holds the GPU while the host enqueues the call, so the
    host never waits for the GPU (host_ms: wall clock around the call) and the GPU then runs the call
    from its queue without launch gaps (gpu_ms: CUDA events around the call). `timed` measures the two
    overlapped, back to back: where its time exceeds gpu_ms, the host set the pace. The sleep: SleepAhead.
    host_ms is a single call's, the first after a synchronize: on virtualised hosts that one runs several times slower
    than the calls of a run (enqueue_us).
    Medians over `rounds`, the slowest rank's."""
    ahead, host, gpu = SleepAhead(group), [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    while len(gpu) < rounds:
        args = sets[len(gpu) % len(sets)]
        ahead.start()
        start.record()
        t0 = time.perf_counter()
        fn(*args)
        host_ms = (time.perf_counter() - t0) * 1e3
        end.record()
        torch.cuda.synchronize()
        if ahead.redo(host_ms):
            continue
        host.append(host_ms)
        gpu.append(start.elapsed_time(end))
    medians = torch.tensor([statistics.median(host), statistics.median(gpu)], dtype=torch.float64,
                           device=ahead.device)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=group)
    return float(medians[0]), float(medians[1])


def enqueue_us(fn, sets, group, calls=24, warm=8, rounds=10, device=None):
    """The host's time (us) per fn(*set) call in a run of calls, as a training step issues them: `calls` calls back
    to back, timed after `warm` untimed calls of the same run, the whole run queued behind a sleep kernel so the
    host never waits for the GPU. The warm calls matter on virtualised hosts: the first calls after the host blocked
    in a synchronize run several times slower (docs/performance.md), which is what queued_ms's single call measures.
    Median over `rounds`, the slowest rank's (device None: the current CUDA device)."""
    ahead, samples = SleepAhead(group, device), []
    while len(samples) < rounds:
        ahead.start()
        t0 = time.perf_counter()
        for i in range(warm):
            fn(*sets[i % len(sets)])
        t1 = time.perf_counter()
        for i in range(calls):
            fn(*sets[(warm + i) % len(sets)])
        t2 = time.perf_counter()
        if ahead.redo((t2 - t0) * 1e3):
            continue
        samples.append((t2 - t1) / calls * 1e6)
    torch.cuda.synchronize()
    return slowest_median(samples, group, ahead.device)


@functools.cache
def sleep_cycles_per_ms(reps=5):
    """How many cycles of torch.cuda._sleep (a spin kernel that counts SM clock cycles) make a millisecond
    on this GPU: the median of `reps` timed 10M-cycle sleeps, measured once per process (callers size
    their sleeps generously; SleepAhead doubles one that proves too short)."""
    cycles = 10_000_000
    torch.cuda._sleep(cycles)   # warm-up
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return cycles / statistics.median(times)


class CapturedCalls:
    """fn(*set) for every input set, captured once in one CUDA graph after `warmup` eager calls on a side
    stream (plans built, kernels compiled, as torch.cuda.graph asks); samples() times replays. The graph
    keeps the calls' outputs and its memory pool alive until the object is dropped."""

    def __init__(self, fn, sets, warmup=3):
        if not torch.cuda.is_available():
            raise RuntimeError("timing CUDA graph replays needs a CUDA device")
        self.calls = len(sets)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(warmup):
                fn(*sets[i % len(sets)])
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = [fn(*args) for args in sets]
        self.graph.replay()
        torch.cuda.synchronize()

    def samples(self, reps, group):
        """This rank's time (ms) per call of `reps` calls (reps / calls replays, each timed with CUDA events),
        after a barrier of `group` (None: one process, no barrier)."""
        if group is not None:
            dist.barrier(group)
        replays = max(1, reps // self.calls)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
        for i in range(replays):
            starts[i].record()
            self.graph.replay()
            ends[i].record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) / self.calls for s, e in zip(starts, ends)]


def graph_timed(fn, sets, reps, group, warmup=3):
    """Median time (ms) of one fn(*set) call replayed from a CUDA graph (CapturedCalls), the slowest rank's."""
    captured = CapturedCalls(fn, sets, warmup)
    samples = captured.samples(reps, group)
    del captured
    return slowest_median(samples, group)
