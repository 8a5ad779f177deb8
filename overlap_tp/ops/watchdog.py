"""The watchdog: a stuck overlapped op becomes a clear error instead of a silent hang.

Every op plan owns one event. An eager call records it where the op's work ends; a daemon thread polls
every plan's event and fails when one has stayed incomplete for OVERLAP_TP_WATCHDOG_S seconds (default
300, 0 disables): it prints the op, its group, its plan and the words it waits on (read on a fresh stream),
and ends the process, as NCCL's own watchdog does (a hung GPU stream cannot be unwound from Python, and a
silent hang wastes a whole allocation). "Stayed incomplete" is judged across polls of the same plan, so a
plan called continuously is only reported when the GPU has not reached its latest call for the whole
timeout. The thread switches its own stream-capture mode to relaxed, so its queries never invalidate a
capture running on another thread (as PyTorch's NCCL watchdog does).

Under CUDA graphs the calls are not recorded (an event recorded inside a capture cannot be queried from
outside it): a replayed graph whose peer never arrives hangs in the stream wait or the NCCL kernel, where
PyTorch's NCCL watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING) or the job's own timeout has to catch it. Run one
eager step first (Megatron does, before it captures) and the same plans are watched there.
"""
import ctypes
import os
import sys
import threading
import time

import torch

from overlap_tp.ops import memops

WATCHDOG_ENV = "OVERLAP_TP_WATCHDOG_S"
DEFAULT_WATCHDOG_S = 300.0
CU_STREAM_CAPTURE_MODE_RELAXED = 2
CUDA_ERROR_NOT_READY = 600


class Watched:
    """What the watchdog knows of one plan: its event, how to describe it, and the device words it waits on."""

    def __init__(self, describe, words=()):
        self.describe = describe
        self.words = words
        self.event = memops.Event()
        self.recorded = False
        self.stuck_since = None

    def record(self, stream: int):
        """The op's work on `stream` ends here (eager calls only)."""
        self.event.record(stream)
        if not self.recorded:
            self.recorded = True
            watchdog().add(self)


class Watchdog:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.watched = []
        self.lock = threading.Lock()
        self.thread = None

    def add(self, item: Watched):
        if self.timeout_s <= 0:
            return
        with self.lock:
            self.watched.append(item)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="overlap_tp-watchdog", daemon=True)
                self.thread.start()

    def _run(self):
        lib = memops._driver()
        mode = ctypes.c_int(CU_STREAM_CAPTURE_MODE_RELAXED)
        lib.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode))
        period = min(0.5, self.timeout_s / 4)
        while True:
            time.sleep(period)
            now = time.monotonic()
            with self.lock:
                items = list(self.watched)
            for item in items:
                if lib.cuEventQuery(item.event.handle) != CUDA_ERROR_NOT_READY:
                    item.stuck_since = None
                elif item.stuck_since is None:
                    item.stuck_since = now
                elif now - item.stuck_since > self.timeout_s:
                    self._fail(item)

    def _fail(self, item: Watched):
        state = "".join(f"; {name} {_read(words)}" for name, words in item.words)
        sys.stderr.write(f"overlap_tp watchdog: {item.describe} did not complete within {self.timeout_s:g} s "
                         f"(set {WATCHDOG_ENV} to change){state}. A rank stopped issuing collectives, a peer "
                         "died, or a signal was lost. Ending the process instead of hanging.\n")
        sys.stderr.flush()
        os._exit(70)


def _read(words: torch.Tensor):
    """Read device words on a fresh stream (the op's streams may be stuck); give up after 2 s."""
    with torch.cuda.device(words.device):
        stream = torch.cuda.Stream()
        host = torch.empty(words.shape, dtype=words.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            host.copy_(words, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        deadline = time.monotonic() + 2.0
        while not done.query():
            if time.monotonic() > deadline:
                return "unreadable"
            time.sleep(0.01)
        return [v & 0xFFFFFFFF for v in host.tolist()]


def timeout_from_env() -> float:
    """OVERLAP_TP_WATCHDOG_S as seconds (a number >= 0; 0 disables the watchdog)."""
    raw = os.environ.get(WATCHDOG_ENV)
    if raw is None:
        return DEFAULT_WATCHDOG_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{WATCHDOG_ENV}={raw!r}: expected a number of seconds >= 0 (0 disables the watchdog)")
    return value


_instance = None


def watchdog() -> Watchdog:
    global _instance
    if _instance is None:
        _instance = Watchdog(timeout_from_env())
    return _instance
