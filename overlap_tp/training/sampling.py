"""Overlap statistics in training: time the overlapped ops of the step whose end is logged and set each
call against its GEMM alone and its collective alone on the same shapes (the figures:
overlap_tp.training.throughput, "Overlap statistics").

    SAMPLER.attach(model)     (the train_step hook: the model's overlapped linears observe their op calls through
                              SAMPLER.observe, overlap_tp.megatron.layers.set_op_observer; once per model chunk)
    SAMPLER.armed = True      (the train_step hook, for the iteration whose end is logged)
    the layers' gemm_rs / gemm_ar / ag_gemm calls -> a start and an end stamp around each synchronous call
    SAMPLER.collect(stats)    (the training_log hook, on every rank) -> stats.record(kind, op, gemm, comm,
                              gpu_waited) per sampled call

The references of an (op, shape) are measured once, by `collect`, the first time the shape is seen: the
bare GEMM (cuBLAS) and the bare collective (torch.distributed, Megatron's path), median of
`REFERENCE_REPS`, on fresh random operands. They run collectives, so every rank of the op's group must
measure the same shapes in the same order: the sampled iteration calls the same ops in the same order on
every rank of a TP group, and `collect` measures new shapes in first-call order. The ThroughputLogger
takes its interval stamp after `collect`, so the measurement stays out of the logged step time.

What is not sampled: calls with async_op=True (the column-parallel backward's dgrad reduction, whose end
is joined behind the wgrad GEMM, so the call has no time of its own), the MoE expert ops (their
all-to-all shapes differ between ranks, so a per-shape reference would not be measured in step), calls on a
group of one rank (TP 1: nothing crosses ranks, so there is no communication to time), and anything a CUDA graph
replays (the layers' Python does not run; the step's figures are then left out).
Off (`--overlap-tp off` with overlap_tp's layers) is sampled like the rest: GEMM then collective, so its
exposed communication is about its collectives' time and nothing is hidden.

On the GPU the stamps are CUDA events on the caller's stream (a call's time is its span on the stream);
right after the host has issued a call, the start event is queried: if the GPU is already past it, the
GPU may have waited for the host inside the call (`gpu_waited`; a step where most calls did is
host-bound and its figures are left out). On CPU tensors (gloo tests) the stamps are host clocks.
"""
import statistics
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from overlap_tp.ops import comm

REFERENCE_REPS = 3
REFERENCE_SEED = 0   # the reference operands' own generator (measure_reference)
SAMPLED_OPS = ("gemm_rs", "gemm_ar", "ag_gemm")   # the kinds the layers' observer sees


@dataclass(frozen=True)
class OpShape:
    """What a sampled call's reference is measured on (and keyed by)."""
    kind: str              # gemm_rs | gemm_ar | ag_gemm
    a_shape: tuple
    w_shape: tuple
    dtype: torch.dtype
    device: torch.device
    group: Any


@dataclass
class Reference:
    """The GEMM alone and the collective alone on one call's shapes (ms, medians)."""
    gemm_ms: float
    comm_ms: float


def _stamp(device):
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _elapsed_ms(start, end) -> float:
    if isinstance(start, float):
        return (end - start) * 1e3
    end.synchronize()
    return start.elapsed_time(end)


def _median_ms(fn, device, reps=REFERENCE_REPS) -> float:
    fn()  # warm-up: allocator, cuBLAS heuristics, NCCL's first use of the buffers
    times = []
    for _ in range(reps):
        start = _stamp(device)
        fn()
        times.append(_elapsed_ms(start, _stamp(device)))
    return statistics.median(times)


def measure_reference(shape: OpShape) -> Reference:
    """The GEMM alone (cuBLAS) and the collective alone (Megatron's, torch.distributed) on random operands
    of `shape`, drawn from a generator of their own: training's random streams (dropout, router jitter on the
    default generator) must not depend on whether, or at which step, the telemetry measured."""
    t = dist.get_world_size(shape.group)
    device, dtype = shape.device, shape.dtype
    gen = torch.Generator(device=device).manual_seed(REFERENCE_SEED)
    a = torch.randn(shape.a_shape, dtype=dtype, device=device, generator=gen)
    w = torch.randn(shape.w_shape, dtype=dtype, device=device, generator=gen) / shape.w_shape[1] ** 0.5
    rows = shape.a_shape[0] * t if shape.kind == "ag_gemm" else shape.a_shape[0]
    gemm_in = (torch.randn(rows, shape.a_shape[1], dtype=dtype, device=device, generator=gen)
               if shape.kind == "ag_gemm" else a)
    product = gemm_in @ w.t()
    coll = comm.TorchCollectives(shape.group)   # the collective of method 'off': Megatron's path
    if shape.kind == "gemm_rs":
        received = product.new_empty(rows // t, product.shape[1])

        def collective():
            coll.reduce_scatter(received, product)
    elif shape.kind == "gemm_ar":
        def collective():
            coll.all_reduce(product)
    elif shape.kind == "ag_gemm":
        def collective():
            coll.all_gather_rows(gemm_in, a, 0, shape.a_shape[0])
    else:
        raise ValueError(f"overlap_tp sampling: op kind {shape.kind!r} is not one of {SAMPLED_OPS}")
    return Reference(gemm_ms=_median_ms(lambda: torch.matmul(gemm_in, w.t()), device),
                     comm_ms=_median_ms(collective, device))


@dataclass
class Sample:
    """One stamped call: its shape, its start and end stamps, and whether the GPU had reached its start by
    the time the host had issued it (CUDA only)."""
    shape: OpShape
    start: Any
    end: Any
    gpu_waited: bool = False


class OpSampler:
    """Stamps the overlapped ops while `armed`; `collect` turns the stamps into OverlapStats records."""

    def __init__(self, measure: Callable[[OpShape], Reference] = measure_reference):
        self._armed = False
        self.was_armed = False   # armed at some point since the last collect: a step was sampled
        self.measure = measure
        self.samples = []
        self.references = {}
        self._attached = weakref.WeakSet()   # the model chunks whose layers observe through this sampler

    @property
    def armed(self):
        return self._armed

    @armed.setter
    def armed(self, value):
        self._armed = bool(value)
        self.was_armed = self.was_armed or self._armed

    def attach(self, model) -> int:
        """Observe the synchronous op calls of the overlapped linear layers of `model` (a module, or Megatron's list
        of model chunks); each chunk once (later calls with it cost a set lookup). Returns how many layers were newly
        set. Without megatron-core there are no such layers: 0."""
        try:
            from overlap_tp.megatron.layers import set_op_observer
        except ImportError:
            return 0
        count = 0
        for chunk in (model if isinstance(model, (list, tuple)) else [model]):
            if isinstance(chunk, torch.nn.Module) and chunk not in self._attached:
                count += set_op_observer(chunk, self.observe)
                self._attached.add(chunk)
        return count

    def observe(self, kind, call, a, w, group):
        """The layers' op observer: call() as is while disarmed, stamped around while armed."""
        if not self.armed or (a.is_cuda and torch.cuda.is_current_stream_capturing()):
            # a call captured into a CUDA graph runs later, at replay: there is nothing to time now (and
            # querying an event inside a capture is an error)
            return call()
        group = comm.resolve_group(group)
        if dist.get_world_size(group) == 1:   # nothing crosses ranks: no communication to set against the GEMM
            return call()
        start = _stamp(a.device)
        out = call()
        end = _stamp(a.device)
        # The host has issued the whole call. If the GPU is already past its start, it may have idled waiting
        # for the launches inside the call, so the call's time includes host time (a host-bound step).
        gpu_waited = not isinstance(start, float) and start.query()
        self.samples.append(Sample(OpShape(kind, tuple(a.shape), tuple(w.shape), a.dtype, a.device, group),
                                   start, end, gpu_waited))
        return out

    def collect(self, stats) -> int:
        """Record every stamped call into `stats` (measuring references of new shapes); returns how many."""
        samples, self.samples = self.samples, []
        self.was_armed = self._armed
        for sample in samples:
            if sample.shape not in self.references:
                self.references[sample.shape] = self.measure(sample.shape)
        for sample in samples:
            ref = self.references[sample.shape]
            stats.record(sample.shape.kind, _elapsed_ms(sample.start, sample.end), ref.gemm_ms, ref.comm_ms,
                         gpu_waited=sample.gpu_waited)
        return len(samples)


SAMPLER = OpSampler()


def sample_iteration(iteration: Optional[int], log_interval: int) -> bool:
    """Whether the train step that ends at `iteration` + 1 is sampled: the one whose end is logged."""
    return iteration is not None and (iteration + 1) % max(1, log_interval) == 0
