"""AllGather+GEMM: all_gather(a_shard) @ w.T (+ bias), as a plan (AgGemm) and a function (ag_gemm).

    plan = AgGemm(group, m_local, n, k, dtype, device, config)
    out = plan(a_shard[M/t, K], w[N, K], bias)              # [M, N], rows in the standard order (rank k's
                                                            # shard is rows [k*M/t, (k+1)*M/t))
    out, gathered = plan(a_shard, w, return_gathered=True)  # also the gathered [M, K] input (a row-parallel
                                                            # layer's backward reuses it for wgrad); with the p2p
                                                            # transport it is the shape's shared buffer, valid
                                                            # until the next AllGather of the shape (GatherBuffer)
    out = ag_gemm(a_shard, w, group, bias=..., config=...)  # the same through a cached plan

AgGemm(...) returns the plan of the strategy that runs the resolved config (AgGemm.strategy_for), one class each:
  AgGemmOff               method `off`: torch.distributed's all-gather, then cuBLAS (Megatron's path; the reference
                          under gloo).
  AgGemmDecomposedNccl    method `decompose`, transport `nccl`: the local rows' GEMM first, while the comm stream
                          gathers the peers' rows in `chunks` row ranges (in-place broadcasts); each chunk's cuBLAS GEMM
                          waits for its chunk only.
  AgGemmDecomposedP2P     method `decompose`, transport `p2p`: the same with the copy engines' pulls (as below); the
                          local GEMM reads the shard itself, so it waits for no copy, and no SM or Triton GEMM is
                          involved.
  AgGemmSignaled...       method `signal`: one persistent Triton GEMM (kernels/signaled_gemm.py) over a tile plan
                          (tile_plan.ag_plan) that computes the local rows first, with no wait, then every chunk of the
                          peers' rows; before a chunk's first load a CTA spins (acquire) on the chunk's ready flag,
                          which the comm stream raises (to 1) once the chunk's transfer completed; after the GEMM the
                          caller's stream lowers the flags again (0), so every call and every graph replay waits for
                          the same value (AgGemmSignaled). The transfers:
    AgGemmSignaledNccl         transport `nccl`: per chunk, one ncclBroadcast per rank in a group call, straight into
                               place (two alternatives measured slower: nccl.Communicator.all_gather_rows_at); the GEMM
                               leaves `comm_sms` SMs to NCCL (a spinning GEMM on every SM would starve it).
    AgGemmSignaledCopyEngines  transport `p2p`, comm_sms 0: copy-engine pulls from the peers' regions of their
                               symmetric gathered buffers into ours (ops/p2p_gather.py GatherBuffer, one per shard
                               shape): no SM spent on communication (ConCCL/FiCCO), and the shard is copied once, into
                               our region, where the GEMM and the peers read it. chunk_by 'peer' cuts the chunks by
                               peer instead of by rows: one copy per chunk, each chunk's tiles waiting for that peer's
                               rows only (OverlapConfig.chunk_by; its default 'auto' takes it where t > 2).
    AgGemmSignaledCopyLanes    the same pulls split over `copy_lanes` streams.
    AgGemmSignaledSMPulls      transport `p2p`, comm_sms > 0: the same pulls as a kernel of comm_sms CTAs on the SMs
                               the GEMM's grid leaves free (kernels/peer_copy.py: loads over NVLink). It moves no more
                               bytes per second than the copy engines, but it does the handshakes too: the READY
                               exchange, each chunk's flag and PULLED are its own stores and spins, where the copy
                               engines' path has stream memory operations, each several times a kernel's store and spin
                               inside a graph (docs/performance.md): one launch per call (GatherBuffer.signaled_pull).
With FP8 operands (a_shard and w kernels.fp8_quant.ScaledFp8, ops/fp8.py) the FP8 counterparts gather the shards'
FP8 rows (one byte per element) and every rank's scales, and run the FP8 GEMM over the same tables:
  AgGemmOffFp8            `off`: torch.distributed's all-gathers of the rows and the scales, then torch's scaled GEMM
                          per rank's rows (the reference).
  AgGemmSignaledNcclFp8   `signal` over `nccl`: the scales' broadcasts ahead of the first chunk's rows.
  AgGemmSignaledP2PFp8    `signal` over `p2p` with the copy engines' pulls (comm_sms 0, one copy lane): the scales
                          pulled with the first chunk, from a symmetric scale buffer under the rows' signals.
  (`decompose`, the SM pulls and copy lanes have no FP8 strategy: a ValueError names what to use.)
Method `auto` is the tuner's choice, resolved when the plan is built (`off` on CPU tensors).
Rows always land at their standard position, so no reorder pass follows the transfer. Eagerly, a signal call on the
p2p transport whose operand addresses the plan has seen before launches as one CUDA graph (ops/replay.py).
"""
import math
from collections import OrderedDict
from typing import Optional

import torch
import torch.distributed as dist

from overlap_tp.kernels.fp8_quant import ScaledFp8
from overlap_tp.kernels.signaled_gemm import default_offsets
from overlap_tp.ops import comm, memops, replay
from overlap_tp.ops.config import OverlapConfig
from overlap_tp.ops.fp8 import Fp8Plan, fp8_counterpart
from overlap_tp.ops.p2p_gather import GatherBuffer, ScaledGatherBuffer
from overlap_tp.ops.plan_base import (OpPlan, Pending, after_work, cached_plan, check_not_capturing, chunk_bounds,
                                       gemm_programs, joined, operand_plan_args)
from overlap_tp.ops.resolve import fill_defaults
from overlap_tp.ops.tile_plan import ag_plan
from overlap_tp.ops.watchdog import Watched

READY = 1   # the value a chunk's flag is raised to; the GEMM's tiles wait for it


class AgGemm(OpPlan):
    """all_gather(a_shard) @ w.T + bias for shards a_shard[m, k] (m: this rank's rows), w[n, k]. AgGemm(...) is the
    factory of its strategies (the module's docstring); each one's plan(a_shard, w, bias) returns out [t * m, n] (and
    the gathered input with return_gathered=True).

    gather (an option of the constructor): the GatherBuffer to pull into (OwnGather's, a consumer's own); None = the
    shape's shared one. Only the p2p transport's strategies (signal or decompose, CUDA) pull into a buffer."""

    op = "ag_gemm"

    def strategy_for(self, gather: Optional[GatherBuffer] = None) -> type:
        """The strategy of the resolved config's method, transport and pulls (FP8 operands: its FP8 counterpart); a
        ValueError where none runs it here."""
        strategy = self._bf16_strategy(gather)
        if self.fp8 is None:
            return strategy
        if gather is not None:
            raise ValueError("overlap_tp ag_gemm with FP8 operands: the plan gathers into a buffer of its own; pass no "
                             "gather buffer (gathering in place, OwnGather, takes bf16 shards)")
        return fp8_counterpart(self, strategy, FP8_STRATEGIES)

    def _bf16_strategy(self, gather: Optional[GatherBuffer]) -> type:
        config, device, method = self.config, self.device, self.method
        if gather is not None and not OwnGather.supports(config, device):
            raise ValueError(f"ag_gemm: a gather buffer of its own is for the p2p transport (method signal or "
                             f"decompose, CUDA); this plan runs method={method!r}, transport={config.transport!r} "
                             f"on {device}")
        if method == "off":
            return AgGemmOff
        if config.chunk_by == "peer" and (config.transport != "p2p" or config.copy_lanes != 1
                                          or (method == "signal" and config.comm_sms)):
            raise ValueError(f"ag_gemm: chunk_by='peer' pulls one peer's rows per chunk with one copy-engine copy: "
                             f"it needs transport='p2p', copy_lanes=1 and (method signal) comm_sms=0; this plan has "
                             f"method={method!r}, transport={config.transport!r}, copy_lanes={config.copy_lanes}, "
                             f"comm_sms={config.comm_sms}")
        if method == "decompose":
            if config.transport != "p2p":
                return AgGemmDecomposedNccl
            if device.type != "cuda":
                raise ValueError("ag_gemm: transport='p2p' needs CUDA tensors (symmetric memory)")
            return AgGemmDecomposedP2P
        if config.transport == "p2p":
            if config.comm_sms > 0 and config.copy_lanes > 1:
                raise ValueError(f"ag_gemm: copy_lanes={config.copy_lanes} splits the copy engines' pulls; with "
                                 f"comm_sms={config.comm_sms} the pulls run on SMs (one kernel per chunk): use "
                                 f"copy_lanes=1 or comm_sms=0")
            if device.type != "cuda":   # symmetric memory (any backend's group)
                raise ValueError("ag_gemm: transport='p2p' needs CUDA tensors (symmetric memory)")
            if config.comm_sms > 0:
                return AgGemmSignaledSMPulls
            return AgGemmSignaledCopyEngines if config.copy_lanes == 1 else AgGemmSignaledCopyLanes
        if device.type == "cuda" and config.comm_sms < 1:
            raise ValueError("ag_gemm: method='signal' with transport='nccl' needs comm_sms >= 1: the GEMM spins "
                             "on ready flags that NCCL kernels raise, so NCCL must have SMs the GEMM does not "
                             "hold (transport='p2p' spends no SM and runs with comm_sms=0)")
        return AgGemmSignaledNccl

    def build(self, gather: Optional[GatherBuffer] = None):
        self.out_shape = (self.t * self.m, self.n)

    def __call__(self, a_shard: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                 return_gathered: bool = False):
        self.check_call(a_shard, w, bias)
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        gathered = self._run(a_shard, w, bias, out)
        return (out, gathered) if return_gathered else out

    def _run(self, a_shard, w, bias, out) -> torch.Tensor:
        """The strategy's call: fills `out` (bias included) and returns the gathered input."""
        raise NotImplementedError(f"overlap_tp {self.op}: a strategy defines _run")

    def start(self, a_shard: torch.Tensor) -> "StartedAgGemm":
        """Phase one of a call split in two (AgGemmSignaled.start): the signaled strategies only."""
        raise ValueError(f"{self.describe()}: start()/finish() split the signaled AllGather+GEMM; this plan runs "
                         f"method={self.method!r} (call the plan instead)")

    def _check_a(self, a_shard: torch.Tensor):
        """start()'s shard is one the plan was built for (finish() checks the whole call); else a ValueError."""
        if (a_shard.shape != (self.m, self.k) or a_shard.dtype != self.dtype or a_shard.device != self.device
                or not a_shard.is_contiguous()):
            raise ValueError(f"{self.describe()}: start() with a contiguous [{self.m}, {self.k}] {self.dtype} shard on "
                             f"{self.device}; got {tuple(a_shard.shape)} {a_shard.dtype} on {a_shard.device}")

    def _pull_into_gather_buffer(self, gather: Optional[GatherBuffer]):
        """The p2p transport's state: the gathered buffer to pull into (`gather`, or the shape's, shared with the other
        AllGathers of the shape) and the streams its pulls are split over (config.copy_lanes; None: the comm stream
        alone)."""
        self.gather = self._gather_buffer(gather)
        self.lanes = comm.comm_engine(self.device, self.instance).copy_lanes(self.config.copy_lanes)
        if self.watched is not None:   # a stuck call names the stage's and the pulls' signals too
            self.watched.words += (("peer signals [PULLED, READY] x rank", self.gather.signals.words),)

    def _gather_buffer(self, gather: Optional[GatherBuffer]) -> GatherBuffer:
        """`gather`, or the shape's buffer (shared with the other AllGathers of the shape)."""
        return gather if gather is not None else row_gather(self.group, self.m, self.k, self.dtype, self.device).buffer


class AgGemmOff(AgGemm):
    """Method 'off': torch.distributed's all-gather of the shards, then one cuBLAS GEMM over the gathered rows, the
    bias added after. No comm stream and no synchronisation state of its own: Megatron's path, and the reference."""

    variant = "off"

    def _run(self, a_shard, w, bias, out):
        gathered = self._gathered(a_shard)
        self._mm(gathered, w, out)
        if bias is not None:
            out += bias
        return gathered

    def _gathered(self, a_shard):
        gathered, _ = comm.all_gather_rows(a_shard, self.group)
        return gathered


class AgGemmDecomposedNccl(AgGemm):
    """Method 'decompose' on the NCCL transport: the shard copied into its rows of a new gathered buffer, the local
    rows' cuBLAS GEMM at once, and chunk c of the peers' rows gathered on the comm stream (in-place broadcasts), then
    its GEMMs on the caller's stream behind a join. One fork, after the local shard's copy (the in-place broadcasts send
    this rank's rows from `gathered`) and before the local GEMM: no gather waits for a GEMM (a fork per chunk made
    chunk c's gather wait for chunk c-1's GEMM: no overlap at all). The bias is added after."""

    variant = "decompose"

    def build(self, gather=None):
        super().build()
        self.coll = comm.collectives(self.group, self.device, self.config.comm_sms)
        self.bounds = chunk_bounds(self.m, self.config.chunks)
        self.engine = comm.comm_engine(self.device, self.instance)

    def _run(self, a_shard, w, bias, out):
        gathered = torch.empty(self.t * self.m, self.k, dtype=a_shard.dtype, device=a_shard.device)
        self._chunked(a_shard, w, gathered, out)
        if bias is not None:
            out += bias
        return gathered

    def _chunked(self, a_shard, w, gathered, out):
        """The local rows' GEMM at once; chunk c's rows gathered on the comm stream, then its GEMM (the class's
        docstring)."""
        t, rank, engine = self.t, self.rank, self.engine
        regions, out_regions = gathered.chunk(t), out.chunk(t)
        cuda = engine.stream is not None
        capturing = comm.capturing(self.device)
        wt = w.t()
        regions[rank].copy_(a_shard)
        if cuda:
            current = engine.current()
            engine.fork(current, capturing)
        torch.mm(a_shard, wt, out=out_regions[rank])
        for lo, hi in self.bounds:
            if cuda:
                self.coll.all_gather_rows(gathered, a_shard, lo, hi, stream=engine.raw)
                engine.join(current, capturing)
            else:
                self.coll.all_gather_rows(gathered, a_shard, lo, hi)
            for p in range(t):
                if p != rank:
                    torch.mm(regions[p][lo:hi], wt, out=out_regions[p][lo:hi])


class AgGemmDecomposedP2P(AgGemm):
    """Method 'decompose' on the p2p transport (CUDA): cuBLAS over the copy engines' pulls into the gathered buffer
    (GatherBuffer's protocol: stage, READY exchange, pulls, PULLED; its order argument in ops/p2p_gather.py). The local
    rows' GEMM from the shard itself, enqueued first (with one hardware queue a wait enqueued ahead of it would hold its
    launch: CommEngine.transfers_then_gemm), then on the comm stream the shard's copy into its region of the gathered
    buffer (where the peers pull it from; beside the GEMM, on the copy engines) and each chunk of the peers' rows
    pulled; each chunk's GEMMs once the caller's stream joined that far. chunk_by 'peer': each peer's rows pulled and
    multiplied in turn (ring order). Returns the gathered buffer."""

    variant = "decompose/p2p"

    def build(self, gather=None):
        super().build()
        self._pull_into_gather_buffer(gather)
        self.bounds = chunk_bounds(self.m, self.config.chunks)
        self.by_peer = self.config.chunk_by == "peer"
        self.engine = comm.comm_engine(self.device, self.instance)

    def _run(self, a_shard, w, bias, out):
        engine, gather, t, rank = self.engine, self.gather, self.t, self.rank
        capturing = engine.capturing()
        current, raw = engine.current(), engine.raw
        engine.fork(current, capturing)   # the shard is ready
        wt = w.t()
        out_regions = out.chunk(t)
        _mm(a_shard, wt, out_regions[rank], bias)
        gather.stage(raw, a_shard, capturing)
        gathered = gather.gathered()
        regions = gathered.chunk(t)
        gather.ready(raw, capturing)
        if self.by_peer:   # peer by peer (ring order), each region's rows in `chunks`
            for p in gather.peers:
                for lo, hi in self.bounds:
                    gather.pull_peer(raw, p, lo, hi)
                    engine.join(current, capturing)
                    _mm(regions[p][lo:hi], wt, out_regions[p][lo:hi], bias)
        else:
            for lo, hi in self.bounds:
                gather.pull(raw, lo, hi, self.lanes, capturing)
                engine.join(current, capturing)
                for p in range(t):
                    if p != rank:
                        _mm(regions[p][lo:hi], wt, out_regions[p][lo:hi], bias)
        gather.finish(raw)
        engine.join_watched(current, capturing, self.watched)   # the comm stream's last work (PULLED) joins too
        return gathered


class AgGemmSignaled(AgGemm):
    """Method 'signal': one persistent Triton GEMM over tile_plan.ag_plan, the local rows first (no wait), then each
    chunk of the peers' rows behind its ready flag, which the comm stream raises (to READY) once the chunk's transfer
    completed; the caller's stream lowers the flags after the GEMM (comm.ReadyFlags), so every call and every replay
    waits for the same value. The transfers are the subclass's (one per transport and pull mechanism). A call can be
    split in two (start() issues the transfers, finish() launches the GEMM)."""

    def build(self, gather=None):
        super().build()
        config, device, t, m = self.config, self.device, self.t, self.m
        plan = ag_plan(t * m, self.n, self.k, t, self.rank, config.block_m, config.block_n, config.groups,
                       self.operand_bytes, config.chunk_by)
        self.chunks = tuple((c.src_lo, c.src_hi) for c in plan.collectives)
        self.chunk_peers = plan.chunk_peers   # chunk_by 'peer': each chunk's one peer (None: every peer)
        self.tiles = plan.tiles.to(device)
        self.flags = torch.zeros(max(1, len(self.chunks)), dtype=torch.int32, device=device)
        self.gemm = self.launcher(self.tiles, gemm_programs(device, config), config, bias_rows=(0, t * m),
                                  flags=self.flags, wait_target=READY)
        self.ready = comm.ReadyFlags(self.flags)
        if self.watched is not None:
            self.watched.words = (("ready flags", self.flags),)
        self.engine = comm.comm_engine(device, self.instance)
        self._started = None   # the call start() issued and finish() has not launched (StartedAgGemm)
        if device.type == "cuda":
            default_offsets(device)
            # start(): recorded behind this plan's transfers, so that finish() waits for them alone (one event per
            # capture state: an event waited on inside a capture must have been recorded inside it); eagerly the
            # plan's watched event, which the watchdog then watches (no record of its own)
            self._transfers_done = {False: self.watched.event, True: memops.Event()}

    def _start_transfers(self, a_shard):
        """The shard staged on the caller's stream and the transfers as a function of the comm stream: (the gathered
        input, transfers, the caller's stream or None on CPU, whether it is being captured)."""
        raise NotImplementedError(f"overlap_tp {self.op}: a signaled strategy defines _start_transfers")

    def start(self, a_shard: torch.Tensor) -> "StartedAgGemm":
        """Phase one of a call split in two: the shard staged and the transfers issued on the comm stream now;
        finish() launches the GEMM. For a schedule that runs other work between an AllGather's transfers and its
        GEMM: the token split issues half B's transfers ahead of half A's compute (docs/fused_block.md, Token
        split), each half through a plan with a gathered buffer of its own (`gather`), so that both can be in flight.
        finish() makes the caller's stream wait for this plan's transfers only, not for those issued on the comm
        stream after them.
        Under a CUDA graph the transfers run beside whatever the caller issues between start and finish. Eagerly,
        with one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1), that work is dispatched behind the transfers'
        stream waits, as CommEngine.transfers_then_gemm explains: the split is for captured graphs. Method 'signal'
        (either transport); one call of a plan in flight at a time."""
        engine = self.engine
        if self._started is not None and self._started.capturing and not engine.capturing():
            self._started = None   # started in a capture that ended before its finish(): it failed, nothing of it ran
        if self._started is not None:
            raise RuntimeError(f"{self.describe()}: start() while the previous start() has not been finished; a plan "
                               f"has one call in flight (build one plan, with its own gathered buffer, per half)")
        self._check_a(a_shard)
        gathered, transfers, current, capturing = self._start_transfers(a_shard)
        done = None if engine.stream is None else self._transfers_done[capturing]
        engine.transfers_ahead(transfers, current, capturing, done)
        self._started = StartedAgGemm(a_shard, gathered, current, capturing, done)
        return self._started

    def finish(self, started: "StartedAgGemm", w: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
               return_gathered: bool = False):
        """Phase two: the GEMM over the rows start() gathers, on the stream start() was called on (its tiles wait for
        their chunks' flags). Returns what a call returns."""
        if started is None or started is not self._started:
            raise RuntimeError(f"{self.describe()}: finish() of a call this plan has not started (or finished "
                               f"already)")
        engine = self.engine
        if engine.stream is not None and engine.current() != started.current:
            raise RuntimeError(f"{self.describe()}: finish() on another stream than its start(); the GEMM must "
                               f"follow what the shard's producer enqueued on that stream")
        if started.capturing != engine.capturing():
            raise RuntimeError(f"{self.describe()}: start() and finish() on either side of a CUDA graph capture's "
                               f"edge")
        self.check_call(started.a_shard, w, bias)
        self._started = None
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        gathered = started.gathered
        started.a_shard = started.gathered = None   # a handle kept after finish() holds no buffer (GatherBuffer's check)
        gemm = self.gemm.launch_checked
        engine.gemm_after_transfers(lambda: gemm(gathered, w, out, bias), self.ready, self.watched, started.current,
                                    started.capturing, started.done)
        return (out, gathered) if return_gathered else out


class AgGemmSignaledNccl(AgGemmSignaled):
    """Method 'signal' on the NCCL transport: the shard copied into its rows of a new gathered buffer on the caller's
    stream; per chunk, on the comm stream, one broadcast per rank in a group call straight into place, then the chunk's
    flag. The GEMM leaves `comm_sms` SMs to NCCL and is enqueued first where it has them (a spinning GEMM on every SM
    would starve NCCL's kernels). Under gloo (CPU tensors): torch.distributed's broadcasts, the kernel in the Triton
    interpreter."""

    variant = "signal/nccl"

    def build(self, gather=None):
        super().build()
        t, m = self.t, self.m
        self.coll = comm.collectives(self.group, self.device, self.config.comm_sms)
        # a raw NCCL communicator takes addresses: per chunk, every root's rows of the gathered buffer as
        # (byte offset, elements), made once (no region or row views per call)
        self._broadcasts = None
        if hasattr(self.coll, "all_gather_rows_at"):
            from overlap_tp.ops.nccl import gather_spans   # as comm.collectives: NCCL's module on CUDA only
            self._broadcasts = tuple(gather_spans(t, m, self.k, self.operand_bytes, lo, hi) for lo, hi in self.chunks)

    def _new_gathered(self):
        """The call's gathered input, not written yet."""
        return torch.empty(self.t * self.m, self.k, dtype=self.dtype, device=self.device)

    def _run(self, a_shard, w, bias, out):
        gathered = self._new_gathered()
        transfers, current = self._transfers(a_shard, gathered)
        gemm = self.gemm.launch_checked   # the bias in the GEMM's epilogue
        self.engine.transfers_then_gemm(transfers, lambda: gemm(gathered, w, out, bias), self.ready, self.watched,
                                        gemm_first=self.config.comm_sms > 0, current=current)
        return gathered

    def _start_transfers(self, a_shard):
        gathered = self._new_gathered()
        transfers, current = self._transfers(a_shard, gathered)
        return gathered, transfers, current, self.engine.capturing()

    def _transfers(self, a_shard, gathered):
        """The shard copied into its rows of `gathered` on the caller's stream, and the transfers (each chunk's
        broadcasts, then its flag) as a function of the comm stream. Returns (transfers, the caller's stream or None on
        CPU)."""
        engine, current = self.engine, None
        if engine.stream is None:
            gathered.narrow(0, self.rank * self.m, self.m).copy_(a_shard)
        else:   # a copy-engine copy through the driver: a fraction of copy_'s host time
            nbytes = a_shard.numel() * a_shard.element_size()
            current = engine.current()
            memops.copy(current, gathered.data_ptr() + self.rank * nbytes, a_shard.data_ptr(), nbytes)

        if self._broadcasts is not None:   # the raw communicator (CUDA): each chunk's broadcasts by address
            coll, base, dtype = self.coll, gathered.data_ptr(), gathered.dtype

            def transfers(stream):
                for spans, flag in zip(self._broadcasts, self.ready.addresses):
                    coll.all_gather_rows_at(base, spans, dtype, stream)
                    memops.write_value(stream, flag, READY)   # engine.raise_flag, the address looked up once
        else:
            def transfers(stream):
                for c, (lo, hi) in enumerate(self.chunks):
                    self.coll.all_gather_rows(gathered, a_shard, lo, hi, stream=stream)
                    engine.raise_flag(self.ready, c)
        return transfers, current


class AgGemmSignaledP2P(AgGemmSignaled):
    """Method 'signal' on the p2p transport (CUDA): the shard staged into its region of the gathered buffer on the
    caller's stream (the GEMM's local rows read it there), each peer chunk pulled on the comm stream behind the peers'
    READY, raising its flag, PULLED after the last (GatherBuffer's protocol and order argument: ops/p2p_gather.py); the
    GEMM enqueued first (the pulls need no SM it holds). Returns the gathered buffer. Eagerly, a call is replayed from
    the CUDA graph of its operands' addresses where the plan has one (ops/replay.py; `graphs`, None where replays are
    off). How the chunks are pulled (`_transfers`) is the subclass's."""

    variant = "signal/p2p"

    def build(self, gather=None):
        super().build()
        self._pull_into_gather_buffer(gather)
        self.graphs = replay.CallGraphs(self.device, self.watched) if replay.enabled(self.device) else None

    def _transfers(self, stream, capturing: bool):
        """The pulls of every chunk on `stream` (the comm stream), the READY exchange before and PULLED after."""
        raise NotImplementedError(f"overlap_tp {self.op}: a p2p signaled strategy defines _transfers")

    def _run(self, a_shard, w, bias, out):
        """_pulled, eagerly replayed from the graph of the operands' addresses where it has one (ops/replay.py), the
        key also saying whether the stage finds our region claimed (OwnGather: the producer wrote the shard in place,
        and the stage waits for nothing)."""
        gather, engine = self.gather, self.engine
        if self.graphs is None or engine.capturing():
            return self._pulled(a_shard, w, bias, out)
        claimed = gather.claim_in_force()
        if not self.graphs.replayed((claimed,) + replay.operands_key(a_shard, w, out, bias), engine.current(),
                                    self._pulled, a_shard, w, bias, out):
            return self._pulled(a_shard, w, bias, out)
        if claimed:
            gather.claimed = None   # the claim is used up, as the stage a replay stands for leaves it
        return gather.gathered()

    def _pulled(self, a_shard, w, bias, out):
        """One call issued: the stage, the transfers on the comm stream, the GEMM first on the caller's stream."""
        gathered, transfers, current, capturing = self._start_transfers(a_shard)
        gemm = self.gemm.launch_checked
        self.engine.transfers_then_gemm(transfers, lambda: gemm(gathered, w, out, bias), self.ready, self.watched,
                                        gemm_first=True, current=current, capturing=capturing)
        return gathered

    def _start_transfers(self, a_shard):
        engine, gather = self.engine, self.gather
        capturing, current = engine.capturing(), engine.current()   # asked once per call
        gather.stage(current, a_shard, capturing)
        transfers = self._transfers
        return gather.gathered(), lambda stream: transfers(stream, capturing), current, capturing


class AgGemmSignaledCopyEngines(AgGemmSignaledP2P):
    """AgGemmSignaledP2P with one lane of copy-engine pulls (comm_sms 0, copy_lanes 1): every chunk's copies (one per
    peer; chunk_by 'peer': its one peer's) and its flag's address listed once when the plan is built, so a call walks a
    list; the last chunk's flag and the PULLED signal to the peers go out in one driver call."""

    def build(self, gather=None):
        super().build(gather)
        self._list_pulls()

    def _list_pulls(self):
        """The pull list (the buffer's and the flags' addresses are the plan's). A group of one rank has no chunk
        (nothing to pull) and no peer to signal: an empty batch."""
        gather, peers = self.gather, self.chunk_peers or (None,) * len(self.chunks)
        self._pulls = tuple((tuple(gather.copies(lo, hi)) if peer is None else (gather.peer_copy(peer, lo, hi),), flag)
                            for (lo, hi), peer, flag in zip(self.chunks, peers, self.ready.addresses))
        last_flag = [("write", self._pulls[-1][1], READY)] if self._pulls else []
        self._last_flag_pulled = memops.MemOps(last_flag + self.gather.signals.signal_ops(self.gather.PULLED))

    def _transfers(self, stream, capturing):
        """Behind the peers' READY, each chunk's copies from every peer and its ready flag (the list made when the plan
        was built), then PULLED (batched with the last chunk's flag)."""
        self.gather.ready(stream, capturing)
        pulls = self._pulls
        for c, (copies, flag) in enumerate(pulls, 1):
            for dst, src, nbytes in copies:
                memops.copy(stream, dst, src, nbytes)
            if c < len(pulls):
                memops.write_value(stream, flag, READY)   # engine.raise_flag, the address looked up once
        self._last_flag_pulled.issue(stream)   # the last flag, then gather.finish (PULLED)


class AgGemmSignaledCopyLanes(AgGemmSignaledP2P):
    """AgGemmSignaledP2P with the copy engines' pulls split over `copy_lanes` streams (comm_sms 0): each chunk's rows in
    near-equal parts, one per lane, forked from the comm stream and joined back before the chunk's flag."""

    def _transfers(self, stream, capturing):
        engine, gather = self.engine, self.gather
        gather.ready(stream, capturing)
        for c, (lo, hi) in enumerate(self.chunks):
            gather.pull(stream, lo, hi, self.lanes, capturing)
            engine.raise_flag(self.ready, c)
        gather.finish(stream)


class AgGemmSignaledSMPulls(AgGemmSignaledP2P):
    """AgGemmSignaledP2P with the pulls on SMs (comm_sms > 0): the READY exchange, every chunk's pulls and flag, and
    PULLED as one kernel of comm_sms CTAs on the SMs the GEMM's grid leaves free (GatherBuffer.signaled_pull,
    kernels/peer_copy.py)."""

    def build(self, gather=None):
        super().build(gather)
        self.puller = self.gather.signaled_pull(self.config.comm_sms, self.chunks, self.flags, self.describe())

    def _transfers(self, stream, capturing):
        self.puller(stream)


class AgGemmOffFp8(Fp8Plan, AgGemmOff):
    """AgGemmOff with FP8 operands: torch.distributed's all-gathers of the shards' FP8 rows (as bytes) and of their
    scales, stacked in rank order (fp8_quant's gathered layout: tensorwise [t], 1x128 [t, K/128, m]), then torch's
    scaled GEMM of each rank's rows with that rank's scales (ops/fp8.py scaled_mm), the bias added after: the FP8
    strategies' reference. Returns the gathered ScaledFp8 (new tensors, the caller's)."""

    def _gathered(self, a_shard: ScaledFp8) -> ScaledFp8:
        rows, _ = comm.all_gather_rows(a_shard.q.view(torch.uint8), self.group)
        scales, _ = comm.all_gather_rows(a_shard.ds.unsqueeze(0), self.group)
        shape = self.fp8.gathered_scale_shape(self.t, self.m, self.k)
        return ScaledFp8(rows.view(a_shard.q.dtype), scales.view(shape), a_shard.scaling)


class AgGemmSignaledNcclFp8(Fp8Plan, AgGemmSignaledNccl):
    """AgGemmSignaledNccl with FP8 operands. The gathered input is a new ScaledFp8 per call: the shards' FP8 rows
    [t * m, K] (moved as bytes: half of bf16's) and every rank's scales stacked ([t] or [t, K/128, m]: fp8_quant's
    gathered layout, which the FP8 GEMM reads as they are). This rank's rows and scales are copied into their places
    on the caller's stream before the GEMM, so the local rows' tiles, which wait for no flag, read them at once.
    The peers' scales are gathered whole, with the first chunk: on the comm stream one broadcast per rank of its
    scales (in place, as the rows'; 4 bytes per rank tensorwise, 4 per 128 elements of a row blockwise: 1/32 of the
    rows' bytes) precedes chunk 0's rows, so chunk 0's flag, and every later one, is raised after them; every peer
    tile waits for a flag, so none reads a peer's scale before it landed, and the GEMM's start waits for no
    collective. Then each chunk's rows and flag as in bf16."""

    def build(self, gather=None):
        super().build()
        a_ds, _ = self.fp8.scale_shapes(self.m, self.n, self.k)
        self._scale_elems = math.prod(a_ds)   # one rank's scales
        self._scale_spans = None
        if self._broadcasts is not None:   # the raw communicator (CUDA): every rank's scales by address, made once
            from overlap_tp.ops.nccl import gather_spans
            self._scale_spans = gather_spans(self.t, 1, self._scale_elems, 4, 0, 1)

    def _new_gathered(self) -> ScaledFp8:
        fp8 = self.fp8
        return ScaledFp8(torch.empty(self.t * self.m, self.k, dtype=fp8.a_dtype, device=self.device),
                         torch.empty(fp8.gathered_scale_shape(self.t, self.m, self.k), dtype=torch.float32,
                                     device=self.device), fp8.a_scaling)

    def _transfers(self, a_shard: ScaledFp8, gathered: ScaledFp8):
        engine, current, t, rank = self.engine, None, self.t, self.rank
        rows, shard_rows = gathered.q.view(torch.uint8), a_shard.q.view(torch.uint8)
        scales, shard_scales = gathered.ds.view(t, self._scale_elems), a_shard.ds.view(1, self._scale_elems)
        if engine.stream is None:
            rows.narrow(0, rank * self.m, self.m).copy_(shard_rows)
            scales[rank].copy_(shard_scales[0])
        else:   # copy-engine copies through the driver, as the bf16 shard's
            current = engine.current()
            nbytes, scale_bytes = shard_rows.numel(), 4 * self._scale_elems
            memops.copy(current, rows.data_ptr() + rank * nbytes, shard_rows.data_ptr(), nbytes)
            memops.copy(current, scales.data_ptr() + rank * scale_bytes, shard_scales.data_ptr(), scale_bytes)

        if self._broadcasts is not None:   # the raw communicator (CUDA): by address
            coll, rows_base, scales_base = self.coll, rows.data_ptr(), scales.data_ptr()

            def transfers(stream):
                coll.all_gather_rows_at(scales_base, self._scale_spans, torch.float32, stream)
                for spans, flag in zip(self._broadcasts, self.ready.addresses):
                    coll.all_gather_rows_at(rows_base, spans, torch.uint8, stream)
                    memops.write_value(stream, flag, READY)
        else:
            def transfers(stream):
                self.coll.all_gather_rows(scales, shard_scales, 0, 1, stream=stream)
                for c, (lo, hi) in enumerate(self.chunks):
                    self.coll.all_gather_rows(rows, shard_rows, lo, hi, stream=stream)
                    engine.raise_flag(self.ready, c)
        return transfers, current


class AgGemmSignaledP2PFp8(Fp8Plan, AgGemmSignaledCopyEngines):
    """AgGemmSignaledCopyEngines with FP8 operands (transport 'p2p', comm_sms 0, one copy lane; chunk_by either): the
    plan's own ScaledGatherBuffer (ops/p2p_gather.py) holds the FP8 rows (one byte per element) and, in a symmetric
    buffer of its own under the same PULLED / READY signals, every rank's scales. The stage copies the shard's rows
    and scales into this rank's regions on the caller's stream (the local rows' tiles read them there); the peers'
    scales are pulled whole with the first chunk, ahead of its rows in its copy list, so the first flag, and every
    later one, rises after them (the argument of AgGemmSignaledNcclFp8). Returns the gathered ScaledFp8: the plan's
    buffers, valid until its next call (a call while it is still referenced is refused, as GatherBuffer's)."""

    def _gather_buffer(self, gather):
        a_ds, _ = self.fp8.scale_shapes(self.m, self.n, self.k)
        return ScaledGatherBuffer(self.group, self.rank, self.t, self.m, self.k, self.fp8.a_dtype, self.fp8.a_scaling,
                                  a_ds, self.device, self.describe())

    def _list_pulls(self):
        super()._list_pulls()
        if self._pulls:   # the peers' scales first in chunk 0's copies
            (copies, flag), rest = self._pulls[0], self._pulls[1:]
            self._pulls = ((tuple(self.gather.scale_copies()) + copies, flag),) + rest


# each bf16 strategy's FP8 counterpart, or why it has none (ops/fp8.py fp8_counterpart; method 'decompose' has none)
FP8_STRATEGIES = {
    AgGemmOff: AgGemmOffFp8,
    AgGemmSignaledNccl: AgGemmSignaledNcclFp8,
    AgGemmSignaledCopyEngines: AgGemmSignaledP2PFp8,
    AgGemmSignaledCopyLanes: "the copy engines' pulls split over copy_lanes streams take bf16 rows only; use "
                             "copy_lanes=1",
    AgGemmSignaledSMPulls: "the pulls on SMs (transport='p2p' with comm_sms > 0) take bf16 rows only; use comm_sms=0 "
                           "(the copy engines' pulls) or transport='nccl'",
}


class StartedAgGemm:
    """A call that AgGemm.start() issued: what finish() needs (the shard, the gathered buffer, the caller's stream and
    capture state, the event behind the transfers). It references the shard and the buffer until finish()."""

    __slots__ = ("a_shard", "gathered", "current", "capturing", "done")

    def __init__(self, a_shard, gathered, current, capturing, done):
        self.a_shard, self.gathered, self.current = a_shard, gathered, current
        self.capturing, self.done = capturing, done


def _mm(x, wt, out, bias):
    """out = x @ wt (+ bias, in cuBLAS's epilogue)."""
    if bias is None:
        torch.mm(x, wt, out=out)
    else:
        torch.addmm(bias, x, wt, out=out)


def ag_gemm(a_shard, w, group=None, *, bias: Optional[torch.Tensor] = None, config: Optional[OverlapConfig] = None,
            return_gathered: bool = False, instance: int = 0):
    """all_gather(a_shard) @ w.T + bias; with return_gathered=True returns (out, gathered). a_shard and w: bf16 / fp16
    tensors, or both ScaledFp8 (FP8, K-major; out bf16, gathered the ScaledFp8 of every rank's rows with their scales
    stacked: fp8_quant's gathered layout). Runs the cached AgGemm plan of this shape and operands (of `instance`:
    cached_plan)."""
    plan = _cached(a_shard, w, bias, group, config, instance, check=True)
    return plan(a_shard, w, bias, return_gathered=return_gathered)


def ag_gemm_plan(a_shard, w, group=None, config: Optional[OverlapConfig] = None, instance: int = 0) -> AgGemm:
    """The cached AgGemm plan that ag_gemm(a_shard, w, group, config=config, instance=instance) runs (for its
    start()/finish())."""
    return _cached(a_shard, w, None, group, config, instance, check=False)


def _cached(a_shard, w, bias, group, config, instance, check: bool) -> AgGemm:
    m, n, k, dtype, device, fp8 = operand_plan_args(a_shard, w, bias, check)
    return cached_plan(AgGemm, comm.resolve_group(group), m, n, k, dtype, device, config, instance, fp8)


class OwnGather:
    """A column-parallel layer's own gathered input buffer, written in place by the producer of its input: the fused
    block's pull variant (docs/fused_block.md). The norm before the GEMM writes its rows straight into this rank's region
    (claim()), the AllGather+GEMM then stages nothing (no copy on the critical path, where CUDA graphs run it as an SM
    kernel) and the peers pull the rows from there; the buffer is the layer's alone, so the whole gathered input is
    still in it at the backward, whose wgrad reads it with no re-gather (no copies or pulls beside the dgrad GEMM).
    Costs (t - 1) shards of memory per layer over the saved shard it replaces. One per (layer, shard shape); plans
    per (weight rows, config), built at first use, collectively (every rank's layers run in the same order).

        region = own.claim()                  # [m, k]: the producer writes the shard here (on the current stream)
        out, gathered = own.ag_gemm(region, w, bias, config)   # gathered: valid until the next claim

    The p2p transport with method signal or decompose only (supports()); any other config runs the shared path."""

    def __init__(self, group, m: int, k: int, dtype, device: torch.device, instance: int = 0):
        """instance: its plans' (OpPlan.instance: their own comm stream)."""
        check_not_capturing(device, "a layer's own gathered buffer")
        self.instance = instance
        self.group = comm.resolve_group(group)
        self.m, self.k, self.dtype, self.device = m, k, dtype, device
        t, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.buffer = GatherBuffer(self.group, rank, t, m, k, dtype, device, f"all_gather(M={m}, K={k}, t={t}, "
                                   f"p2p, in place)", memory_kind="gathered in place")
        self.region_ptr = self.buffer.own[rank]
        self.engine = comm.comm_engine(device, instance)
        self._plans = {}

    @staticmethod
    def supports(config: OverlapConfig, device: torch.device) -> bool:
        """Whether an ag_gemm of this config on this device can gather in place (symmetric memory: CUDA)."""
        return config.method in ("signal", "decompose") and config.transport == "p2p" and device.type == "cuda"

    def fits(self, m: int, k: int, dtype, device) -> bool:
        return (m, k, dtype, device) == (self.m, self.k, self.dtype, self.device)

    def claim(self) -> torch.Tensor:
        """This rank's region [m, k] of the buffer, writable on the current stream (every peer pulled the previous
        call's rows out of it)."""
        engine = self.engine
        return self.buffer.claim(engine.current(), engine.capturing())

    def holds(self, x: torch.Tensor) -> bool:
        """Whether x is the claimed region (the next ag_gemm stages nothing)."""
        return (self.buffer.claimed is not None and x.data_ptr() == self.region_ptr
                and x.shape == (self.m, self.k))

    def ag_gemm(self, a_shard: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], config: OverlapConfig):
        """all_gather(a_shard) @ w.T + bias through this buffer: (out, gathered)."""
        key = (w.shape[0], config)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = AgGemm(self.group, self.m, w.shape[0], self.k, self.dtype, self.device, config,
                                             gather=self.buffer, instance=self.instance)
        return plan(a_shard, w, bias, return_gathered=True)


class RowGather:
    """all_gather of row shards, a_shard [m, k] -> [t * m, k] in rank order, by copy-engine pulls into the shape's
    gathered buffer (GatherBuffer), for one (group, m, k, dtype, device): no SM spent. Built collectively, once per
    shape (row_gather); the AgGemm plans of the shape on the p2p transport pull into the same buffer.
    What it is for alone (gather_rows): the column-parallel backward re-gathers its input for the wgrad while the dgrad
    GEMM runs; NCCL's all-gather there takes SMs from that GEMM (with the p2p transports, this leaves no NCCL kernel
    in a sequence-parallel layer)."""

    def __init__(self, group, m: int, k: int, dtype, device: torch.device):
        check_not_capturing(device, "the copy-engine all-gather")
        self.t, self.m, self.k, self.dtype, self.device = dist.get_world_size(group), m, k, dtype, device
        describe = f"all_gather(M={m}, K={k}, t={self.t}, p2p)"
        self.buffer = GatherBuffer(group, dist.get_rank(group), self.t, m, k, dtype, device, describe)
        self.engine = comm.comm_engine(device)
        self.watched = Watched(describe, (("peer signals [PULLED, READY] x rank", self.buffer.signals.words),))

    def __call__(self, a_shard: torch.Tensor, copy_lanes: int = 1) -> Pending:
        """The gather issued on the comm stream (its pulls split over `copy_lanes` streams); wait() makes the caller's
        stream wait for it and returns the gathered rows: the shape's buffer, valid until the next AllGather of the
        shape (GatherBuffer)."""
        if (a_shard.shape != (self.m, self.k) or a_shard.dtype != self.dtype or a_shard.device != self.device
                or not a_shard.is_contiguous()):
            raise ValueError(f"overlap_tp all_gather: called with {tuple(a_shard.shape)} {a_shard.dtype} on "
                             f"{a_shard.device}; built for a contiguous [{self.m}, {self.k}] {self.dtype} on "
                             f"{self.device}")
        engine, buffer = self.engine, self.buffer
        capturing = engine.capturing()
        engine.fork(engine.current(), capturing)   # a_shard is ready
        raw = engine.raw
        buffer.stage(raw, a_shard, capturing)
        gathered = buffer.gathered()
        buffer.ready(raw, capturing)
        buffer.pull(raw, 0, self.m, engine.copy_lanes(copy_lanes), capturing)
        buffer.finish(raw)
        if not capturing:
            self.watched.record(raw)
        return Pending(joined(self.device, lambda: gathered), a_shard, gathered)


_row_gathers = OrderedDict()
MAX_ROW_GATHERS = 64


def row_gather(group, m: int, k: int, dtype, device) -> RowGather:
    """The RowGather of this shape (built at its first use, collectively; the 64 most recent kept)."""
    key = (group, m, k, dtype, device)
    plan = _row_gathers.get(key)
    if plan is None:
        plan = _row_gathers[key] = RowGather(group, m, k, dtype, device)
        if len(_row_gathers) > MAX_ROW_GATHERS:
            _row_gathers.popitem(last=False)
    else:
        _row_gathers.move_to_end(key)
    return plan


def gather_rows(a_shard: torch.Tensor, group, config: Optional[OverlapConfig] = None) -> Pending:
    """all_gather(a_shard) along rows, issued now; wait() returns it. With config's transport 'p2p' (method 'signal'
    or 'decompose'; an unset transport resolved as for ag_gemm, ops/resolve.py) on CUDA: the copy engines (RowGather,
    whose result is the shape's shared buffer: valid until the next AllGather of the shape); otherwise
    torch.distributed's all-gather."""
    group = comm.resolve_group(group)
    t = dist.get_world_size(group)
    config = fill_defaults(config, "ag_gemm", a_shard.device, t) if config is not None else None
    if (config is not None and config.method in ("signal", "decompose") and config.transport == "p2p"
            and a_shard.is_cuda and t > 1):
        return row_gather(group, a_shard.shape[0], a_shard.shape[1], a_shard.dtype, a_shard.device)(a_shard,
                                                                                                  config.copy_lanes)
    gathered, work = comm.all_gather_rows(a_shard, group, async_op=True)
    return Pending(after_work(work, lambda: gathered), gathered)
