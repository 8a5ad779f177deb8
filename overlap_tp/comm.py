"""Communication engine: process groups, the comm stream, waiting on tile counters, the watchdog.

The comm stream is a high-priority CUDA stream per device. For every group of tiles it (1) waits on
the group's counter without spending an SM (cuStreamWaitValue32: the stream's front end polls the
word) or, where stream memory operations are unavailable, behind a one-thread Triton spin kernel,
then (2) issues the group's collective through torch.distributed on a communicator whose CTAs are
capped at the SMs the GEMM left free.

Why this cannot deadlock: the GEMM never waits on communication (GEMM+RS / GEMM+AR), so its CTAs
always finish; the collective kernels queue behind waits that the GEMM is guaranteed to satisfy, and
every rank issues the same collectives in the same order. The watchdog turns any violation of that
argument (a bug, a dead peer) into a clear error instead of a silent hang.
"""
import os
import sys
import threading
import time
import warnings
from collections import deque

import torch
import torch.distributed as dist

WATCHDOG_ENV = "OVERLAP_TP_WATCHDOG_S"
DEFAULT_WATCHDOG_S = 300.0


# ---------------------------------------------------------------------------------------------------
# Process groups
# ---------------------------------------------------------------------------------------------------

def resolve_group(group=None):
    """`None` means Megatron's tensor-parallel group when Megatron is initialized, else the default."""
    if group is not None:
        return group
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("overlap_tp: torch.distributed is not initialized; call "
                           "dist.init_process_group() (torchrun) or pass group=")
    from overlap_tp.megatron_patches.parallel_state import megatron_tp_group
    tp_group = megatron_tp_group()
    return tp_group if tp_group is not None else dist.group.WORLD


_capped_groups = {}


def capped_group(group, max_ctas: int):
    """An NCCL communicator over the same ranks as `group`, limited to `max_ctas` CTAs, on a
    high-priority stream. Created once per (group, cap) by the group's ranks only."""
    if max_ctas == 0 or dist.get_backend(group) != "nccl":
        return group
    key = (id(group), max_ctas)
    if key not in _capped_groups:
        options = dist.ProcessGroupNCCL.Options()
        options.config.max_ctas = max_ctas
        options.is_high_priority_stream = True
        _capped_groups[key] = dist.new_group(dist.get_process_group_ranks(group), pg_options=options,
                                             use_local_synchronization=True)
    return _capped_groups[key]


def reduce_scatter(out, inp, group):
    """out = rank's block of sum over ranks of inp (dim 0). Gloo has no reduce-scatter: all-reduce."""
    if dist.get_backend(group) == "gloo":
        total = inp.float()
        dist.all_reduce(total, group=group)
        rank = dist.get_rank(group)
        out.copy_(total.view(dist.get_world_size(group), *out.shape)[rank])
    else:
        dist.reduce_scatter_tensor(out, inp, group=group)


def all_reduce(x, group):
    """In-place sum over ranks (gloo sums in fp32, then rounds once, like NCCL's bf16 sum at t = 2)."""
    if dist.get_backend(group) == "gloo" and x.dtype in (torch.bfloat16, torch.float16):
        total = x.float()
        dist.all_reduce(total, group=group)
        x.copy_(total)
    else:
        dist.all_reduce(x, group=group)


# ---------------------------------------------------------------------------------------------------
# Waiting on counters
# ---------------------------------------------------------------------------------------------------

def _stream_memop_wait():
    """cuStreamWaitValue32 through cuda-bindings, or None where it is missing."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    geq = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ

    def wait(stream, counters, index, target):
        # GEQ compares cyclically, (int32)(*addr - value) >= 0, so the epoch targets may wrap.
        address = counters.data_ptr() + 4 * index
        (err,) = driver.cuStreamWaitValue32(driver.CUstream(stream.cuda_stream), driver.CUdeviceptr(address),
                                            target & 0xFFFFFFFF, geq)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"overlap_tp: cuStreamWaitValue32 failed: {err}")

    return wait


def _spin_kernel_wait(stream, counters, index, target):
    from overlap_tp.kernels.spin_wait import spin_wait
    with torch.cuda.stream(stream):
        spin_wait(counters, index, target)


def _host_wait(stream, counters, index, target):
    """CPU tensors (the Triton interpreter runs kernels synchronously): the tiles must all be there."""
    got = int(counters[index]) & 0xFFFFFFFF
    if got != target & 0xFFFFFFFF:
        raise RuntimeError(f"overlap_tp: group {index} signaled {got} of {target & 0xFFFFFFFF} tiles")


class CommEngine:
    """One per device: the comm stream, the counter wait and the watchdog."""

    def __init__(self, device: torch.device, wait: str):
        self.device = device
        if device.type != "cuda":
            self.stream, self.wait_kind, self._wait = None, "host", _host_wait
            return
        self.stream = torch.cuda.Stream(device=device, priority=torch.cuda.Stream.priority_range()[1])
        memop = _stream_memop_wait() if wait in ("auto", "stream_memop") else None
        if memop is None and wait == "stream_memop":
            raise RuntimeError("overlap_tp: wait='stream_memop' needs cuda-bindings (pip install cuda-bindings)")
        if memop is None and wait == "auto":
            warnings.warn("overlap_tp: cuda-bindings missing, the comm stream waits behind a one-thread spin "
                          "kernel (wait='spin_kernel'); install cuda-bindings to wait without an SM")
        self.wait_kind = "stream_memop" if memop else "spin_kernel"
        self._wait = memop or _spin_kernel_wait

    def wait_counter(self, counters: torch.Tensor, index: int, target: int):
        """Make the comm stream wait until counters[index] reaches target (cyclically)."""
        self._wait(self.stream, counters, index, target)

    def watch(self, event, describe, counters=None, targets=None):
        """Have the watchdog check that `event` (recorded on the comm stream) completes in time."""
        _watchdog().watch(event, describe, counters, targets)


_engines = {}


def comm_engine(device: torch.device, wait: str = "auto") -> CommEngine:
    key = (device.type, device.index, wait)
    if key not in _engines:
        _engines[key] = CommEngine(device, wait)
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
