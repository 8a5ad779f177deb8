"""Peer-to-peer GEMM+ReduceScatter and GEMM+AllReduce through PyTorch symmetric memory (peer-mapped over NVLink), no
collective.

GEMM+ReduceScatter (`P2PReduceScatter`): the GEMM's epilogue stores each region's rows straight into the
owning rank's receive buffer, then every rank sums the t partial slots it received. The GEMM is the signaled
Triton kernel (method 'signal', one persistent launch over a tile plan) or cuBLAS, one call per region
(method 'decompose': `RegionGemms`). With OverlapConfig.rs_transfer 'copy' the signaled GEMM stores the peers'
regions locally instead, one after another, and the copy engines push each to its owner behind the GEMM's group
counters (no SM moves the bytes). The call's second half, the sum, is a `DeferredSum`.

GEMM+AllReduce (`P2PAllReduce`): the ReduceScatter above with each rank's sum written into its own region of a
symmetric gathered buffer (ops/p2p_gather.py GatherBuffer), from where its peers pull it with the copy engines (the
all-gather half).

What it removes against per-group NCCL reduce-scatters (shared/DEVICE.md, contention section): the
collective's CTAs (no SM is taken from the GEMM), the partial's round trip through local HBM before
NCCL reads it back, and NCCL's own copy. What it adds: remote stores in the epilogue and one sum pass
over the received slots (read t x M/t x N, write M/t x N).

Both use one buffer and one-shot signals (overlap_tp/ops/sync.py: raised by the producer, reset by the
waiter), so every call, eager or a replay of a captured graph, runs the same protocol; each protocol's order
argument is written next to it. Buffers belong to their plan and live as long as it does.
"""
import torch

from overlap_tp.kernels.signaled_gemm import SignaledGemm, default_offsets
from overlap_tp.kernels.sum_slots import SlotsSummed, SumSlots
from overlap_tp.ops import comm, memops, replay, symmetric
from overlap_tp.ops.p2p_gather import GatherBuffer
from overlap_tp.ops.sync import PeerSignals
from overlap_tp.ops.tile_plan import p2p_copy_plan, p2p_plan, ring_peers

# Offsets between buffers are used as 16-element-aligned by the kernel (16-byte stores).
OFFSET_ALIGNMENT = 16


class P2PReduceScatter:
    """reduce_scatter(a @ w.T) [+ bias] for one (group, M, N, dtype) through epilogue stores into the owners'
    receive buffers [t, M/t, N] (slot s of rank k: rank s's partial of region k).

    Per call, on the caller's stream, in two halves (the second may be queued after other work, which then
    hides the wait for the slowest peer's GEMM):
        store half:  wait SUMMED from every peer (it has summed our previous partials out of its buffer),
                     reset; GEMM: region k's rows into rank k's buffer, slot `rank`; signal ARRIVED to every
                     peer (our stores are complete: the write is fenced behind the kernels)
        reduce half: wait ARRIVED from every peer, reset; sum the t slots; signal SUMMED to every peer (the sum's
                     own last CTA, after every CTA's loads: kernels/sum_slots.py; after a kernel that reads the
                     slots itself, a stream write-value)
    Order argument for the resets: a peer raises our SUMMED word for call i+1 only after its sum of call i+1,
    which waits for our ARRIVED of call i+1, which we raise after our reset of SUMMED in call i+1; a peer
    raises our ARRIVED word for call i+1 only after it waited for our SUMMED of call i, raised after our
    reset of ARRIVED in call i. SUMMED starts raised: there is no previous call to wait for.

    rs_transfer 'copy' (p2p_copy_plan): the same words and the same order, with the transfer moved to the comm
    stream (push half):
        caller's stream:  fork; GEMM: the peers' regions into a local staging matrix, ring order, raising counter g
                          per stored tile of push group g; the own region into our own slot, last
        comm stream:      wait SUMMED from every peer, reset; per push group g: wait until counter g is complete,
                          reset it; push its rows into the owner's slot `rank` (a copy-engine copy); after the last
                          push signal ARRIVED to every peer
        reduce half:      join the comm stream (its pushes read the staging matrix, which the next call's GEMM
                          overwrites), then as above
    Order argument: the pushes take the epilogue stores' place between the same wait and signal, so the one above
    holds; the staging matrix is rewritten by call i+1's GEMM only after call i's join, which follows its pushes;
    our own slot is written by our GEMM only, after our previous sum on the same stream."""

    SUMMED, ARRIVED = 0, 1

    def __init__(self, group, rank, t, m, n, dtype, device, config, programs, watched, instance=0, replays=True,
                 launcher=SignaledGemm):
        """config.method 'signal': the signaled GEMM stores the tiles (programs: its grid; launcher: its launcher,
        SignaledGemm or for FP8 operands Fp8SignaledGemm); 'decompose': cuBLAS (RegionGemms). config.rs_transfer
        (resolved: 'epilogue' or 'copy') says whether the GEMMs store into the owners' buffers or the copy engines push
        what they stored locally (_build_pushes, push_half). instance: the plan's (OpPlan.instance), whose comm stream
        the pushes run on. replays: summed's eager calls replayed from graphs (P2PAllReduce, which replays its whole
        call, passes False)."""
        from torch.distributed import _symmetric_memory as symm_mem
        self.t, self.m_local, self.n, self.watched, self.instance = t, m // t, n, watched, instance
        self.buf = symmetric.empty(t * self.m_local, n, dtype=dtype, device=device, kind="reduce-scatter slots")
        handle = symm_mem.rendezvous(self.buf, group)
        within = self.buf.data_ptr() - handle.buffer_ptrs[rank]        # the same on every rank
        byte_offsets = [handle.buffer_ptrs[k] + within - self.buf.data_ptr() for k in range(t)]
        if any(off % (OFFSET_ALIGNMENT * self.buf.element_size()) for off in byte_offsets):
            raise RuntimeError(f"overlap_tp: symmetric buffers are not {OFFSET_ALIGNMENT}-element aligned: "
                               f"{byte_offsets}")
        self.handle = handle
        self.copy = config.rs_transfer == "copy"
        self.join = None   # rs_transfer 'copy': the call's join of the comm stream, run by its reduce half
        self.regions = None   # method 'decompose' with rs_transfer 'copy': the region GEMMs (RegionGemms)
        if config.method == "decompose" and not self.copy:
            self.store = RegionGemms.into_owners(handle, self.buf, rank, t, within // self.buf.element_size())
        elif self.copy:
            self._build_pushes(group, rank, t, m, n, dtype, device, config, programs, handle, within, launcher)
        else:
            tiles = p2p_plan(m, n, t, rank, config.block_m, config.block_n).tiles.to(device)
            offsets = torch.tensor([off // self.buf.element_size() for off in byte_offsets], dtype=torch.int64,
                                   device=device)
            default_offsets(device)
            gemm = launcher(tiles, programs, config, dst_offsets=offsets,
                            bias_rows=(rank * self.m_local, (rank + 1) * self.m_local))
            buf = self.buf
            self.store = lambda a, w, bias: gemm.launch_checked(a, w, buf, bias)
        self.signals = PeerSignals(group, rank, t, device, initial=(1, 0), describe=watched.describe,
                                   names=("SUMMED", "ARRIVED"))
        # the sum raises SUMMED itself and reports an eager call's end to the watchdog (kernels/sum_slots.py)
        signals = self.signals
        self.sum = SumSlots(t, self.m_local * n, SlotsSummed(
            signals.words, signals.word_offsets(self.SUMMED, signals.peers, remote=True), watched.progress_word()))
        self.slots = self.buf.view(t, self.m_local, n)          # the views a call reads, made once
        self.flat_slots = self.buf.view(t, self.m_local * n)
        self.device_index = device.index
        self.outstanding = None   # "eager" / "capture": a call whose second half (its DeferredSum) has not run
        # summed's eager calls replayed from graphs (ops/replay.py); None: issued one by one
        self.graphs = replay.CallGraphs(device, watched) if replays and replay.enabled(device) else None
        watched.words = (("peer signals [SUMMED, ARRIVED] x rank", self.signals.words),)
        if self.copy and self.regions is None:
            watched.words += (("push group counters", self.waits.counters),)

    def _build_pushes(self, group, rank, t, m, n, dtype, device, config, programs, handle, within, launcher):
        """rs_transfer 'copy': the staging matrix, the GEMM over p2p_copy_plan raising its push groups' counters (or,
        for method 'decompose', one cuBLAS GEMM per run of rows: RegionGemms), and each group's copy (dst in the
        owner's slot `rank`, src in the staging matrix, bytes), made once. `programs` must leave an SM free for the
        comm stream's waits (GemmRS: a captured graph waits with one-thread kernels, which the persistent GEMM's CTAs
        need not leave room for beside them; PeerSignals' graph_deadline)."""
        plan = p2p_copy_plan(m, n, t, rank, config.block_m, config.block_n, config.groups,
                             torch.finfo(dtype).bits // 8)
        self.staging = torch.empty(plan.staging_shape, dtype=dtype, device=device)
        size, row_bytes = self.buf.element_size(), n * self.buf.element_size()
        staging_ptr, slot = self.staging.data_ptr(), rank * self.m_local
        groups = list(zip(plan.collectives[:-1], plan.chunk_peers[:-1]))   # the push groups: the last is our own
        self.pushes = tuple((handle.buffer_ptrs[owner] + within + (slot + c.dst_lo) * row_bytes,
                             staging_ptr + c.src_lo * row_bytes, (c.dst_hi - c.dst_lo) * row_bytes)
                            for c, owner in groups)
        self.engine = comm.comm_engine(device, self.instance)
        self.engine.prepare_graph_waits()
        if config.method == "decompose":
            # group g's rows of `a` (the peer's region's run: its source rows) into staging rows [src_lo, src_hi);
            # the last group, our own region, into our own slot
            runs = [(owner * self.m_local + c.dst_lo, c.dst_hi - c.dst_lo, self.staging[c.src_lo:c.src_hi])
                    for c, owner in groups]
            runs.append((slot, self.m_local, self.buf.view(t, self.m_local, n)[rank]))
            self.regions = RegionGemms(runs)
            return
        own_offset = self.buf.data_ptr() - self.staging.data_ptr()   # bytes from the staging matrix to our slots
        if own_offset % (OFFSET_ALIGNMENT * size):
            raise RuntimeError(f"overlap_tp: the receive buffer is not {OFFSET_ALIGNMENT}-element aligned with the "
                               f"staging matrix: {own_offset} bytes apart")
        offsets = torch.tensor([0, own_offset // size], dtype=torch.int64, device=device)
        counters = torch.zeros(plan.num_groups, dtype=torch.int32, device=device)
        pushes = len(groups)   # our own region's group follows: stored in place, pushed nowhere
        self.waits = comm.CounterWaits(counters, plan.group_tiles[:pushes],
                                       unwaited=((pushes, plan.group_tiles[pushes]),))
        default_offsets(device)
        gemm = launcher(plan.tiles.to(device), programs, config, counters=counters, dst_offsets=offsets,
                        bias_rows=(rank * self.m_local, (rank + 1) * self.m_local))
        staging = self.staging
        self.store = lambda a, w, bias: gemm.launch_checked(a, w, staging, bias)

    def __call__(self, a, w, bias):
        """Issue the call's first half on the caller's stream and return the second half, a DeferredSum, to be
        run once on the stream that will read the output: at once, or after work queued to hide the wait for
        the peers (the column-parallel backward's wgrad GEMM, through gemm_rs(async_op=True)), or by the kernel
        that reads the sum (the fused add + RMSNorm). Until it ran, the plan refuses another call: that call's
        wait for SUMMED would queue ahead of the sum it waits for, on every rank (a deadlock on the GPU)."""
        capturing, stream = self._begin()
        if self.copy:
            self.join = self.push_half(a, w, bias, capturing)
        else:
            self.store_half(stream, lambda: self.store(a, w, bias), capturing)
        self.outstanding = "capture" if capturing else "eager"
        return DeferredSum(self)

    def _begin(self):
        """(capturing, the caller's raw stream) for a new call; refused while the previous call's second half has
        not run."""
        capturing = torch.cuda.is_current_stream_capturing()
        if self.outstanding == "capture" and not capturing:
            # issued into a capture that ended without its second half: the capture failed, and nothing of it
            # ran on the GPU, so the words are as the last completed call left them (and its join is dropped)
            self.outstanding = self.join = None
        if self.outstanding is not None:
            raise RuntimeError("overlap_tp gemm_rs (p2p): the plan was called again before the previous call's "
                               "result was waited for (Pending.wait()); wait for it first")
        return capturing, torch._C._cuda_getCurrentRawStream(self.device_index)

    def summed(self, a, w, bias) -> torch.Tensor:
        """The whole call on the caller's stream, summed at once (gemm_rs without async_op): the same operations as
        __call__ and then its DeferredSum, with the ARRIVED signal and the wait for the peers' ARRIVED that follows
        it in one batched driver call (store_and_reduce) instead of two. Eagerly, replayed from the graph of the
        operands' addresses where it has one (ops/replay.py)."""
        capturing, stream = self._begin()
        out = torch.empty(self.m_local, self.n, dtype=self.buf.dtype, device=self.buf.device)
        if self.graphs is None:
            self._summed_into(stream, a, w, bias, out, capturing)
        else:
            self.graphs.call(self._summed_into, stream, capturing, a, w, bias, out)
        return out

    def _summed_into(self, stream, a, w, bias, out, capturing: bool):
        reduce = self._summing(out, capturing)
        if self.copy:
            self.push_half(a, w, bias, capturing)()   # the pushes, joined
            self.reduce_half(stream, reduce, capturing, raises_summed=True)
        else:
            self.store_and_reduce(stream, lambda: self.store(a, w, bias), reduce, capturing)

    def _summing(self, out, capturing: bool):
        """The reduce step that sums the slots into `out` and raises SUMMED (SumSlots with SlotsSummed), eagerly also
        writing the call's number into the watchdog's progress word: what ends a call whose result is the sum. The call
        is numbered (and watched) as the sum is launched: a call whose earlier launches raised is not watched."""
        if capturing:
            return lambda: self.sum.launch_checked(self.flat_slots, out, 0)
        return lambda: self.sum.launch_checked(self.flat_slots, out, self.watched.next_call())

    def finish(self, read_slots):
        """The call's second half on the current stream, around read_slots(slots [t, M/t, N]) (a kernel that reads the
        sum itself), SUMMED raised by a stream write-value after it."""
        stream, capturing = self._second_half()
        self.reduce_half(stream, lambda: read_slots(self.slots), capturing)
        self.outstanding = None
        if not capturing:
            self.watched.record(stream)

    def finish_sum(self, out):
        """The call's second half on the current stream: the signalling sum into `out`."""
        stream, capturing = self._second_half()
        self.reduce_half(stream, self._summing(out, capturing), capturing, raises_summed=True)
        self.outstanding = None

    def _second_half(self):
        """(the current raw stream, capturing) for the call's second half, with the comm stream joined first where the
        pushes ran there (rs_transfer 'copy')."""
        stream = torch._C._cuda_getCurrentRawStream(self.device_index)
        capturing = torch.cuda.is_current_stream_capturing()
        if self.join is not None:
            self.join()
            self.join = None
        return stream, capturing

    def push_half(self, a, w, bias, capturing: bool):
        """rs_transfer 'copy''s first half: fork; the GEMM on the caller's stream, and on the comm stream the SUMMED
        wait, each push group's push behind its rows' GEMM, and the ARRIVED signal after the last. Returns the join.
        Method 'signal': one persistent GEMM raising a counter per group, each push behind its counter's wait
        (CommEngine.gemm_then_collectives). Method 'decompose': one cuBLAS GEMM per group (RegionGemms), each push
        behind a fork of the comm stream after its GEMM (as reduction.decomposed issues its chunks' collectives), our
        own region's GEMM last, beside the last push."""
        pushes, last = self.pushes, len(self.pushes) - 1

        def push(g, stream):
            if g == 0:
                self.signals.wait(stream, self.SUMMED, capturing)
            memops.copy(stream, *pushes[g])
            if g == last:
                self.signals.signal(stream, self.ARRIVED)
        if self.regions is None:
            return self.engine.gemm_then_collectives(lambda: self.store(a, w, bias), self.waits, push, self.watched)
        engine, regions, wt = self.engine, self.regions, w.t()
        current = engine.current()
        for g in range(len(pushes)):
            regions.run(a, wt, bias, g)
            engine.fork(current, capturing)   # the comm stream waits for this run's GEMM (and what came before)
            push(g, engine.raw)
        regions.run(a, wt, bias, len(pushes))   # our own region, into our own slot
        if not capturing and self.watched is not None:
            self.watched.record(engine.raw)

        def join():
            engine.join(engine.current(), engine.capturing())
        return join

    def store_half(self, stream, store, capturing: bool):
        """wait SUMMED from every peer, reset; store (the GEMM into the owners' buffers); signal ARRIVED."""
        self.signals.wait(stream, self.SUMMED, capturing)
        store()
        self.signals.signal(stream, self.ARRIVED)

    def store_and_reduce(self, stream, store, reduce, capturing: bool):
        """store_half, then reduce_half with a reduce that raises SUMMED itself (the signalling sum), on one stream:
        the same order of operations, with store_half's closing signal and reduce_half's opening wait issued together
        (PeerSignals.signal_then_wait)."""
        self.signals.wait(stream, self.SUMMED, capturing)
        store()
        self.signals.signal_then_wait(stream, self.ARRIVED, capturing)
        reduce()

    def reduce_half(self, stream, reduce, capturing: bool, raises_summed: bool = False):
        """wait ARRIVED from every peer, reset; reduce (the sum of our slots); signal SUMMED (the signalling sum,
        raises_summed, signals at its own end)."""
        self.signals.wait(stream, self.ARRIVED, capturing)
        reduce()
        if not raises_summed:
            self.signals.signal(stream, self.SUMMED)


class P2PAllReduce:
    """all_reduce(a @ w.T) [+ bias] for one (group, M, N, dtype) with no collective: the p2p ReduceScatter
    (P2PReduceScatter) sums this rank's region of the rows straight into its own region of a symmetric gathered buffer
    (GatherBuffer [M, N], claimed: nothing staged), then the copy engines pull every peer's summed region from the
    peers' buffers into the output and copy our own beside them: a ring all-reduce's all-gather half as pulls, with no
    SM spent on either half.

    Per call:
        caller's stream:  claim our region (wait PULLED from every peer: it pulled our previous region; reset); the p2p
                          ReduceScatter's whole call (P2PReduceScatter.summed's operations) with its sum into our region
        comm stream, forked after it: the READY exchange; every peer's region pulled into the output (ring order);
                          PULLED signalled to every peer
        caller's stream:  our region copied into the output, beside the pulls (another copy engine; behind the
                          pulls on one stream it would lengthen the gather by its own copy time)
        join:             the caller's stream waits for the comm stream
    Order argument: the ReduceScatter's and the GatherBuffer's, each on its own words (the claim is a stage whose copy
    the sum replaced). Our region is rewritten by the next call's sum only after that call's claim (every peer pulled
    it) and this call's join (our own copy of it is done). The bias goes into each region once, by its owner's GEMM
    (P2PReduceScatter's bias rows), so once into every row of the output."""

    def __init__(self, group, rank, t, m, n, dtype, device, config, programs, watched, instance=0,
                 launcher=SignaledGemm):
        """launcher: the signaled GEMM's (P2PReduceScatter's)."""
        self.reduce_scatter = P2PReduceScatter(group, rank, t, m, n, dtype, device, config, programs, watched, instance,
                                               replays=False, launcher=launcher)
        self.gather = gather = GatherBuffer(group, rank, t, m // t, n, dtype, device, watched.describe,
                                            memory_kind="all-reduce regions")
        self.m, self.n, self.dtype, self.device, self.watched = m, n, dtype, device, watched
        self.engine = comm.comm_engine(device, instance)
        # (byte offset into the output, source address, bytes): every peer's region in ring order; our own
        self.pulls = tuple((p * gather.region_bytes, gather.own[p], gather.region_bytes) for p in gather.peers)
        self.own_copy = (rank * gather.region_bytes, gather.own[rank], gather.region_bytes)
        watched.words += (("peer signals [PULLED, READY] x rank", gather.signals.words),)
        # eager calls replayed from graphs (ops/replay.py); None: issued one by one
        self.graphs = replay.CallGraphs(device, watched) if replay.enabled(device) else None

    def __call__(self, a, w, bias) -> torch.Tensor:
        """The whole call on the caller's stream and its comm stream, joined: the all-reduced [M, N]."""
        capturing, stream = self.reduce_scatter._begin()
        out = torch.empty(self.m, self.n, dtype=self.dtype, device=self.device)
        if self.graphs is None:
            self._issue(stream, a, w, bias, out, capturing)
        else:
            self.graphs.call(self._issue, stream, capturing, a, w, bias, out)
        return out

    def _issue(self, stream, a, w, bias, out, capturing: bool):
        gather, engine = self.gather, self.engine
        region = gather.claim(stream, capturing)
        self.reduce_scatter._summed_into(stream, a, w, bias, region, capturing)
        gather.stage(stream, region, capturing)   # claimed: nothing to copy
        engine.fork(stream, capturing)
        raw, base = engine.raw, out.data_ptr()
        gather.ready(raw, capturing)
        for offset, src, nbytes in self.pulls:
            memops.copy(raw, base + offset, src, nbytes)
        gather.finish(raw)
        offset, src, nbytes = self.own_copy
        memops.copy(stream, base + offset, src, nbytes)
        engine.join_watched(stream, capturing, self.watched)


class RegionGemms:
    """The decompose method's GEMMs: one cuBLAS GEMM per run of rows of a @ w.T, each into its own output, in order.
    Into the owners' receive buffers (`into_owners`): rows [k*M/t, (k+1)*M/t) straight into slot `rank` of rank k's
    buffer (peer-mapped: cuBLAS's own epilogue stores go over NVLink, as the signaled kernel's do), so the GEMMs run
    at cuBLAS's speed and no SM or copy engine moves anything afterwards. The next rank's region first and our own
    last: at t > 2 the ranks write into different owners at any time. With rs_transfer 'copy' the peers' runs go into
    the local staging matrix instead, and the copy engines push each after its GEMM (P2PReduceScatter.push_half).
    The bias (added once, after the sum, in Megatron) goes into our own region only, in cuBLAS's epilogue (addmm):
    the last run."""

    def __init__(self, runs):
        """runs: (first source row, rows, output [rows, N]) in order, our own region's last."""
        self.runs = runs

    @classmethod
    def into_owners(cls, handle, buf, rank, t, within_elems):
        m_local, n = buf.shape[0] // t, buf.shape[1]
        # slot `rank` of every owner's buffer, as a tensor (a peer's through its mapping), made once
        slots = [buf.view(t, m_local, n)[rank] if k == rank else
                 handle.get_buffer(k, (t, m_local, n), buf.dtype, within_elems)[rank] for k in range(t)]
        return cls([(k * m_local, m_local, slots[k]) for k in ring_peers(rank, t) + [rank]])

    def run(self, a, wt, bias, index: int):
        """Run `index`'s GEMM (wt: w.t()); the bias into the last run only."""
        first, rows, out = self.runs[index]
        rows = a.narrow(0, first, rows)
        if index == len(self.runs) - 1 and bias is not None:
            torch.addmm(bias, rows, wt, out=out)
        else:
            torch.mm(rows, wt, out=out)

    def __call__(self, a, w, bias):
        wt = w.t()
        for index in range(len(self.runs)):
            self.run(a, wt, bias, index)


class DeferredSum:
    """The second half of one P2PReduceScatter call: this rank's rows are the sum of the t partials in the
    plan's receive buffer once every peer's ARRIVED signal is in. Run exactly once, on the stream that reads
    the result: calling it sums them into a new [M/t, N] tensor (kernels/sum_slots.py: fp32, rounded once; at
    t = 2 NCCL's bf16 a + b exactly); `consume(kernel)` instead runs kernel(slots [t, M/t, N]) between the
    same wait and signal, for a kernel that reads the sum itself (the fused add + RMSNorm: one pass less)."""

    def __init__(self, op: P2PReduceScatter):
        self._op = op

    @property
    def done(self) -> bool:
        """Whether it ran (summed or consumed)."""
        return self._op is None

    def _op_to_run(self) -> P2PReduceScatter:
        if self._op is None:
            raise RuntimeError("overlap_tp gemm_rs (p2p): the deferred sum was already run")
        return self._op

    def _take(self) -> P2PReduceScatter:
        op, self._op = self._op_to_run(), None
        return op

    def __call__(self) -> torch.Tensor:
        op = self._take()
        out = torch.empty(op.m_local, op.n, dtype=op.buf.dtype, device=op.buf.device)
        op.finish_sum(out)
        return out

    def consume(self, kernel):
        self._take().finish(kernel)

    def into(self, out: torch.Tensor) -> torch.Tensor:
        """As calling it, into `out` ([M/t, N], contiguous, the slots' dtype and device): for a caller that handed `out`
        on before the sum ran (the token split sums an unlinked layer's fc2 at its bda, after the other half's MLP).
        The sum's launch does not check its output (SumSlots.launch_checked), so `out` is checked here."""
        op = self._op_to_run()
        if (out.shape != (op.m_local, op.n) or out.dtype != op.buf.dtype or out.device != op.buf.device
                or not out.is_contiguous()):
            raise ValueError(f"overlap_tp gemm_rs (p2p): the deferred sum goes into a contiguous [{op.m_local}, {op.n}] "
                             f"{op.buf.dtype} tensor on {op.buf.device}; got {tuple(out.shape)} {out.dtype} on "
                             f"{out.device}{'' if out.is_contiguous() else ', not contiguous'}")
        self._take().finish_sum(out)
        return out
