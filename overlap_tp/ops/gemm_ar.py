"""GEMM+AllReduce: all_reduce(a @ w.T) + bias, as a plan (GemmAR) and a function (gemm_ar).

    plan = GemmAR(group, m, n, k, dtype, device, config)
    out = plan(a[M, K_local], w[N, K_local], bias)           # [M, N] on every rank
    out = gemm_ar(a, w, group, bias=..., config=...)        # the same through a cached plan

GemmAR(...) returns the plan of the strategy that runs the resolved config (GemmAR.strategy_for), one class each, as
gemm_rs's (ops/gemm_rs.py) with an all-reduce per group:
  GemmAROff             method `off`: cuBLAS then torch.distributed's all-reduce.
  GemmARDecomposedNccl  method `decompose`, transport `nccl`: M-chunked cuBLAS, each chunk all-reduced in place on the
                        comm stream.
  GemmARSignaledNccl    method `signal`, transport `nccl`: the signaled GEMM stores every tile in place into the
                        output (a one-region plan) and each group's rows are all-reduced in place behind its counter.
  GemmAROverP2P         method `signal` or `decompose`, transport `p2p` (CUDA, M divisible by t): gemm_rs's p2p
                        ReduceScatter, each rank's sum written into its region of a symmetric buffer, then the copy
                        engines pull the peers' regions into the output (ops/p2p_reduction.py P2PAllReduce): no
                        collective and no SM spent on communication, and with no NCCL inside, an eager call replays
                        from a CUDA graph (ops/replay.py).
With FP8 operands (kernels.fp8_quant.ScaledFp8, ops/fp8.py) the FP8 counterparts, the GEMM in FP8 and the partials
bf16, reduced as above: GemmAROffFp8, GemmARSignaledNcclFp8, GemmAROverP2PFp8 (method `signal`; `decompose` has none).
The bias is added once: by rank 0's epilogue (signal), after the reduction (off, decompose), or into each region by
its owner's GEMM (p2p). async_op returns a Pending (on the p2p transport, of the call already joined on the caller's
stream).
"""
from typing import Optional

import torch

from overlap_tp.ops import comm
from overlap_tp.ops.collective_reduction import SignaledReduction, decomposed
from overlap_tp.ops.config import OverlapConfig
from overlap_tp.ops.fp8 import Fp8Plan, fp8_counterpart
from overlap_tp.ops.p2p_reduction import P2PAllReduce
from overlap_tp.ops.plan_base import (OpPlan, Pending, after_work, cached_plan, chunk_bounds, gemm_programs, joined,
                                       operand_plan_args, plus_bias)
from overlap_tp.ops.tile_plan import make_plan


class GemmAR(OpPlan):
    """all_reduce(a @ w.T) + bias for a[m, k], w[n, k] on `group`: built once, called per step. GemmAR(...) is the
    factory of its strategies (the module's docstring); each one's plan(a, w, bias, async_op=False) returns the
    all-reduced [M, N], or with async_op=True a Pending whose wait() returns it."""

    op = "gemm_ar"

    def strategy_for(self) -> type:
        """The strategy of the resolved config's method and transport (FP8 operands: its FP8 counterpart); a
        ValueError where it cannot run here."""
        strategy = self._bf16_strategy()
        return strategy if self.fp8 is None else fp8_counterpart(self, strategy, FP8_STRATEGIES)

    def _bf16_strategy(self) -> type:
        config, m, t = self.config, self.m, self.t
        if self.method == "off":
            return GemmAROff
        if config.transport == "p2p":
            if m % t:
                raise ValueError(f"gemm_ar: transport='p2p' reduces rows in t regions: M={m} is not divisible by the "
                                 f"group size t={t}")
            if self.device.type != "cuda":   # symmetric memory, rendezvoused over the group's store (any backend)
                raise ValueError("gemm_ar: transport='p2p' needs CUDA tensors (symmetric memory)")
            return GemmAROverP2P
        if self.method == "signal":
            if config.schedule == "tile_exact" and (m % config.block_m or self.n % config.block_n):
                raise ValueError(f"gemm_ar: method='signal' cannot run: schedule 'tile_exact' needs M={m} % "
                                 f"block_m={config.block_m} == 0 and N={self.n} % block_n={config.block_n} == 0")
            return GemmARSignaledNccl
        return GemmARDecomposedNccl


class GemmAROff(GemmAR):
    """Method 'off': the whole GEMM (cuBLAS), then torch.distributed's all-reduce of it in place (async with async_op),
    the bias added after. Megatron's path, and the reference."""

    variant = "off"

    def build(self):
        self.coll = comm.TorchCollectives(self.group)

    def __call__(self, a, w, bias=None, *, async_op=False):
        self.check_call(a, w, bias)
        out = torch.empty(self.m, self.n, dtype=self.dtype, device=self.device)
        self._mm(a, w, out)
        pending = Pending(after_work(self.coll.all_reduce(out, async_op=async_op), plus_bias(out, bias)))
        return pending if async_op else pending.wait()


class GemmARDecomposedNccl(GemmAR):
    """Method 'decompose' on the NCCL transport: the rows in `chunks` M-chunks, each chunk's cuBLAS GEMM stored in
    place into the output on the caller's stream and all-reduced in place on the comm stream behind a fork after it
    (collective_reduction.decomposed); the caller's stream joins the comm stream, then the bias is added."""

    variant = "decompose"

    def build(self):
        self.coll = comm.collectives(self.group, self.device, self.config.comm_sms)
        self.bounds = chunk_bounds(self.m, self.config.chunks)

    def __call__(self, a, w, bias=None, *, async_op=False):
        self.check_call(a, w, bias)
        out = torch.empty(self.m, self.n, dtype=a.dtype, device=a.device)

        def chunk(lo, hi):
            return torch.mm(a[lo:hi], w.t(), out=out[lo:hi])

        def collective(dst, src, stream):   # every chunk is stored in place: src is dst
            self.coll.all_reduce(dst, stream=stream)

        decomposed(a.device, out, chunk, collective, self.bounds)
        pending = Pending(joined(a.device, plus_bias(out, bias)), out)
        return pending if async_op else pending.wait()


class GemmARSignaledNccl(GemmAR):
    """Method 'signal' on the NCCL transport: one persistent Triton GEMM over a one-region tile plan stores every tile
    in place into the output and raises its group's counter per tile (release); the comm stream waits for each
    counter's tile count, resets it and all-reduces the group's rows in place (SignaledReduction's protocol). The
    tile-exact schedule's rows are put back in order after the join. Rank 0's epilogue adds the bias, so it is added
    once."""

    variant = "signal/nccl"

    def build(self):
        config, device, m = self.config, self.device, self.m
        plan = make_plan(config.schedule, m, self.n, 1, config.block_m, config.block_n, config.groups,
                         torch.finfo(self.dtype).bits // 8)
        self.signaled = SignaledReduction(plan, device, config, gemm_programs(device, config),
                                          (0, m) if self.rank == 0 else (0, 0),
                                          comm.collectives(self.group, device, config.comm_sms), "all_reduce",
                                          launcher=self.launcher)
        if self.watched is not None:
            self.watched.words = (("counters", self.signaled.counters),)

    def __call__(self, a, w, bias=None, *, async_op=False):
        self.check_call(a, w, bias)
        signaled = self.signaled
        out = torch.empty(signaled.plan.out_shape, dtype=self.dtype, device=self.device)
        join = signaled.run(a, w, bias, out, out, self.watched)   # stored in place, reduced in place

        def finish():
            join()
            return out if signaled.order is None else signaled.order.undo(out)
        if not async_op:   # joined at once: no Pending to hold the buffers
            return finish()
        return Pending(finish, out)


class GemmAROverP2P(GemmAR):
    """Methods 'signal' and 'decompose' on the p2p transport (CUDA, M divisible by t): P2PAllReduce, gemm_rs's p2p
    ReduceScatter summed into this rank's region of a symmetric gathered buffer, then the copy engines pull the peers'
    summed regions into the output (its protocol and order argument: ops/p2p_reduction.py). Each call is joined on the
    caller's stream before it returns (async_op: a Pending with nothing left to wait for)."""

    @property
    def variant(self) -> str:
        # rs_transfer 'copy': the copy engines push the partials (OverlapConfig.rs_transfer)
        return f"{self.method}/p2p" + ("/copy" if self.config.rs_transfer == "copy" else "")

    def build(self):
        config = self.config
        # as GemmRSOverP2P: rs_transfer 'copy' leaves one SM to the comm stream's waits
        programs = gemm_programs(self.device, config, spare_sms=int(self.method == "signal"
                                                                    and config.rs_transfer == "copy"))
        self.p2p = P2PAllReduce(self.group, self.rank, self.t, self.m, self.n, self.dtype, self.device, config,
                                programs, self.watched, self.instance, launcher=self.launcher)

    def __call__(self, a, w, bias=None, *, async_op=False):
        self.check_call(a, w, bias)
        out = self.p2p(a, w, bias)
        return Pending(lambda: out, out) if async_op else out


class GemmAROffFp8(Fp8Plan, GemmAROff):
    """GemmAROff with FP8 operands: torch's scaled GEMM (ops/fp8.py scaled_mm) into a bf16 product, then the same
    all-reduce and bias: the FP8 strategies' reference."""


class GemmARSignaledNcclFp8(Fp8Plan, GemmARSignaledNccl):
    """GemmARSignaledNccl with FP8 operands: the FP8 signaled GEMM over the same one-region plan, bf16 tiles stored in
    place and all-reduced in bf16 behind the same counters."""


class GemmAROverP2PFp8(Fp8Plan, GemmAROverP2P):
    """GemmAROverP2P with FP8 operands, method 'signal': P2PAllReduce with the FP8 signaled GEMM storing the bf16
    partials into the owners' slots; the sums and the pulls unchanged."""


# each bf16 strategy's FP8 counterpart (ops/fp8.py fp8_counterpart; method 'decompose' has none)
FP8_STRATEGIES = {GemmAROff: GemmAROffFp8, GemmARSignaledNccl: GemmARSignaledNcclFp8, GemmAROverP2P: GemmAROverP2PFp8}


def gemm_ar(a, w, group=None, *, bias: Optional[torch.Tensor] = None, config: Optional[OverlapConfig] = None,
            async_op: bool = False):
    """all_reduce(a @ w.T) + bias, bias added once. async_op=True: a Pending whose wait() returns that. a and w: bf16 /
    fp16 tensors, or both ScaledFp8 (FP8, K-major; the result bf16). Runs the cached GemmAR plan of this shape and
    operands."""
    m, n, k, dtype, device, fp8 = operand_plan_args(a, w, bias)
    plan = cached_plan(GemmAR, comm.resolve_group(group), m, n, k, dtype, device, config, fp8=fp8)
    return plan(a, w, bias, async_op=async_op)
