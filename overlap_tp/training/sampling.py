"""Overlap statistics in training: time the overlapped ops of one sampled iteration per log interval and
compare each with its sequential cost on the same shape.

    SAMPLER.install()         (once: the Megatron layers' op observer, overlap_tp.megatron.layers.set_op_observer)
    SAMPLER.armed = True      (the train_step hook, for the iteration whose end is logged)
    the layers' gemm_rs / gemm_ar / ag_gemm calls -> a start and an end stamp around each synchronous call
    SAMPLER.collect(stats)    (the training_log hook, on every rank) -> stats.record(kind, overlapped,
                              sequential, gemm, comm) per sampled call

The sequential cost of an (op, shape) is measured once, by `collect`, the first time the shape is seen:
the bare GEMM (cuBLAS), the bare collective (torch.distributed) and the two back to back (the op with
method='off', Megatron's sequence), median of `REFERENCE_REPS`, on fresh random operands. It runs
collectives, so every rank of the op's group must measure the same shapes in the same order: the
sampled iteration calls the same ops in the same order on every rank of a TP group, and `collect`
measures new shapes in first-call order. The ThroughputLogger takes its interval stamp after `collect`,
so the measurement stays out of the logged step time.

What is not sampled: calls with async_op=True (the column-parallel backward's dgrad reduction, whose end
is joined behind the wgrad GEMM, so the call has no time of its own) and the MoE expert ops (their
all-to-all shapes differ between ranks, so a per-shape reference would not be measured in step).
Off (`--overlap-tp off` with overlap_tp's layers) is sampled like the rest: its overlapped time is the
sequential one, and its exposed communication is the baseline's.

On the GPU the stamps are CUDA events on the caller's stream (a call's time is its span on the stream,
launch gaps included); on CPU tensors (gloo tests) they are host clocks around the call.
"""
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from overlap_tp.ops import comm
from overlap_tp.ops.ag_gemm import ag_gemm
from overlap_tp.ops.config import OverlapConfig
from overlap_tp.ops.gemm_rs import gemm_ar, gemm_rs

REFERENCE_REPS = 3
SAMPLED_OPS = ("gemm_rs", "gemm_ar", "ag_gemm")   # the kinds the layers' observer sees
_FUNCTIONAL_OPS = {"gemm_rs": gemm_rs, "gemm_ar": gemm_ar, "ag_gemm": ag_gemm}   # what references run


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
    sequential_ms: float
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


def measure_reference(shape: OpShape, op: Callable) -> Reference:
    """GEMM alone, collective alone and `op(..., method='off')` on random operands of `shape`."""
    t = dist.get_world_size(shape.group)
    device, dtype = shape.device, shape.dtype
    a = torch.randn(shape.a_shape, dtype=dtype, device=device)
    w = torch.randn(shape.w_shape, dtype=dtype, device=device) / shape.w_shape[1] ** 0.5
    rows = shape.a_shape[0] * t if shape.kind == "ag_gemm" else shape.a_shape[0]
    gemm_in = torch.randn(rows, shape.a_shape[1], dtype=dtype, device=device) if shape.kind == "ag_gemm" else a
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
    off = OverlapConfig(method="off")
    return Reference(sequential_ms=_median_ms(lambda: op(a, w, shape.group, config=off), device),
                     gemm_ms=_median_ms(lambda: torch.matmul(gemm_in, w.t()), device),
                     comm_ms=_median_ms(collective, device))


@dataclass
class Sample:
    """One stamped call: its shape, the op (undecorated) and its start and end stamps."""
    shape: OpShape
    op: Callable
    start: Any
    end: Any


class OpSampler:
    """Stamps the overlapped ops while `armed`; `collect` turns the stamps into OverlapStats records."""

    def __init__(self, measure: Callable[[OpShape, Callable], Reference] = measure_reference):
        self.armed = False
        self.measure = measure
        self.samples = []
        self.references = {}

    def install(self):
        """Observe the Megatron layers' synchronous op calls (idempotent). Without megatron-core there are no
        layers to observe: returns False."""
        try:
            from overlap_tp.megatron.layers import set_op_observer
        except ImportError:
            return False
        set_op_observer(self.observe)
        return True

    def observe(self, kind, call, a, w, group):
        """The layers' op observer: call() as is while disarmed, stamped around while armed."""
        if not self.armed:
            return call()
        group = comm.resolve_group(group)
        start = _stamp(a.device)
        out = call()
        self.samples.append(Sample(OpShape(kind, tuple(a.shape), tuple(w.shape), a.dtype, a.device, group),
                                   _FUNCTIONAL_OPS[kind], start, _stamp(a.device)))
        return out

    def collect(self, stats) -> int:
        """Record every stamped call into `stats` (measuring references of new shapes); returns how many."""
        samples, self.samples = self.samples, []
        for sample in samples:
            if sample.shape not in self.references:
                self.references[sample.shape] = self.measure(sample.shape, sample.op)
        for sample in samples:
            ref = self.references[sample.shape]
            stats.record(sample.shape.kind, _elapsed_ms(sample.start, sample.end), ref.sequential_ms,
                         ref.gemm_ms, ref.comm_ms)
        return len(samples)


SAMPLER = OpSampler()


def sample_iteration(iteration: Optional[int], log_interval: int) -> bool:
    """Whether the train step that ends at `iteration` + 1 is sampled: the one whose end is logged."""
    return iteration is not None and (iteration + 1) % max(1, log_interval) == 0
