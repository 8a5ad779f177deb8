"""Replay-safe synchronisation between ranks: one-shot signals that the waiter consumes.

Every word goes 0 -> 1 (raised by the producer) -> 0 (reset by the consumer right after its wait), so each
call of an op starts from the same state and waits for the same fixed values. That is what a CUDA graph
needs: a captured wait-value replays with the value it was captured with, so targets that grew with a
host-side call count would be satisfied by a stale count on the second replay. The
reset is safe because of the order argument written next to each protocol (overlap_tp/ops/p2p_*.py):
a producer raises a word again only after something that the consumer does after its reset.

The words live in symmetric memory: rank r's word (slot, p) is raised by peer p, written over NVLink with a
stream write-value (no SM), and waited on and reset by r with stream memory operations on its own stream;
under graph capture the wait is a one-thread kernel per word instead, which gives up after the watchdog's
timeout (overlap_tp/ops/watchdog.py): a replayed graph whose peer never arrives then ends the process with a
message naming the plan, the peer and the signal, where the stream wait-value would wait forever (eager
waits are covered by the plan's watched event).
"""
from typing import Sequence

import torch
import torch.distributed as dist

from overlap_tp.ops import memops, symmetric, watchdog


class PeerSignals:
    """int32 words [slots, t] in symmetric memory: word (slot, p) of rank r is "p signalled r in `slot`".

    signal(stream, slot): on `stream`, after its prior work, raise (slot, rank) in every peer's memory.
    wait(stream, slot, capturing): on `stream`, wait until every peer raised (slot, p) here, then reset them to 0.
    signal_then_wait(stream, slot, capturing): both, in that order.
    Eagerly each is one batched driver call, built once (build_batches).
    `initial[slot]` (0 or 1) is every word's starting value (1: the first wait passes, as if a previous call
    had signalled). `describe` (the plan) and `names` (one per slot) name a wait that timed out in a graph
    replay. `graph_deadline=False` keeps the stream wait-value under capture too (no SM, no deadline): for
    waits that may run while a GEMM which depends on them holds every SM (GatherBuffer, RowPull: the AllGather+GEMM's
    tiles spin on flags raised behind these waits; a one-warp kernel would need a free slot next to the
    persistent GEMM's CTAs, which their registers need not leave). Built collectively by the group's
    ranks; the build synchronizes (never under capture)."""

    def __init__(self, group, rank: int, t: int, device: torch.device, initial: Sequence[int], describe: str,
                 names: Sequence[str], graph_deadline: bool = True):
        from torch.distributed import _symmetric_memory as symm_mem
        self.rank, self.t, self.slots, self.device, self.describe = rank, t, len(initial), device, describe
        self.graph_deadline = graph_deadline
        self.words = symmetric.empty(self.slots, t, dtype=torch.int32, device=device, kind="signals")
        for slot, value in enumerate(initial):
            self.words[slot].fill_(value)
        handle = symm_mem.rendezvous(self.words, group)
        within = self.words.data_ptr() - handle.buffer_ptrs[rank]   # the same on every rank
        self.peers = [p for p in range(t) if p != rank]
        # address of word (slot, rank) in peer p's memory, and of word (slot, p) in ours
        self.remote = {p: handle.buffer_ptrs[p] + within + 4 * rank for p in self.peers}
        self.local = {p: self.words.data_ptr() + 4 * p for p in self.peers}
        self.handle = handle
        self.build_batches()
        self.what = {(slot, p): f"rank {dist.get_global_rank(group, p)}'s {name} signal (peer {p} of group "
                                f"{group.group_name}, word [{slot}, {p}])"
                     for slot, name in enumerate(names) for p in self.peers}
        if graph_deadline:
            watchdog.prepare_graph_waits(device)
        torch.cuda.synchronize(device)
        handle.barrier(channel=0)   # every rank's words hold their initial values before anyone signals
        torch.cuda.synchronize(device)

    def build_batches(self):
        """Per slot, the eager signal (a write-value into every peer's word) and wait (per peer: wait-value, reset)
        as one batched driver call each (memops.MemOps): the addresses are fixed for the signals' lifetime."""
        self.signals, self.waits, self.exchanges = [], [], []
        for slot in range(self.slots):
            row = 4 * self.t * slot
            signal = self.signal_ops(slot)
            wait = [op for p in self.peers for op in (("wait", self.local[p] + row, 1), ("write", self.local[p] + row, 0))]
            self.signals.append(memops.MemOps(signal))
            self.waits.append(memops.MemOps(wait))
            self.exchanges.append(memops.MemOps(signal + wait))   # signal_then_wait

    def word_offsets(self, slot: int, peers, remote: bool):
        """For a kernel that addresses every signal word from `words` (kernels/peer_copy.py, kernels/sum_slots.py): per
        peer p of `peers`, in int32 words from ours, word (slot, rank) in p's memory (remote: what we raise there) or
        word (slot, p) in ours (what p raises here)."""
        base, row = self.words.data_ptr(), 4 * self.t * slot
        return [((self.remote[p] if remote else self.local[p]) + row - base) // 4 for p in peers]

    def signal_ops(self, slot: int):
        """signal(slot)'s memory operations, for a caller that batches them with its own (memops.MemOps)."""
        return [("write", self.remote[p] + 4 * self.t * slot, 1) for p in self.peers]

    def signal(self, stream: int, slot: int):
        self.signals[slot].issue(stream)

    def signal_then_wait(self, stream: int, slot: int, capturing: bool):
        """signal(slot), then wait(slot): eagerly (and under capture without a deadline) one batched driver call."""
        if capturing and self.graph_deadline:
            self.signal(stream, slot)
            self.wait(stream, slot, capturing)
        else:
            self.exchanges[slot].issue(stream)

    def wait(self, stream: int, slot: int, capturing: bool):
        """capturing: whether the caller's stream is being captured (the caller asks once per call)."""
        if capturing and self.graph_deadline:
            row = 4 * self.t * slot
            for p in self.peers:
                watchdog.graph_wait(stream, self.device, self.local[p] + row, 1, self.describe, self.what[slot, p])
            return
        self.waits[slot].issue(stream)
