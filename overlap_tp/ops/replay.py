"""Eager calls replayed from CUDA graphs: a plan's call captured once per set of operand addresses, then launched
whole with one driver call (cudaGraphLaunch), where the eager path issues its launches, copies, events and stream
memory operations one by one, with Python around each: the eager host time per call (docs/performance.md).

Why a replay does what the eager call would. At a plan's fixed shape, what one call issues depends on the operands'
addresses and w's layout (CallGraphs' key) and on the plan's state: its buffers, device words and tables, all fixed
when the plan was built. A graph captured for a key therefore issues what every later call of that key would. It runs
the plan's captured path, the one a call inside the user's own CUDA graph runs (Megatron's --cuda-graph-impl local),
which waits on the same device words for the same values as the eager path: a rank that replays and a peer that
issues eagerly follow one protocol. What an eager call checks on the host on its way (a previous call still
outstanding, a gathered buffer still referenced) the plan checks before it replays; host state that changes what a
call issues (ag_gemm: whether a norm claimed our region and wrote the shard in place) is part of the key; calls whose
second half runs later (async_op, a sum deferred into a norm, the split AllGather) issue eagerly. The plan's watched
event is recorded behind every launch, so the watchdog watches a replay as it watches an eager call.

When. A key's first call runs eagerly: it compiles and binds what it meets for the first time. The second is captured
on a side stream (thread-local capture mode, so other threads' CUDA calls are unaffected; nothing is allocated inside:
the plan allocated the output before) and replayed; later ones replay. At most MAX_GRAPHS keys per plan get a graph;
calls with other keys then run eagerly, after one warning. The graphs live as long as their plan.

Which plans. The p2p transports' (gemm_rs summed at once, gemm_ar, ag_gemm's signaled calls): no NCCL inside.
NCCL's captured collectives may register their buffers with the peers at capture, which a peer issuing the same
collective eagerly would not match, so the NCCL transports issue eagerly. OVERLAP_TP_EAGER_GRAPHS=0 turns replays off (each call issues
its operations one by one, as before)."""
import os
import warnings

import torch

from overlap_tp.kernels.fp8_quant import ScaledFp8

ENV = "OVERLAP_TP_EAGER_GRAPHS"
MAX_GRAPHS = 128   # graphs per plan: driver state only (nothing is allocated inside a capture)
MAX_SEEN = 4096    # first-seen keys remembered per plan (forgotten all at once past this)


def from_env() -> bool:
    """OVERLAP_TP_EAGER_GRAPHS: 1, empty or unset (the default) replays, 0 issues every call one by one; another value
    is a ValueError (megatron.validation.validate_overlap_env raises it at start)."""
    raw = os.environ.get(ENV, "")
    if raw not in ("", "0", "1"):
        raise ValueError(f"{ENV}={raw!r}: expected 1 (eager calls replayed from CUDA graphs, the default) or 0 "
                         f"(each call's operations issued one by one)")
    return raw != "0"


def enabled(device: torch.device) -> bool:
    """Whether a plan on `device` replays its eager calls: CUDA, and not turned off (from_env)."""
    return device.type == "cuda" and from_env()


def operands_key(a, w, out: torch.Tensor, bias) -> tuple:
    """What a dense plan's call issues depends on at the plan's fixed shape: the operands' addresses and w's layout
    (FP8 operands, ScaledFp8: their values' and their scales' addresses; they are K-major)."""
    if isinstance(a, ScaledFp8):
        return (a.q.data_ptr(), a.ds.data_ptr(), w.q.data_ptr(), w.ds.data_ptr(), out.data_ptr(),
                0 if bias is None else bias.data_ptr())
    return a.data_ptr(), w.data_ptr(), w.stride(0), out.data_ptr(), 0 if bias is None else bias.data_ptr()


class CallGraphs:
    """One plan's captured calls, by key (operands_key, and whatever else the plan's call depends on)."""

    def __init__(self, device: torch.device, watched):
        """watched: the plan's Watched, whose event a launch records behind the graph."""
        self.device, self.watched = device, watched
        self.graphs = {}
        self._seen = set()
        self._stream = None   # the side stream captures run on, made at the first capture
        self._pool = None     # one memory pool for the plan's graphs (nothing is allocated inside them)
        self._full = False

    def replayed(self, key, stream: int, call, *args) -> bool:
        """Launch key's graph on `stream` (the current one), capturing call(*args) into it first at the key's second
        sighting, and record the plan's watched event behind it. False: the caller issues the call eagerly itself
        (the key's first sighting, or no room for more graphs). call issues the plan's call on the current stream,
        as under any capture."""
        graph = self.graphs.get(key)
        if graph is None:
            if key not in self._seen or len(self.graphs) >= MAX_GRAPHS:
                self._first_sighting(key)
                return False
            graph = self.graphs[key] = self.capture(call, args)
        self.launch(graph)
        self.watched.record(stream)
        return True

    def call(self, issue, stream: int, capturing: bool, a, w, bias, out):
        """A dense plan's call into `out`: issue(stream, a, w, bias, out, capturing) issues it; eagerly the graph of
        its operands_key is launched instead where there is one (replayed)."""
        if capturing or not self.replayed(operands_key(a, w, out, bias), stream, self._issue_captured, issue,
                                          a, w, bias, out):
            issue(stream, a, w, bias, out, capturing)

    def _issue_captured(self, issue, a, w, bias, out):
        issue(torch._C._cuda_getCurrentRawStream(self.device.index), a, w, bias, out, True)

    def _first_sighting(self, key):
        if len(self.graphs) >= MAX_GRAPHS:
            if not self._full:
                self._full = True
                warnings.warn(f"overlap_tp {self.watched.describe}: {MAX_GRAPHS} sets of operand addresses have eager CUDA "
                              f"graphs; calls with other addresses issue their operations eagerly "
                              f"(ops/replay.py)", stacklevel=4)
            return
        if len(self._seen) >= MAX_SEEN:
            self._seen.clear()
        self._seen.add(key)

    def capture(self, call, args):
        """call(*args) captured into a new graph on the side stream, instantiated."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._stream):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                call(*args)
            except BaseException:
                try:   # end the capture; the partial graph is dropped with the error
                    graph.capture_end()
                except RuntimeError:
                    pass
                raise
            graph.capture_end()
        return graph

    @staticmethod
    def launch(graph):
        """The graph on the current stream, unwrapped: watchdog.watch_graph_replays wraps torch.cuda.CUDAGraph.replay
        to record an event of its own, where the plan records its watched event instead."""
        torch._C._CUDAGraph.replay(graph)
