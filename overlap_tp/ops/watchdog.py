"""The watchdog: a stuck overlapped op becomes a clear error instead of a silent hang.

Eager calls. Every op plan owns one event. An eager call records it where the op's work ends, or, where the op's
last kernel can say so itself (the p2p GEMM+ReduceScatter's signalling sum, kernels/sum_slots.py), numbers the call
(Watched.next_call) and the kernel writes that number into the plan's progress word, an int32 of pinned host memory:
no driver call on the host's path. A daemon thread polls the plans with work in flight (the event queried, the
progress word read) and fails when one has stayed incomplete for OVERLAP_TP_WATCHDOG_S seconds (default
300, 0 disables): it prints the op, its group, its plan and the words it waits on (read on a fresh stream),
and ends the process, as NCCL's own watchdog does (a hung GPU stream cannot be unwound from Python, and a
silent hang wastes a whole allocation). "Stayed incomplete" is judged across polls of the same plan, so a
plan called continuously is only reported when the GPU has not reached its latest call for the whole
timeout. The thread switches its own stream-capture mode to relaxed, so its queries never invalidate a
capture running on another thread (as PyTorch's NCCL watchdog does).

CUDA graphs. An event recorded inside a capture cannot be queried from outside it, so a replayed graph is
watched from the device: under capture every wait on a device word (the comm stream's tile counters,
CommEngine.wait_counter; the p2p GEMM+ReduceScatter's peer signals, PeerSignals.wait) is a one-thread kernel
with a deadline (kernels/deadline_wait.py) that spins at most OVERLAP_TP_WATCHDOG_S (as read when the process's
watchdog starts), then writes a record into the mailbox, one int64 of pinned host memory: the code of the
wait, registered here with its plan's description and what it waited for when the call is captured, and the
value it saw. The same thread polls the mailbox (a plain read of host memory, no CUDA call), prints the
plan, the wait and the value, and ends the process (exit 70); the kernel traps a moment later, so a process
whose thread cannot report still fails instead of hanging.
What the deadline kernels cannot bound: the NCCL kernels of the methods that call NCCL (a peer that never
replays leaves this rank's collective waiting inside NCCL; PyTorch's NCCL watchdog does not see the raw
communicators either), and the AllGather+GEMM's copy-engine handshake (GatherBuffer keeps stream wait-values
under capture: the GEMM's tiles spin on flags raised behind those waits while it holds every SM, so a wait
kernel might find no slot; PeerSignals says more). For those, every graph replay is watched whole
(watch_graph_replays): an event behind the replay, judged like an eager call's, so a replay that never
completes ends the process with a message naming the graph after OVERLAP_TP_WATCHDOG_S.
"""
import ctypes
import os
import sys
import threading
import time

import torch

from overlap_tp.kernels.deadline_wait import DeadlineWait
from overlap_tp.ops import memops

WATCHDOG_ENV = "OVERLAP_TP_WATCHDOG_S"
DEFAULT_WATCHDOG_S = 300.0
CU_STREAM_CAPTURE_MODE_RELAXED = 2
CUDA_ERROR_NOT_READY = 600
EXIT_CODE = 70


class Watched:
    """What the watchdog knows of one plan: its event, its progress word (if a kernel of it writes one), how to
    describe it, and the device words it waits on."""

    def __init__(self, describe, words=(), event=None):
        self.describe = describe
        self.words = words
        self.event = memops.Event() if event is None else event
        self.progress = None       # progress_word(): the pinned int32 the op's last kernel writes a call's number into
        self._progress_seen = None
        self.issued = 0            # the number of the latest call numbered by next_call (never 0)
        self.in_flight = False     # in the watchdog's list: recorded, and the GPU had not reached it at the last poll
        self.stuck_since = None
        if event is None:
            watch_graph_replays()  # a process with overlapped ops watches its graph replays too

    def record(self, stream: int):
        """The op's work on `stream` ends here (eager calls only)."""
        watchdog().record(self, stream)

    def join(self, producer: int, waiter: int):
        """`waiter` waits for everything enqueued on `producer` so far through this plan's event, which the watchdog
        then watches (eager calls only): a call whose work ends with a join (the comm stream's transfers into the
        caller's stream) records one event for both instead of two."""
        memops.stream_waits_for(waiter, producer, self.event)
        self.watch()

    def watch(self):
        """Watch the plan's event as last recorded (by its caller, as the end of this call's work)."""
        dog = watchdog()
        if dog.timeout_s > 0:
            dog.watch(self)

    def progress_word(self, word: torch.Tensor = None) -> torch.Tensor:
        """The plan's progress word (made at the first ask, eagerly: when the plan is built), for a kernel that ends
        the op's eager calls to write next_call()'s numbers into. `word` stands in for it where there is no GPU."""
        if self.progress is None:
            self.progress = torch.zeros(1, dtype=torch.int32, pin_memory=True) if word is None else word
            self._progress_seen = self.progress.numpy()
        return self.progress

    def next_call(self) -> int:
        """An eager call's number (1 .. 2**31 - 1, cyclic) for the op's last kernel to write into the progress word,
        watched from now until it is there; 0 (the kernel writes nothing) while the watchdog is off."""
        dog = watchdog()
        if dog.timeout_s <= 0:
            return 0
        self.issued = self.issued % 0x7FFFFFFF + 1
        dog.watch(self)
        return self.issued

    def reached(self, event_complete) -> bool:
        """Whether the GPU reached the latest call: its progress word holds the latest number (if it ever had one),
        and event_complete(self.event) (its latest record complete)."""
        return (self._progress_seen is None or int(self._progress_seen[0]) == self.issued) and event_complete(self.event)


class Watchdog:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.watched = []
        # Items the poll found complete, let go by the next record() on the recording thread: the last reference
        # to a plan (and to its symmetric memory) must never drop on this thread, where freeing symmetric
        # memory while the main thread captures a CUDA graph aborts the process (an evicted plan's buffers freed by
        # the poll during a capture: `operation not permitted when stream is capturing`).
        self.reached = []
        self.lock = threading.Lock()
        self.thread = None
        self.mailbox = None
        self._box = None   # the mailbox as a numpy array: what the thread reads

    def record(self, item: Watched, stream: int):
        """Record item's event on `stream` and watch it until the GPU has reached it. Only plans with work in
        flight are in the list: one whose event completed is dropped at the next poll (and added again by its
        next call), so plans that were built once and let go (the expert ops build one per routing) are neither
        kept alive nor polled for ever; they are let go here, on the recording thread. Under the lock, so a poll
        never drops an item between its new record and the check whether it is listed."""
        if self.timeout_s <= 0:
            return
        with self.lock:
            item.event.record(stream)
            self._list(item)

    def watch(self, item: Watched):
        """As record, for a call that its own kernel reports (Watched.next_call) or whose event its caller recorded
        (Watched.join): listed, nothing recorded here. (Recorded outside the lock: a poll that found the previous
        record complete and unlisted the item did so under the lock, before this listing, which lists it again.)"""
        with self.lock:
            self._list(item)

    def _list(self, item: Watched):
        self.reached.clear()
        if not item.in_flight:
            item.in_flight = True
            self.watched.append(item)
            self._start()

    def poll(self, reached, now: float):
        """One pass over the listed items: reached(item) says whether the GPU reached its latest call. Completed
        items leave the list (held in `reached` until the next record); one incomplete for longer than the
        timeout ends the process."""
        with self.lock:
            listed, self.watched = self.watched, []
            for item in listed:
                if reached(item):
                    item.stuck_since, item.in_flight = None, False
                    self.reached.append(item)
                    continue
                self.watched.append(item)
                if item.stuck_since is None:
                    item.stuck_since = now
                elif now - item.stuck_since > self.timeout_s:
                    self._fail(item)

    def open_mailbox(self, mailbox: torch.Tensor = None) -> torch.Tensor:
        """The mailbox the capture-time waits report into: one int64 of pinned host memory, created at the
        first call (eagerly, when a plan is built: no allocation may happen inside a capture), and watched from
        then on. `mailbox` stands in for it where there is no GPU (tests)."""
        with self.lock:
            if self.mailbox is None:
                self.mailbox = torch.zeros(1, dtype=torch.int64, pin_memory=True) if mailbox is None else mailbox
                self._box = self.mailbox.numpy()
                if self.timeout_s > 0:
                    self._start()
        return self.mailbox

    def _start(self):
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="overlap_tp-watchdog", daemon=True)
            self.thread.start()

    def _run(self):
        lib = None
        period = min(0.5, self.timeout_s / 4)
        while True:
            time.sleep(period)
            if self._box is not None and self._box[0] != 0:
                self._fail_graph_wait(int(self._box[0]))
            if self.watched and lib is None:
                # before this thread's first CUDA call: relaxed capture mode
                lib = memops._driver()
                mode = ctypes.c_int(CU_STREAM_CAPTURE_MODE_RELAXED)
                lib.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode))
            if lib is not None:
                self.poll(lambda item: item.reached(lambda event: lib.cuEventQuery(event.handle) != CUDA_ERROR_NOT_READY),
                          time.monotonic())

    def _fail(self, item: Watched):
        try:
            read = [(name, _read(words)) for name, words in item.words]
            state = "".join(f"; {name} {value}" for name, value in read)
            if any(value is UNREADABLE for _, value in read) and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
                state += (" (with CUDA_DEVICE_MAX_CONNECTIONS=1, as Megatron sets it for sequence parallelism, every "
                          "stream feeds one hardware queue, so a read waits behind the stuck wait)")
        except Exception as error:   # the report must never stop the process from ending
            state = f"; its words unreadable ({type(error).__name__}: {error})"
        _end(f"overlap_tp watchdog: {item.describe} did not complete within {self.timeout_s:g} s "
             f"(set {WATCHDOG_ENV} to change){state}. A rank stopped issuing collectives, a peer "
             "died, or a signal was lost. Ending the process instead of hanging.")

    def _fail_graph_wait(self, record: int):
        _end(graph_wait_message(record))


def _end(message: str):
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    os._exit(EXIT_CODE)


UNREADABLE = "unreadable"   # what _read reports for words whose read did not complete


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
                return UNREADABLE
            time.sleep(0.01)
        return unsigned_words(host)


def unsigned_words(words: torch.Tensor):
    """int32 words of any shape as nested lists of their unsigned values (what the waits compare)."""
    return (words.to(torch.int64) & 0xFFFFFFFF).tolist()


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


# ---------------------------------------------------------------------------------------------------
# Waits inside CUDA graphs
# ---------------------------------------------------------------------------------------------------

_waits = []    # code - 1 -> (the plan's description, what the wait waits for, its timeout in seconds)
_codes = {}
_waiters = {}  # device index -> DeadlineWait


def wait_code(describe: str, what: str, timeout_s: float) -> int:
    """The code (>= 1) a capture-time wait writes into the mailbox when it times out: registered the first
    time the wait is captured, so the watchdog can name the plan and the wait from the code alone."""
    key = (describe, what, timeout_s)
    if key not in _codes:
        _waits.append(key)
        _codes[key] = len(_waits)
    return _codes[key]


def decode(record: int):
    """A mailbox record as (code, the value the wait saw): the kernel writes (code << 32) | uint32(seen)."""
    record &= 0xFFFFFFFFFFFFFFFF
    seen = record & 0xFFFFFFFF
    return record >> 32, seen - (1 << 32) if seen >= 1 << 31 else seen


def graph_wait_message(record: int) -> str:
    code, seen = decode(record)
    if not 1 <= code <= len(_waits):
        return (f"overlap_tp watchdog: a wait in a CUDA graph replay timed out (unregistered code {code}, saw "
                f"{seen}). Ending the process instead of hanging.")
    describe, what, timeout_s = _waits[code - 1]
    return (f"overlap_tp watchdog: {describe} waited {timeout_s:g} s for {what} in a CUDA graph replay and saw "
            f"{seen} (set {WATCHDOG_ENV} to change). A peer never arrived (it stopped replaying, stopped or died) "
            f"or a signal was lost. Ending the process instead of hanging.")


def prepare_graph_waits(device: torch.device):
    """Eagerly, when a plan that waits under capture is built: the mailbox and the compiled wait kernel."""
    waiter = _waiters.get(device.index)
    if waiter is None:
        waiter = _waiters[device.index] = DeadlineWait(device)
    waiter.prepare(watchdog().open_mailbox())


def graph_wait(stream: int, device: torch.device, word: int, target: int, describe: str, what: str):
    """Under capture, on `stream`: wait until the int32 at device address `word` == target, then reset it to 0,
    within the watchdog's timeout (a timed-out wait ends the process with `describe` and `what`)."""
    dog = watchdog()
    _waiters[device.index](stream, word, target, dog.timeout_s, dog.mailbox,
                           wait_code(describe, what, dog.timeout_s))


# ---------------------------------------------------------------------------------------------------
# Whole graph replays
# ---------------------------------------------------------------------------------------------------

_unwatched_replay = None   # torch.cuda.CUDAGraph.replay before watch_graph_replays wrapped it


def watch_graph_replays():
    """Watch every torch.cuda.CUDAGraph replay as an eager call is watched: an event recorded behind the replay
    on its stream, reported when it stays incomplete for the watchdog's timeout. This bounds what the waits
    with a deadline cannot: NCCL kernels in a graph (a peer that never replays leaves a collective waiting
    inside NCCL) and the AllGather+GEMM's copy-engine handshake (stream wait-values), in Megatron's per-layer
    and full-iteration graphs alike (both replay torch.cuda.CUDAGraph objects). Called when the first plan is
    built (Watched); idempotent; nothing is wrapped while the watchdog is off. Costs one event record per
    replay."""
    global _unwatched_replay
    if _unwatched_replay is not None or watchdog().timeout_s <= 0:
        return
    unwatched = _unwatched_replay = torch.cuda.CUDAGraph.replay

    def replay(self):
        unwatched(self)
        watched = getattr(self, "_overlap_tp_watched", None)
        if watched is None:
            watched = self._overlap_tp_watched = Watched(
                f"a CUDA graph replay (torch.cuda.CUDAGraph at {id(self):#x}; NCCL kernels and copy-engine waits "
                f"inside graphs are bounded only here)", event=memops.Event())
        watched.record(torch.cuda.current_stream().cuda_stream)

    torch.cuda.CUDAGraph.replay = replay
