"""Communication engine: process groups, the comm stream, waiting on tile counters, the watchdog.

The comm stream is a high-priority CUDA stream per device. For every group of tiles it (1) waits on
the group's counter without spending an SM (cuStreamWaitValue32: the stream's front end polls the
word), then (2) issues the group's collective on an NCCL communicator whose CTAs are capped at the
SMs the GEMM left free.

Why this cannot deadlock: the GEMM never waits on communication (GEMM+RS / GEMM+AR), so its CTAs
always finish; the collective kernels queue behind waits that the GEMM is guaranteed to satisfy, and
every rank issues the same collectives in the same order. The watchdog turns any violation of that
argument (a bug, a dead peer) into a clear error instead of a silent hang.
"""
import os
import sys
import threading
import time
from collections import deque

import torch
import torch.distributed as dist

WATCHDOG_ENV = "OVERLAP_TP_WATCHDOG_S"
DEFAULT_WATCHDOG_S = 300.0


# ---------------------------------------------------------------------------------------------------
# Process groups
# ---------------------------------------------------------------------------------------------------

def _megatron_parallel_state():
    """megatron.core.parallel_state if Megatron has set up its model-parallel groups, else None. Looked up
    among the loaded modules, not imported: the op layer depends on nothing above it, and a process whose
    Megatron is initialized has loaded the module already."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None or not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state


def _check_initialized():
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("overlap_tp: torch.distributed is not initialized; call "
                           "dist.init_process_group() (torchrun) or pass group=")


def resolve_group(group=None):
    """`None` means Megatron's tensor-parallel group when Megatron is initialized, else the default."""
    if group is not None:
        return group
    _check_initialized()
    parallel_state = _megatron_parallel_state()
    return dist.group.WORLD if parallel_state is None else parallel_state.get_tensor_model_parallel_group()


def resolve_ep_group(group=None):
    """The expert ops' group: `None` means Megatron's expert-model-parallel group when Megatron is
    initialized, else the default group."""
    if group is not None:
        return group
    _check_initialized()
    parallel_state = _megatron_parallel_state()
    return dist.group.WORLD if parallel_state is None else parallel_state.get_expert_model_parallel_group()


class TorchCollectives:
    """Collectives through torch.distributed: Megatron's own path (method 'off') and the CPU/gloo path.
    Gloo has no reduce-scatter and sums bf16 poorly, so there it all-reduces in fp32 and rounds once
    (what NCCL's bf16 sum gives at t = 2)."""

    def __init__(self, group):
        self.group = group
        self.gloo = dist.get_backend(group) == "gloo"

    def reduce_scatter(self, out, inp, async_op=False):
        """Returns torch.distributed's work with async_op (None where it completed: gloo)."""
        if not self.gloo:
            return dist.reduce_scatter_tensor(out, inp, group=self.group, async_op=async_op)
        total = inp.float()
        dist.all_reduce(total, group=self.group)
        out.copy_(total.view(dist.get_world_size(self.group), *out.shape)[dist.get_rank(self.group)])
        return None

    def all_gather_rows(self, gathered, src, lo, hi):
        """Rows [lo, hi) of every rank's shard `src` into the same rows of that rank's region of
        `gathered` [t * rows, K] (the standard order)."""
        regions = gathered.chunk(dist.get_world_size(self.group))
        dist.all_gather([region[lo:hi] for region in regions], src[lo:hi], group=self.group)

    def exchange(self, sends, recvs):
        """Send every (peer, tensor) of `sends` and receive every (peer, tensor) of `recvs` in place, as one
        batch of point-to-point ops (peers are ranks of the group)."""
        ops = [dist.P2POp(op, x, dist.get_global_rank(self.group, peer), self.group)
               for op, pairs in ((dist.isend, sends), (dist.irecv, recvs)) for peer, x in pairs]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def all_reduce(self, x, async_op=False):
        """Returns torch.distributed's work with async_op (None where it completed: gloo bf16/fp16)."""
        if not self.gloo or x.dtype == torch.float32:
            return dist.all_reduce(x, group=self.group, async_op=async_op)
        total = x.float()
        dist.all_reduce(total, group=self.group)
        x.copy_(total)
        return None


def all_gather_rows(x: torch.Tensor, group, async_op: bool = False):
    """torch.distributed's all-gather of [m, ...] shards into a new [t*m, ...] tensor in rank order
    (gloo has no all_gather_into_tensor: a list of row blocks there). Returns (gathered, work or None)."""
    t = dist.get_world_size(group)
    out = torch.empty((t * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    if dist.get_backend(group) == "gloo":
        handle = dist.all_gather(list(out.chunk(t)), x, group=group, async_op=async_op)
    else:
        handle = dist.all_gather_into_tensor(out, x, group=group, async_op=async_op)
    return out, handle


_communicators = {}


def collectives(group, device: torch.device, max_ctas: int):
    """What the overlapped methods issue their collectives through: a raw NCCL communicator over the
    group's ranks capped at `max_ctas` CTAs (overlap_tp/ops/nccl.py says why), or torch.distributed on
    CPU tensors. Created once per (group, device, cap), collectively by the group's ranks."""
    if device.type != "cuda" or dist.get_backend(group) != "nccl":
        return TorchCollectives(group)
    key = (id(group), device.index, max_ctas)
    if key not in _communicators:
        from overlap_tp.ops.nccl import Communicator
        _communicators[key] = Communicator(group, device, max_ctas)
    return _communicators[key]


# ---------------------------------------------------------------------------------------------------
# Waiting on counters
# ---------------------------------------------------------------------------------------------------

class _StreamMemOps:
    """cuStreamWaitValue32 / cuStreamWriteValue32 through cuda-bindings, with the driver's handle objects
    built once per stream and per word (the words waited on are plan counters and flags that live as long
    as their plan), since a signaled call issues one wait per group of tiles."""

    def __init__(self):
        try:
            from cuda.bindings import driver
        except ImportError as e:
            raise RuntimeError("overlap_tp: the comm stream waits and signals with CUDA stream memory operations, "
                               "which need the cuda-bindings package (pip install 'overlap_tp[gpu]')") from e
        self.driver = driver
        self.geq = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        self.fenced = driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
        self.success = driver.CUresult.CUDA_SUCCESS
        self.streams, self.words = {}, {}

    def handles(self, stream, address):
        raw = stream.cuda_stream
        cu_stream = self.streams.get(raw)
        if cu_stream is None:
            cu_stream = self.streams[raw] = self.driver.CUstream(raw)
        word = self.words.get(address)
        if word is None:
            if len(self.words) > 4096:   # transient addresses: keep the table bounded
                self.words.clear()
            word = self.words[address] = self.driver.CUdeviceptr(address)
        return cu_stream, word


_memops = None


def _stream_memops() -> _StreamMemOps:
    global _memops
    if _memops is None:
        _memops = _StreamMemOps()
    return _memops


def stream_wait_value(stream, address: int, target: int):
    """cuStreamWaitValue32 on the word at `address` (local or peer-mapped): the stream's front end polls
    it, no SM is spent. GEQ compares cyclically, (int32)(*addr - value) >= 0, so epochs may wrap."""
    ops = _stream_memops()
    (err,) = ops.driver.cuStreamWaitValue32(*ops.handles(stream, address), target & 0xFFFFFFFF, ops.geq)
    if err != ops.success:
        raise RuntimeError(f"overlap_tp: cuStreamWaitValue32 failed: {err}")


def stream_write_value(stream, address: int, value: int):
    """cuStreamWriteValue32 of `value` to the word at `address` (local or peer-mapped), after all prior
    work of the stream. The default flags put a system-scope memory fence before the write, so whoever
    observes the value also observes everything the stream wrote before it."""
    ops = _stream_memops()
    (err,) = ops.driver.cuStreamWriteValue32(*ops.handles(stream, address), value & 0xFFFFFFFF, ops.fenced)
    if err != ops.success:
        raise RuntimeError(f"overlap_tp: cuStreamWriteValue32 failed: {err}")


def _host_wait(counters, index, target):
    """CPU tensors (the Triton interpreter runs kernels synchronously): the tiles must all be there."""
    got = int(counters[index]) & 0xFFFFFFFF
    if got != target & 0xFFFFFFFF:
        raise RuntimeError(f"overlap_tp: group {index} signaled {got} of {target & 0xFFFFFFFF} tiles")


class CommEngine:
    """One per device: the comm stream, the counter wait and the watchdog."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = None if device.type != "cuda" else torch.cuda.Stream(
            device=device, priority=torch.cuda.Stream.priority_range()[1])

    def wait_counter(self, counters: torch.Tensor, index: int, target: int):
        """Make the comm stream wait until counters[index] reaches target (cyclically)."""
        if self.stream is None:
            _host_wait(counters, index, target)
        else:
            stream_wait_value(self.stream, counters.data_ptr() + 4 * index, target)

    def raise_flag(self, flags: torch.Tensor, index: int, value: int):
        """flags[index] = value once everything the comm stream issued so far has completed."""
        if self.stream is None:
            flags[index] = value
        else:
            stream_write_value(self.stream, flags.data_ptr() + 4 * index, value)

    def watch(self, event, describe, counters=None, targets=None):
        """Have the watchdog check that `event` (the end of an op, recorded on its stream) completes in time."""
        _watchdog().watch(event, describe, counters, targets)


_engines = {}


def comm_engine(device: torch.device) -> CommEngine:
    key = (device.type, device.index)
    if key not in _engines:
        _engines[key] = CommEngine(device)
    return _engines[key]


# ---------------------------------------------------------------------------------------------------
# Watchdog
# ---------------------------------------------------------------------------------------------------

class Watchdog:
    """A daemon thread that checks, oldest first, that every watched comm-stream event completes within
    OVERLAP_TP_WATCHDOG_S seconds (default 300, 0 disables). On a timeout it prints which op and
    group counters are stuck and ends the process, as NCCL's own watchdog does: a hung GPU stream
    cannot be unwound from Python, and a silent hang wastes a whole allocation."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.pending = deque()
        self.lock = threading.Lock()
        self.thread = None

    def watch(self, event, describe, counters, targets):
        if self.timeout_s <= 0:
            return
        with self.lock:
            self.pending.append((time.monotonic() + self.timeout_s, event, describe, counters, targets))
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="overlap_tp-watchdog", daemon=True)
                self.thread.start()

    def _run(self):
        while True:
            time.sleep(min(0.5, self.timeout_s / 4))
            with self.lock:
                while self.pending and self.pending[0][1].query():
                    self.pending.popleft()
                expired = self.pending[0] if self.pending and time.monotonic() > self.pending[0][0] else None
            if expired is not None:
                self._fail(*expired[1:])

    def _fail(self, event, describe, counters, targets):
        state = ""
        if counters is not None:
            state = f"; counters {self._read(counters)} vs targets {[t & 0xFFFFFFFF for t in targets]}"
        sys.stderr.write(f"overlap_tp watchdog: {describe} did not complete within {self.timeout_s:g} s "
                         f"(set {WATCHDOG_ENV} to change){state}. A rank stopped issuing collectives, a peer "
                         "died, or a signal was lost. Ending the process instead of hanging.\n")
        sys.stderr.flush()
        os._exit(70)

    @staticmethod
    def _read(counters):
        """Read the counters on a fresh stream (the comm stream may be stuck); give up after 2 s."""
        with torch.cuda.device(counters.device):
            stream = torch.cuda.Stream()
            host = torch.empty(counters.shape, dtype=counters.dtype, pin_memory=True)
            with torch.cuda.stream(stream):
                host.copy_(counters, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            deadline = time.monotonic() + 2.0
            while not done.query():
                if time.monotonic() > deadline:
                    return "unreadable"
                time.sleep(0.01)
            return [v & 0xFFFFFFFF for v in host.tolist()]


_watchdog_instance = None


def _watchdog() -> Watchdog:
    global _watchdog_instance
    if _watchdog_instance is None:
        _watchdog_instance = Watchdog(float(os.environ.get(WATCHDOG_ENV, DEFAULT_WATCHDOG_S)))
    return _watchdog_instance
