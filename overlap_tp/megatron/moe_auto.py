"""method='auto' for one MoE layer's expert ops: try each method, keep the fastest, agree over the EP group.

The dense ops' tuner measures a shape once before training; an MoE layer's sizes change with the routing every
step, and whether the overlap pays depends on the interconnect (at EP 2 over NVLink the all-to-all is a small share
of the grouped GEMMs and the overlap does not pay; where the all-to-all is slow it does: docs/performance.md). So
`auto` measures in training itself, as Tutel switches its parallelism online: the
layer's first calls take `off`, `signal` and `decompose` in turn (WARMUP untimed calls each, then TRIALS timed ones
each; both overlapped methods on the layer's transport), each timed on the GPU by CUDA events around the experts'
forward (fc1 + dispatch, activation, fc2 + combine). At the call after the last trial every rank waits for its events
(once), the EP group takes each method's largest median over the ranks (one all-reduce: the step waits for its
slowest rank), and the layer keeps the faster overlapped method if it beats `off` by more than MARGIN, else `off`,
for the rest of the run, named in a warning. With one EP rank there
is nothing to overlap: `off` at once, no trial. The schedule is a function of the call count alone, so every rank runs
the same method at every call and decides at the same call (the all-to-alls stay matched).

Under CUDA graph capture before the decision: `off` (a warning says so); after it, the chosen method is captured.
"""
import statistics
import time
import warnings
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from overlap_tp.ops import comm

METHODS = ("off", "signal", "decompose")   # off first: the baseline the others must beat
WARMUP = 1   # per method: plan builds, Triton compiles
TRIALS = 5   # per method
# an overlapped method is kept only if its median beats off's by this fraction: off is Megatron's path, and two trials
# of the same method differ by a few percent from call to call (without a margin, a short trial can keep a method
# that cannot win, as signal at EP 1)
MARGIN = 0.02


def _warn_on_rank0(message: str):
    if dist.get_rank() == 0:
        warnings.warn(message, stacklevel=3)


class _WallTimer:
    """A CUDA event pair's interface on the host clock (CPU tensors under gloo)."""

    def __init__(self):
        self.start = self.end = None

    def record_start(self):
        self.start = time.perf_counter()

    def record_end(self):
        self.end = time.perf_counter()

    def ms(self) -> float:
        return (self.end - self.start) * 1e3


class _EventTimer:
    def __init__(self):
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def record_start(self):
        self.start.record()

    def record_end(self):
        self.end.record()

    def ms(self) -> float:
        self.end.synchronize()
        return self.start.elapsed_time(self.end)


class MethodTrial:
    """The method of each call of one layer under `auto`: next_call() says which method runs and hands a timer to
    wrap it in (None: untimed), until the decision; then the chosen method."""

    def __init__(self, group, device: torch.device, what: str = "MoE layer", warn: Callable[[str], None] = None,
                 warmup: int = WARMUP, trials: int = TRIALS, timer_factory: Optional[Callable] = None,
                 margin: float = MARGIN, methods: Tuple[str, ...] = METHODS):
        if methods[0] != "off":
            raise ValueError(f"MethodTrial: the methods start with 'off', the baseline; got {methods}")
        self.group, self.device, self.what, self.methods = group, device, what, tuple(methods)
        self.warn = warn or _warn_on_rank0
        self.warmup, self.trials, self.margin = warmup, trials, margin
        self.timer_factory = timer_factory or (_EventTimer if device.type == "cuda" else _WallTimer)
        self.calls = 0
        self.timed: List[Tuple[str, object]] = []
        self.chosen: Optional[str] = None
        self.medians: Optional[dict] = None
        self._warned_capture = False

    @property
    def schedule_length(self) -> int:
        return len(self.methods) * (self.warmup + self.trials)

    def next_call(self):
        """(method, timer or None) for this call."""
        if self.chosen is None and comm.capturing(self.device):
            if not self._warned_capture:
                self._warned_capture = True
                self.warn(f"overlap_tp {self.what} (method auto): captured into a CUDA graph after {self.calls} of "
                          f"the {self.schedule_length} trial calls; the graph runs method 'off' (run the trial "
                          f"steps eagerly before capturing to let auto choose)")
            return "off", None
        if self.chosen is None and self.calls == 0 and dist.get_world_size(self.group) == 1:
            self.chosen = "off"
            self.warn(f"overlap_tp {self.what} (method auto): runs 'off': with one EP rank there is no all-to-all "
                      f"to overlap")
        if self.chosen is None and self.calls >= self.schedule_length:
            self._decide()
        if self.chosen is not None:
            return self.chosen, None
        index, self.calls = self.calls, self.calls + 1
        method = self.methods[index % len(self.methods)]
        if index < len(self.methods) * self.warmup:
            return method, None
        timer = self.timer_factory()
        self.timed.append((method, timer))
        return method, timer

    def _decide(self):
        mine = [statistics.median(t.ms() for m, t in self.timed if m == method) for method in self.methods]
        agreed = torch.tensor(mine, dtype=torch.float64, device=self.device if self.device.type == "cuda" else None)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
        self.medians = dict(zip(self.methods, agreed.tolist()))
        best = min(self.methods[1:], key=lambda method: self.medians[method])   # the first of equal ones
        self.chosen = best if self.medians[best] < self.medians["off"] * (1 - self.margin) else "off"
        self.timed = []
        times = ", ".join(f"{method} {ms:.3f} ms" for method, ms in self.medians.items())
        self.warn(f"overlap_tp {self.what} (method auto): runs '{self.chosen}' from now on (forward of the "
                  f"experts, median of {self.trials} calls each, the slowest rank's: {times}; an overlapped method "
                  f"must win by {self.margin:.0%})")
