"""Communication engine: process groups, collectives, the comm stream and its synchronisation.

The comm stream is a high-priority CUDA stream per device. For every group of tiles it (1) waits on
the group's counter (a stream wait-value in eager mode, no SM; a one-thread kernel with the watchdog's
deadline under graph capture), resets it, then (2) issues the group's collective on an NCCL communicator whose CTAs are capped at the
SMs the GEMM left free.

Why this cannot deadlock: the GEMM never waits on communication (GEMM+RS / GEMM+AR), so its CTAs
always finish; the collective kernels queue behind waits that the GEMM is guaranteed to satisfy, and
every rank issues the same collectives in the same order. The watchdog (overlap_tp/ops/watchdog.py) turns
any violation of that argument (a bug, a dead peer) into a clear error instead of a silent hang.
"""
import datetime
import pickle
import sys
from typing import Optional

import torch
import torch.distributed as dist

from overlap_tp.ops import memops, watchdog


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
    (what NCCL's bf16 sum gives at t = 2). `stream` is accepted for the overlapped ops' CPU path, where
    it is None: torch.distributed issues on the current stream."""

    def __init__(self, group):
        self.group = group
        self.gloo = dist.get_backend(group) == "gloo"

    def connect_peers(self):
        """Nothing to do: torch.distributed connects its peers itself (Communicator.connect_peers)."""

    def reduce_scatter(self, out, inp, async_op=False, stream=None):
        """Returns torch.distributed's work with async_op (None where it completed: gloo)."""
        if not self.gloo:
            return dist.reduce_scatter_tensor(out, inp, group=self.group, async_op=async_op)
        total = inp.float()
        dist.all_reduce(total, group=self.group)
        out.copy_(total.view(dist.get_world_size(self.group), *out.shape)[dist.get_rank(self.group)])
        return None

    def all_gather_rows(self, gathered, src, lo, hi, stream=None):
        """Rows [lo, hi) of every rank's shard `src` into the same rows of that rank's region of
        `gathered` [t * rows, K] (the standard order)."""
        regions = gathered.chunk(dist.get_world_size(self.group))
        dist.all_gather([region[lo:hi] for region in regions], src[lo:hi], group=self.group)

    def exchange(self, sends, recvs, stream=None):
        """Send every (peer, tensor) of `sends` and receive every (peer, tensor) of `recvs` in place, as one
        batch of point-to-point ops (peers are ranks of the group)."""
        ops = [dist.P2POp(op, x, dist.get_global_rank(self.group, peer), self.group)
               for op, pairs in ((dist.isend, sends), (dist.irecv, recvs)) for peer, x in pairs]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def all_reduce(self, x, async_op=False, stream=None):
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
    key = (group, device.index, max_ctas)   # the group itself: its id() could be reused once it is freed
    if key not in _communicators:
        from overlap_tp.ops.nccl import Communicator
        _communicators[key] = Communicator(group, device, max_ctas)
    return _communicators[key]


def exchange_collectives(group, device: torch.device, max_ctas: int):
    """collectives() for the MoE exchanges (NCCL send / receive), with NCCL's peer connections made before the
    first exchange (Communicator.connect_peers says why). Called by every rank of the group at the same op."""
    coll = collectives(group, device, max_ctas)
    coll.connect_peers()
    return coll


_agreements = {}   # group -> how many agreements it has run (every rank builds its plans in the same order)


def agree(group, fields: dict, what: str):
    """Check that every rank of `group` passes the same `fields` (shapes, dtype, config: what the ranks'
    collectives must match on); else a ValueError on every rank naming each rank's values, instead of a hang
    or a silent wrong result. Called once per plan, not per call.

    Exchanged through the process group's key-value store (the default store, keys unique per group and
    agreement), waiting at most OVERLAP_TP_WATCHDOG_S: a rank that never reaches the op (it called another
    one, stopped or died) is a RuntimeError naming it, not a hang."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    count = _agreements[group] = _agreements.get(group, 0) + 1
    prefix = f"overlap_tp/agree/{group.group_name}/{count}/"
    keys = [prefix + str(r) for r in range(world)]
    store.set(keys[rank], pickle.dumps(fields))
    timeout_s = watchdog.timeout_from_env() or 10 ** 7   # 0 disables the watchdog: wait (almost) forever
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistError) as error:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise RuntimeError(f"overlap_tp {what}: rank(s) {missing} of the group did not reach this op within "
                           f"{timeout_s:g} s ({watchdog.WATCHDOG_ENV}): a rank called another op, stopped or "
                           f"died") from error
    everyone = [pickle.loads(store.get(key)) for key in keys]
    differ = sorted({name for entry in everyone for name in fields if entry.get(name) != fields[name]})
    if differ:
        per_rank = "; ".join(f"rank {r}: " + ", ".join(f"{name}={entry.get(name)!r}" for name in differ)
                             for r, entry in enumerate(everyone))
        raise ValueError(f"overlap_tp {what}: the ranks of the group disagree on {', '.join(differ)} ({per_rank}); "
                         f"every rank must call the op with the same shapes, dtype and config")


# ---------------------------------------------------------------------------------------------------
# The comm stream
# ---------------------------------------------------------------------------------------------------

def capturing(device: torch.device) -> bool:
    """Whether the caller's stream on `device` is being captured into a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class CommEngine:
    """One per device: the comm stream (high priority) and the synchronisation every overlapped op uses.

    Every op forks the comm stream from the caller's stream (fork), enqueues its transfers there and joins it
    back (join), so under stream capture the comm stream's work lands in the same graph. A GEMM's group
    counters are waited on and then reset to zero (wait_counter): every call counts from zero to a fixed
    target, so a captured graph replays correctly and no host state has to match the device's
    (overlap_tp/ops/sync.py, docs/ARCHITECTURE.md)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = None
        if device.type == "cuda":
            self.stream = torch.cuda.Stream(device=device, priority=torch.cuda.Stream.priority_range()[1])
            self.raw = self.stream.cuda_stream
            # fork and join events for eager calls and for calls under capture (an event waited on inside a
            # capture must have been recorded inside it)
            self._events = {False: (memops.Event(), memops.Event()), True: (memops.Event(), memops.Event())}
        self._lanes = {}

    def capturing(self) -> bool:
        """Whether the caller's stream is being captured into a CUDA graph (asked once or twice per call of an op:
        no device check beyond the engine's own, which has a stream exactly where its device is a GPU)."""
        return self.stream is not None and torch.cuda.is_current_stream_capturing()

    def copy_lanes(self, count: int) -> Optional["CopyLanes"]:
        """This device's CopyLanes of `count` streams (made at the first use), or None where there is one lane (or no
        CUDA): the caller then issues on its own stream."""
        if count == 1 or self.stream is None:
            return None
        if count not in self._lanes:
            if self.capturing():   # streams and events are made outside a capture, as every plan's state is
                raise RuntimeError(f"overlap_tp: copy lanes ({count} streams) would be made during CUDA graph capture; "
                                   "run the op (or one training step) eagerly first")
            self._lanes[count] = CopyLanes(self.device, count)
        return self._lanes[count]

    def current(self) -> int:
        """The caller's current stream on this device, as a raw handle."""
        return torch._C._cuda_getCurrentRawStream(self.device.index)

    def fork(self, current: int, capturing: bool):
        """The comm stream waits for everything the caller enqueued so far (inputs and buffers ready)."""
        memops.stream_waits_for(self.raw, current, self._events[capturing][0])

    def join(self, current: int, capturing: bool):
        """The caller's stream waits for everything enqueued on the comm stream so far."""
        memops.stream_waits_for(current, self.raw, self._events[capturing][1])

    def join_watched(self, current: int, capturing: bool, watched):
        """join(), eagerly through the plan's watched event, which the watchdog then watches (Watched.join: one event
        record for the join and the watchdog); under capture (or unwatched) the engine's own join."""
        if capturing or watched is None:
            self.join(current, capturing)
        else:
            watched.join(self.raw, current)

    def wait_counter(self, waits: "CounterWaits", index: int, capturing: bool, describe: str = ""):
        """On the comm stream: wait until group `index`'s counter reaches its target (the GEMM stored that group's
        tiles), then reset it to 0. Eager calls wait with a stream wait-value (no SM): the GEMM was launched
        before this wait was enqueued, so nothing queued behind the wait can hold the GEMM back. A captured graph
        does not keep that launch order (its scheduler sees no dependency between the GEMM and the wait, and with
        one hardware queue, CUDA_DEVICE_MAX_CONNECTIONS=1, a wait at the head would block the GEMM's launch: a
        deadlock), so under capture a one-thread kernel spins instead: it holds a thread slot of one SM
        while it waits, and a kernel never blocks the launch of another stream's kernel. That kernel gives up
        after the watchdog's timeout and ends the process naming `describe` (the plan) and the counter
        (overlap_tp/ops/watchdog.py): an eager wait is watched through the plan's event instead."""
        if self.stream is None:
            _take_count(waits.counters, index, waits.targets[index], "group")
        elif capturing:
            target = waits.targets[index]
            watchdog.graph_wait(self.raw, self.device, waits.addresses[index], target, describe or "an overlap_tp op",
                                f"tile counter {index} to reach {target} (its GEMM's tiles of group {index})")
        else:
            waits.eager[index].issue(self.raw)

    def gemm_then_collectives(self, gemm, waits: "CounterWaits", collective, watched):
        """The signaled GEMM+collective shape (GEMM+RS, GEMM+AR, GEMM+A2A): fork, the GEMM on the caller's
        stream (it raises counter g per stored tile of group g), then on the comm stream per group of `waits`:
        wait until its counter reaches the group's tile count, reset, collective(g, comm stream); last, on the
        caller's stream, the counters no collective waits on reset behind the GEMM (CounterWaits.unwaited). Returns
        the join, which the caller runs before reading what the collectives wrote (at once, or in Pending.wait())."""
        if self.stream is None:   # CPU: the interpreter finishes the kernel before the collectives start
            gemm()
            for g in range(len(waits.targets)):
                self.wait_counter(waits, g, False)
                collective(g, None)
            for g, target in waits.unwaited:
                _take_count(waits.counters, g, target, "unexchanged group")
            return _no_join
        capturing, current = self.capturing(), self.current()
        self.fork(current, capturing)   # before the GEMM launch: inputs and buffers ready, no more
        gemm()
        raw = self.raw
        if capturing:
            describe = "" if watched is None else watched.describe
            for g in range(len(waits.targets)):
                self.wait_counter(waits, g, True, describe)
                collective(g, raw)
        else:
            for g, wait_and_reset in enumerate(waits.eager):
                wait_and_reset.issue(raw)
                collective(g, raw)
        # enqueued after the comm stream's waits (one hardware queue: a write behind the GEMM holds what follows it
        # until the GEMM ends, so it goes where nothing else waits behind it)
        waits.resetting.issue(current)

        def join():   # eagerly the watchdog watches the join's event: the comm stream's work up to the join
            self.join_watched(self.current(), self.capturing(), watched)
        return join

    def transfers_then_gemm(self, transfers, gemm, flags, watched, gemm_first: bool, current: Optional[int] = None,
                            capturing: Optional[bool] = None):
        """The AllGather+GEMM shape (AG+GEMM, A2A+GEMM): fork, the transfers on the comm stream (each raises its
        chunk's flag) and the GEMM on the caller's stream (its tiles wait for their chunk's flag), the join, and the
        flags lowered behind the join. Behind the join, not behind the GEMM: a flag that no tile waits on (an
        expert chunk with no rows here, a rank whose GEMM has no tile) is raised at a time the GEMM's end does not
        bound, and lowered before that raise it would stay raised into the next call, whose tiles would read the
        chunk before its transfer.
        The enqueue order matters in eager mode with one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1, Megatron's
        setting): the queue dispatches in order and stops at the first item whose dependency is pending, so the
        comm stream's chain (transfer, flag, transfer, ...) enqueued first would hold the GEMM's launch until the last
        transfer had completed: the exchange, then the GEMM, no overlap.
        gemm_first: the GEMM is enqueued first and the transfers run beside it; the caller says so only where the
        transfers need no SM that the persistent GEMM holds (copy-engine pulls, or NCCL capped at the comm_sms
        SMs the GEMM's grid leaves free). Otherwise the transfers go first, so that their CTAs are resident
        before the GEMM fills every SM. A captured graph keeps dependencies, not the enqueue order.
        current, capturing: the caller's stream and capture state where the caller asked already (each is asked
        here otherwise)."""
        if self.stream is None:   # CPU: the transfers complete before the (interpreted) kernel starts
            transfers(None)
            gemm()
            self.lower_flags(flags, None)
            return
        if capturing is None:
            capturing = self.capturing()
        if current is None:
            current = self.current()
        self.fork(current, capturing)   # before the GEMM: the transfers wait for the inputs only
        if gemm_first:
            gemm()
            transfers(self.raw)
        else:
            transfers(self.raw)
            gemm()
        # eagerly the watchdog watches the join's event (the GEMM's tiles wait on nothing but the transfers)
        self.join_watched(current, capturing, watched)
        self.lower_flags(flags, current)   # after every raise (the join) and the GEMM that waited on them

    def transfers_ahead(self, transfers, current: int, capturing: bool, done: Optional["memops.Event"]):
        """Phase one of transfers_then_gemm split in two (a plan's start()): fork, the transfers on the comm stream,
        and `done` recorded behind them, so that gemm_after_transfers can wait for these transfers only, not for
        whatever is issued on the comm stream after them (the next plan's transfers). CPU: the transfers run now."""
        if self.stream is None:
            transfers(None)
            return
        self.fork(current, capturing)
        transfers(self.raw)
        done.record(self.raw)

    def gemm_after_transfers(self, gemm, flags, watched, current: int, capturing: bool,
                             done: Optional["memops.Event"]):
        """Phase two (a plan's finish()): the GEMM on the caller's stream (its tiles wait for their chunks' flags), the
        caller's stream joined to `done` (these transfers, not the comm stream's tail), and the flags lowered behind
        the join (transfers_then_gemm says why). `current` must be the stream that phase one forked from."""
        gemm()
        if self.stream is None:
            self.lower_flags(flags, None)
            return
        done.wait(current)
        self.lower_flags(flags, current)
        if not capturing and watched is not None:
            watched.watch()   # eagerly `done` is the plan's watched event (AgGemmSignaled._transfers_done)

    def prepare_graph_waits(self):
        """Compile the capture-time wait kernel now, eagerly (a compile inside a capture could load a module
        mid-capture), and open the watchdog's mailbox it reports into."""
        if self.stream is not None:
            watchdog.prepare_graph_waits(self.device)

    def raise_flag(self, flags: "ReadyFlags", index: int):
        """Flag `index` = 1 once everything the comm stream issued so far has completed."""
        if self.stream is None:
            flags.words[index] = 1
        else:
            memops.write_value(self.raw, flags.addresses[index], 1)

    def lower_flags(self, flags: "ReadyFlags", stream: int):
        """Every flag = 0 on `stream` (the consumer's, after the kernel that waited on them)."""
        if self.stream is None:
            flags.words.zero_()
        else:
            flags.lowering.issue(stream)


def near_equal_parts(lo: int, hi: int, count: int):
    """[lo, hi) in min(count, hi - lo) contiguous parts whose sizes differ by at most one, larger first (at least one
    part, empty where lo == hi)."""
    count = max(1, min(count, hi - lo))
    base, extra = divmod(hi - lo, count)
    parts = []
    for i in range(count):
        end = lo + base + (i < extra)
        parts.append((lo, end))
        lo = end
    return parts


class CopyLanes:
    """Copies split over `count` streams, so that several copy engines can move them at once (one copy runs on one
    engine). Lane 0 is the stream the caller issues on; lanes 1.. are extra high-priority streams of the device, each
    forked from it before its part and joined back into it after, so whatever the caller enqueues next on its stream
    (a ready flag, a join into the GEMM's stream, the PULLED signal) follows every part, and under capture the extra
    streams enter and leave the graph through those events. One per (device, count), shared by every plan: a host
    thread enqueues one call at a time, and an event's record and wait take effect at enqueue."""

    def __init__(self, device: torch.device, count: int):
        priority = torch.cuda.Stream.priority_range()[1]
        self.count = count
        self._streams = [torch.cuda.Stream(device=device, priority=priority) for _ in range(count - 1)]
        self.raws = [stream.cuda_stream for stream in self._streams]
        # per extra lane, its fork and join events: eager calls' and captured calls' (CommEngine's reason)
        self._events = {capturing: [(memops.Event(), memops.Event()) for _ in self.raws] for capturing in (False, True)}

    def run(self, stream: int, lo: int, hi: int, issue, capturing: bool):
        """issue(lane stream, a, b, lane) for near-equal parts [a, b) of rows [lo, hi), one per lane; lane 0's on
        `stream`."""
        parts = near_equal_parts(lo, hi, self.count)
        lanes = list(zip(self.raws, self._events[capturing], parts[1:]))
        for lane, (raw, (fork, _), (a, b)) in enumerate(lanes, 1):
            memops.stream_waits_for(raw, stream, fork)
            issue(raw, a, b, lane)
        issue(stream, *parts[0], 0)
        for raw, (_, join), _ in lanes:
            memops.stream_waits_for(stream, raw, join)


def _take_count(counters: torch.Tensor, index: int, target: int, what: str):
    """CPU: counter `index` holds exactly its group's tile count (the interpreted GEMM has finished); reset it to 0."""
    got = int(counters[index])
    if got != target:
        raise RuntimeError(f"overlap_tp: {what} {index} signaled {got} of {target} tiles")
    counters[index] = 0


class CounterWaits:
    """The per-group waits of one signaled GEMM's counters, built once per plan: group g's collective starts
    when counters[g] reached targets[g] (every tile of the group stored) and the wait resets the counter to 0.
    Eagerly that is one driver call per group (a wait-value and a write-value batched, memops.MemOps: the
    addresses and values never change, so the batch is built here, not per call).
    unwaited: (index, tiles) of counters the GEMM raises but no collective waits on (the MoE combine's local rows,
    stored straight into the output): written back to 0 behind the GEMM on the caller's stream, so that every call
    leaves every counter at 0. A plan of another routing may wait on that word for one of its groups (the number
    of groups follows the routing), and a count left over would release its collective before its tiles exist."""

    def __init__(self, counters: torch.Tensor, targets, unwaited=()):
        self.counters, self.targets, self.unwaited = counters, tuple(targets), tuple(unwaited)
        self.addresses = tuple(counters.data_ptr() + 4 * g for g in range(len(self.targets)))
        self.eager = tuple(memops.MemOps([("wait", address, target), ("write", address, 0)])
                           for address, target in zip(self.addresses, self.targets))
        self.resetting = memops.MemOps([("write", counters.data_ptr() + 4 * g, 0) for g, _ in self.unwaited])


class ReadyFlags:
    """The ready words an AllGather-shaped GEMM's tiles wait on (value 1): chunk c's transfer raises word c on
    the comm stream, and the caller's stream lowers them all behind the GEMM (one batched driver call, built
    here once), so every call and every replay waits for the same value."""

    def __init__(self, words: torch.Tensor):
        self.words = words
        self.addresses = tuple(words.data_ptr() + 4 * i for i in range(words.numel()))
        self.lowering = memops.MemOps([("write", address, 0) for address in self.addresses])


def _no_join():
    return None


_engines = {}


def comm_engine(device: torch.device, instance: int = 0) -> CommEngine:
    """The device's CommEngine for plans of `instance` (OpPlan.instance): each instance has its own comm stream, so
    that the token split's two halves' transfers do not queue behind each other (on one stream half B's pulls would
    queue behind half A's pushes, and B's GEMM would wait for both)."""
    key = (device.type, device.index, instance)
    if key not in _engines:
        _engines[key] = CommEngine(device)
    return _engines[key]
