"""The expert ops' peer-to-peer exchanges through PyTorch symmetric memory (peer-mapped over NVLink), copy engines
only, no collective. Their sizes change per routing, so they run over row buffers sized for the largest routing seen,
with the AllGather's and the ReduceScatter's protocols (ops/p2p_gather.py, ops/p2p_reduction.py): the dispatch pulls
(`RowPull`), the combine pushes (`RowPush`). One-shot signals (overlap_tp/ops/sync.py); each protocol's order argument
is written next to it.
"""
import torch

from overlap_tp.ops import memops, symmetric
from overlap_tp.ops.sync import PeerSignals


def _symmetric_rows(group, rank, t, capacity, cols, dtype, device):
    """A symmetric [capacity, cols] row buffer of the expert exchanges, rendezvoused over the group: (the buffer, its
    handle, every rank's address of it, the bytes of a row)."""
    from torch.distributed import _symmetric_memory as symm_mem
    buf = symmetric.empty(capacity, cols, dtype=dtype, device=device, kind="expert exchange rows")
    handle = symm_mem.rendezvous(buf, group)
    within = buf.data_ptr() - handle.buffer_ptrs[rank]   # the same on every rank
    return buf, handle, [handle.buffer_ptrs[p] + within for p in range(t)], cols * buf.element_size()


class RowPull:
    """The expert dispatch's pulls: a symmetric copy of this rank's rows (a buffer of `capacity` rows of which a call
    fills the first T: T changes per call), from which the peers pull the rows the caller names (copy_rows), copy
    engines only. Per call, on the comm stream:
        start:     wait PULLED from every peer (it finished pulling our previous rows), reset; copy our rows into
                   the symmetric buffer; signal READY to every peer, wait READY from every peer, reset
        copy_rows: rows of a peer's buffer into ours (chunk by chunk)
        finish:    signal PULLED to every peer
    Order argument: GatherBuffer's."""

    PULLED, READY = 0, 1

    def __init__(self, group, rank, t, capacity, cols, dtype, device, describe):
        self.capacity = capacity
        self.buf, self.handle, self.peer_ptrs, self.row_bytes = _symmetric_rows(group, rank, t, capacity, cols, dtype,
                                                                                device)
        self.peer_ptrs[rank] = None   # never pulled from
        self.signals = PeerSignals(group, rank, t, device, initial=(1, 0), describe=describe,
                                   names=("PULLED", "READY"), graph_deadline=False)

    def start(self, stream: int, x: torch.Tensor, capturing: bool):
        self.signals.wait(stream, self.PULLED, capturing)
        memops.copy(stream, self.buf.data_ptr(), x.data_ptr(), x.numel() * x.element_size())
        self.signals.signal_then_wait(stream, self.READY, capturing)

    def copy_rows(self, stream: int, dst_ptr: int, peer: int, src_row: int, rows: int):
        """Rows [src_row, src_row + rows) of `peer`'s buffer to dst_ptr (a copy-engine copy)."""
        memops.copy(stream, dst_ptr, self.peer_ptrs[peer] + src_row * self.row_bytes, rows * self.row_bytes)

    def finish(self, stream: int):
        self.signals.signal(stream, self.PULLED)


class RowPush:
    """Rows pushed by the copy engines into the peers' receive buffers (symmetric [capacity, cols] per rank) for one
    (group, cols, dtype): the expert combine's exchange, whose sizes change per routing. Per call:
        comm stream, before the first push: wait CONSUMED from every peer (it copied our previous rows out), reset
        push:    rows of ours into a peer's buffer (copy engine, no SM), behind the GEMM's group counters
        comm stream, after the last push: signal ARRIVED to every peer
        the reader's stream: wait ARRIVED from every peer, reset; copy the received rows out; signal CONSUMED
    Order argument: P2PReduceScatter's, with CONSUMED for SUMMED: a peer raises our CONSUMED word for call i+1 only
    after its copy-out of call i+1, which waits for our ARRIVED of call i+1, raised after our reset of CONSUMED in
    call i+1; a peer raises our ARRIVED word for call i+1 only after it waited for our CONSUMED of call i, raised
    after our reset of ARRIVED in call i. CONSUMED starts raised: nothing was pushed before the first call."""

    CONSUMED, ARRIVED = 0, 1

    def __init__(self, group, rank, t, capacity, cols, dtype, device, describe):
        self.capacity = capacity
        self.buf, self.handle, self.peer_ptrs, self.row_bytes = _symmetric_rows(group, rank, t, capacity, cols, dtype,
                                                                                device)
        self.signals = PeerSignals(group, rank, t, device, initial=(1, 0), describe=describe,
                                   names=("CONSUMED", "ARRIVED"))

    def begin(self, stream: int, capturing: bool):
        self.signals.wait(stream, self.CONSUMED, capturing)

    def push(self, stream: int, peer: int, dst_row: int, src_ptr: int, rows: int):
        memops.copy(stream, self.peer_ptrs[peer] + dst_row * self.row_bytes, src_ptr, rows * self.row_bytes)

    def end(self, stream: int):
        self.signals.signal(stream, self.ARRIVED)

    def receive(self, stream: int, copies, capturing: bool):
        """On the reader's stream: wait ARRIVED, copy out (dst_ptr, row, rows) of our buffer, signal CONSUMED."""
        self.signals.wait(stream, self.ARRIVED, capturing)
        base = self.buf.data_ptr()
        for dst_ptr, row, rows in copies:
            memops.copy(stream, dst_ptr, base + row * self.row_bytes, rows * self.row_bytes)
        self.signals.signal(stream, self.CONSUMED)
