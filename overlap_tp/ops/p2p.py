"""Peer-to-peer transports through PyTorch symmetric memory (peer-mapped over NVLink), no collective.

GEMM+ReduceScatter (`P2PReduceScatter`): the GEMM's epilogue stores each region's rows straight into the
owning rank's receive buffer, then every rank sums the t partial slots it received. The GEMM is the signaled
Triton kernel (method 'signal', one persistent launch over a tile plan) or cuBLAS, one call per region
(method 'decompose': `RegionGemms`). With OverlapConfig.rs_transfer 'copy' the signaled GEMM stores the peers'
regions locally instead, one after another, and the copy engines push each to its owner behind the GEMM's group
counters (no SM moves the bytes).

GEMM+AllReduce (`P2PAllReduce`): the ReduceScatter above with each rank's sum written into its own region of a
symmetric gathered buffer, from where its peers pull it with the copy engines (the all-gather half).

AllGather+GEMM (`GatherBuffer`): every rank copies its shard into its own region of a symmetric gathered buffer and
tells its peers; each rank then pulls the peers' rows chunk by chunk from their buffers into its own with copy-engine
copies (no SM spent on the transfer), or with one kernel on the SMs a signaled GEMM leaves free (`signaled_pull`:
loads over NVLink, the handshakes and the chunks' flags as the kernel's own stores and spins). Waits and signals are
otherwise stream memory operations. The expert ops' exchanges, whose sizes change per routing, use the same two
protocols over row buffers sized for the largest routing seen: the dispatch pulls (`RowPull`), the combine pushes
(`RowPush`).

What it removes against per-group NCCL reduce-scatters (shared/DEVICE.md, contention section): the
collective's CTAs (no SM is taken from the GEMM), the partial's round trip through local HBM before
NCCL reads it back, and NCCL's own copy. What it adds: remote stores in the epilogue and one sum pass
over the received slots (read t x M/t x N, write M/t x N).

Both use one buffer and one-shot signals (overlap_tp/ops/sync.py: raised by the producer, reset by the
waiter), so every call, eager or a replay of a captured graph, runs the same protocol; each protocol's order
argument is written next to it. Buffers belong to their plan and live as long as it does, except the AllGather's
gathered buffer, which the plans of one shard shape share (GatherBuffer).
"""
import torch

from overlap_tp.kernels.peer_copy import SignaledPull
from overlap_tp.kernels.signaled_gemm import SignaledGemm, default_offsets
from overlap_tp.kernels.sum_slots import SlotsSummed, SumSlots
from overlap_tp.ops import comm, memops, replay, symmetric, watchdog
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

    def __init__(self, group, rank, t, m, n, dtype, device, config, programs, watched, instance=0, replays=True):
        """config.method 'signal': the signaled GEMM stores the tiles (programs: its grid); 'decompose': cuBLAS
        (RegionGemms). config.rs_transfer (resolved: 'epilogue' or 'copy') says whether the GEMMs store into the
        owners' buffers or the copy engines push what they stored locally (_build_pushes, push_half). instance: the
        plan's (OpPlan.instance), whose comm stream the pushes run on. replays: summed's eager calls replayed from
        graphs (P2PAllReduce, which replays its whole call, passes False)."""
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
            self._build_pushes(group, rank, t, m, n, dtype, device, config, programs, handle, within)
        else:
            tiles = p2p_plan(m, n, t, rank, config.block_m, config.block_n).tiles.to(device)
            offsets = torch.tensor([off // self.buf.element_size() for off in byte_offsets], dtype=torch.int64,
                                   device=device)
            default_offsets(device)
            gemm = SignaledGemm(tiles, programs, config, dst_offsets=offsets,
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

    def _build_pushes(self, group, rank, t, m, n, dtype, device, config, programs, handle, within):
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
        gemm = SignaledGemm(plan.tiles.to(device), programs, config, counters=counters, dst_offsets=offsets,
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
        caller's stream:  our region copied into the output, beside the pulls (another copy engine: in call 2 of
                          session 41 the copy after the pulls on one stream made the gather ~0.13 ms of 0.37)
        join:             the caller's stream waits for the comm stream
    Order argument: the ReduceScatter's and the GatherBuffer's, each on its own words (the claim is a stage whose copy
    the sum replaced). Our region is rewritten by the next call's sum only after that call's claim (every peer pulled
    it) and this call's join (our own copy of it is done). The bias goes into each region once, by its owner's GEMM
    (P2PReduceScatter's bias rows), so once into every row of the output."""

    def __init__(self, group, rank, t, m, n, dtype, device, config, programs, watched, instance=0):
        self.reduce_scatter = P2PReduceScatter(group, rank, t, m, n, dtype, device, config, programs, watched, instance,
                                               replays=False)
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
        whether it, or a view of it, is still referenced). detach() makes that alias in a fifth of view()'s host time
        (0.45 against 2.5 us on a CPU; the buffer never requires grad)."""
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
        the READY exchange, the flags and PULLED as the kernel's stores and spins (no stream memory operation: ~6 us
        per cross-GPU hop inside a graph, docs/perf/s34/README.md). Launched on the stream that would pull, after
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


def _symmetric_rows(group, rank, t, capacity, cols, dtype, device):
    """A symmetric [capacity, cols] row buffer of the expert exchanges, rendezvoused over the group: (the buffer, its
    handle, every rank's address of it, the bytes of a row)."""
    from torch.distributed import _symmetric_memory as symm_mem
    buf = symmetric.empty(capacity, cols, dtype=dtype, device=device, kind="expert exchange rows")
    handle = symm_mem.rendezvous(buf, group)
    within = buf.data_ptr() - handle.buffer_ptrs[rank]   # the same on every rank
    return buf, handle, [handle.buffer_ptrs[p] + within for p in range(t)], cols * buf.element_size()


class RowPull:
    """The expert dispatch's pulls: a symmetric copy of this rank's rows (a buffer of `capacity` rows of which a call
    fills the first T: T changes per call), from which the peers pull the rows the caller names (copy_rows), copy
    engines only. Per call, on the comm stream:
        start:     wait PULLED from every peer (it finished pulling our previous rows), reset; copy our rows into
                   the symmetric buffer; signal READY to every peer, wait READY from every peer, reset
        copy_rows: rows of a peer's buffer into ours (chunk by chunk)
        finish:    signal PULLED to every peer
    Order argument: GatherBuffer's."""

    PULLED, READY = 0, 1

    def __init__(self, group, rank, t, capacity, cols, dtype, device, describe):
        self.capacity = capacity
        self.buf, self.handle, self.peer_ptrs, self.row_bytes = _symmetric_rows(group, rank, t, capacity, cols, dtype,
                                                                                device)
        self.peer_ptrs[rank] = None   # never pulled from
        self.signals = PeerSignals(group, rank, t, device, initial=(1, 0), describe=describe,
                                   names=("PULLED", "READY"), graph_deadline=False)

    def start(self, stream: int, x: torch.Tensor, capturing: bool):
        self.signals.wait(stream, self.PULLED, capturing)
        memops.copy(stream, self.buf.data_ptr(), x.data_ptr(), x.numel() * x.element_size())
        self.signals.signal_then_wait(stream, self.READY, capturing)

    def copy_rows(self, stream: int, dst_ptr: int, peer: int, src_row: int, rows: int):
        """Rows [src_row, src_row + rows) of `peer`'s buffer to dst_ptr (a copy-engine copy)."""
        memops.copy(stream, dst_ptr, self.peer_ptrs[peer] + src_row * self.row_bytes, rows * self.row_bytes)

    def finish(self, stream: int):
        self.signals.signal(stream, self.PULLED)


class RowPush:
    """Rows pushed by the copy engines into the peers' receive buffers (symmetric [capacity, cols] per rank) for one
    (group, cols, dtype): the expert combine's exchange, whose sizes change per routing. Per call:
        comm stream, before the first push: wait CONSUMED from every peer (it copied our previous rows out), reset
        push:    rows of ours into a peer's buffer (copy engine, no SM), behind the GEMM's group counters
        comm stream, after the last push: signal ARRIVED to every peer
        the reader's stream: wait ARRIVED from every peer, reset; copy the received rows out; signal CONSUMED
    Order argument: P2PReduceScatter's, with CONSUMED for SUMMED: a peer raises our CONSUMED word for call i+1 only
    after its copy-out of call i+1, which waits for our ARRIVED of call i+1, raised after our reset of CONSUMED in
    call i+1; a peer raises our ARRIVED word for call i+1 only after it waited for our CONSUMED of call i, raised
    after our reset of ARRIVED in call i. CONSUMED starts raised: nothing was pushed before the first call."""

    CONSUMED, ARRIVED = 0, 1

    def __init__(self, group, rank, t, capacity, cols, dtype, device, describe):
        self.capacity = capacity
        self.buf, self.handle, self.peer_ptrs, self.row_bytes = _symmetric_rows(group, rank, t, capacity, cols, dtype,
                                                                                device)
        self.signals = PeerSignals(group, rank, t, device, initial=(1, 0), describe=describe,
                                   names=("CONSUMED", "ARRIVED"))

    def begin(self, stream: int, capturing: bool):
        self.signals.wait(stream, self.CONSUMED, capturing)

    def push(self, stream: int, peer: int, dst_row: int, src_ptr: int, rows: int):
        memops.copy(stream, self.peer_ptrs[peer] + dst_row * self.row_bytes, src_ptr, rows * self.row_bytes)

    def end(self, stream: int):
        self.signals.signal(stream, self.ARRIVED)

    def receive(self, stream: int, copies, capturing: bool):
        """On the reader's stream: wait ARRIVED, copy out (dst_ptr, row, rows) of our buffer, signal CONSUMED."""
        self.signals.wait(stream, self.ARRIVED, capturing)
        base = self.buf.data_ptr()
        for dst_ptr, row, rows in copies:
            memops.copy(stream, dst_ptr, base + row * self.row_bytes, rows * self.row_bytes)
        self.signals.signal(stream, self.CONSUMED)
