"""GEMM+AllReduce: all_reduce(a @ w.T) + bias, as a plan (GemmAR) and a function (gemm_ar).

    plan = GemmAR(group, m, n, k, dtype, device, config)
    out = plan(a[M, K_local], w[N, K_local], bias)           # [M, N] on every rank
    out = gemm_ar(a, w, group, bias=..., config=...)        # the same through a cached plan

The methods are gemm_rs's (ops/gemm_rs.py) with an all-reduce per group: the signaled GEMM stores every tile
in place into the output (a one-region plan) and each group's rows are all-reduced in place behind its
counter. The bias is added once: by rank 0's epilogue (signal) or after the reduction (off, decompose).
Transport `p2p` (signal or decompose, CUDA, M divisible by t): gemm_rs's p2p ReduceScatter, each rank's sum written
into its region of a symmetric buffer, then the copy engines pull the peers' regions into the output (ops/p2p.py
P2PAllReduce): no collective and no SM spent on communication, and with no NCCL inside, an eager call replays from
a CUDA graph (ops/replay.py). The bias goes into each region once, by its owner's GEMM. async_op returns a Pending
of the call already joined on the caller's stream.
"""
from typing import Optional

import torch

from overlap_tp.kernels.signaled_gemm import check_operands
from overlap_tp.ops import comm
from overlap_tp.ops.common import OpPlan, Pending, cached_plan, chunk_bounds, gemm_programs
from overlap_tp.ops.config import OverlapConfig, rs_transfer_for
from overlap_tp.ops.p2p import P2PAllReduce
from overlap_tp.ops.reduction import SignaledReduction, after_work, decomposed, joined, plus_bias
from overlap_tp.ops.tile_plan import make_plan


class GemmAR(OpPlan):
    """all_reduce(a @ w.T) + bias for a[m, k], w[n, k] on `group`: built once, called per step."""

    op = "gemm_ar"

    def __init__(self, group, m: int, n: int, k: int, dtype=torch.bfloat16, device=None,
                 config: Optional[OverlapConfig] = None, instance: int = 0):
        super().__init__(group, m, n, k, dtype, device, config, instance)
        config, device, t = self.config, self.device, self.t
        self.p2p = None   # the p2p transport's state (a call tests for it, not for the method and transport)
        if self.method in ("signal", "decompose") and config.transport == "p2p":
            if m % t:
                raise ValueError(f"gemm_ar: transport='p2p' reduces rows in t regions: M={m} is not divisible by the "
                                 f"group size t={t}")
            if device.type != "cuda":   # symmetric memory, rendezvoused over the group's store (any backend)
                raise ValueError("gemm_ar: transport='p2p' needs CUDA tensors (symmetric memory)")
            # as GemmRS: rs_transfer 'copy' leaves one SM to the comm stream's waits
            programs = gemm_programs(device, config, spare_sms=int(self.method == "signal"
                                                                   and config.rs_transfer == "copy"))
            self.p2p = P2PAllReduce(self.group, self.rank, t, m, n, dtype, device, config, programs, self.watched,
                                    self.instance)
        elif self.method == "signal":
            if config.schedule == "tile_exact" and (m % config.block_m or n % config.block_n):
                raise ValueError(f"gemm_ar: method='signal' cannot run: schedule 'tile_exact' needs M={m} % "
                                 f"block_m={config.block_m} == 0 and N={n} % block_n={config.block_n} == 0")
            plan = make_plan(config.schedule, m, n, 1, config.block_m, config.block_n, config.groups,
                             torch.finfo(dtype).bits // 8)
            self.signaled = SignaledReduction(plan, device, config, gemm_programs(device, config),
                                              (0, m) if self.rank == 0 else (0, 0),
                                              comm.collectives(self.group, device, config.comm_sms), "all_reduce")
            if self.watched is not None:
                self.watched.words = (("counters", self.signaled.counters),)
        elif self.method == "decompose":
            self.coll = comm.collectives(self.group, device, config.comm_sms)
            self.bounds = chunk_bounds(m, config.chunks)
        else:
            self.coll = comm.TorchCollectives(self.group)

    def _resolve(self, config: OverlapConfig) -> OverlapConfig:
        """OpPlan's resolution, then rs_transfer 'auto' for this group's size (the p2p transport's ReduceScatter)."""
        return rs_transfer_for(super()._resolve(config), self.t)

    def __call__(self, a: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                 async_op: bool = False):
        self.check_call(a, w, bias)
        m, n = self.m, self.n
        if self.p2p is not None:   # joined on the caller's stream: nothing left to wait for
            out = self.p2p(a, w, bias)
            return Pending(lambda: out, out) if async_op else out
        if self.method == "signal":
            signaled = self.signaled
            out = torch.empty(signaled.plan.out_shape, dtype=a.dtype, device=a.device)
            join = signaled.run(a, w, bias, out, out, self.watched)   # stored in place, reduced in place

            def finish():
                join()
                return out if signaled.order is None else signaled.order.undo(out)
            if not async_op:   # joined at once: no Pending to hold the buffers
                return finish()
            pending = Pending(finish, out)
        elif self.method == "decompose":
            out = torch.empty(m, n, dtype=a.dtype, device=a.device)

            def chunk(lo, hi):
                return torch.mm(a[lo:hi], w.t(), out=out[lo:hi])

            def collective(dst, src, stream):   # every chunk is stored in place: src is dst
                self.coll.all_reduce(dst, stream=stream)

            decomposed(a.device, out, chunk, collective, self.bounds)
            pending = Pending(joined(a.device, plus_bias(out, bias)), out)
        else:
            out = a @ w.t()
            pending = Pending(after_work(self.coll.all_reduce(out, async_op=async_op), plus_bias(out, bias)))
        return pending if async_op else pending.wait()


def gemm_ar(a: torch.Tensor, w: torch.Tensor, group=None, *, bias: Optional[torch.Tensor] = None,
            config: Optional[OverlapConfig] = None, async_op: bool = False):
    """all_reduce(a @ w.T) + bias, bias added once. async_op=True: a Pending whose wait() returns that.
    Runs the cached GemmAR plan of this shape."""
    check_operands(a, w, bias)
    plan = cached_plan(GemmAR, comm.resolve_group(group), a.shape[0], w.shape[0], w.shape[1], a.dtype, a.device,
                       config)
    return plan(a, w, bias, async_op=async_op)
