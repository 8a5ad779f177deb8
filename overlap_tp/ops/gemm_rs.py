"""GEMM+ReduceScatter: reduce_scatter(a @ w.T + bias) along dim 0, as a plan (GemmRS) and a function (gemm_rs).

    plan = GemmRS(group, m, n, k, dtype, device, config)   # once per shape: config resolved, buffers, tables
    out = plan(a[M, K_local], w[N, K_local], bias)           # [M/t, N]: rank k gets rows [k*M/t, (k+1)*M/t)
    out = gemm_rs(a, w, group, bias=..., config=...)        # the same through a cached plan

Methods (OverlapConfig.method): `signal` (persistent Triton GEMM + per-group collectives on the comm stream,
ops/reduction.py; or, with transport 'p2p', epilogue stores into the owners' symmetric buffers, or with
rs_transfer 'copy' (the default where t > 2) local stores that the copy engines push to the owners group by group,
ops/p2p.py), `decompose` (M-chunked cuBLAS + chunked collectives on the comm stream; or, with transport 'p2p',
one cuBLAS GEMM per owner's region writing straight into that owner's symmetric buffer, ops/p2p.py RegionGemms, or
with rs_transfer 'copy' into a local staging matrix, each pushed by the copy engines after its GEMM),
the collectives through a raw NCCL communicator (ops/nccl.py); `off` (cuBLAS then torch.distributed's
reduce-scatter: Megatron's path and, on CPU tensors under gloo, the reference); `auto` (the tuner's choice, resolved
when the plan is built).
On CPU tensors `signal` runs its Triton kernel in the interpreter and the same per-group collectives, so the
whole signaled data path is tested without a GPU.

bias: added once, after the reduction (Megatron's semantics). The signaled kernel adds it in fp32 to the
rows this rank will own, which equals adding it after the sum without another pass over the output.

async_op=True returns a `Pending`: the GEMM is issued and its communication may still be running when the
call returns, so the caller can queue independent work (the column-parallel backward's wgrad GEMM, as
Megatron overlaps its dgrad reduce-scatter) before `wait()`. Without it, a call on the p2p transport whose operand
addresses the plan has seen before launches eagerly as one CUDA graph (ops/replay.py).
"""
from typing import Optional

import torch

from overlap_tp.kernels.signaled_gemm import check_operands
from overlap_tp.ops import comm
from overlap_tp.ops.common import OpPlan, Pending, cached_plan, chunk_bounds, gemm_programs
from overlap_tp.ops.config import OverlapConfig, rs_transfer_for
from overlap_tp.ops.p2p import P2PReduceScatter
from overlap_tp.ops.reduction import SignaledReduction, after_work, decomposed, joined, plus_bias
from overlap_tp.ops.tile_plan import make_plan


class GemmRS(OpPlan):
    """reduce_scatter(a @ w.T + bias) for a[m, k], w[n, k] on `group`: built once, called per step."""

    op = "gemm_rs"
    rows_split = True

    def __init__(self, group, m: int, n: int, k: int, dtype=torch.bfloat16, device=None,
                 config: Optional[OverlapConfig] = None, instance: int = 0):
        super().__init__(group, m, n, k, dtype, device, config, instance)
        config, device, t = self.config, self.device, self.t
        self.m_local = m // t
        self.p2p = None   # the p2p transport's state (a call tests for it, not for the method and transport)
        if self.method in ("signal", "decompose") and config.transport == "p2p":
            if device.type != "cuda":   # symmetric memory, rendezvoused over the group's store (any backend)
                raise ValueError("gemm_rs: transport='p2p' needs CUDA tensors (symmetric memory)")
            # rs_transfer 'copy': one SM left to the comm stream's waits, which a captured graph runs as one-thread
            # kernels
            programs = gemm_programs(device, config, spare_sms=int(self.method == "signal"
                                                                   and config.rs_transfer == "copy"))
            self.p2p = P2PReduceScatter(self.group, self.rank, t, m, n, dtype, device, config, programs,
                                        self.watched, self.instance)
        elif self.method == "signal":
            if config.schedule == "tile_exact" and (self.m_local % config.block_m or n % config.block_n):
                raise ValueError(f"gemm_rs: method='signal' cannot run: schedule 'tile_exact' needs M/t={self.m_local} "
                                 f"% block_m={config.block_m} == 0 and N={n} % block_n={config.block_n} == 0")
            plan = make_plan(config.schedule, m, n, t, config.block_m, config.block_n, config.groups,
                             torch.finfo(dtype).bits // 8)
            self.signaled = SignaledReduction(plan, device, config, gemm_programs(device, config),
                                              (self.rank * self.m_local, (self.rank + 1) * self.m_local),
                                              comm.collectives(self.group, device, config.comm_sms), "reduce_scatter")
            if self.watched is not None:
                self.watched.words = (("counters", self.signaled.counters),)
        elif self.method == "decompose":
            self.coll = comm.collectives(self.group, device, config.comm_sms)
            self.bounds = chunk_bounds(self.m_local, config.chunks)
        else:
            self.coll = comm.TorchCollectives(self.group)

    def _resolve(self, config: OverlapConfig) -> OverlapConfig:
        """OpPlan's resolution, then rs_transfer 'auto' for this group's size (config.rs_transfer_for)."""
        return rs_transfer_for(super()._resolve(config), self.t)

    def __call__(self, a: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                 async_op: bool = False):
        self.check_call(a, w, bias)
        n, m_local = self.n, self.m_local
        if self.p2p is not None:
            # the sum (after the wait for every peer's stores) runs on the stream current at wait(): with
            # async_op, work queued before wait() hides the wait for the slowest peer. pending.deferred_sum lets
            # the kernel that reads the output sum the slots itself instead (the fused add + RMSNorm).
            if not async_op:   # summed at once, on this stream
                return self.p2p.summed(a, w, bias)
            deferred = self.p2p(a, w, bias)
            pending = Pending(deferred, deferred_sum=deferred)
        elif self.method == "signal":
            signaled = self.signaled
            order = signaled.order
            out = torch.empty(m_local, n, dtype=a.dtype, device=a.device)
            received = out if order is None else torch.empty(signaled.plan.out_shape, dtype=a.dtype, device=a.device)
            staging = torch.empty(signaled.plan.staging_shape, dtype=a.dtype, device=a.device)
            join = signaled.run(a, w, bias, received, staging, self.watched)

            def finish():
                join()
                return out if order is None else order.undo(received)
            if not async_op:   # joined at once: no Pending to hold the buffers
                return finish()
            pending = Pending(finish, staging, received)
        elif self.method == "decompose":
            out = torch.empty(m_local, n, dtype=a.dtype, device=a.device)
            a3, wt, t = a.view(self.t, m_local, -1), w.t(), self.t

            def chunk(lo, hi):
                return torch.matmul(a3[:, lo:hi], wt).view(t * (hi - lo), n)

            def collective(dst, src, stream):
                self.coll.reduce_scatter(dst, src, stream=stream)

            staged = decomposed(a.device, out, chunk, collective, self.bounds)
            pending = Pending(joined(a.device, plus_bias(out, bias)), staged)
        else:
            out = torch.empty(m_local, n, dtype=a.dtype, device=a.device)
            partial = a @ w.t()
            pending = Pending(after_work(self.coll.reduce_scatter(out, partial, async_op=async_op),
                                         plus_bias(out, bias)), partial)
        return pending if async_op else pending.wait()


def gemm_rs(a: torch.Tensor, w: torch.Tensor, group=None, *, bias: Optional[torch.Tensor] = None,
            config: Optional[OverlapConfig] = None, async_op: bool = False, instance: int = 0):
    """reduce_scatter(a @ w.T + bias) along dim 0: rank k gets rows [k*M/t, (k+1)*M/t), bias added once.
    async_op=True: a Pending whose wait() returns that. Runs the cached GemmRS plan of this shape (of `instance`:
    cached_plan)."""
    check_operands(a, w, bias)
    plan = cached_plan(GemmRS, comm.resolve_group(group), a.shape[0], w.shape[0], w.shape[1], a.dtype, a.device,
                       config, instance)
    return plan(a, w, bias, async_op=async_op)
