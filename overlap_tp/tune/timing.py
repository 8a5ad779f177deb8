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


def queued_ms(fn, sets, group, rounds=5):
    """(host_ms, gpu_ms) of one fn(*set) on the GPU: the host's enqueue time, and the GPU's time with
    every launch already queued. A sleep kernel holds the GPU while the host enqueues the call, so the
    host never waits for the GPU (host_ms: wall clock around the call) and the GPU then runs the call
    from its queue without launch gaps (gpu_ms: CUDA events around the call). `timed` measures the two
    overlapped, back to back: where its time exceeds gpu_ms, the host set the pace. The sleep is 4x the
    first round's host time (the slowest rank's; the same on every rank), doubled for a round whose host
    time reached 80% of it (that round is redone). host_ms is a single call's, the first after a synchronize: on the
    H200 hosts that one runs several times slower than the calls of a run (enqueue_us).
    Medians over `rounds`, the slowest rank's."""
    cycles_per_ms = sleep_cycles_per_ms()
    sleep_ms, host, gpu = None, [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    while len(gpu) < rounds:
        args = sets[len(gpu) % len(sets)]
        torch.cuda.synchronize()
        dist.barrier(group)
        if sleep_ms is not None:
            torch.cuda._sleep(int(sleep_ms * cycles_per_ms))
        start.record()
        t0 = time.perf_counter()
        fn(*args)
        host_ms = (time.perf_counter() - t0) * 1e3
        end.record()
        torch.cuda.synchronize()
        # One sleep for every rank (the longest), or the first collective would also wait out the
        # difference between the ranks' sleeps; every rank redoes the same rounds.
        late = torch.tensor([float(sleep_ms is None or host_ms > 0.8 * sleep_ms), host_ms], device=start.device)
        dist.all_reduce(late, op=dist.ReduceOp.MAX, group=group)
        if float(late[0]):
            sleep_ms = 4 * float(late[1]) if sleep_ms is None else 2 * max(sleep_ms, float(late[1]))
            continue
        host.append(host_ms)
        gpu.append(start.elapsed_time(end))
    medians = torch.tensor([statistics.median(host), statistics.median(gpu)], dtype=torch.float64,
                           device=start.device)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=group)
    return float(medians[0]), float(medians[1])


def enqueue_us(fn, sets, group, calls=24, warm=8, rounds=10):
    """The host's time (us) per fn(*set) call in a run of calls, as a training step issues them: `calls` calls back
    to back, timed after `warm` untimed calls of the same run, the whole run queued behind a sleep kernel so the
    host never waits for the GPU. The warm calls matter on the H200 hosts (virtual machines): the first calls after
    the host blocked in a synchronize run 2-5x slower (a Python no-op 0.31 against 0.07 us, an output allocation 10.5
    against 3.0: docs/perf/s40), which is what queued_ms's single call measures. The sleep is sized as queued_ms
    sizes it (4x a first unslept run, doubled for a run that reached 80% of it). Median over `rounds`, the slowest
    rank's."""
    cycles_per_ms = sleep_cycles_per_ms()
    sleep_ms, samples, device = None, [], torch.device("cuda", torch.cuda.current_device())
    while len(samples) < rounds:
        torch.cuda.synchronize()
        dist.barrier(group)
        if sleep_ms is not None:
            torch.cuda._sleep(int(sleep_ms * cycles_per_ms))
        t0 = time.perf_counter()
        for i in range(warm):
            fn(*sets[i % len(sets)])
        t1 = time.perf_counter()
        for i in range(calls):
            fn(*sets[(warm + i) % len(sets)])
        t2 = time.perf_counter()
        run_ms = (t2 - t0) * 1e3
        late = torch.tensor([float(sleep_ms is None or run_ms > 0.8 * sleep_ms), run_ms], device=device)
        dist.all_reduce(late, op=dist.ReduceOp.MAX, group=group)
        if float(late[0]):
            sleep_ms = 4 * float(late[1]) if sleep_ms is None else 2 * max(sleep_ms, float(late[1]))
            continue
        samples.append((t2 - t1) / calls * 1e6)
    torch.cuda.synchronize()
    return slowest_median(samples, group, device)


@functools.cache
def sleep_cycles_per_ms(reps=5):
    """How many cycles of torch.cuda._sleep (a spin kernel that counts SM clock cycles) make a millisecond
    on this GPU: the median of `reps` timed 10M-cycle sleeps, measured once per process (callers size
    their sleeps generously; queued_ms doubles one that proves too short)."""
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
