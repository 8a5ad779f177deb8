"""Peer-to-peer AllGather through PyTorch symmetric memory (peer-mapped over NVLink), no collective: `GatherBuffer`.

Every rank copies its shard into its own region of a symmetric gathered buffer and tells its peers; each rank then
pulls the peers' rows chunk by chunk from their buffers into its own with copy-engine copies (no SM spent on the
transfer), or with one kernel on the SMs a signaled GEMM leaves free (`signaled_pull`: loads over NVLink, the
handshakes and the chunks' flags as the kernel's own stores and spins). Waits and signals are otherwise stream memory
operations.

One buffer and one-shot signals (overlap_tp/ops/sync.py: raised by the producer, reset by the waiter), so every call,
eager or a replay of a captured graph, runs the same protocol; its order argument is written next to it. The
AllGather's gathered buffer is shared by the plans of one shard shape (or owned by one consumer: ag_gemm.OwnGather).
"""
import math

import torch

from overlap_tp.kernels.fp8_quant import ScaledFp8
from overlap_tp.kernels.peer_copy import SignaledPull
from overlap_tp.ops import memops, symmetric, watchdog
from overlap_tp.ops.sync import PeerSignals
from overlap_tp.ops.tile_plan import ring_peers


class GatherBuffer:
    """AllGather by copy-engine pulls into one symmetric gathered buffer [t * m, k] for one (group, shard shape,
    dtype): rank r's own region (rows [r*m, (r+1)*m)) holds its shard, and is what its peers pull rank r's rows from,
    so a shard is copied once (the GEMM reads the local rows in place too) and no SM is spent.

    Per call:
        stage (caller's stream): wait PULLED from every peer (it finished pulling our region of the previous
                 call), reset; copy our shard into our region
        ready (comm stream, forked after stage): signal READY to every peer, wait READY from every peer, reset
                 (one batched driver call)
        pull:    rows [lo, hi) of every peer's region of its buffer into the same rows of ours (chunk by chunk; the peers
                 in ring order)
        finish:  signal PULLED to every peer (our pulls of its region are complete)
    Order argument for the resets: a peer raises our READY word for call i+1 only after it waited for our
    PULLED of call i, raised after our reset of READY in call i; a peer raises our PULLED word for call i
    only after pulling our region of call i, which waits for our READY of call i, raised after our reset of
    PULLED in call i. PULLED starts raised: nobody reads the buffer before the first call. Our peers' regions of our
    buffer are written by our own pulls only, behind our previous reads of them (stream order: every call forks
    from and joins into the caller's stream).

    The buffer is what a call returns as the gathered input (gathered()), so it is valid until the next call on
    this buffer, which every AllGather of this shape shares (the AgGemm plans and gather_rows of the shape: one
    buffer per shape, as Transformer Engine's userbuffers). A call while the previous call's gathered tensor (or a
    view of it) is still referenced is a RuntimeError, not an overwrite of data the caller may still read.

    Written in place (a buffer of one consumer's own, ag_gemm.OwnGather): the producer of the shard asks for our
    region first (claim: the reference check and the PULLED wait of stage, on its stream), writes the shard there
    itself (the norm before the column-parallel GEMM), and the stage that follows finds the shard in place: no wait
    (done) and no copy. `claimed` is host state of the call in flight: a claim is followed by one stage, in the
    same eager call sequence or the same captured graph; a claim made in a capture that ended before its stage (a
    failed capture: none of it ran) is forgotten, so the next eager call waits for PULLED itself."""

    PULLED, READY = 0, 1

    def __init__(self, group, rank, t, m, k, dtype, device, describe, memory_kind="AllGather buffers"):
        from torch.distributed import _symmetric_memory as symm_mem
        self.rank, self.world, self.m, self.describe = rank, t, m, describe
        self.buf = symmetric.empty(t * m, k, dtype=dtype, device=device, kind=memory_kind)
        handle = symm_mem.rendezvous(self.buf, group)
        within = self.buf.data_ptr() - handle.buffer_ptrs[rank]   # the same on every rank
        self.row_bytes = k * self.buf.element_size()
        self.region_bytes = m * self.row_bytes
        # where each rank's own rows start: ours in our buffer, a peer's in its buffer (the pulls' sources)
        self.own = [handle.buffer_ptrs[p] + within + p * self.region_bytes for p in range(t)]
        # with every rank pulling in ring order, each rank's rows are read by one puller at a time (in rank order all
        # t-1 pullers read rank 0 first and shared its NVLink egress)
        self.peers = ring_peers(rank, t)
        self.base = self.buf.data_ptr()
        self.handle = handle
        # stream wait-values under capture too: the AllGather+GEMM's tiles wait behind these (PeerSignals says why)
        self.signals = PeerSignals(group, rank, t, device, initial=(1, 0), describe=describe,
                                   names=("PULLED", "READY"), graph_deadline=False)
        self._unreferenced = self._references()
        self.claimed = None    # PULLED waited for, our region handed to the producer: "eager" / "capture" (claim)

    def _references(self) -> int:
        """The tensors that use the buffer's storage (the count of its storage's users, less the storage object
        asked): the buffer itself alone once every gathered tensor a call handed out, and every view of one, is gone."""
        return torch._C._storage_Use_Count(self.buf.untyped_storage()._cdata)

    def gathered(self) -> torch.Tensor:
        """This call's gathered [t * m, k]: a new tensor over the buffer's storage (so that the next stage can tell
        whether it, or a view of it, is still referenced). detach() makes that alias in a fraction of view()'s host time
        (the buffer never requires grad)."""
        return self.buf.detach()

    def stage(self, stream: int, a_shard: torch.Tensor, capturing: bool):
        """Our shard into our region, once every peer pulled the previous one: copied, or already there (claim)."""
        if self._claimed(capturing):
            self.claimed = None
            if a_shard.data_ptr() != self.own[self.rank]:   # claimed, then handed another tensor: copy it
                memops.copy(stream, self.own[self.rank], a_shard.data_ptr(), self.region_bytes)
            return
        self._check_unreferenced()
        self.signals.wait(stream, self.PULLED, capturing)
        memops.copy(stream, self.own[self.rank], a_shard.data_ptr(), self.region_bytes)

    def claim(self, stream: int, capturing: bool) -> torch.Tensor:
        """Our region [m, k] for the shard's producer to write into, on `stream` once every peer pulled the previous
        call's rows from it; the next stage() then copies nothing. Claiming twice waits once."""
        if not self._claimed(capturing):
            self._check_unreferenced()
            self.signals.wait(stream, self.PULLED, capturing)
            self.claimed = "capture" if capturing else "eager"
        return self.buf.narrow(0, self.rank * self.m, self.m)

    def _claimed(self, capturing: bool) -> bool:
        """Whether a claim of this call is in force: one made in a capture that has ended (it failed before the
        stage, and nothing of it ran) is dropped."""
        if self.claimed == "capture" and not capturing:
            self.claimed = None
        return self.claimed is not None

    def claim_in_force(self) -> bool:
        """Whether an eager call's stage finds a claim in force (it then waits for nothing and copies nothing, or only
        the tensor handed instead of the region); without one, the check its stage makes first (the RuntimeError of a
        gathered tensor of the previous call still referenced). For a call replayed from a graph (ops/replay.py),
        whose captured stage is what stage() issues in that state: part of the graph's key."""
        if self._claimed(False):
            return True
        self._check_unreferenced()
        return False

    def _check_unreferenced(self):
        if self._references() > self._unreferenced:
            raise RuntimeError(f"overlap_tp {self.describe}: the previous call's gathered input is still referenced, "
                               "and this call overwrites the buffer it lives in; use it before the next AllGather "
                               "into this buffer, or keep a copy (.clone())")

    def ready(self, stream: int, capturing: bool):
        self.signals.signal_then_wait(stream, self.READY, capturing)

    def pull(self, stream: int, lo: int, hi: int, lanes=None, capturing: bool = False):
        """Rows [lo, hi) of every peer's region into ours; with `lanes` (comm.CopyLanes) in parts over its streams,
        every part behind `stream`'s work so far (READY) and joined back into it before what follows (PULLED)."""
        if lanes is None:
            self._copy_rows(stream, lo, hi, 0)
        else:
            lanes.run(stream, lo, hi, self._copy_rows, capturing)

    def _copy_rows(self, stream: int, lo: int, hi: int, lane: int):
        """Rows [lo, hi) of every peer's region into ours, on `stream` (copy engines): copies(lo, hi, lane)."""
        for dst, src, nbytes in self.copies(lo, hi, lane):
            memops.copy(stream, dst, src, nbytes)

    def copies(self, lo: int, hi: int, lane: int = 0):
        """The copy-engine copies that pull rows [lo, hi) of every peer's region into ours, as (dst, src, bytes): the
        peers in ring order, lane `lane` starting `lane` peers further on, so that a rank's lanes read different peers
        at once. Fixed for the buffer's life: a plan whose chunks are fixed makes its list once (AgGemm)."""
        peers = self.peers
        return [self.peer_copy(p, lo, hi) for p in (peers[(i + lane) % len(peers)] for i in range(len(peers)))]

    def peer_copy(self, peer: int, lo: int, hi: int):
        """The copy-engine copy that pulls rows [lo, hi) of `peer`'s region into ours, as (dst, src, bytes)."""
        offset = lo * self.row_bytes
        return self.base + peer * self.region_bytes + offset, self.own[peer] + offset, (hi - lo) * self.row_bytes

    def pull_peer(self, stream: int, peer: int, lo: int, hi: int):
        """Rows [lo, hi) of `peer`'s region into ours, on `stream` (one copy-engine copy)."""
        memops.copy(stream, *self.peer_copy(peer, lo, hi))

    def signaled_pull(self, programs: int, chunks, flags: torch.Tensor, describe: str) -> SignaledPull:
        """ready(), the pulls of `chunks` (local row ranges; flags[c] raised after chunk c) and finish() as one kernel
        of `programs` CTAs (kernels/peer_copy.py): the same rows in the same ring order, loaded by SMs over NVLink,
        the READY exchange, the flags and PULLED as the kernel's stores and spins (no stream memory operation, whose
        cross-GPU hop inside a graph costs several times a kernel's: docs/performance.md). Launched on the stream that
        would pull, after
        stage(). A READY that never comes ends in the watchdog's report naming `describe` (the plan)."""
        size, signals, t, peers = self.buf.element_size(), self.signals, self.world, self.peers
        dog = watchdog.watchdog()
        what = f"every peer's READY signal (group of {t}, the SM pulls)"
        return SignaledPull(self.buf, [(self.own[p] - self.base) // size for p in peers],   # the peers' regions
                            [p * self.region_bytes // size for p in peers], self.row_bytes // size, programs,
                            chunks, signals.words,
                            signals.word_offsets(self.READY, peers, remote=False),
                            signals.word_offsets(self.READY, peers, remote=True),
                            signals.word_offsets(self.PULLED, peers, remote=True), flags,
                            dog.timeout_s, dog.open_mailbox(), watchdog.wait_code(describe, what, dog.timeout_s))

    def finish(self, stream: int):
        self.signals.signal(stream, self.PULLED)


class ScaledGatherBuffer(GatherBuffer):
    """A GatherBuffer of FP8 rows [t * m, k] (one byte per element) with their scales: AllGather+GEMM's FP8 input
    (ag_gemm.AgGemmSignaledP2PFp8, one per plan). The scales are in a symmetric fp32 buffer of their own, rank r's
    region holding r's shard's scales as its rank quantized them (`shard_scales`: tensorwise (1,), 1x128 (k/128, m)),
    so the buffer, read whole, is fp8_quant's gathered layout, which the FP8 GEMM reads as it is. The scale regions
    follow the rows' protocol and signals (GatherBuffer's order argument covers them): stage copies the shard's
    scales into our region right after its rows, behind the PULLED wait and before READY; a puller copies the peers'
    scale regions (scale_copies) after READY and before PULLED, ahead of the first chunk's rows. gathered() is the
    ScaledFp8 of both; the reference check counts both buffers' users. No claim (writing in place): FP8 shards are
    staged."""

    def __init__(self, group, rank, t, m, k, dtype, scaling: str, shard_scales, device, describe):
        from torch.distributed import _symmetric_memory as symm_mem
        self.scaling = scaling
        numel = math.prod(shard_scales)
        self.scale_shape = (t,) if scaling == "tensorwise" else (t, *shard_scales)
        self.scales = symmetric.empty(t, numel, dtype=torch.float32, device=device, kind="FP8 AllGather scales")
        handle = symm_mem.rendezvous(self.scales, group)
        within = self.scales.data_ptr() - handle.buffer_ptrs[rank]   # the same on every rank
        self.scale_bytes = 4 * numel
        # each rank's scale region: ours in our buffer, a peer's in its buffer (the pulls' sources)
        self.scale_own = [handle.buffer_ptrs[p] + within + p * self.scale_bytes for p in range(t)]
        self.scale_handle = handle
        super().__init__(group, rank, t, m, k, dtype, device, describe, memory_kind="FP8 AllGather buffers")

    def _references(self) -> int:
        use_count = torch._C._storage_Use_Count
        return (use_count(self.buf.untyped_storage()._cdata) + use_count(self.scales.untyped_storage()._cdata))

    def gathered(self) -> ScaledFp8:
        """This call's gathered rows and every rank's scales (new tensors over the buffers' storage)."""
        return ScaledFp8(self.buf.detach(), self.scales.detach().view(self.scale_shape), self.scaling)

    def stage(self, stream: int, a_shard: ScaledFp8, capturing: bool):
        """Our shard's rows and scales into our regions, once every peer pulled the previous ones."""
        super().stage(stream, a_shard.q, capturing)
        memops.copy(stream, self.scale_own[self.rank], a_shard.ds.data_ptr(), self.scale_bytes)

    def scale_copies(self):
        """The copy-engine copies that pull every peer's scale region into ours, as (dst, src, bytes), the peers in
        ring order."""
        base = self.scales.data_ptr()
        return [(base + p * self.scale_bytes, self.scale_own[p], self.scale_bytes) for p in self.peers]
