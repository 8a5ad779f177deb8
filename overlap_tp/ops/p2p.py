"""Peer-to-peer transports through PyTorch symmetric memory (peer-mapped over NVLink), no collective.

GEMM+ReduceScatter (`gemm_rs_p2p`): the GEMM epilogue stores each region's tiles straight into the
owning rank's receive buffer, then a barrier, then every rank sums the t partial slots it received.

AllGather+GEMM (`ShardPull`): every rank copies its shard into a symmetric buffer and tells its peers
so by writing the call's epoch into their `ready` words (cuStreamWriteValue32 on peer-mapped memory);
each rank then pulls the peers' rows chunk by chunk with copy-engine copies. No SM is spent on the
transfer; waits and signals are stream memory operations.

What it removes against per-group NCCL reduce-scatters (shared/DEVICE.md, contention section): the
collective's CTAs (no SM is taken from the GEMM), the partial's round trip through local HBM before
NCCL reads it back, and NCCL's own copy. What it adds: remote stores in the epilogue and one sum pass
over the received slots (read t x M/t x N, write M/t x N), which the fused RMSNorm can absorb later.

Buffers are double-buffered so one barrier per call suffices: a rank starts writing buffer b of call
i only after the barrier of call i-1, which every peer reaches only after summing buffer b of call
i-2 (stream order on each rank).
"""
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from overlap_tp.ops import comm
from overlap_tp.kernels.signaled_gemm import signaled_gemm
from overlap_tp.ops.plan import TilePlan, p2p_plan

# Offsets between buffers are used as 16-element-aligned by the kernel (16-byte stores).
OFFSET_ALIGNMENT = 16


@dataclass
class P2PState:
    plan: TilePlan
    tiles: torch.Tensor
    counters: torch.Tensor            # raised by the kernel; nothing waits on a part of a p2p GEMM
    buffers: List[Tuple[torch.Tensor, object, torch.Tensor]]   # (receive buffer, handle, offsets)
    calls: int = 0


_states = {}


def _receive_buffer(group, rank, t, m_local, n, dtype, device):
    """A symmetric [t * M/t, N] buffer and, per rank k, the element offset of rank k's copy from ours."""
    from torch.distributed import _symmetric_memory as symm_mem
    buf = symm_mem.empty(t * m_local, n, dtype=dtype, device=device)
    handle = symm_mem.rendezvous(buf, group)
    within = buf.data_ptr() - handle.buffer_ptrs[rank]        # the same on every rank
    byte_offsets = [handle.buffer_ptrs[k] + within - buf.data_ptr() for k in range(t)]
    if any(off % (OFFSET_ALIGNMENT * buf.element_size()) for off in byte_offsets):
        raise RuntimeError(f"overlap_tp: symmetric buffers are not {OFFSET_ALIGNMENT}-element aligned: {byte_offsets}")
    offsets = torch.tensor([off // buf.element_size() for off in byte_offsets], dtype=torch.int64, device=device)
    return buf, handle, offsets


def p2p_state(group, rank, t, m, n, config, dtype, device) -> P2PState:
    key = (id(group), m, n, config.block_m, config.block_n, dtype, device.index)
    if key not in _states:
        plan = p2p_plan(m, n, t, rank, config.block_m, config.block_n)
        buffers = [_receive_buffer(group, rank, t, m // t, n, dtype, device) for _ in range(2)]
        _states[key] = P2PState(plan, plan.tiles.to(device), torch.zeros(1, dtype=torch.int32, device=device),
                                buffers)
    return _states[key]


def gemm_rs_p2p(a, w, bias, group, rank, t, config, programs):
    """reduce_scatter(a @ w.T) [+ bias] through epilogue stores into the owners' buffers."""
    m, n = a.shape[0], w.shape[0]
    m_local = m // t
    state = p2p_state(group, rank, t, m, n, config, a.dtype, a.device)
    buf, handle, offsets = state.buffers[state.calls % 2]
    state.calls += 1
    signaled_gemm(a, w, buf, state.tiles, state.counters, programs, config, bias,
                  (rank * m_local, (rank + 1) * m_local), dst_offsets=offsets)
    handle.barrier(channel=0)
    done = torch.cuda.Event()
    done.record()
    comm.comm_engine(a.device).watch(done, f"gemm_rs(M={m}, N={n}, K={a.shape[1]}, t={t}, p2p) barrier")
    # bf16 sum over the slots accumulates in fp32 and rounds once: at t = 2, NCCL's bf16 a + b exactly.
    return buf.view(t, m_local, n).sum(0)


@dataclass
class ShardPull:
    """AllGather by copy-engine pulls, for one (group, shard shape): double-buffered symmetric copies of
    this rank's shard and a symmetric int32 `ready[t]` word per source rank.

    Why double buffering with one epoch per call is safe: a rank overwrites shard buffer b in call i
    only after its comm stream saw every peer's epoch i-1, which a peer writes only after its pulls of
    call i-2 (from buffer b) completed (stream order on that peer)."""
    rank: int
    world: int
    shards: List[Tuple[torch.Tensor, object]]   # (symmetric [M/t, K] buffer, handle) x 2
    peer_shards: List[List[Optional[torch.Tensor]]]   # per buffer: every rank's copy mapped here (None: ours)
    ready: torch.Tensor                          # symmetric int32 [t]: ready[p] = epoch of p's shard
    peer_ready: List[int]                        # address of ready[rank] on each rank
    calls: int = 0

    def start(self, engine, a_shard):
        """On the comm stream: publish a_shard to the peers and wait until theirs are published.
        Returns the peers' shard buffers for this call, as tensors on this device (None for this rank)."""
        b = self.calls % 2
        self.calls += 1
        self.shards[b][0].copy_(a_shard)
        for p in range(self.world):
            if p != self.rank:
                comm.stream_write_value(engine.stream, self.peer_ready[p], self.calls)
        for p in range(self.world):
            if p != self.rank:
                comm.stream_wait_value(engine.stream, self.ready.data_ptr() + 4 * p, self.calls)
        return self.peer_shards[b]

    @staticmethod
    def pull(gathered, peer_shards, lo, hi):
        """On the current (comm) stream: rows [lo, hi) of every peer's shard into its region of `gathered`."""
        regions = gathered.chunk(len(peer_shards))
        for region, shard in zip(regions, peer_shards):
            if shard is not None:
                region[lo:hi].copy_(shard[lo:hi])


_pulls = {}


def shard_pull(group, rank, t, m_local, k, dtype, device) -> ShardPull:
    """The ShardPull of this group and shard shape, created collectively on first use."""
    key = (id(group), m_local, k, dtype, device.index)
    if key not in _pulls:
        from torch.distributed import _symmetric_memory as symm_mem
        shards, peer_shards = [], []
        for _ in range(2):
            buf = symm_mem.empty(m_local, k, dtype=dtype, device=device)
            handle = symm_mem.rendezvous(buf, group)
            offset = (buf.data_ptr() - handle.buffer_ptrs[rank]) // buf.element_size()
            shards.append((buf, handle))
            peer_shards.append([None if p == rank else handle.get_buffer(p, tuple(buf.shape), buf.dtype, offset)
                                for p in range(t)])
        ready = symm_mem.empty(t, dtype=torch.int32, device=device)
        ready.zero_()
        handle = symm_mem.rendezvous(ready, group)
        within = ready.data_ptr() - handle.buffer_ptrs[rank]
        peer_ready = [handle.buffer_ptrs[p] + within + 4 * rank for p in range(t)]
        torch.cuda.synchronize(device)
        handle.barrier(channel=0)   # every rank's ready words are zero before anyone writes a peer's
        torch.cuda.synchronize(device)
        _pulls[key] = ShardPull(rank, t, shards, peer_shards, ready, peer_ready)
    return _pulls[key]
