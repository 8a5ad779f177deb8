"""The synchronisation state machines, run on the CPU through a fake device.

The real op code records its stream operations (waits, writes, copies, collectives, kernel launches) into a
fake: that recording is what a CUDA graph captures, and replaying it is what a graph replay does. A small
simulator then runs the recorded programs of the GEMM, the comm stream and (for p2p) every rank, in random
interleavings that respect stream order and wait conditions, many times over, and checks the invariants:
- the counter protocol (SignaledReduction): a group's collective never starts before every tile of that
  group *in the same replay* is stored; counters are back at zero after each call; two plans interleaved
  keep their own counters; a capture that is recorded but never run (a failed capture) leaves the next
  eager call correct;
- the peer protocols (P2PReduceScatter, GatherBuffer, P2PAllReduce, and the expert combine's RowPush): no rank overwrites a buffer a
  peer has not consumed yet, and no rank consumes a buffer before every peer's data of the same call is in it; the
  same with GatherBuffer's pulls split over copy lanes (extra streams forked and joined per chunk), row by row;
- the cuBLAS paths over the copy engines (method decompose, transport p2p; each rank's caller stream and comm stream,
  with their forks and joins): AgGemmDecomposedP2P._run and the expert dispatch's chunks read only rows pulled in
  the same call, their local GEMMs enqueued before any peer wait; the expert combine pushes only rows its matmuls
  already wrote and copies out only rows pushed in the same call.
A mutation check proves the simulator can fail: the counter wait without its reset passes stale targets.
"""
import random

import pytest
import torch

from types import SimpleNamespace

from overlap_tp.ops import ag_gemm, comm, p2p_expert, p2p_gather, p2p_reduction, sync, watchdog
from overlap_tp.ops.config import OverlapConfig
from overlap_tp.ops.collective_reduction import SignaledReduction
from overlap_tp.ops.p2p_expert import RowPush
from overlap_tp.ops.p2p_reduction import P2PReduceScatter
from overlap_tp.ops.tile_plan import GROUP, make_plan, ring_peers


class Recorder:
    """Stands in for overlap_tp.ops.memops: appends each stream operation to its stream's program."""

    def __init__(self):
        self.programs = {}
        self.sequence = []   # (stream, op) in the order the host enqueued them, across streams

    def emit(self, stream, op):
        self.programs.setdefault(stream, []).append(op)
        self.sequence.append((stream, op))

    def wait_value(self, stream, address, value, equal=False):
        self.emit(stream, ("wait", address, value))

    def write_value(self, stream, address, value):
        self.emit(stream, ("write", address, value))

    def copy(self, stream, dst, src, nbytes):
        self.emit(stream, ("copy", dst, src, nbytes))

    def stream_waits_for(self, waiter, producer, event):
        """The waiter waits for everything enqueued on the producer so far (an event recorded there, then waited on)."""
        self.emit(waiter, ("after", producer, len(self.programs.get(producer, ()))))

    def MemOps(self, ops):
        """memops.MemOps: a batch built once, whose issue() records its operations in order."""
        recorder = self

        class Batch:
            def issue(self, stream):
                for op in ops:
                    recorder.emit(stream, tuple(op))
        return Batch()

    def take(self):
        programs, self.programs, self.sequence = self.programs, {}, []
        return programs


class Memory:
    """Words by address: the CPU tensors' own elements (int32)."""

    def __init__(self, *tensors):
        self.words = {}
        for tensor in tensors:
            for i in range(tensor.numel()):
                self.words[tensor.data_ptr() + 4 * i] = (tensor.view(-1), i)

    def __getitem__(self, address):
        tensor, i = self.words[address]
        return int(tensor[i])

    def __setitem__(self, address, value):
        tensor, i = self.words[address]
        tensor[i] = value


def run(programs, memory, act, rng, max_steps=100000, joins=False):
    """Run every stream's program to its end in a random interleaving: a wait runs once its word is >= its
    value (cyclic compare, as cuStreamWaitValue32 GEQ), a write sets the word, anything else calls act(op).
    joins: an ("after", producer, n) op runs once the producer ran its first n ops (an event wait); otherwise
    it is skipped (the programs of one stream per rank). Raises on a deadlock (no stream can move)."""
    position = {stream: 0 for stream in programs}
    for _ in range(max_steps):
        runnable = []
        for stream, program in programs.items():
            if position[stream] == len(program):
                continue
            op = program[position[stream]]
            if op[0] == "wait" and ((memory[op[1]] - op[2]) & 0xFFFFFFFF) >= 0x80000000:
                continue
            if joins and op[0] == "after" and position[op[1]] < op[2]:
                continue
            runnable.append(stream)
        if not runnable:
            if all(position[s] == len(p) for s, p in programs.items()):
                return
            raise AssertionError(f"deadlock: {[(s, programs[s][position[s]]) for s in programs if position[s] < len(programs[s])]}")
        stream = rng.choice(runnable)
        op = programs[stream][position[stream]]
        position[stream] += 1
        if op[0] == "write":
            memory[op[1]] = op[2]
        elif op[0] not in ("wait", "after"):
            act(stream, op)
    raise AssertionError("too many steps")


# ---------------------------------------------------------------------------------------------------
# The counter protocol of the signaled GEMM + per-group collectives
# ---------------------------------------------------------------------------------------------------

class FakeEngine(comm.CommEngine):
    """The real CommEngine's eager code path (stream memory operations) on named fake streams."""

    def __init__(self, recorder):
        self.device, self.stream, self.raw = torch.device("cpu"), "comm", "comm"
        self._events = {False: (None, None), True: (None, None)}
        self.recorder = recorder

    def capturing(self):
        return False

    def current(self):
        return "main"


class FakeCollectives:
    def __init__(self, recorder, plan_id):
        self.recorder, self.plan_id = recorder, plan_id

    def reduce_scatter(self, dst, src, stream=None):
        self.recorder.emit(stream, ("collective", self.plan_id, dst.data_ptr()))


def NoWatch():
    """A plan's Watched with the watchdog off (the recorder fixture's): its joins recorded, nothing watched."""
    return watchdog.Watched("a recorded plan", event=object())


def _reduction(recorder, plan_id, groups):
    plan = make_plan("row_slice", 512, 256, 2, 32, 64, groups)
    reduction = SignaledReduction(plan, torch.device("cpu"), OverlapConfig(method="signal"), 4, (0, 0),
                                  FakeCollectives(recorder, plan_id), "reduce_scatter", engine=FakeEngine(recorder))
    reduction.gemm = SimpleNamespace(   # the plan's launch (SignaledGemm.launch_checked)
        launch_checked=lambda a, w, staging, bias: recorder.emit("main", ("gemm", plan_id)))
    return reduction


def _record_call(recorder, reduction):
    """One call's programs, as a capture would record them: {stream: ops}."""
    plan = reduction.plan
    received = torch.empty(plan.out_shape)
    staging = torch.empty(plan.staging_shape)
    reduction.run(None, None, None, received, staging, NoWatch())()
    programs = recorder.take()
    # which group each collective belongs to, by its output rows
    dst_group = {received[c.dst_lo:c.dst_hi].data_ptr(): g for g, c in enumerate(plan.collectives)}
    return programs, dst_group


def _replay(reductions, recorded, rng, order):
    """Replay the recorded calls in `order` (plan indices); each call: the GEMM's per-tile increments on the
    main stream in a random interleaving with its comm program. Checks every collective's group is complete."""
    for index in order:
        reduction, (programs, dst_group) = reductions[index], recorded[index]
        plan = reduction.plan
        groups = plan.tiles[:, GROUP].tolist()
        done = [0] * plan.num_groups
        memory = Memory(reduction.counters)
        tiles = [("tile", g) for g in groups]
        rng.shuffle(tiles)   # a persistent GEMM finishes tiles in any order

        def act(stream, op):
            if op[0] == "gemm":
                return
            if op[0] == "tile":
                done[op[1]] += 1
                reduction.counters[op[1]] += 1
            elif op[0] == "collective":
                g = dst_group[op[2]]
                assert done[g] == plan.group_tiles[g], f"group {g} collective after {done[g]} of {plan.group_tiles[g]} tiles"

        streams = {"main": programs["main"] + tiles, "comm": programs["comm"]}
        run(streams, memory, act, rng)
        assert reduction.counters.tolist() == [0] * plan.num_groups   # every call ends where it started


@pytest.fixture
def recorder(monkeypatch):
    fake = Recorder()
    monkeypatch.setattr(comm, "memops", fake)
    monkeypatch.setattr(sync, "memops", fake)
    for module in (p2p_reduction, p2p_gather, p2p_expert):
        monkeypatch.setattr(module, "memops", fake)
    monkeypatch.setattr(watchdog, "memops", fake)   # Watched.join: an eager call's join through the plan's event
    monkeypatch.setattr(watchdog, "_instance", watchdog.Watchdog(0.0))
    return fake


@pytest.mark.parametrize("seed", range(5))
def test_replays_of_one_plan_never_pass_a_stale_target(recorder, seed):
    reduction = _reduction(recorder, 0, groups=3)
    recorded = _record_call(recorder, reduction)
    _replay([reduction], [recorded], random.Random(seed), [0] * 50)


@pytest.mark.parametrize("seed", range(3))
def test_two_plans_interleaved_keep_their_own_counters(recorder, seed):
    reductions = [_reduction(recorder, 0, groups=2), _reduction(recorder, 1, groups=4)]
    recorded = [_record_call(recorder, r) for r in reductions]
    rng = random.Random(seed)
    _replay(reductions, recorded, rng, [rng.randrange(2) for _ in range(60)])


def test_a_capture_that_never_runs_leaves_eager_calls_correct(recorder):
    reduction = _reduction(recorder, 0, groups=3)
    _record_call(recorder, reduction)                  # captured, then the capture failed: never executed
    recorded = _record_call(recorder, reduction)       # the next (eager) call
    _replay([reduction], [recorded], random.Random(0), [0] * 5)


def test_the_simulator_catches_a_wait_without_reset(recorder):
    """Mutation: the counter is waited on but not reset (targets that do not restart per call). The second
    replay's waits then pass on the first replay's counts, before its own tiles: the check must fire."""
    reduction = _reduction(recorder, 0, groups=3)
    waits = reduction.waits
    waits.eager = tuple(recorder.MemOps([("wait", address, target)])
                        for address, target in zip(waits.addresses, waits.targets))
    recorded = _record_call(recorder, reduction)
    with pytest.raises(AssertionError, match="collective after|counters|assert"):
        _replay([reduction], [recorded], random.Random(1), [0] * 20)


# ---------------------------------------------------------------------------------------------------
# The peer protocols (two ranks)
# ---------------------------------------------------------------------------------------------------

def _peer_signals(t, initial):
    """PeerSignals of t ranks over plain CPU words: ranks' words[slot, p], addresses wired like the
    symmetric-memory rendezvous would."""
    signals = []
    for rank in range(t):
        s = sync.PeerSignals.__new__(sync.PeerSignals)
        s.rank, s.t, s.slots, s.device = rank, t, len(initial), torch.device("cpu")   # eager waits: memops
        s.words = torch.tensor([[v] * t for v in initial], dtype=torch.int32)
        s.peers = [p for p in range(t) if p != rank]
        signals.append(s)
    for s in signals:
        s.remote = {p: signals[p].words.data_ptr() + 4 * s.rank for p in s.peers}
        s.local = {p: s.words.data_ptr() + 4 * p for p in s.peers}
        s.build_batches()
    return signals


def _signalling_sum(recorder, signals, rank, call, early=False):
    """The signalling sum (kernels/sum_slots.py with SlotsSummed) as its memory operations: the slots read, then (its
    last program) SUMMED into every peer. early: the mutation that raises SUMMED before the reads."""
    raised = [tuple(op) for op in signals.signal_ops(P2PReduceScatter.SUMMED)]
    for op in raised + [("sum", rank, call)] if early else [("sum", rank, call)] + raised:
        recorder.emit(rank, op)


def _run_p2p_reduce_scatter(recorder, t, seed, early=False):
    signals = _peer_signals(t, (1, 0))
    ranks = []
    for rank in range(t):
        op = P2PReduceScatter.__new__(P2PReduceScatter)
        op.signals = signals[rank]
        ranks.append(op)
    calls = 30
    rng = random.Random(seed + 100)
    kinds = [rng.choice(["whole", "halves", "consumed"]) for _ in range(calls)]
    programs = {}
    for rank, op in enumerate(ranks):
        for call in range(calls):   # recorded once per call: the same ops a graph replays every time
            store = lambda r=rank, c=call: recorder.emit(r, ("store", r, c))
            summing = lambda r=rank, c=call: _signalling_sum(recorder, signals[r], r, c, early)
            if kinds[call] == "whole":
                op.store_and_reduce(rank, store, summing, False)
            else:
                op.store_half(rank, store, False)
                if kinds[call] == "halves":
                    op.reduce_half(rank, summing, False, raises_summed=True)
                else:   # a kernel reading the slots (the fused add + RMSNorm), SUMMED by a stream write-value after it
                    op.reduce_half(rank, lambda r=rank, c=call: recorder.emit(r, ("sum", r, c)), False)
        programs[rank] = recorder.take()[rank]
    slots = [[-1] * t for _ in range(t)]   # slots[owner][source]: the call whose partial is there
    summed = [-1] * t

    def act(stream, op):
        kind, rank, call = op
        if kind == "store":
            for owner in range(t):
                assert summed[owner] == call - 1 or owner == rank, \
                    f"rank {rank} call {call} overwrote rank {owner}'s buffer before its sum of call {call - 1}"
                slots[owner][rank] = call
        else:
            assert slots[rank] == [call] * t, f"rank {rank} summed call {call} from {slots[rank]}"
            summed[rank] = call

    run(programs, Memory(*[s.words for s in signals]), act, random.Random(seed))
    assert summed == [calls - 1] * t


@pytest.mark.parametrize("t, seed", [(2, 0), (2, 1), (2, 2), (3, 3)])
def test_p2p_reduce_scatter_never_overwrites_or_reads_early(recorder, t, seed):
    """Calls in two halves (store_half, then reduce_half: async_op, the deferred sums: summed, or consumed by another
    kernel) and whole (store_and_reduce: gemm_rs summed at once, the ARRIVED signal and wait batched), mixed at random
    per call, every rank the same; the sums raise SUMMED at their own end."""
    _run_p2p_reduce_scatter(recorder, t, seed)


def test_the_simulator_catches_a_sum_raising_summed_before_its_reads(recorder):
    with pytest.raises(AssertionError, match="overwrote"):
        for seed in range(10):
            _run_p2p_reduce_scatter(recorder, 2, seed, early=True)


class RankEngine(FakeEngine):
    """FakeEngine with rank r's own streams: its caller's stream `r` and comm stream `comm r`."""

    def __init__(self, recorder, rank):
        super().__init__(recorder)
        self.stream = self.raw = f"comm {rank}"
        self.rank = rank

    def current(self):
        return self.rank


class _FakeWeight:
    def t(self):
        return self


def _run_push_reduce_scatter(recorder, t, seed, groups_per_peer=2, summed_wait=True, calls=25, regions=False):
    """rs_transfer 'copy' (P2PReduceScatter.push_half, then its reduce half: the plan's own code on every rank's caller
    and comm streams, with forks and joins), calls in two halves or whole at random, every rank the same. Method
    'signal': the GEMM's tiles complete in a random order behind its counters; `regions` (method 'decompose'): one
    GEMM per group (two "tiles" each, in order), each push behind a fork after its GEMM. Checks: a tile never
    overwrites staging rows its previous call has not pushed yet, nor our own slot before our previous sum; a push
    copies only tiles of its own call, complete, into an owner that summed the previous call; a sum sees every
    source's rows of its call."""
    signals = _peer_signals(t, (1, 0))
    pushes = groups_per_peer * (t - 1)
    own = pushes   # the own region's group
    ranks, counters = [], []
    for rank in range(t):
        op = P2PReduceScatter.__new__(P2PReduceScatter)
        op.signals, op.copy, op.join, op.watched, op.regions = signals[rank], True, None, NoWatch(), None
        op.engine = RankEngine(recorder, rank)
        words = torch.zeros(pushes + 1, dtype=torch.int32)
        counters.append(words)
        op.waits = comm.CounterWaits(words, [2] * pushes, unwaited=((own, 2),))   # two tiles per group
        peers = ring_peers(rank, t)
        # push g: (dst, src, bytes) as addresses that name (owner, source rank, part)
        op.pushes = tuple((1000 * peers[g // groups_per_peer] + 10 * rank + g % groups_per_peer, 0, 0)
                          for g in range(pushes))
        if not summed_wait:   # the mutation: pushes without the SUMMED wait
            real = signals[rank]
            op.signals = SimpleNamespace(
                wait=lambda stream, slot, capturing, real=real: None if slot == P2PReduceScatter.SUMMED else
                real.wait(stream, slot, capturing), signal=real.signal)
        ranks.append(op)
    rng = random.Random(seed + 100)
    whole = [rng.random() < 0.5 for _ in range(calls)]
    programs = {}
    for rank, op in enumerate(ranks):
        if regions:   # RegionGemms.run(a, wt, bias, g): group g's GEMM, `a` standing for the call
            op.regions = SimpleNamespace(run=lambda call, wt, bias, g, r=rank: [recorder.emit(r, ("tile", r, g, call))
                                                                                 for _ in range(2)])
        for call in range(calls):
            tiles = [("tile", rank, g, call) for g in range(pushes + 1) for _ in range(2)]
            rng.shuffle(tiles)

            def store(a, w, bias, r=rank, tiles=tiles):   # the signaled GEMM: tiles in any order
                for tile in tiles:
                    recorder.emit(r, tile)
            op.store = store
            join = op.push_half(call, _FakeWeight(), None, False)
            if not whole[call]:
                recorder.emit(rank, ("other work", rank, call))   # the wgrad, queued between the halves
            join()
            if whole[call]:   # summed(): the signalling sum
                op.reduce_half(rank, lambda r=rank, c=call: _signalling_sum(recorder, signals[r], r, c), False,
                               raises_summed=True)
            else:             # consumed by a kernel, SUMMED by a stream write-value
                op.reduce_half(rank, lambda r=rank, c=call: recorder.emit(r, ("sum", r, c)), False)
        for stream, program in recorder.take().items():
            programs[stream] = program
    tiles_done = {}                                         # (rank, group, call): tiles stored
    pushed = [[-1] * pushes for _ in range(t)]              # pushed[rank][g]: the last call pushed
    slots = [[[-1] * groups_per_peer for _ in range(t)] for _ in range(t)]   # slots[owner][source][part]: call
    summed = [-1] * t

    def act(stream, op):
        kind = op[0]
        if kind == "tile":
            _, rank, g, call = op
            if g == own:
                assert summed[rank] == call - 1, f"rank {rank} call {call} stored into its own slot before its sum"
                tiles_done[rank, g, call] = tiles_done.get((rank, g, call), 0) + 1
                if tiles_done[rank, g, call] == 2:
                    slots[rank][rank] = [call] * groups_per_peer
            else:
                assert pushed[rank][g] == call - 1, \
                    f"rank {rank} call {call} overwrote staging group {g} before pushing call {call - 1}"
                tiles_done[rank, g, call] = tiles_done.get((rank, g, call), 0) + 1
            counters[rank][g] += 1
        elif kind == "copy":
            owner, source, part = op[1] // 1000, op[1] % 1000 // 10, op[1] % 10
            g = next(g for g, push in enumerate(ranks[source].pushes) if push[0] == op[1])
            call = pushed[source][g] + 1
            assert tiles_done.get((source, g, call)) == 2, f"rank {source} pushed group {g} of call {call} early"
            assert summed[owner] == call - 1, f"rank {source} pushed into rank {owner} before its sum of {call - 1}"
            pushed[source][g] = call
            slots[owner][source][part] = call
        elif kind == "sum":
            _, rank, call = op
            assert slots[rank] == [[call] * groups_per_peer] * t, f"rank {rank} summed call {call} from {slots[rank]}"
            summed[rank] = call

    run(programs, Memory(*[s.words for s in signals], *counters), act, random.Random(seed), max_steps=400000,
        joins=True)
    assert summed == [calls - 1] * t


@pytest.mark.parametrize("t, seed, parts", [(2, 0, 2), (2, 1, 1), (3, 2, 2), (4, 3, 1), (4, 4, 2)])
@pytest.mark.parametrize("method", ["signal", "decompose"])
def test_p2p_reduce_scatter_by_copies_never_overwrites_or_reads_early(recorder, t, seed, parts, method):
    _run_push_reduce_scatter(recorder, t, seed, parts, regions=method == "decompose")


def test_the_simulator_catches_pushes_without_their_summed_wait(recorder):
    with pytest.raises(AssertionError, match="before its sum"):
        for seed in range(5):
            _run_push_reduce_scatter(recorder, 2, seed, 1, summed_wait=False)


def test_the_simulator_catches_region_pushes_without_their_fork(recorder, monkeypatch):
    """Mutation: the decompose path's push issued without the comm stream's fork after its GEMM."""
    monkeypatch.setattr(FakeEngine, "fork", lambda self, current, capturing: None)
    with pytest.raises(AssertionError, match="pushed group .* early"):
        for seed in range(5):
            _run_push_reduce_scatter(recorder, 2, seed, 1, regions=True)


def _gather_buffers(t, signals, m=1):
    """GatherBuffers of t ranks over CPU buffers [t regions of m rows, 4] int32, wired as the rendezvous would: rank
    p's own region in its own buffer is what the others pull p's rows from."""
    bufs = [torch.zeros(t * m, 4, dtype=torch.int32) for _ in range(t)]
    gathers = []
    for rank in range(t):
        g = p2p_gather.GatherBuffer.__new__(p2p_gather.GatherBuffer)
        g.rank, g.world, g.m, g.describe, g.signals = rank, t, m, "all_gather(test)", signals[rank]
        g.buf, g.base, g.row_bytes, g.region_bytes = bufs[rank], bufs[rank].data_ptr(), 16, 16 * m
        g._unreferenced = g._references()
        g.claimed = None
        g.own = [bufs[p].data_ptr() + p * 16 * m for p in range(t)]
        g.peers = ring_peers(rank, t)
        gathers.append(g)
    return gathers, bufs


def _pull_lists(gathers, chunks, by_peer=False):
    """Per rank, an AgGemm's one-lane pull list over its GatherBuffer (AgGemmSignaledCopyEngines._list_pulls: the
    plan's own code), with ready-flag words of its own: (the plans, the flag tensors). by_peer: chunk_by 'peer', each
    of `chunks` once per peer in the rank's ring order (ag_plan's chunk_peers)."""
    t = len(gathers)
    count = len(chunks) * (t - 1 if by_peer else 1)
    flags = [torch.zeros(count, dtype=torch.int32) for _ in gathers]
    plans = []
    for rank, (g, words) in enumerate(zip(gathers, flags)):
        plan = object.__new__(ag_gemm.AgGemmSignaledCopyEngines)
        plan.gather, plan.chunks, plan.chunk_peers = g, chunks, None
        if by_peer:
            plan.chunks = list(chunks) * (t - 1)
            plan.chunk_peers = tuple(p for p in ring_peers(rank, t) for _ in chunks)
        plan.ready = SimpleNamespace(addresses=[words.data_ptr() + 4 * c for c in range(count)])
        plan._list_pulls()
        plans.append(plan)
    return plans, flags


def _run_gather(recorder, t, seed, stage_waits=True, in_place=False, plan_pulls=False, by_peer=False):
    """30 calls per rank of GatherBuffer's steps (stage, ready, pull, finish: one stream per rank, the order the caller's
    stream and the forked comm stream give them), run in a random interleaving: a rank's staging copy must not land
    before every peer pulled its previous shard, and a rank's GEMM (check) must see every peer's shard of its call.
    in_place: the shard's producer claims our region and writes it there itself (a copy into the region after the
    claim, standing for the norm's kernel), and the stage that follows finds it in place (records nothing).
    plan_pulls: ready, pull and finish as AgGemm's one-lane pull list issues them (its last flag and PULLED batched);
    by_peer: that list cut by peer (chunk_by 'peer')."""
    signals = _peer_signals(t, (1, 0))
    gathers, bufs = _gather_buffers(t, signals)
    plans, flags = _pull_lists(gathers, [(0, 1)], by_peer) if plan_pulls else ([None] * t, [])
    calls = 30
    programs = {}
    for rank, g in enumerate(gathers):
        if not stage_waits:   # the mutation: the stage without its PULLED wait
            g.signals = type("NoPulledWait", (), {"wait": lambda self, *a: None,
                                                  "signal_then_wait": signals[rank].signal_then_wait,
                                                  "signal": signals[rank].signal})()
        for call in range(calls):
            if in_place:
                region = g.claim(rank, False)
                recorder.emit(rank, ("copy", g.own[rank], 0, 16))   # the producer's kernel writes the region
                before = len(recorder.programs[rank])
                g.stage(rank, region, False)
                assert len(recorder.programs[rank]) == before and g.claimed is None   # in place: no wait, no copy
                del region   # the next claim refuses while a view of the buffer is alive (the reference check)
            else:
                g.stage(rank, torch.full((1, 4), call, dtype=torch.int32), False)
            if plan_pulls:
                plans[rank]._transfers(rank, False)
            else:
                g.ready(rank, False)
                g.pull(rank, 0, 1)
            recorder.emit(rank, ("check", rank, call))
            if not plan_pulls:
                g.finish(rank)
        programs[rank] = recorder.take()[rank]
    act, published = _gather_checks(gathers, bufs)
    run(programs, Memory(*[s.words for s in signals], *flags), act, random.Random(seed))
    assert published == [calls - 1] * t


def _gather_checks(gathers, bufs):
    """The checks of a simulated AllGather run, as act(stream, op) for run(), and the list of each rank's last staged
    call: a rank's staging copy must not land before every peer pulled its previous shard, and a rank's GEMM ("check")
    must see every peer's shard of its call."""
    t = len(gathers)
    published = [-1] * t
    pulled = [[-1] * t for _ in range(t)]   # pulled[r][p]: the call of p's shard that r's buffer holds
    region = {bufs[r].data_ptr() + p * 16: (r, p) for r in range(t) for p in range(t)}

    def act(stream, op):
        if op[0] == "copy":
            r, p = region[op[1]]
            if r == p:   # rank p stages its shard into its own region, which its peers pull from
                for q in range(t):
                    assert q == p or pulled[q][p] == published[p], \
                        f"rank {p} overwrote its region before rank {q} pulled call {published[p]}"
                published[p] += 1
            else:        # rank r pulls peer p's region
                assert op[2] == gathers[p].own[p], "a pull reads the peer's own region"
                pulled[r][p] = published[p]
        elif op[0] == "check":
            _, rank, call = op
            assert published[rank] == call and all(pulled[rank][p] == call for p in range(t) if p != rank), \
                (rank, call, pulled[rank])
    return act, published


@pytest.mark.parametrize("t, seed", [(2, 0), (2, 1), (2, 2), (3, 3), (4, 4)])
def test_gather_buffer_never_overwrites_a_region_being_pulled_or_reads_early(recorder, t, seed):
    _run_gather(recorder, t, seed)


@pytest.mark.parametrize("t, seed", [(2, 0), (2, 1), (3, 2), (4, 3)])
def test_ag_gemm_pull_list_keeps_the_protocol(recorder, monkeypatch, t, seed):
    """AgGemm's one-lane pulls (the peers' READY, each chunk's copies and flag, the last flag batched with PULLED)
    under the same checks, staged and in place."""
    monkeypatch.setattr(ag_gemm, "memops", recorder)
    _run_gather(recorder, t, seed, plan_pulls=True)
    _run_gather(recorder, t, seed, plan_pulls=True, in_place=True)
    # chunk_by 'peer': one copy per chunk, each from one peer in ring order
    _run_gather(recorder, t, seed, plan_pulls=True, by_peer=True)
    _run_gather(recorder, t, seed, plan_pulls=True, in_place=True, by_peer=True)


def test_ag_gemm_pull_list_raises_pulled_after_the_last_copies(recorder, monkeypatch):
    """One call's program: READY exchanged, then per chunk the copies from the peer and the chunk's flag; the last
    chunk's flag and the PULLED signal to the peer form one batch, after every copy (a PULLED ahead of a copy would
    let the peer overwrite rows still being read)."""
    monkeypatch.setattr(ag_gemm, "memops", recorder)
    signals = _peer_signals(2, (1, 0))
    gathers, _ = _gather_buffers(2, signals, m=2)
    plans, flags = _pull_lists(gathers, [(0, 1), (1, 2)])
    plans[0]._transfers(0, False)
    ops = recorder.take()[0]
    flag = [flags[0].data_ptr() + 4 * c for c in range(2)]
    pulled = signals[0].remote[1] + 4 * 2 * p2p_gather.GatherBuffer.PULLED
    assert [op[0] for op in ops] == ["write", "wait", "write", "copy", "write", "copy", "write", "write"], ops
    assert ops[4] == ("write", flag[0], ag_gemm.READY) and ops[6:] == [("write", flag[1], ag_gemm.READY),
                                                                       ("write", pulled, 1)]


def test_ag_gemm_pull_list_of_a_one_rank_group_is_empty(recorder, monkeypatch):
    """t = 1 (a legal group): no chunk to pull and no peer to signal, so the plan's pull list is built (no last chunk
    to batch PULLED with) and a call issues nothing on the comm stream."""
    monkeypatch.setattr(ag_gemm, "memops", recorder)
    signals = _peer_signals(1, (1, 0))
    gathers, _ = _gather_buffers(1, signals, m=2)
    plans, _ = _pull_lists(gathers, [])
    plans[0]._transfers(0, False)
    assert recorder.take() == {}


def test_the_simulator_catches_a_stage_without_its_pulled_wait(recorder):
    with pytest.raises(AssertionError, match="overwrote its region"):
        for seed in range(20):
            _run_gather(recorder, 2, seed, stage_waits=False)


def _signaled_pulls(gathers, monkeypatch):
    """Per rank, the SM pulls' kernel (GatherBuffer.signaled_pull) as built for an AgGemm with one chunk: its tables
    (the peers' regions, the READY / PULLED words it spins on and raises), which _kernel_call_ops turns into the
    kernel's memory operations."""
    monkeypatch.setattr(p2p_gather, "watchdog", SimpleNamespace(
        watchdog=lambda: SimpleNamespace(timeout_s=0.0, open_mailbox=lambda: torch.zeros(1, dtype=torch.int64)),
        wait_code=lambda *a: 1))
    return [g.signaled_pull(1, [(0, g.m)], torch.zeros(1, dtype=torch.int32), "ag_gemm(test)") for g in gathers]


def _kernel_call_ops(pull, gather, rank, call, reset_before_pulled=True):
    """One call of the SM pull kernel (kernels/peer_copy.py) as the memory operations its programs make, in the order
    the kernel guarantees (its last program runs the tail after every program passed the waits and did its loads):
    READY into every peer, the waits on every peer's READY, the pulls, the GEMM's reads (its tiles wait for the
    chunk's flag, raised after the pulls), then our READY words reset and PULLED into every peer.
    reset_before_pulled=False: the mutation with PULLED ahead of the reset."""
    words, size = gather.signals.words.data_ptr(), gather.buf.element_size()

    def address(offsets):
        return [words + 4 * int(o) for o in offsets.tolist()]
    ops = [("write", a, 1) for a in address(pull.ready_out)]
    ops += [("wait", a, 1) for a in address(pull.ready_in)]
    lo, hi = pull.chunks.tolist()
    for src, dst in zip(pull.src_offsets.tolist(), pull.dst_offsets.tolist()):
        ops.append(("copy", gather.base + dst * size + lo * gather.row_bytes, gather.base + src * size + lo *
                    gather.row_bytes, (hi - lo) * gather.row_bytes))
    ops.append(("check", rank, call))
    reset = [("write", a, 0) for a in address(pull.ready_in)]
    pulled = [("write", a, 1) for a in address(pull.pulled_out)]
    return ops + (reset + pulled if reset_before_pulled else pulled + reset)


def _run_gather_kernel(recorder, monkeypatch, t, seed, in_place=False, reset_before_pulled=True):
    """_run_gather's checks with the pulls done by the SM pull kernel (its handshakes inside it) after each stage."""
    signals = _peer_signals(t, (1, 0))
    gathers, bufs = _gather_buffers(t, signals)
    pulls = _signaled_pulls(gathers, monkeypatch)
    calls = 30
    programs = {}
    for rank, g in enumerate(gathers):
        for call in range(calls):
            if in_place:
                region = g.claim(rank, False)
                recorder.emit(rank, ("copy", g.own[rank], 0, 16))   # the producer's kernel writes the region
                g.stage(rank, region, False)
                del region
            else:
                g.stage(rank, torch.full((1, 4), call, dtype=torch.int32), False)
            for op in _kernel_call_ops(pulls[rank], g, rank, call, reset_before_pulled):
                recorder.emit(rank, op)
        programs[rank] = recorder.take()[rank]
    act, published = _gather_checks(gathers, bufs)
    run(programs, Memory(*[s.words for s in signals]), act, random.Random(seed))
    assert published == [calls - 1] * t


@pytest.mark.parametrize("t, seed", [(2, 0), (2, 1), (3, 2), (4, 3)])
def test_sm_pull_kernel_keeps_the_gather_protocol(recorder, monkeypatch, t, seed):
    """The SM pulls' kernel resets our READY words at its end, not right after its wait as the stream memory
    operations do: still no rank overwrites a region a peer is pulling, every GEMM sees its call's rows, and no READY
    is lost (a lost one deadlocks the next call), staged and written in place; its tables address every peer's
    region and words once."""
    _run_gather_kernel(recorder, monkeypatch, t, seed)
    _run_gather_kernel(recorder, monkeypatch, t, seed, in_place=True)


def test_the_simulator_catches_a_pull_kernel_raising_pulled_before_its_reset(recorder, monkeypatch):
    """PULLED ahead of the READY reset lets a peer's READY of the next call land before the reset wipes it."""
    with pytest.raises(AssertionError, match="deadlock"):
        for seed in range(20):
            _run_gather_kernel(recorder, monkeypatch, 2, seed, reset_before_pulled=False)


@pytest.mark.parametrize("t, seed", [(2, 0), (2, 1), (3, 2), (4, 3)])
def test_gather_buffer_written_in_place_by_its_producer_never_overwrites_a_region_being_pulled(recorder, t, seed):
    """claim() is the stage's PULLED wait moved ahead of the producer: the producer's write never lands on a region a
    peer is still pulling, and every rank's GEMM sees every peer's rows of its call."""
    _run_gather(recorder, t, seed, in_place=True)


def test_the_simulator_catches_a_claim_without_its_pulled_wait(recorder):
    with pytest.raises(AssertionError, match="overwrote its region"):
        for seed in range(20):
            _run_gather(recorder, 2, seed, stage_waits=False, in_place=True)


def test_a_claimed_region_handed_another_tensor_is_copied_and_claims_wait_once(recorder):
    """A claim followed by a stage of some other tensor (the producer's rows went elsewhere): the stage copies it into
    the region without waiting again (the claim waited); a second claim before the stage waits nothing more."""
    signals = _peer_signals(2, (1, 0))
    g = _gather_buffers(2, signals)[0][0]
    g.claim(0, False)
    g.claim(0, False)
    waits = [op for op in recorder.take()[0] if op[0] == "wait"]
    assert len(waits) == 1, waits
    g.stage(0, torch.full((1, 4), 7, dtype=torch.int32), False)
    ops = recorder.take()[0]
    assert [op[0] for op in ops] == ["copy"] and ops[0][1] == g.own[0]
    held = g.gathered()   # a call's gathered input, still referenced: the next claim refuses to overwrite it
    with pytest.raises(RuntimeError, match="still referenced"):
        g.claim(0, False)
    del held
    g.claim(0, False)


def test_a_claim_in_a_failed_capture_is_forgotten(recorder):
    """A claim recorded into a capture that ended before its stage (a failed capture: the GPU ran none of it): the
    next eager claim, and an eager stage, wait for PULLED themselves instead of trusting it."""
    signals = _peer_signals(2, (1, 0))
    signals[0].graph_deadline = False   # GatherBuffer's (its waits under capture are the eager ones)
    g = _gather_buffers(2, signals)[0][0]
    g.claim(0, True)
    recorder.take()
    g.claim(0, False)
    assert [op[0] for op in recorder.take()[0]] == ["wait", "write"]   # PULLED waited for, and reset
    g.stage(0, torch.full((1, 4), 7, dtype=torch.int32), False)   # the eager claim is in force: no second wait
    assert [op[0] for op in recorder.take()[0]] == ["copy"]
    g.claim(0, True)
    recorder.take()
    g.stage(0, torch.full((1, 4), 7, dtype=torch.int32), False)
    assert [op[0] for op in recorder.take()[0]] == ["wait", "write", "copy"]


def _run_all_reduce(recorder, t, seed, ready_waits=True, calls=25):
    """gemm_ar over p2p (P2PAllReduce._issue: the plan's own code on every rank's caller and comm streams, with the
    fork and the join): the p2p ReduceScatter summed at once into our region of the gathered buffer (claimed first),
    then the peers' regions pulled into the output on the comm stream and our own copied on the caller's stream.
    Checks: the ReduceScatter's (no store into an owner's slots before its previous sum, a sum sees every source's
    partial of its call); the sum never lands on our region before every peer pulled, and we copied, the previous
    call's; a pull or our own copy reads the region of its own call; after the join the output holds every region of
    its call. Mutation: ready_waits=False, the pulls without the READY exchange's wait.
    The claim's PULLED wait is implied here: a peer raises ARRIVED for call c, which our sum of c waits for, only after
    its join of call c - 1, behind its pulls of our region (a claim without that wait passed every seed)."""
    rs_signals, gather_signals = _peer_signals(t, (1, 0)), _peer_signals(t, (1, 0))
    gathers, _ = _gather_buffers(t, gather_signals)
    outs = {}                                   # an output's address -> (rank, call, the output, kept alive)
    ops = []
    for rank in range(t):
        op = p2p_reduction.P2PAllReduce.__new__(p2p_reduction.P2PAllReduce)
        op.reduce_scatter = P2PReduceScatter.__new__(P2PReduceScatter)
        op.reduce_scatter.signals, op.reduce_scatter.copy = rs_signals[rank], False
        op.gather, op.engine, op.watched = gathers[rank], RankEngine(recorder, rank), NoWatch()
        g = gathers[rank]
        op.pulls = tuple((p * g.region_bytes, g.own[p], g.region_bytes) for p in g.peers)
        op.own_copy = (rank * g.region_bytes, g.own[rank], g.region_bytes)
        if not ready_waits:   # the mutation: READY raised, never waited for
            real = gather_signals[rank]
            g.signals = SimpleNamespace(wait=real.wait, signal=real.signal,
                                        signal_then_wait=lambda stream, slot, capturing, real=real: real.signal(
                                            stream, slot))
        ops.append(op)
    programs = {}
    for rank, op in enumerate(ops):
        for call in range(calls):
            out = torch.zeros(t, 4, dtype=torch.int32)
            outs[out.data_ptr()] = (rank, call, out)
            op.reduce_scatter.store = lambda a, w, bias, r=rank, c=call: recorder.emit(r, ("store", r, c))
            op.reduce_scatter._summing = lambda region, capturing, r=rank, c=call: (
                lambda: _signalling_sum(recorder, rs_signals[r], r, c))
            op._issue(rank, None, None, None, out, False)
            recorder.emit(rank, ("check", rank, call))
        programs.update(recorder.take())
    slots = [[-1] * t for _ in range(t)]        # slots[owner][source]: the call whose partial is there
    summed = [-1] * t                           # the call whose sum each rank's region holds
    read = [[-1] * t for _ in range(t)]         # read[r][p]: the call of p's region that r last pulled (or copied)
    filled = {}                                 # (rank, call): the regions of its output written
    region_of = {g.own[g.rank]: g.rank for g in gathers}

    def act(stream, op):
        kind = op[0]
        if kind == "store":
            _, rank, call = op
            for owner in range(t):
                assert summed[owner] == call - 1 or owner == rank, \
                    f"rank {rank} call {call} overwrote rank {owner}'s slots before its sum of call {call - 1}"
                slots[owner][rank] = call
        elif kind == "sum":
            _, rank, call = op
            assert slots[rank] == [call] * t, f"rank {rank} summed call {call} from {slots[rank]}"
            for q in range(t):
                assert read[q][rank] == call - 1, \
                    f"rank {rank} overwrote its region before rank {q} read call {call - 1} (read {read[q][rank]})"
            summed[rank] = call
        elif kind == "copy":
            dst, src = op[1], op[2]
            base = next(b for b in outs if b <= dst < b + 16 * t)
            rank, call, _ = outs[base]
            p = region_of[src]
            assert summed[p] == call, f"rank {rank} call {call} read rank {p}'s region holding call {summed[p]}"
            assert dst == base + 16 * p, "a region lands at its rank's rows"
            read[rank][p] = call
            filled.setdefault((rank, call), set()).add(p)
        elif kind == "check":
            _, rank, call = op
            assert filled.get((rank, call)) == set(range(t)), \
                f"rank {rank} call {call} ended with regions {filled.get((rank, call))}"

    run(programs, Memory(*[s.words for s in rs_signals + gather_signals]), act, random.Random(seed),
        max_steps=400000, joins=True)
    assert summed == [calls - 1] * t


@pytest.mark.parametrize("t, seed", [(2, 0), (2, 1), (3, 2), (4, 3)])
def test_p2p_all_reduce_never_overwrites_a_region_being_read_or_reads_early(recorder, t, seed):
    _run_all_reduce(recorder, t, seed)


def test_the_simulator_catches_all_reduce_pulls_without_the_ready_wait(recorder):
    _some_seed_fails(recorder, "read rank .* region holding call", lambda seed: _run_all_reduce(
        recorder, 2, seed, ready_waits=False))


class _FakeLanes(comm.CopyLanes):
    """CopyLanes over the simulator's streams: rank r's extra lanes are the streams (r, 1), (r, 2), ...; joined=False
    is the mutation that leaves the lanes' copies unjoined (what follows on the pulling stream need not wait)."""

    def __init__(self, rank, count, joined=True):
        self.count = count
        self.raws = [(rank, i) for i in range(1, count)]
        self._events = {capturing: [(None, None) for _ in self.raws] for capturing in (False, True)}
        self.joined = joined

    def run(self, stream, lo, hi, issue, capturing):
        if self.joined:
            return super().run(stream, lo, hi, issue, capturing)
        for lane, (raw, (a, b)) in enumerate(zip(self.raws, comm.near_equal_parts(lo, hi, self.count)[1:]), 1):
            comm.memops.stream_waits_for(raw, stream, None)
            issue(raw, a, b, lane)
        issue(stream, *comm.near_equal_parts(lo, hi, self.count)[0], 0)


def _run_gather_lanes(recorder, t, seed, lanes, rows=5, chunks=2, joined=True):
    """30 calls per rank of GatherBuffer's steps with each chunk's pulls split over `lanes` streams (CopyLanes: forked
    from the pulling stream, joined back), rows per region tracked one by one, run with the forks and joins honoured:
    no staging copy lands on a row a peer has not pulled yet, and a rank's GEMM (check) sees every row of every peer's
    shard of its call."""
    signals = _peer_signals(t, (1, 0))
    gathers, bufs = _gather_buffers(t, signals, m=rows)
    calls = 30
    programs = {}
    for rank, g in enumerate(gathers):
        split = _FakeLanes(rank, lanes, joined)
        for call in range(calls):
            g.stage(rank, torch.full((rows, 4), call, dtype=torch.int32), False)
            g.ready(rank, False)
            for lo, hi in comm.near_equal_parts(0, rows, chunks):
                g.pull(rank, lo, hi, split, False)
            recorder.emit(rank, ("check", rank, call))
            g.finish(rank)
        programs.update(recorder.take())
    published = [-1] * t
    pulled = [[[-1] * rows for _ in range(t)] for _ in range(t)]   # pulled[r][p][row]: the call of p's row r holds
    where = {bufs[r].data_ptr() + 16 * (p * rows + i): (r, p, i) for r in range(t) for p in range(t) for i in range(rows)}

    def act(stream, op):
        if op[0] == "copy":
            r, p, first = where[op[1]]
            count = op[3] // 16
            if r == p:   # rank p stages its shard (every row at once)
                assert count == rows
                for q in range(t):
                    assert q == p or pulled[q][p] == [published[p]] * rows, \
                        f"rank {p} overwrote its region before rank {q} pulled every row of call {published[p]}"
                published[p] += 1
            else:        # rank r pulls rows [first, first + count) of peer p's region
                assert op[2] == gathers[p].own[p] + 16 * first, "a pull reads the same rows of the peer's own region"
                for i in range(first, first + count):
                    pulled[r][p][i] = published[p]
        elif op[0] == "check":
            _, rank, call = op
            assert published[rank] == call and all(pulled[rank][p] == [call] * rows for p in range(t) if p != rank), \
                f"rank {rank}'s GEMM of call {call} ran before every row of its peers' shards arrived: {pulled[rank]}"

    run(programs, Memory(*[s.words for s in signals]), act, random.Random(seed), joins=True)
    assert published == [calls - 1] * t


@pytest.mark.parametrize("t, lanes, seed", [(2, 2, 0), (2, 2, 1), (2, 3, 2), (2, 8, 3), (3, 2, 4), (4, 3, 5)])
def test_gather_buffer_pulls_split_over_copy_lanes_keep_the_protocol(recorder, t, lanes, seed):
    _run_gather_lanes(recorder, t, seed, lanes)


def test_the_simulator_catches_copy_lanes_without_their_join(recorder):
    with pytest.raises(AssertionError, match="overwrote its region|before every row"):
        for seed in range(20):
            _run_gather_lanes(recorder, 2, seed, 2, joined=False)


@pytest.mark.parametrize("t, lanes", [(4, 1), (4, 3), (8, 7), (8, 3), (3, 2)])
def test_pulls_read_every_peer_in_ring_order_one_puller_per_source(recorder, t, lanes):
    """Each rank pulls its peers in ring order (rank+1 first), lane j starting j peers on: at the k-th copy of every
    lane, the t ranks' copies read t distinct ranks when there is one lane (no rank's rows are read by two pullers at
    once, as in rank order, where every puller read rank 0 first), and a rank's lanes read distinct peers at once; a
    chunk still reads every peer's rows exactly once."""
    gathers, bufs = _gather_buffers(t, _peer_signals(t, (1, 0)), m=lanes)
    owner = {g.own[p]: p for g in gathers for p in range(t)}
    reads = {}   # (rank, lane) -> the peers it reads, in issue order
    for rank, g in enumerate(gathers):
        g.pull(rank, 0, lanes, _FakeLanes(rank, lanes) if lanes > 1 else None, False)
        for stream, ops in recorder.take().items():
            lane = stream[1] if isinstance(stream, tuple) else 0
            reads[rank, lane] = [owner[op[2] - 16 * (stream[1] if isinstance(stream, tuple) else 0)]
                                 for op in ops if op[0] == "copy"]
    for rank in range(t):
        everything = sorted(p for lane in range(lanes) for p in reads[rank, lane])
        assert everything == sorted([p for p in range(t) if p != rank] * lanes)
        assert reads[rank, 0] == [(rank + i) % t for i in range(1, t)]
        for k in range(t - 1):
            assert len({reads[rank, lane][k] for lane in range(lanes)}) == min(lanes, t - 1)
    if lanes == 1:
        for k in range(t - 1):
            assert len({reads[rank, 0][k] for rank in range(t)}) == t


def test_copy_lanes_are_made_outside_a_capture():
    """The lanes' streams and events are plan state: made at an eager call, refused (named) inside a capture."""
    engine = comm.CommEngine.__new__(comm.CommEngine)
    engine.device, engine.stream, engine._lanes = torch.device("cpu"), "comm", {}
    engine.capturing = lambda: True
    assert engine.copy_lanes(1) is None   # one lane: the comm stream itself, nothing to make
    with pytest.raises(RuntimeError, match="copy lanes .2 streams. would be made during CUDA graph capture"):
        engine.copy_lanes(2)
    engine._lanes[2] = made = object()    # made by an eager call before the capture: handed out
    assert engine.copy_lanes(2) is made


def test_near_equal_parts():
    assert comm.near_equal_parts(0, 10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert comm.near_equal_parts(5, 7, 4) == [(5, 6), (6, 7)]      # no more parts than rows
    assert comm.near_equal_parts(3, 3, 2) == [(3, 3)]              # an empty range: one empty part
    assert comm.near_equal_parts(0, 8, 1) == [(0, 8)]


def test_gather_buffer_refuses_a_call_while_the_last_gathered_tensor_is_referenced(recorder):
    """The gathered tensor is the shape's shared buffer: the next stage would overwrite what the caller still holds."""
    g = _gather_buffers(2, _peer_signals(2, (1, 0)))[0][0]
    shard = torch.zeros(1, 4, dtype=torch.int32)
    g.stage(0, shard, False)
    kept = g.gathered()[:1]   # a view of it keeps it referenced too
    with pytest.raises(RuntimeError, match="still referenced"):
        g.stage(0, shard, False)
    del kept
    g.stage(0, shard, False)   # released: the next call goes on
    g.gathered()
    g.stage(0, shard, False)   # a result nobody kept


def _row_push_programs(recorder, t, rows, calls, begin=True):
    """Every rank's recorded RowPush calls: push `rows` rows to every peer, then copy out what the peers pushed.
    Returns (programs, receive buffers, outputs)."""
    signals = _peer_signals(t, (1, 0))
    bufs = [torch.zeros(t * rows, 4, dtype=torch.int32) for _ in range(t)]   # source s's rows at s * rows
    outs = [torch.zeros(t * rows, 4, dtype=torch.int32) for _ in range(t)]
    staging = [torch.zeros(rows, 4, dtype=torch.int32) for _ in range(t)]
    programs = {}
    for rank in range(t):
        push = RowPush.__new__(RowPush)
        push.signals, push.buf, push.row_bytes = signals[rank], bufs[rank], 4 * 4
        push.peer_ptrs = [buf.data_ptr() for buf in bufs]
        for call in range(calls):
            recorder.emit(rank, ("call", rank, call))
            if begin:
                push.begin(rank, False)
            for peer in range(t):
                if peer != rank:
                    push.push(rank, peer, rank * rows, staging[rank].data_ptr(), rows)
            push.end(rank)
            push.receive(rank, [(outs[rank].data_ptr() + s * rows * 16, s * rows, rows) for s in range(t) if s != rank],
                         False)
            recorder.emit(rank, ("check", rank, call))
        programs[rank] = recorder.take()[rank]
    return programs, signals, bufs


def _run_row_push(programs, signals, bufs, t, rows, seed):
    current = [0] * t
    arrived = [[-1] * t for _ in range(t)]    # arrived[o][s]: the call of s's rows in o's receive buffer
    consumed = [[-1] * t for _ in range(t)]   # consumed[o][s]: the call of s's rows that o copied out
    region = {bufs[o].data_ptr() + s * rows * 16: (o, s) for o in range(t) for s in range(t)}

    def act(stream, op):
        if op[0] == "call":
            current[op[1]] = op[2]
        elif op[0] == "copy" and stream != region.get(op[1], (stream,))[0]:   # a push into a peer's buffer
            owner, source = region[op[1]]
            assert consumed[owner][source] == current[source] - 1, \
                f"rank {source} call {current[source]} overwrote rows rank {owner} had not copied out"
            arrived[owner][source] = current[source]
        elif op[0] == "copy":                                                # a copy-out of our own buffer
            owner, source = region[op[2]]
            assert arrived[owner][source] == current[owner], \
                f"rank {owner} copied out call {current[owner]} from {arrived[owner][source]}"
            consumed[owner][source] = current[owner]
        elif op[0] == "check":
            _, rank, call = op
            assert all(consumed[rank][s] == call for s in range(t) if s != rank), (rank, call, consumed[rank])

    run(programs, Memory(*[s.words for s in signals]), act, random.Random(seed))


@pytest.mark.parametrize("t, seed", [(2, 0), (2, 1), (3, 2), (4, 3)])
def test_row_push_never_overwrites_unread_rows_or_reads_early(recorder, t, seed):
    """The expert combine's p2p exchange (RowPush): a rank pushes call i+1's rows into a peer's receive buffer only
    after the peer copied call i's out, and copies out only once every peer's rows of the same call are in."""
    programs, signals, bufs = _row_push_programs(recorder, t, rows=2, calls=30)
    _run_row_push(programs, signals, bufs, t, 2, seed)


def test_the_simulator_catches_a_push_without_its_wait(recorder):
    """Mutation: no wait for CONSUMED before pushing: some interleaving overwrites rows not yet copied out."""
    programs, signals, bufs = _row_push_programs(recorder, 2, rows=2, calls=30, begin=False)
    with pytest.raises(AssertionError, match="overwrote|copied out"):
        for seed in range(20):
            _run_row_push(programs, signals, bufs, 2, 2, seed)
            for s in signals:   # the next seed starts from the initial words
                s.words.copy_(torch.tensor([[1] * 2, [0] * 2], dtype=torch.int32))


class _OrderEngine(comm.CommEngine):
    """A CommEngine whose stream operations only record their order (no GPU)."""

    def __init__(self):
        self.device, self.stream, self.raw, self.log = torch.device("cuda", 0), "comm stream", "comm", []

    def capturing(self):
        return False

    def current(self):
        return "caller"

    def fork(self, current, capturing):
        self.log.append("fork")

    def join(self, current, capturing):
        self.log.append("join")

    def lower_flags(self, flags, stream):
        self.log.append(f"lower flags on {stream}")


@pytest.mark.parametrize("gemm_first", [True, False])
def test_transfers_then_gemm_enqueues_the_gemm_before_the_transfers_where_they_need_no_sm_it_holds(gemm_first):
    """With one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1) a comm-stream chain enqueued before the GEMM holds
    the GEMM's launch until the chain completes: gemm_first enqueues the GEMM right after the fork; without it
    (NCCL with no SM left free) the transfers go first. Either way the join, then the flags lowered on the caller's
    stream (behind every raise, whether or not a tile waited on it)."""
    engine = _OrderEngine()
    engine.transfers_then_gemm(lambda stream: engine.log.append(f"transfers on {stream}"),
                               lambda: engine.log.append("gemm"), None, None, gemm_first=gemm_first)
    middle = ["gemm", "transfers on comm"] if gemm_first else ["transfers on comm", "gemm"]
    assert engine.log == ["fork"] + middle + ["join", "lower flags on caller"]


def test_decomposed_allgather_forks_once_so_no_gather_waits_for_a_gemm(monkeypatch):
    """AgGemm's decompose method on NCCL (AgGemmDecomposedNccl): the comm stream forks once, after the local shard is
    in `gathered` (the in-place broadcasts send it from there) and before any GEMM; then gather c, join, GEMM c. A
    fork per chunk made each gather wait for the previous chunk's GEMM (no overlap at all)."""
    from overlap_tp.ops.ag_gemm import AgGemmDecomposedNccl
    engine = _OrderEngine()
    log = engine.log
    a_shard, w = torch.randn(4, 3), torch.randn(5, 3)
    gathered, out = torch.zeros(8, 3), torch.zeros(8, 5)
    engine.fork = lambda current, capturing: log.append(("fork", torch.equal(gathered[:4], a_shard)))

    class Coll:
        def all_gather_rows(self, gathered, src, lo, hi, stream=None):
            log.append(f"gather {lo}:{hi} on {stream}")
            gathered[4 + lo:4 + hi] = 1.0                 # the peer's rows

    plan = object.__new__(AgGemmDecomposedNccl)
    plan.t, plan.rank, plan.device, plan.engine, plan.coll, plan.bounds = 2, 0, torch.device("cpu"), engine, Coll(), \
        [(0, 2), (2, 4)]
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b, out: (log.append(f"gemm {tuple(a.shape)}"), real_mm(a, b, out=out)))
    plan._chunked(a_shard, w, gathered, out)
    assert log == [("fork", True), "gemm (4, 3)", "gather 0:2 on comm", "join", "gemm (2, 3)",
                   "gather 2:4 on comm", "join", "gemm (2, 3)"]
    assert torch.allclose(out, gathered @ w.t())


def test_decomposed_dispatch_forks_once_so_no_exchange_waits_for_a_matmul(monkeypatch):
    """a2a_gemm's decompose method: one fork before the local rows' matmuls; then exchange c, join, matmuls c."""
    from types import SimpleNamespace
    from overlap_tp.ops import expert
    engine = _OrderEngine()
    log = engine.log
    monkeypatch.setattr(comm, "comm_engine", lambda device: engine)
    monkeypatch.setattr(expert, "expert_mm", lambda a, w, pieces, outs: log.append(f"matmuls {pieces}"))

    class Coll:
        def exchange(self, sends, recvs, stream=None):
            log.append(f"exchange on {stream}")

    chunk = SimpleNamespace(sends=[(1, 0, 2)], recvs=[(1, 4, 6)])
    plan = SimpleNamespace(local=(2, 4, 0), gemm_groups=["local", "chunk 0", "chunk 1"], exchanges=[chunk, chunk])
    x, xr = torch.randn(4, 3), torch.zeros(8, 3)
    expert._dispatch_decomposed(x, None, xr, None, plan, Coll())
    assert log == ["fork", "matmuls local", "exchange on comm", "join", "matmuls chunk 0", "exchange on comm", "join",
                   "matmuls chunk 1"]
    assert torch.equal(xr[0:2], x[2:4])


class _RankEngine(comm.CommEngine):
    """The real CommEngine's eager fork and join (recorded event waits) between one rank's named streams."""

    def __init__(self, rank):
        self.device, self.stream, self.raw = torch.device("cpu"), f"comm{rank}", f"comm{rank}"
        self.main = f"main{rank}"
        self._events = {False: (None, None), True: (None, None)}

    def capturing(self):
        return False

    def current(self):
        return self.main


def _run_pulled_decomposed(recorder, monkeypatch, t, seed, chunks=2, joins_per_chunk=True, lanes=1, by_peer=False):
    """30 calls per rank of AgGemmDecomposedP2P._run (the cuBLAS path over the copy engines), each rank's caller
    stream and comm stream recorded with their forks and joins, the GEMMs recorded as reads of their rows; run in a
    random interleaving that respects every wait and every join. Checks: a GEMM of peer rows reads this call's rows,
    every pulled; a rank restages its shard only after every peer pulled the previous one; the local rows' GEMM is
    enqueued before any comm-stream wait on a peer (one hardware queue would otherwise hold its launch behind it).
    by_peer: chunk_by 'peer' (each peer's rows in `chunks`, pulled and multiplied peer by peer)."""
    from overlap_tp.ops import ag_gemm as ag
    m, calls = 4, 30
    signals = _peer_signals(t, (1, 0))
    gathers, bufs = _gather_buffers(t, signals, m)
    programs, first_order = {}, []
    for rank in range(t):
        plan = object.__new__(ag.AgGemmDecomposedP2P)
        plan.t, plan.rank, plan.gather, plan.watched = t, rank, gathers[rank], None
        plan.lanes = None if lanes == 1 else _FakeLanes(rank, lanes)   # each chunk's pulls over `lanes` streams
        plan.engine = _RankEngine(rank)
        plan.by_peer = by_peer
        plan.bounds = [(lo, min(m, lo + m // chunks)) for lo in range(0, m, m // chunks)]
        if not joins_per_chunk:   # the mutation: only the final join
            final = plan.engine.join
            joins = chunks * (t - 1 if by_peer else 1) + 1   # one per chunk (per peer where by_peer), then the last
            plan.engine.join = lambda current, capturing, n=[0]: (n.__setitem__(0, n[0] + 1),
                                                                  n[0] % joins == 0 and final(current, capturing))
        main = plan.engine.main
        monkeypatch.setattr(ag, "_mm", lambda x, wt, out, bias, main=main: recorder.emit(
            main, ("mm", x.data_ptr(), x.shape[0])))
        for call in range(calls):
            recorder.emit(main, ("call", rank, call))
            shard = torch.full((m, 4), call, dtype=torch.int32)
            out = torch.empty(t * m, 2)
            plan._run(shard, torch.zeros(2, 4), None, out)
            if call == 0:
                first_order = [(stream, op[0]) for stream, op in recorder.sequence]
                first_mm = first_order.index((main, "mm"))
                # (the fork's event wait may come first: it waits for what the caller's stream runs before the GEMM)
                first_wait = min(i for i, (stream, kind) in enumerate(first_order)
                                 if stream == plan.engine.raw and kind == "wait")
                assert first_mm < first_wait, first_order
        programs.update(recorder.take())
    current = [0] * t
    published = [-1] * t                                      # the call of p's shard in p's own region
    pulled = [[[-1] * m for _ in range(t)] for _ in range(t)]   # pulled[r][p][row]: the call of p's row in r's buffer
    where = {}                                                  # address of row i of region p of rank r's buffer
    for r in range(t):
        for p in range(t):
            for row in range(m):
                where[bufs[r].data_ptr() + (p * m + row) * 16] = (r, p, row)

    def act(stream, op):
        if op[0] == "call":
            current[op[1]] = op[2]
        elif op[0] == "copy" and op[1] in where:
            r, p, row = where[op[1]]
            rows = op[3] // 16
            if r == p:   # rank p stages its shard into its own region
                assert row == 0 and rows == m
                for q in range(t):
                    assert q == p or pulled[q][p] == [published[p]] * m, \
                        f"rank {p} restaged before rank {q} pulled call {published[p]}: {pulled[q][p]}"
                published[p] += 1
            else:        # rank r pulls rows [row, row + rows) of peer p's region
                assert op[2] == gathers[p].own[p] + row * 16, "a pull reads the peer's own region"
                for i in range(row, row + rows):
                    pulled[r][p][i] = published[p]
        elif op[0] == "mm" and op[1] in where:   # a GEMM of peer rows (the local GEMM reads the shard itself)
            r, p, row = where[op[1]]
            assert p != r, "the local rows' GEMM reads the shard, not the gathered buffer"
            got = pulled[r][p][row:row + op[2]]
            assert got == [current[r]] * op[2], f"rank {r} call {current[r]}: a GEMM read peer {p}'s rows of {got}"

    run(programs, Memory(*[s.words for s in signals]), act, random.Random(seed), joins=True)
    assert published == [calls - 1] * t


@pytest.mark.parametrize("t, seed, chunks, lanes", [(2, 0, 2, 1), (2, 1, 4, 1), (2, 2, 1, 1), (3, 3, 2, 1), (4, 4, 2, 1),
                                                   (2, 5, 2, 2), (2, 6, 1, 3), (3, 7, 2, 2)])
def test_pulled_decomposed_gemms_read_only_rows_pulled_in_the_same_call(recorder, monkeypatch, t, seed, chunks, lanes):
    _run_pulled_decomposed(recorder, monkeypatch, t, seed, chunks, lanes=lanes)


@pytest.mark.parametrize("t, seed, chunks", [(2, 0, 1), (2, 1, 2), (3, 2, 1), (4, 3, 2), (4, 4, 1)])
def test_pulled_decomposed_by_peer_reads_only_rows_pulled_in_the_same_call(recorder, monkeypatch, t, seed, chunks):
    """chunk_by 'peer': each peer's rows pulled (one copy per chunk) and multiplied in turn, under the same checks."""
    _run_pulled_decomposed(recorder, monkeypatch, t, seed, chunks, by_peer=True)


def test_the_simulator_catches_a_by_peer_gemm_without_its_join(recorder, monkeypatch):
    _some_seed_fails(recorder, "a GEMM read peer", lambda seed: _run_pulled_decomposed(
        recorder, monkeypatch, 3, seed, chunks=1, joins_per_chunk=False, by_peer=True))


def _some_seed_fails(recorder, match, run):
    """A mutation check: run(seed) fails with `match` for one of 20 seeds (random interleavings)."""
    with pytest.raises(AssertionError, match=match):
        for seed in range(20):
            run(seed)
            recorder.take()


def test_the_simulator_catches_a_chunk_gemm_without_its_join(recorder, monkeypatch):
    """Mutation: the caller's stream joins the comm stream only at the end, so a chunk's GEMMs may read rows not yet
    pulled in this call."""
    _some_seed_fails(recorder, "a GEMM read peer", lambda seed: _run_pulled_decomposed(
        recorder, monkeypatch, 2, seed, chunks=2, joins_per_chunk=False))


# ---------------------------------------------------------------------------------------------------
# The expert ops' cuBLAS path over the copy engines (method decompose, transport p2p)
# ---------------------------------------------------------------------------------------------------

def _expert_counts_for(t, seed, experts=2):
    """counts[ep, E] with empty and skewed entries (a rank receiving nothing from someone, an expert getting most)."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 6, (t, t * experts), generator=g)
    counts[0, 0] += 9
    counts[t - 1, -experts:] = 0
    return counts


def _row_addresses(tensors):
    """address of row i of tensor k -> (k, i), for [rows, 4] int32 tensors."""
    return {tensor.data_ptr() + 16 * i: (k, i) for k, tensor in tensors.items() for i in range(tensor.shape[0])}


def _dispatch_reads(t, bufs, capacity, xs, xrs, reader, local_rows=None):
    """The simulator's act() for the expert dispatch over RowPull buffers `bufs` (rank p's x of each call in xs, its
    xr in xrs, both by (rank, call)), and `staged` (the call of each rank's x in its symmetric buffer): every xr row
    an "mm" reads (but the call's local rows) must have been pulled in the same call, from the peer's x of that call;
    `reader` names the reads in the failure."""
    staged = [-1] * t
    pulled = {}                                         # (rank, call, xr row) -> the call of the rows pulled there
    xr_rows, x_of = _row_addresses(xrs), {x.data_ptr(): key for key, x in xs.items()}
    current = [0] * t

    def act(stream, op):
        if op[0] == "call":
            current[op[1]] = op[2]
        elif op[0] == "copy" and op[2] in x_of:          # RowPull.start: rank p's x into its symmetric buffer
            p, call = x_of[op[2]]
            assert op[1] == bufs[p].data_ptr()
            staged[p] = call
        elif op[0] == "copy":                            # a chunk's pull: peer rows into this rank's xr
            (rank, call), row = xr_rows[op[1]]
            peer = next(p for p in range(t) if p != rank and bufs[p].data_ptr() <= op[2] < bufs[p].data_ptr()
                        + capacity * 16)
            for i in range(op[3] // 16):
                pulled[rank, call, row + i] = staged[peer]
        elif op[0] == "mm":
            rank = int(stream[4:])
            call = current[rank]
            assert op[1] == xrs[rank, call].data_ptr()
            for lo, hi in op[2]:
                for i in range(lo, hi):
                    if local_rows is None or i not in local_rows[rank, call]:
                        got = pulled.get((rank, call, i))
                        assert got == call, f"rank {rank} call {call}: {reader} read xr row {i} holding {got}"
    return act, staged


def _run_expert_dispatch_decomposed(recorder, monkeypatch, t, seed, joins_per_chunk=True):
    """30 calls per rank of the dispatch's cuBLAS path over the copy engines (expert._dispatch_decomposed with a
    RowPull), each rank's caller and comm streams recorded with their forks and joins and the matmuls recorded as
    reads of their xr rows, a new routing every call; run in a random interleaving. Checks: a chunk's matmuls read only
    rows pulled in the same call, from the peer's x of that call; the local matmuls are enqueued before any peer wait."""
    from overlap_tp.ops import expert
    from overlap_tp.ops.moe_tile_plan import dispatch_plan, layout
    calls, capacity, parts = 30, 64, 2
    signals = _peer_signals(t, (1, 0))
    bufs = [torch.zeros(capacity, 4, dtype=torch.int32) for _ in range(t)]
    pulls = []
    for rank in range(t):
        pull = p2p_expert.RowPull.__new__(p2p_expert.RowPull)
        pull.capacity, pull.buf, pull.row_bytes, pull.signals = capacity, bufs[rank], 16, signals[rank]
        pull.peer_ptrs = [None if p == rank else bufs[p].data_ptr() for p in range(t)]
        pulls.append(pull)
    programs, xrs, xs, local_rows = {}, {}, {}, {}
    for rank in range(t):
        engine = _RankEngine(rank)
        if not joins_per_chunk:   # the mutation: the chunks' joins dropped (the final one kept)
            engine.join = lambda current, capturing, final=engine.join, n=[0]: (
                n.__setitem__(0, n[0] + 1), n[0] % (parts + 1) == 0 and final(current, capturing))
        monkeypatch.setattr(comm, "comm_engine", lambda device, engine=engine: engine)
        monkeypatch.setattr(expert, "expert_mm", lambda a, w, pieces, outs, main=engine.main: recorder.emit(
            main, ("mm", a.data_ptr(), tuple((p.src_lo, p.src_hi) for p in pieces if p.src_lo < p.src_hi))))
        for call in range(calls):
            counts = _expert_counts_for(t, 1000 * seed + call)
            lay = layout(counts, rank)
            plan = dispatch_plan(lay, 8, 16, 16, parts)
            x = torch.full((lay.tokens, 4), call, dtype=torch.int32)
            xr = torch.zeros(max(lay.rows, 1), 4, dtype=torch.int32)
            xs[rank, call], xrs[rank, call] = x, xr
            local_rows[rank, call] = set(range(plan.local[2], plan.local[2] + plan.local[1] - plan.local[0]))
            recorder.emit(engine.main, ("call", rank, call))
            expert._dispatch_decomposed(x, None, xr, None, plan, None, pulls[rank])
            if call == 0:
                order = [(stream, op[0]) for stream, op in recorder.sequence]
                first_wait = min(i for i, (stream, kind) in enumerate(order) if stream == engine.raw and kind == "wait")
                assert order.index((engine.main, "mm")) < first_wait, order
        programs.update(recorder.take())
    act, staged = _dispatch_reads(t, bufs, capacity, xs, xrs, "a matmul", local_rows)
    run(programs, Memory(*[s.words for s in signals]), act, random.Random(seed), joins=True)
    assert staged == [calls - 1] * t


@pytest.mark.parametrize("t, seed", [(2, 0), (2, 1), (3, 2), (4, 3)])
def test_expert_dispatch_decomposed_over_p2p_reads_only_rows_of_its_call(recorder, monkeypatch, t, seed):
    _run_expert_dispatch_decomposed(recorder, monkeypatch, t, seed)


def test_the_simulator_catches_a_dispatch_chunk_without_its_join(recorder, monkeypatch):
    _some_seed_fails(recorder, "a matmul read xr row", lambda seed: _run_expert_dispatch_decomposed(
        recorder, monkeypatch, 2, seed, joins_per_chunk=False))


def _run_expert_combine_decomposed(recorder, monkeypatch, t, seed, fork=True):
    """30 calls per rank of the combine's cuBLAS path over the copy engines (expert._combine_decomposed with a
    RowPush), as the dispatch's above. Checks: a push reads staging rows this call's matmuls already wrote (the fork
    after each group's matmuls); the rows copied into z were pushed in the same call."""
    from overlap_tp.ops import expert
    from overlap_tp.ops.moe_tile_plan import combine_plan, layout
    calls, capacity, parts = 30, 64, 2
    signals = _peer_signals(t, (1, 0))
    bufs = [torch.zeros(capacity, 4, dtype=torch.int32) for _ in range(t)]
    pushes = []
    for rank in range(t):
        push = RowPush.__new__(RowPush)
        push.capacity, push.buf, push.row_bytes, push.signals = capacity, bufs[rank], 16, signals[rank]
        push.peer_ptrs = [buf.data_ptr() for buf in bufs]
        pushes.append(push)
    programs, stagings, zs = {}, {}, {}
    for rank in range(t):
        engine = _RankEngine(rank)
        if not fork:   # the mutation: the pushes do not wait for the matmuls that wrote their rows
            engine.fork = lambda current, capturing: None
        monkeypatch.setattr(comm, "comm_engine", lambda device, engine=engine: engine)
        monkeypatch.setattr(expert, "expert_mm", lambda a, w, pieces, outs, main=engine.main: recorder.emit(
            main, ("mm", outs[0].data_ptr(), tuple((p.dst_lo, p.dst_lo + p.src_hi - p.src_lo) for p in pieces
                                                   if p.dst_buf == 0 and p.src_lo < p.src_hi))))
        for call in range(calls):
            lay = layout(_expert_counts_for(t, 1000 * seed + call), rank)
            plan = combine_plan(lay, 8, 16, 16, parts)
            staging = torch.zeros(max(plan.staging_rows, 1), 4, dtype=torch.int32)
            z = torch.zeros(max(lay.tokens, 1), 4, dtype=torch.int32)
            stagings[rank, call], zs[rank, call] = staging, z
            recorder.emit(engine.main, ("call", rank, call))
            expert._combine_decomposed(torch.zeros(1), None, staging, z, plan, None, pushes[rank])
        programs.update(recorder.take())
    written = {}                                         # (rank, call, staging row): written by its matmul
    received = {}                                        # (owner, buffer row) -> (source, call) pushed there
    staging_rows, z_rows = _row_addresses(stagings), _row_addresses(zs)
    current = [0] * t

    def act(stream, op):
        if op[0] == "call":
            current[op[1]] = op[2]
        elif op[0] == "mm":
            (rank, call), _ = staging_rows[op[1]]
            for lo, hi in op[2]:
                for i in range(lo, hi):
                    written[rank, call, i] = True
        elif op[0] == "copy" and op[2] in staging_rows:   # a push: staged rows into a peer's receive buffer
            (rank, call), row = staging_rows[op[2]]
            owner = next(o for o in range(t) if bufs[o].data_ptr() <= op[1] < bufs[o].data_ptr() + capacity * 16)
            dst_row = (op[1] - bufs[owner].data_ptr()) // 16
            for i in range(op[3] // 16):
                assert written.get((rank, call, row + i)), \
                    f"rank {rank} call {call}: pushed staging row {row + i} before its matmul wrote it"
                received[owner, dst_row + i] = call
        elif op[0] == "copy" and op[1] in z_rows:          # the copy-out of the peers' rows into z
            (rank, call), _ = z_rows[op[1]]
            row = (op[2] - bufs[rank].data_ptr()) // 16
            for i in range(op[3] // 16):
                assert received.get((rank, row + i)) == call, \
                    f"rank {rank} call {call}: copied out row {row + i} pushed in call {received.get((rank, row + i))}"

    run(programs, Memory(*[s.words for s in signals]), act, random.Random(seed), joins=True)


@pytest.mark.parametrize("t, seed", [(2, 0), (2, 1), (3, 2), (4, 3)])
def test_expert_combine_decomposed_over_p2p_pushes_written_rows_and_copies_out_its_call(recorder, monkeypatch, t,
                                                                                        seed):
    _run_expert_combine_decomposed(recorder, monkeypatch, t, seed)


def test_the_simulator_catches_a_push_without_its_fork(recorder, monkeypatch):
    _some_seed_fails(recorder, "before its matmul wrote it", lambda seed: _run_expert_combine_decomposed(
        recorder, monkeypatch, 2, seed, fork=False))


# ---------------------------------------------------------------------------------------------------
# The expert dispatch's signaled GEMM over the copy engines (method signal, transport p2p): the ready flags
# ---------------------------------------------------------------------------------------------------

def _dispatch_routing(t, seed, call, experts=2):
    """counts[ep, E] for call `call`: every third call a routing in which rank 0 receives nothing and the last rank
    sends nothing (rank 0's GEMM then has no tile, so no tile waits on its chunks' flags), the others skewed."""
    counts = _expert_counts_for(t, 1000 * seed + call, experts)
    if call % 3 == 1:
        counts[:, :experts] = 0
        counts[t - 1] = 0
    return counts


def _run_expert_dispatch_signaled(recorder, monkeypatch, t, seed, lowered_after_join=True):
    """30 calls per rank of the dispatch's signaled GEMM over the copy engines (expert._dispatch_signaled with a
    RowPull and ready flags shared by every call, as the op's _ExpertOp shares them), each rank's caller and comm
    streams recorded with their forks and joins; the GEMM recorded as, per chunk with tiles, a wait on the chunk's
    flag (the tiles' acquire spin) and the reads of its rows; a new routing every call, some with chunks that no
    tile waits on. Checks: every row a tile reads was pulled in the same call; the flags are lowered when a rank's
    streams have run to their end. lowered_after_join=False: the mutation that lowers the flags behind the GEMM
    only, before the join."""
    from overlap_tp.ops import expert
    from overlap_tp.ops.moe_tile_plan import dispatch_plan, layout, pulled_rows
    calls, capacity, parts, experts = 30, 64, 2, 2
    signals = _peer_signals(t, (1, 0))
    bufs = [torch.zeros(capacity, 4, dtype=torch.int32) for _ in range(t)]
    words = [torch.zeros(parts + 1, dtype=torch.int32) for _ in range(t)]   # _ExpertOp.words: groups + 1
    programs, xrs, xs = {}, {}, {}
    for rank in range(t):
        pull = p2p_expert.RowPull.__new__(p2p_expert.RowPull)
        pull.capacity, pull.buf, pull.row_bytes, pull.signals = capacity, bufs[rank], 16, signals[rank]
        pull.peer_ptrs = [None if p == rank else bufs[p].data_ptr() for p in range(t)]
        engine = _RankEngine(rank)
        if not lowered_after_join:
            def transfers_then_gemm(transfers, gemm, flags, watched, gemm_first, engine=engine):
                current = engine.current()
                engine.fork(current, False)
                gemm()
                transfers(engine.raw)
                engine.lower_flags(flags, current)
                engine.join(current, False)
            engine.transfers_then_gemm = transfers_then_gemm
        monkeypatch.setattr(comm, "comm_engine", lambda device, engine=engine: engine)
        for call in range(calls):
            lay = layout(_dispatch_routing(t, seed, call, experts), rank)
            plan = dispatch_plan(lay, 8, 16, 16, parts)
            x = torch.full((max(lay.tokens, 1), 4), call, dtype=torch.int32)
            xr = torch.zeros(max(lay.rows, 1), 4, dtype=torch.int32)
            xs[rank, call], xrs[rank, call] = x, xr
            copies = [pulled_rows(lay, exchange) for exchange in plan.exchanges]
            flags = comm.ReadyFlags(words[rank][:len(plan.exchanges)])

            def gemm_launch(a, w, y, copies=copies, flags=flags, main=engine.main):
                for c, chunk in enumerate(copies):
                    if chunk:   # the chunk's tiles: a spin on its flag, then their rows
                        recorder.emit(main, ("wait", flags.addresses[c], 1))
                        recorder.emit(main, ("mm", a.data_ptr(), tuple((row, row + rows) for _, _, row, rows in chunk)))
            state = SimpleNamespace(plan=plan, flags=flags, copies=copies, watched=None, gemm_first=True,
                                    gemm=gemm_launch)
            recorder.emit(engine.main, ("call", rank, call))
            expert._dispatch_signaled(x, None, xr, None, state, None, pull)
        programs.update(recorder.take())
    act, staged = _dispatch_reads(t, bufs, capacity, xs, xrs, "a tile")
    run(programs, Memory(*[s.words for s in signals], *words), act, random.Random(seed), joins=True)
    assert staged == [calls - 1] * t
    assert all(not w.any() for w in words), [w.tolist() for w in words]


@pytest.mark.parametrize("t, seed", [(2, 0), (2, 1), (2, 2), (3, 3), (4, 4)])
def test_expert_dispatch_signaled_over_p2p_reads_only_rows_of_its_call(recorder, monkeypatch, t, seed):
    """The flags are lowered after the join: a chunk's flag that no tile waits on (a chunk with no rows here, or a
    rank with no rows at all, whose GEMM does not run) is raised by the comm stream at a time the caller's stream
    does not otherwise wait for; lowered behind the GEMM alone, it could stay raised into the next call, whose
    tiles would then read the chunk's rows before they are pulled."""
    _run_expert_dispatch_signaled(recorder, monkeypatch, t, seed)


def test_the_simulator_catches_flags_lowered_before_the_join(recorder, monkeypatch):
    _some_seed_fails(recorder, "a tile read xr row", lambda seed: _run_expert_dispatch_signaled(
        recorder, monkeypatch, 2, seed, lowered_after_join=False))
