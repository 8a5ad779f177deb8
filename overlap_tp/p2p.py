"""GEMM+ReduceScatter with no collective: the GEMM epilogue stores each region's tiles straight into
the owning rank's receive buffer (PyTorch symmetric memory, peer-mapped over NVLink), then a barrier,
then every rank sums the t partial slots it received.

What it removes against per-group NCCL reduce-scatters (shared/DEVICE.md, contention section): the
collective's CTAs (no SM is taken from the GEMM), the partial's round trip through local HBM before
NCCL reads it back, and NCCL's own copy. What it adds: remote stores in the epilogue and one sum pass
over the received slots (read t x M/t x N, write M/t x N), which the fused RMSNorm can absorb later.

Buffers are double-buffered so one barrier per call suffices: a rank starts writing buffer b of call
i only after the barrier of call i-1, which every peer reaches only after summing buffer b of call
i-2 (stream order on each rank).
"""
from dataclasses import dataclass
from typing import List, Tuple

import torch

from overlap_tp import comm
from overlap_tp.kernels.signaled_gemm import signaled_gemm
from overlap_tp.plan import TilePlan, p2p_plan

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
