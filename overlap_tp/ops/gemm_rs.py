"""GEMM+ReduceScatter: reduce_scatter(a @ w.T + bias) along dim 0, as a plan (GemmRS) and a function (gemm_rs).

    plan = GemmRS(group, m, n, k, dtype, device, config)   # once per shape: config resolved, buffers, tables
    out = plan(a[M, K_local], w[N, K_local], bias)           # [M/t, N]: rank k gets rows [k*M/t, (k+1)*M/t)
    out = gemm_rs(a, w, group, bias=..., config=...)        # the same through a cached plan

GemmRS(...) returns the plan of the strategy that runs the resolved config (GemmRS.strategy_for), one class each:
  GemmRSOff             method `off`: cuBLAS then torch.distributed's reduce-scatter (Megatron's path and, on CPU
                        tensors under gloo, the reference).
  GemmRSDecomposedNccl  method `decompose`, transport `nccl`: M-chunked cuBLAS + chunked collectives on the comm
                        stream.
  GemmRSSignaledNccl    method `signal`, transport `nccl`: the persistent Triton GEMM + per-group collectives on the
                        comm stream behind its counters (ops/collective_reduction.py SignaledReduction).
  GemmRSOverP2P         method `signal` or `decompose`, transport `p2p` (CUDA): the partial sums go into the owners'
                        symmetric receive slots, by the signaled GEMM's epilogue stores or by one cuBLAS GEMM per
                        owner's region (ops/p2p_reduction.py RegionGemms), or with rs_transfer 'copy' (the default
                        where t > 2) into a local staging matrix that the copy engines push to the owners group by
                        group; each rank then sums its t slots (ops/p2p_reduction.py P2PReduceScatter).
With FP8 operands (a and w kernels.fp8_quant.ScaledFp8, ops/fp8.py), the FP8 counterparts: the GEMM in FP8 over
the same tile tables (or torch's scaled GEMM for `off`), the partial sums bf16 and reduced exactly as above:
  GemmRSOffFp8, GemmRSSignaledNcclFp8, GemmRSOverP2PFp8 (method `signal` only: `decompose` has no FP8 strategy).
The NCCL transport's collectives go through a raw NCCL communicator (ops/nccl.py) on CUDA; method `auto` is the
tuner's choice, resolved when the plan is built. On CPU tensors `signal` runs its Triton kernel in the interpreter and
the same per-group collectives, so the whole signaled data path is tested without a GPU.

bias: added once, after the reduction (Megatron's semantics). The signaled kernel adds it in fp32 to the
rows this rank will own, which equals adding it after the sum without another pass over the output.

async_op=True returns a `Pending`: the GEMM is issued and its communication may still be running when the
call returns, so the caller can queue independent work (the column-parallel backward's wgrad GEMM, as
Megatron overlaps its dgrad reduce-scatter) before `wait()`. Without it, a call on the p2p transport whose operand
addresses the plan has seen before launches eagerly as one CUDA graph (ops/replay.py).
"""
from typing import Optional

import torch

from overlap_tp.ops import comm
from overlap_tp.ops.collective_reduction import SignaledReduction, decomposed
from overlap_tp.ops.config import OverlapConfig
from overlap_tp.ops.fp8 import Fp8Plan, fp8_counterpart
from overlap_tp.ops.p2p_reduction import P2PReduceScatter
from overlap_tp.ops.plan_base import (OpPlan, Pending, after_work, cached_plan, chunk_bounds, gemm_programs, joined,
                                       operand_plan_args, plus_bias)
from overlap_tp.ops.tile_plan import make_plan


class GemmRS(OpPlan):
    """reduce_scatter(a @ w.T + bias) for a[m, k], w[n, k] on `group`: built once, called per step. GemmRS(...) is
    the factory of its strategies (the module's docstring); each one's plan(a, w, bias, async_op=False) returns the
    reduce-scattered [M/t, N], or with async_op=True a Pending whose wait() returns it."""

    op = "gemm_rs"
    rows_split = True

    def strategy_for(self) -> type:
        """The strategy of the resolved config's method and transport (FP8 operands: its FP8 counterpart); a
        ValueError where it cannot run here."""
        strategy = self._bf16_strategy()
        return strategy if self.fp8 is None else fp8_counterpart(self, strategy, FP8_STRATEGIES)

    def _bf16_strategy(self) -> type:
        config = self.config
        if self.method == "off":
            return GemmRSOff
        if config.transport == "p2p":
            if self.device.type != "cuda":   # symmetric memory, rendezvoused over the group's store (any backend)
                raise ValueError("gemm_rs: transport='p2p' needs CUDA tensors (symmetric memory)")
            return GemmRSOverP2P
        if self.method == "signal":
            m_local = self.m // self.t
            if config.schedule == "tile_exact" and (m_local % config.block_m or self.n % config.block_n):
                raise ValueError(f"gemm_rs: method='signal' cannot run: schedule 'tile_exact' needs M/t={m_local} "
                                 f"% block_m={config.block_m} == 0 and N={self.n} % block_n={config.block_n} == 0")
            return GemmRSSignaledNccl
        return GemmRSDecomposedNccl

    def build(self):
        self.m_local = self.m // self.t


class GemmRSOff(GemmRS):
    """Method 'off': the whole GEMM (cuBLAS), then torch.distributed's reduce-scatter of it (async with async_op), the
    bias added after. No comm stream and no synchronisation state of its own: Megatron's path, and the reference."""

    variant = "off"

    def build(self):
        super().build()
        self.coll = comm.TorchCollectives(self.group)

    def __call__(self, a, w, bias=None, *, async_op=False):
        self.check_call(a, w, bias)
        out = torch.empty(self.m_local, self.n, dtype=self.dtype, device=self.device)
        partial = torch.empty(self.m, self.n, dtype=self.dtype, device=self.device)
        self._mm(a, w, partial)
        pending = Pending(after_work(self.coll.reduce_scatter(out, partial, async_op=async_op), plus_bias(out, bias)),
                          partial)
        return pending if async_op else pending.wait()


class GemmRSDecomposedNccl(GemmRS):
    """Method 'decompose' on the NCCL transport: the rows of every rank's region in `chunks` M-chunks; chunk i's cuBLAS
    GEMM on the caller's stream, its reduce-scatter on the comm stream behind a fork after the GEMM
    (collective_reduction.decomposed), so chunk i's collective runs beside chunk i+1's GEMM. The caller's stream joins
    the comm stream (at once, or in Pending.wait()), then the bias is added."""

    variant = "decompose"

    def build(self):
        super().build()
        self.coll = comm.collectives(self.group, self.device, self.config.comm_sms)
        self.bounds = chunk_bounds(self.m_local, self.config.chunks)

    def __call__(self, a, w, bias=None, *, async_op=False):
        self.check_call(a, w, bias)
        n, m_local, t = self.n, self.m_local, self.t
        out = torch.empty(m_local, n, dtype=a.dtype, device=a.device)
        a3, wt = a.view(t, m_local, -1), w.t()

        def chunk(lo, hi):
            return torch.matmul(a3[:, lo:hi], wt).view(t * (hi - lo), n)

        def collective(dst, src, stream):
            self.coll.reduce_scatter(dst, src, stream=stream)

        staged = decomposed(a.device, out, chunk, collective, self.bounds)
        pending = Pending(joined(a.device, plus_bias(out, bias)), staged)
        return pending if async_op else pending.wait()


class GemmRSSignaledNccl(GemmRS):
    """Method 'signal' on the NCCL transport: one persistent Triton GEMM over a tile plan (tile_plan.make_plan: the
    row-slice or tile-exact schedule) stores group g's tiles into a staging matrix and raises counter g once per tile
    (release); the comm stream waits for each counter's tile count, resets it and reduce-scatters the group's rows
    (SignaledReduction: the protocol and why the counters need no memset). The GEMM leaves `comm_sms` SMs to NCCL. The
    tile-exact schedule's rows are put back in order after the join (TileOrder.undo). The bias goes in the epilogue of
    the rows this rank owns."""

    variant = "signal/nccl"

    def build(self):
        super().build()
        config, device = self.config, self.device
        plan = make_plan(config.schedule, self.m, self.n, self.t, config.block_m, config.block_n, config.groups,
                         torch.finfo(self.dtype).bits // 8)
        self.signaled = SignaledReduction(plan, device, config, gemm_programs(device, config),
                                          (self.rank * self.m_local, (self.rank + 1) * self.m_local),
                                          comm.collectives(self.group, device, config.comm_sms), "reduce_scatter",
                                          launcher=self.launcher)
        if self.watched is not None:
            self.watched.words = (("counters", self.signaled.counters),)

    def __call__(self, a, w, bias=None, *, async_op=False):
        self.check_call(a, w, bias)
        signaled = self.signaled
        order = signaled.order
        out = torch.empty(self.m_local, self.n, dtype=self.dtype, device=self.device)
        received = out if order is None else torch.empty(signaled.plan.out_shape, dtype=self.dtype, device=self.device)
        staging = torch.empty(signaled.plan.staging_shape, dtype=self.dtype, device=self.device)
        join = signaled.run(a, w, bias, received, staging, self.watched)

        def finish():
            join()
            return out if order is None else order.undo(received)
        if not async_op:   # joined at once: no Pending to hold the buffers
            return finish()
        return Pending(finish, staging, received)


class GemmRSOverP2P(GemmRS):
    """Methods 'signal' and 'decompose' on the p2p transport (CUDA): no collective and no SM on communication. The
    call's store half puts each region's partial sum into its owner's symmetric receive slot (the signaled GEMM's
    epilogue stores, cuBLAS per region, or with rs_transfer 'copy' local stores that the copy engines push), its
    reduce half sums this rank's t slots; the SUMMED / ARRIVED peer signals and their order argument are
    P2PReduceScatter's. With async_op the reduce half is the Pending's DeferredSum (pending.deferred_sum), which the
    kernel that reads the output may run itself (the fused add + RMSNorm); without it, the whole call at once, eagerly
    replayed from a CUDA graph where the plan has one for the operands' addresses."""

    @property
    def variant(self) -> str:
        # rs_transfer 'copy': the copy engines push the partials (OverlapConfig.rs_transfer)
        return f"{self.method}/p2p" + ("/copy" if self.config.rs_transfer == "copy" else "")

    def build(self):
        super().build()
        config = self.config
        # rs_transfer 'copy': one SM left to the comm stream's waits, which a captured graph runs as one-thread kernels
        programs = gemm_programs(self.device, config, spare_sms=int(self.method == "signal"
                                                                    and config.rs_transfer == "copy"))
        self.p2p = P2PReduceScatter(self.group, self.rank, self.t, self.m, self.n, self.dtype, self.device, config,
                                    programs, self.watched, self.instance, launcher=self.launcher)

    def __call__(self, a, w, bias=None, *, async_op=False):
        self.check_call(a, w, bias)
        # the sum (after the wait for every peer's stores) runs on the stream current at wait(): with async_op, work
        # queued before wait() hides the wait for the slowest peer. pending.deferred_sum lets the kernel that reads
        # the output sum the slots itself instead (the fused add + RMSNorm).
        if not async_op:   # summed at once, on this stream
            return self.p2p.summed(a, w, bias)
        deferred = self.p2p(a, w, bias)
        return Pending(deferred, deferred_sum=deferred)


class GemmRSOffFp8(Fp8Plan, GemmRSOff):
    """GemmRSOff with FP8 operands: torch's scaled GEMM (ops/fp8.py scaled_mm) into a bf16 partial, then the same
    reduce-scatter and bias: the FP8 strategies' reference."""


class GemmRSSignaledNcclFp8(Fp8Plan, GemmRSSignaledNccl):
    """GemmRSSignaledNccl with FP8 operands: the FP8 signaled GEMM (kernels/fp8_gemm.py) over the same tile plan stores
    bf16 tiles into the staging matrix and raises the same counters; the groups' bf16 reduce-scatters and the tile
    order are unchanged."""


class GemmRSOverP2PFp8(Fp8Plan, GemmRSOverP2P):
    """GemmRSOverP2P with FP8 operands, method 'signal': the FP8 signaled GEMM's epilogue stores the bf16 partials into
    the owners' slots (or, rs_transfer 'copy', into the staging matrix the copy engines push from); the peer signals
    and the slot sum (bf16 slots, summed in fp32) are unchanged."""


# each bf16 strategy's FP8 counterpart (ops/fp8.py fp8_counterpart; method 'decompose' has none)
FP8_STRATEGIES = {GemmRSOff: GemmRSOffFp8, GemmRSSignaledNccl: GemmRSSignaledNcclFp8, GemmRSOverP2P: GemmRSOverP2PFp8}


def gemm_rs(a, w, group=None, *, bias: Optional[torch.Tensor] = None, config: Optional[OverlapConfig] = None,
            async_op: bool = False, instance: int = 0):
    """reduce_scatter(a @ w.T + bias) along dim 0: rank k gets rows [k*M/t, (k+1)*M/t), bias added once.
    async_op=True: a Pending whose wait() returns that. a and w: bf16 / fp16 tensors, or both ScaledFp8 (FP8, K-major;
    the result bf16). Runs the cached GemmRS plan of this shape and operands (of `instance`: cached_plan)."""
    m, n, k, dtype, device, fp8 = operand_plan_args(a, w, bias)
    plan = cached_plan(GemmRS, comm.resolve_group(group), m, n, k, dtype, device, config, instance, fp8)
    return plan(a, w, bias, async_op=async_op)
