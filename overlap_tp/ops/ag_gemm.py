"""AllGather+GEMM: the public op `ag_gemm` and its methods.

    ag_gemm(a_shard[M/t, K], w[N, K]) -> [M, N] = all_gather(a_shard) @ w.T (+ bias), rows in the
    standard order (rank k's shard is rows [k*M/t, (k+1)*M/t)); with return_gathered=True also the
    gathered [M, K] input (a row-parallel layer's backward reuses it for wgrad instead of gathering twice).

Methods (OverlapConfig.method):
  off        torch.distributed's all-gather, then cuBLAS (Megatron's path; the reference under gloo).
  decompose  the local rows' GEMM first, while the comm stream gathers the peers' rows in `chunks`
             row ranges; each chunk's cuBLAS GEMM waits for its chunk only.
  signal     one persistent Triton GEMM (kernels/signaled_gemm.py) over a plan (plan.ag_plan) that
             computes the local rows first, with no wait, then every chunk of the peers' rows; before a
             chunk's first load a CTA spins (acquire) on the chunk's ready flag, which the comm stream
             raises with cuStreamWriteValue32 once the chunk's transfer completed. Transports:
               nccl  per chunk, one ncclBroadcast per rank in a group call, straight into place; the GEMM
                     leaves `comm_sms` SMs to NCCL (a spinning GEMM on every SM would starve it).
               p2p   copy-engine pulls (cudaMemcpyAsync from the peers' symmetric-memory copies of their
                     shards): no SM spent on communication (ConCCL/FiCCO).
  auto       the tuner's choice for the shape (overlap_tp.tune.choose; `off` on CPU tensors).
Rows always land at their standard position, so no reorder pass follows the transfer.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from overlap_tp.ops import comm
from overlap_tp.ops.config import OverlapConfig
from overlap_tp.kernels.signaled_gemm import signaled_gemm
from overlap_tp.ops.gemm_rs import chunk_bounds, collectives_for, gemm_programs, prepare, resolve_method
from overlap_tp.ops.plan import TilePlan, ag_plan


@dataclass
class GatherState:
    """A plan's tile table on the device, its ready flags and the epoch of the last call."""
    plan: TilePlan
    tiles: torch.Tensor
    flags: torch.Tensor
    calls: int = 0


_states = {}


def _gather_state(m, n, k, t, rank, config, elem_bytes, device) -> GatherState:
    key = (m, n, k, t, rank, config.block_m, config.block_n, config.groups, elem_bytes, str(device))
    if key not in _states:
        plan = ag_plan(m, n, k, t, rank, config.block_m, config.block_n, config.groups, elem_bytes)
        _states[key] = GatherState(plan, plan.tiles.to(device),
                                   torch.zeros(max(1, len(plan.collectives)), dtype=torch.int32, device=device))
    return _states[key]


def _decomposed(a_shard, w, gathered, out, coll, rank, t, chunks):
    """The local rows' cuBLAS GEMM at once; chunk c's rows gathered on the comm stream, then its GEMM."""
    m_local = a_shard.shape[0]
    regions, out_regions = gathered.chunk(t), out.chunk(t)
    regions[rank].copy_(a_shard)
    torch.mm(a_shard, w.t(), out=out_regions[rank])
    engine = comm.comm_engine(a_shard.device)
    current = torch.cuda.current_stream(a_shard.device) if a_shard.is_cuda else None
    if current is not None:
        engine.stream.wait_stream(current)
    for lo, hi in chunk_bounds(m_local, chunks):
        if current is None:
            coll.all_gather_rows(gathered, a_shard, lo, hi)
        else:
            with torch.cuda.stream(engine.stream):
                coll.all_gather_rows(gathered, a_shard, lo, hi)
                arrived = torch.cuda.Event()
                arrived.record(engine.stream)
            current.wait_event(arrived)
        for p in range(t):
            if p != rank:
                torch.mm(regions[p][lo:hi], w.t(), out=out_regions[p][lo:hi])
    if current is not None:
        current.wait_stream(engine.stream)


def _signaled(a_shard, w, bias, gathered, out, group, rank, t, config):
    """The persistent GEMM over ag_plan: local rows at once, each peer chunk behind its ready flag,
    which the comm stream raises after the chunk's transfer."""
    m_local, k = a_shard.shape
    m, n = gathered.shape[0], w.shape[0]
    state = _gather_state(m, n, k, t, rank, config, a_shard.element_size(), a_shard.device)
    state.calls += 1
    epoch = (state.calls + 2 ** 31) % 2 ** 32 - 2 ** 31   # the call count as an int32, wrapping
    engine = comm.comm_engine(a_shard.device)
    gathered.chunk(t)[rank].copy_(a_shard)
    programs = gemm_programs(a_shard.device, config)
    if config.transport == "p2p":
        from overlap_tp.ops.p2p import shard_pull
        pull = shard_pull(group, rank, t, m_local, k, a_shard.dtype, a_shard.device)
    else:
        coll = collectives_for("signal", group, a_shard.device, config)

    def transfers():
        peer_shards = pull.start(engine, a_shard) if config.transport == "p2p" else None
        for c, chunk in enumerate(state.plan.collectives):
            if peer_shards is not None:
                pull.pull(gathered, peer_shards, chunk.src_lo, chunk.src_hi)
            else:
                coll.all_gather_rows(gathered, a_shard, chunk.src_lo, chunk.src_hi)
            engine.raise_flag(state.flags, c, epoch)

    def gemm():
        signaled_gemm(gathered, w, out, state.tiles, None, programs, config, bias, (0, m),
                      flags=state.flags, wait_target=epoch)

    if engine.stream is None:   # CPU: the transfers complete before the (interpreted) kernel starts
        transfers()
        gemm()
        return
    current = torch.cuda.current_stream(a_shard.device)
    engine.stream.wait_stream(current)
    with torch.cuda.stream(engine.stream):   # enqueued first: the transfers never queue behind the GEMM
        transfers()
    gemm()
    done = torch.cuda.Event()
    done.record(current)
    current.wait_stream(engine.stream)
    engine.watch(done, f"ag_gemm(M={m}, N={n}, K={k}, t={t}, {config.transport})", state.flags,
                 [epoch] * state.flags.numel())


def ag_gemm(a_shard: torch.Tensor, w: torch.Tensor, group=None, *, bias: Optional[torch.Tensor] = None,
            config: Optional[OverlapConfig] = None, return_gathered: bool = False):
    """all_gather(a_shard) @ w.T + bias; with return_gathered=True returns (out, gathered)."""
    group, t, rank, config = prepare("ag_gemm", a_shard, w, bias, group, config, rows_split=False)
    m_local, k = a_shard.shape
    m, n = t * m_local, w.shape[0]
    method = resolve_method(config, a_shard, w, m_local, n, "ag_gemm")
    if method == "signal" and config.transport == "p2p" and (not a_shard.is_cuda or dist.get_backend(group) != "nccl"):
        raise ValueError("ag_gemm: transport='p2p' needs CUDA tensors and an NCCL group (symmetric memory)")
    if method == "signal" and config.transport == "nccl" and a_shard.is_cuda and config.comm_sms < 1:
        raise ValueError("ag_gemm: method='signal' with transport='nccl' needs comm_sms >= 1: the GEMM spins on "
                         "ready flags that NCCL kernels raise, so NCCL must have SMs the GEMM does not hold "
                         "(transport='p2p' spends no SM and runs with comm_sms=0)")
    out = torch.empty(m, n, dtype=a_shard.dtype, device=a_shard.device)
    if method == "off":
        gathered, _ = comm.all_gather_rows(a_shard, group)
        torch.mm(gathered, w.t(), out=out)
    elif method == "decompose":
        gathered = torch.empty(m, k, dtype=a_shard.dtype, device=a_shard.device)
        _decomposed(a_shard, w, gathered, out, collectives_for(method, group, a_shard.device, config), rank, t,
                    config.chunks)
    else:
        gathered = torch.empty(m, k, dtype=a_shard.dtype, device=a_shard.device)
        _signaled(a_shard, w, bias, gathered, out, group, rank, t, config)
        bias = None   # added in the epilogue
    if bias is not None:
        out += bias
    return (out, gathered) if return_gathered else out
