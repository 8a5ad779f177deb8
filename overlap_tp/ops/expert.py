"""MoE expert-parallel ops: the all-to-all dispatch overlapped with the grouped fc1 GEMM, and the grouped
fc2 GEMM overlapped with the all-to-all combine.

    a2a_gemm(x[T, H], counts[ep, E], w[L, N, H]) -> y[R, N]       (and xr[R, H] with return_received=True)
    gemm_a2a(h[R, F], counts[ep, E], w[L, H, F]) -> z[T, H]

x is this rank's routed tokens sorted by global expert (Megatron's `permute` output); counts[s, e] (CPU
int64, identical on every rank of the EP group: checked once per routing through the store unless the caller
says counts_agreed=True) the rows rank s routes to global expert e, E = ep * L;
rank r owns experts [r*L, (r+1)*L) and their weights w (nn.Linear layout per expert). xr is what
Megatron's alltoall dispatcher's all_to_all returns (source rank major, local expert minor, before its
sort_chunks_by_idxs): R = sum_s sum_l counts[s, r*L + l] rows, and y[j] = xr[j] @ w[l].T for the local
expert l of row j. gemm_a2a takes rows in that order and returns each h[j] @ w[l].T to the rank its token
came from, at the token's row of that rank's x (what the combine all_to_all returns, ready for
unpermute). Both are differentiable in their input and w; xr carries no gradient.

Methods (OverlapConfig.method):
  off        torch.distributed's all_to_all_single with split sizes from counts, and one cuBLAS matmul
             per (source rank, expert) segment (Megatron's path; the reference under gloo).
  decompose  the plan's parts (overlap_tp/ops/moe_tile_plan.py) with cuBLAS: gemm_a2a computes group g and sends
             it on the comm stream while group g+1 is computed; a2a_gemm computes the local rows, then
             each chunk as soon as the comm stream received it. Transports as for signal below: `nccl`, or
             `p2p` (the same copy-engine pulls and pushes, so cuBLAS's matmuls and no SM on communication).
  signal     one persistent Triton GEMM (kernels/signaled_gemm.py) over every local expert (tiles name
             their expert, plan field EXPERT). gemm_a2a: each group's tiles raise its
             counter; the comm stream waits on it (cuStreamWaitValue32, no SM) and exchanges the group's
             rows with every peer (ncclSend/ncclRecv in one group call), received straight into z;
             the local rows are stored into z by the GEMM. a2a_gemm: the comm stream exchanges chunk
             after chunk into xr and raises each chunk's ready flag; the GEMM computes the local rows
             first, then each chunk's tiles after spinning on its flag (with nccl, needs comm_sms >= 1: NCCL must
             have SMs that the spinning GEMM does not hold). Transport `nccl`: the capped communicator of
             overlap_tp/ops/nccl.py; under gloo, torch.distributed's batch_isend_irecv, with the kernel in
             the Triton CPU interpreter. Transport `p2p` (CUDA): the copy engines, no SM and no NCCL
             (overlap_tp/ops/p2p_expert.py): a2a_gemm pulls each chunk from the peers' symmetric copies of their x
             (RowPull), gemm_a2a pushes each group's staged rows into the peers' receive buffers, which
             each rank copies into z after the join (RowPush); the buffers belong to the op, sized for the
             most tokens a rank has had (regrown, collectively, when a routing needs more).
  auto       `off`, with a warning: the ops alone cannot know whether the overlap pays on this routing and
             interconnect. The MoE layer (overlap_tp/megatron/moe_auto.py) resolves `auto` itself: it times
             off, signal and decompose in its first calls and keeps the fastest.
`groups` is the number of parts per peer (an int, or "auto": about 16 MB per group on the busiest
rank); `schedule` does not apply. Unset fields are resolved for the expert ops (ops/resolve.py: groups 2, transport
nccl, comm_sms 4 on nccl and 0 on p2p). The backward runs the mirrored op with each expert's weight
transposed as a view (`transposed`: the kernel reads it in place, no copy) and the grouped wgrad with
cuBLAS, accumulated per (source, expert) segment in place.
"""
from collections import OrderedDict
from typing import Optional

import torch
import torch.distributed as dist

from overlap_tp.kernels.expert_row_tiles import dispatch_row_tiles
from overlap_tp.kernels.signaled_gemm import SignaledGemm, default_offsets, tma_unsupported_reason, weight_layout
from overlap_tp.ops import comm
from overlap_tp.ops.plan_base import check_not_capturing, device_properties, gemm_programs, warn_once
from overlap_tp.ops.config import OverlapConfig
from overlap_tp.ops.moe_tile_plan import (EXPERT_RASTER_M, Layout, combine_plan, dispatch_plan, layout, parts_per_peer,
                                          pulled_rows, pushed_rows)
from overlap_tp.ops.p2p_expert import RowPull, RowPush
from overlap_tp.ops.resolve import resolve
from overlap_tp.ops.tile_plan import MAX_AUTO_GROUPS
from overlap_tp.ops.watchdog import Watched

# offsets between the staging matrix and z are used as 16-element aligned by the kernel (16-byte stores)
OFFSET_ALIGNMENT = 16


# ---------------------------------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------------------------------

def check_counts(counts, ep: int, op: str):
    if not (isinstance(counts, torch.Tensor) and counts.device.type == "cpu" and counts.dtype == torch.int64
            and counts.dim() == 2):
        raise ValueError(f"{op}: counts must be a CPU int64 tensor [ep, E], got "
                         + (f"{counts.dtype} {tuple(counts.shape)} on {counts.device}"
                            if isinstance(counts, torch.Tensor) else type(counts).__name__))
    if counts.shape[0] != ep:
        raise ValueError(f"{op}: counts is [{counts.shape[0]}, {counts.shape[1]}] but the EP group has {ep} ranks")
    if counts.shape[1] == 0 or counts.shape[1] % ep:
        raise ValueError(f"{op}: E={counts.shape[1]} experts is not a positive multiple of ep={ep}")


class Routing:
    """What every call derives from one routing's counts on this rank: its checks passed, the layout, the parts
    per peer for each (groups, row bytes), and the key plans and agreements are cached by. Built once per
    distinct routing (`routing`), so a step's four expert calls (forward and backward of both ops) share it:
    each small CPU tensor op costs tens of microseconds on the GPU hosts, and the four calls repeated them."""

    def __init__(self, counts: torch.Tensor, rank: int, key):
        self.counts, self.key, self.layout = counts, key, layout(counts, rank)
        self.device_counts = None   # the same counts on the GPU, where the caller has them (routing())
        self._parts = {}

    def parts(self, groups, row_bytes: int) -> int:
        if (groups, row_bytes) not in self._parts:
            self._parts[groups, row_bytes] = parts_per_peer(self.layout.counts, groups, row_bytes)
        return self._parts[groups, row_bytes]


_routings = OrderedDict()


def routing(counts, ep: int, rank: int, op: str, device_counts: Optional[torch.Tensor] = None) -> Routing:
    """counts checked (check_counts; values once per distinct routing) and this rank's Routing (cached, the 64
    most recent). device_counts: the same counts on the GPU (the caller guarantees the values; shape, dtype and
    device are checked), kept on the Routing: the dispatch's tile table is then built from them on the GPU without
    copying counts up (_ExpertState)."""
    check_counts(counts, ep, op)
    key = (counts.numpy().tobytes(), tuple(counts.shape))

    def build():
        route = Routing(counts.clone(), rank, key)
        if min(map(min, route.layout.counts)) < 0:
            raise ValueError(f"{op}: counts has negative entries")
        return route
    route = _cached(_routings, key + (rank,), build, 64)
    if device_counts is not None:
        if (device_counts.shape != counts.shape or device_counts.dtype != torch.int64 or not device_counts.is_cuda
                or not device_counts.is_contiguous()):
            raise ValueError(f"{op}: device_counts must be a contiguous CUDA int64 tensor shaped like counts "
                             f"{tuple(counts.shape)}, got {device_counts.dtype} {tuple(device_counts.shape)} on "
                             f"{device_counts.device}")
        route.device_counts = device_counts
    return route


def check_inputs(op: str, a, w, counts, rows: int, rows_name: str, out_name: str):
    """a [rows, K] and w [L, n, K] for the grouped GEMM a @ w[l].T; a ValueError names the broken rule."""
    if a.dim() != 2 or w.dim() != 3:
        raise ValueError(f"{op}: expected a 2-D input and w [L, {out_name}, K]; got {tuple(a.shape)} and "
                         f"w{tuple(w.shape)}")
    experts = counts.shape[1] // counts.shape[0]
    if w.shape[0] != experts:
        raise ValueError(f"{op}: w holds {w.shape[0]} experts, counts gives this rank E/ep = {experts}")
    if w.shape[2] != a.shape[1]:
        raise ValueError(f"{op}: inner dimensions differ: input{tuple(a.shape)} and w{tuple(w.shape)} "
                         "(w is [L, out, in], nn.Linear layout per expert)")
    if a.shape[0] != rows:
        raise ValueError(f"{op}: the input has {a.shape[0]} rows but counts gives {rows} ({rows_name})")
    if a.dtype not in (torch.bfloat16, torch.float16) or w.dtype != a.dtype:
        raise ValueError(f"{op}: input and w must both be bf16 or fp16; got {a.dtype} and {w.dtype}")
    if a.device != w.device:
        raise ValueError(f"{op}: the input is on {a.device} but w is on {w.device}")
    if not a.is_contiguous() or weight_layout(w) is None:
        raise ValueError(f"{op}: the input must be contiguous and w row-major (or the transposed view of a "
                         f"row-major [L, in, out] tensor)")
    if a.is_cuda and a.device.index != torch.cuda.current_device():
        raise ValueError(f"{op}: the input is on {a.device} but this rank's current CUDA device is "
                         f"cuda:{torch.cuda.current_device()} (one GPU per rank, set with torch.cuda.set_device)")


def resolve_method(op: str, config: OverlapConfig, a, w) -> str:
    """The method that runs, checked to be runnable."""
    if config.method == "auto":
        warn_once(f"overlap_tp {op}: method='auto' runs 'off' (the expert ops alone do not tune; OverlapMoELayer "
                  f"resolves auto by timing off, signal and decompose)")
        return "off"
    if config.method in ("signal", "decompose"):
        if config.transport not in ("nccl", "p2p"):
            raise ValueError(f"{op}: transport={config.transport!r} is not implemented for the expert ops; "
                             "use transport='nccl' or 'p2p'")
        if config.transport == "p2p" and not a.is_cuda:
            raise ValueError(f"{op}: transport='p2p' needs CUDA tensors (symmetric memory)")
    if config.method == "signal":
        reason = tma_unsupported_reason(a, w)
        if reason is None and a.is_cuda and device_properties(a.device).major < 9:   # asked once per device
            reason = f"the signaled GEMM needs TMA (compute capability >= 9.0), {torch.cuda.get_device_name(a.device)} lacks it"
        if reason is not None:
            raise ValueError(f"{op}: method='signal' cannot run: {reason}")
        if op == "a2a_gemm" and a.is_cuda and config.transport == "nccl" and config.comm_sms < 1:
            raise ValueError("a2a_gemm: method='signal' needs comm_sms >= 1: the GEMM spins on ready flags that "
                             "NCCL kernels raise, so NCCL must have SMs the GEMM does not hold")
    return config.method


# ---------------------------------------------------------------------------------------------------
# Pieces shared by the methods
# ---------------------------------------------------------------------------------------------------

def expert_mm(a, w, pieces, outs):
    """outs[p.dst_buf][dst rows] = a[p's rows] @ w[p.expert].T for every piece (cuBLAS, one call each)."""
    for p in pieces:
        if p.src_lo < p.src_hi:
            torch.mm(a[p.src_lo:p.src_hi], w[p.expert].t(), out=outs[p.dst_buf][p.dst_lo:p.dst_lo + p.src_hi - p.src_lo])


def expert_wgrad(grad, inp, lay: Layout):
    """dw[l] = sum over the source ranks s of grad[seg(s, l)].T @ inp[seg(s, l)], [L, grad columns, inp
    columns]: accumulated segment by segment in place (no copy of the segments; one rounding per source
    segment, as accumulating micro-batches does); an expert that received nothing gets zeros."""
    dw = torch.empty(lay.experts, grad.shape[1], inp.shape[1], dtype=inp.dtype, device=inp.device)
    written = set()
    for p in lay.segments:
        if p.src_lo == p.src_hi:
            continue
        g, a = grad[p.src_lo:p.src_hi].t(), inp[p.src_lo:p.src_hi]
        if p.expert in written:
            dw[p.expert].addmm_(g, a)
        else:
            torch.mm(g, a, out=dw[p.expert])
            written.add(p.expert)
    for l in set(range(lay.experts)) - written:
        dw[l].zero_()
    return dw


def transposed(w: torch.Tensor, config: OverlapConfig) -> torch.Tensor:
    """Every expert's w[l].T for a backward GEMM: the view, which cuBLAS and the signaled kernel read in
    place, except with several experts whose inner size is not a multiple of block_k (the kernel's K tail
    box would overhang into the next expert): then a copy."""
    wt = w.transpose(1, 2)
    return wt if w.shape[0] == 1 or w.shape[1] % config.block_k == 0 else wt.contiguous()


def all_to_all_rows(inp, rows: int, out_splits, in_splits, group):
    """torch.distributed's all_to_all_single of row blocks (Megatron's dispatch/combine). A one-rank group moves
    nothing: inp itself, as Megatron's all_to_all returns it (NCCL would copy every row and cost a launch)."""
    if len(in_splits) == 1:
        return inp
    out = torch.empty(rows, inp.shape[1], dtype=inp.dtype, device=inp.device)
    dist.all_to_all_single(out, inp, list(out_splits), list(in_splits), group=group)
    return out


def _exchange(coll, exchange, send_buf, recv_buf, stream):
    coll.exchange([(peer, send_buf[lo:hi]) for peer, lo, hi in exchange.sends],
                  [(peer, recv_buf[lo:hi]) for peer, lo, hi in exchange.recvs], stream=stream)


class _ExpertOp:
    """What a signaled expert op keeps across routings, for one (op, output columns, config, group, device): the
    synchronisation words (dispatch: chunk ready flags, raised to 1 and lowered behind the GEMM; combine: group
    counters, waited on and reset to 0 by the comm stream), sized for the most groups a plan of this config can
    have, the persistent grid and the watchdog's record. Every call leaves the words as it found
    them and the calls are ordered on the streams, so one op's calls share them as a dense plan's calls do: a
    new routing (every step) then builds its plan and table only."""

    def __init__(self, kind, config, device, describe):
        groups = config.groups if isinstance(config.groups, int) and not isinstance(config.groups, bool) \
            else MAX_AUTO_GROUPS
        self.words = torch.zeros(groups + 1, dtype=torch.int32, device=device)
        self.programs = gemm_programs(device, config)
        # the dispatch's NCCL exchanges can run beside the GEMM only on SMs its grid leaves free; copy-engine pulls
        # need none
        self.gemm_first = config.comm_sms > 0 or config.transport == "p2p"
        self.describe = describe
        self.row_buffers = {}   # transport 'p2p': (cols, dtype) -> RowPull (dispatch) or RowPush (combine)
        if device.type == "cuda":
            default_offsets(device)
            if kind == "gemm_a2a":
                comm.comm_engine(device).prepare_graph_waits()
        self.watched = Watched(describe, (("flags" if kind == "a2a_gemm" else "counters", self.words),)) \
            if device.type == "cuda" else None

    def row_buffer(self, kind, group, lay: Layout, cols: int, dtype, device):
        """The p2p transport's row buffer of this op for `cols` columns (RowPull for the dispatch, RowPush for the
        combine), holding at least the most tokens any rank of this routing has. Built at the first use and
        rebuilt larger when a routing needs more rows, to twice the old size at least: every rank sees the same
        counts (agreed), so every rank rebuilds at the same call, as the build (a rendezvous) needs."""
        needed = max(sum(row) for row in lay.counts)
        current = self.row_buffers.get((cols, dtype))
        if current is None or current.capacity < needed:
            check_not_capturing(device, f"{kind} (p2p) with a routing larger than its buffers")
            capacity = max(needed, 2 * current.capacity if current is not None else 0, 1)
            cls = RowPull if kind == "a2a_gemm" else RowPush
            current = self.row_buffers[cols, dtype] = cls(group, lay.rank, lay.ep, capacity, cols, dtype, device,
                                                          self.describe + " (p2p)")
        return current


class _ExpertState:
    """A signaled expert op's tile plan on the device, for one routing (counts): its table and the kernel
    launcher over it, with the op's words and watchdog record (_ExpertOp). Built once per routing; calls with
    the same counts (static routing: capacity factor with padding) reuse it, which is what lets them be captured
    in a CUDA graph."""

    def __init__(self, kind, plan, op: _ExpertOp, device, config, counts, offsets=None, device_counts=None):
        check_not_capturing(device, f"{kind} with new routing counts")
        self.op, self.plan, self.words, self.watched, self.gemm_first = op, plan, op.words, op.watched, op.gemm_first
        used = len(plan.exchanges) if kind == "a2a_gemm" else len(plan.group_tiles)
        assert used <= self.words.numel(), (kind, used, self.words.numel())
        if kind == "a2a_gemm":   # the flags this plan raises, lowered behind its GEMM
            self.flags = comm.ReadyFlags(self.words[:used])
        else:   # the waits of the groups with an exchange; the last group's tiles (the local rows, stored straight
            # into z) are not waited on, and its counter is reset behind the GEMM (CounterWaits says why)
            exchanged = len(plan.exchanges)
            self.waits = comm.CounterWaits(self.words, plan.group_tiles[:exchanged],
                                           unwaited=[(g, plan.group_tiles[g])
                                                     for g in range(exchanged, len(plan.group_tiles))])
        # transport 'p2p': per chunk / group, the copies of the exchange (moe_tile_plan.pulled_rows / pushed_rows)
        rows = pulled_rows if kind == "a2a_gemm" else pushed_rows
        self.copies = [rows(plan.layout, exchange) for exchange in plan.exchanges] \
            if config.transport == "p2p" else None
        if kind == "a2a_gemm" and device.type == "cuda":
            # the dispatch's table is needed at once (the GPU waits for its GEMM): built on the GPU from the counts,
            # one small copy and one launch, cheaper than the host's numpy build and the table's copy
            n_tiles = -(-plan.n // plan.block_n)
            if device_counts is None or device_counts.device != device:
                device_counts = host_table_to(counts, device)
            self.tiles = dispatch_row_tiles(device_counts, plan.layout.rank, plan.layout.experts,
                                            plan.parts, plan.block_m, plan.num_tiles // n_tiles, n_tiles,
                                            EXPERT_RASTER_M)
        else:   # the combine's table: built while the GPU runs the dispatch's GEMM
            self.tiles = plan.tiles.to(lambda table: host_table_to(table, device))
        if kind == "a2a_gemm":
            self.gemm = SignaledGemm(self.tiles, op.programs, config, flags=self.words if plan.exchanges else None,
                                     wait_target=1)
        else:
            self.gemm = SignaledGemm(self.tiles, op.programs, config, counters=self.words,
                                     dst_offsets=None if offsets is None else host_table_to(offsets, device))


class PinnedStaging:
    """Host-built tables on their way to the GPU without a host synchronisation and without pinning fresh memory
    per table. A copy from pageable memory waits for the stream to drain (dynamic routing builds tables every
    step); `Tensor.pin_memory()` queues the copy but takes a new page-locked block whenever the earlier ones
    still wait for their copies, and page-locking costs milliseconds of host time. Here a few pinned slots
    are reused in turn: a slot is written only once the GPU has run the copy that last read it (its event), else
    the next slot is tried, and a new one added when every slot is in flight."""

    def __init__(self):
        self.slots = []   # (pinned uint8 buffer, event recorded behind its last copy)
        self.next = 0

    def to_device(self, table: torch.Tensor, device: torch.device) -> torch.Tensor:
        nbytes = table.numel() * table.element_size()
        slot = self._free_slot(nbytes)
        staged = slot[0][:nbytes].view(table.dtype).view(table.shape)
        staged.copy_(table)
        out = torch.empty(table.shape, dtype=table.dtype, device=device)
        out.copy_(staged, non_blocking=True)
        slot[1].record()
        return out

    def _free_slot(self, nbytes: int):
        for i in range(len(self.slots)):
            slot = self.slots[(self.next + i) % len(self.slots)]
            if slot[0].numel() >= nbytes and slot[1].query():   # an event never recorded queries True
                self.next = (self.next + i + 1) % len(self.slots)
                return slot
        # every slot is in flight or too small: a new one, with room to grow (sizes vary with the routing)
        slot = (torch.empty(max(nbytes * 2, 1 << 16), dtype=torch.uint8, pin_memory=True), torch.cuda.Event())
        self.slots.append(slot)
        return slot


_staging = PinnedStaging()


def host_table_to(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host-built table on `device`, queued on the current stream without synchronizing (PinnedStaging)."""
    if device.type != "cuda":
        return table.to(device)
    return _staging.to_device(table.contiguous(), device)


MAX_ROUTINGS = 16
_states = OrderedDict()


def _cached(cache: OrderedDict, key, build, limit: int):
    """cache[key], built at its first use; the least recently used entry dropped past `limit`."""
    value = cache.get(key)
    if value is None:
        value = cache[key] = build()
        if len(cache) > limit:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return value


MAX_OPS = 64
_ops = OrderedDict()


def _op(kind, group, n, config, device, lay: Layout) -> _ExpertOp:
    """The op's _ExpertOp (built once per (kind, group, N, config, device))."""
    return _cached(_ops, (kind, group, n, config, device), lambda: _ExpertOp(
        kind, config, device, f"{kind}(N={n}, ep={lay.ep}, L={lay.experts})"), MAX_OPS)


def _decomposed_rows(kind, group, n, cols, dtype, config, device, lay: Layout):
    """The decompose method's p2p row buffer of `cols` columns (RowPull for the dispatch, RowPush for the combine)
    and its op's watchdog record; (None, None) on NCCL or with one rank (nothing moves)."""
    if config.transport != "p2p" or lay.ep == 1:
        return None, None
    op = _op(kind, group, n, config, device, lay)
    return op.row_buffer(kind, group, lay, cols, dtype, device), op.watched


def _state(kind, plan_fn, route: Routing, n, config, parts, group, device, offsets=None) -> _ExpertState:
    """The _ExpertState of this routing, built at its first call (the least recently used dropped past
    MAX_ROUTINGS: dynamic routing builds one per step), on the op's _ExpertOp (built once)."""
    lay = route.layout
    op = _op(kind, group, n, config, device, lay)
    key = (kind, group, route.key, n, config, parts, device, offsets)
    return _cached(_states, key, lambda: _ExpertState(
        kind, plan_fn(lay, n, config.block_m, config.block_n, parts), op, device, config, route.counts,
        None if offsets is None else torch.tensor(offsets, dtype=torch.int64), route.device_counts), MAX_ROUTINGS)


# what the ranks of a group agreed on (comm.agree): ops by (kind, shape, config), routings by counts. Every rank
# makes the same calls in the same order, so the caches, and which agreements run, are the same on every rank.
MAX_AGREED = 64
_agreed_ops, _agreed_routings = OrderedDict(), OrderedDict()


def agree_routing(group, op: str, route: Routing, n: int, k: int, dtype, config: OverlapConfig,
                  counts_agreed: bool):
    """Every rank of the EP group calls `op` with the same output columns, inner size, dtype and config
    (checked once per combination) and the same counts (once per distinct routing: one agreement serves a
    step's forward and backward ops). Mismatched counts would make the exchanges' split sizes disagree: a hang
    or rows silently misplaced, so a mismatch is a ValueError on every rank naming each rank's values.
    counts_agreed=True skips the counts: the caller guarantees them equal (OverlapMoELayer all-gathers
    them), which saves a round trip through the process group's store per step."""
    if dist.get_world_size(group) == 1:
        return
    what = f"{op}(N={n}, K={k}, ep={route.layout.ep})"
    _cached(_agreed_ops, (group, op, n, k, dtype, config),
            lambda: comm.agree(group, dict(op=op, n=n, k=k, dtype=dtype, config=config), what) or True, MAX_AGREED)
    if not counts_agreed:
        _cached(_agreed_routings, (group, route.key),
                lambda: comm.agree(group, dict(counts=route.counts.tolist()), what) or True, MAX_AGREED)


# ---------------------------------------------------------------------------------------------------
# a2a_gemm: dispatch + fc1
# ---------------------------------------------------------------------------------------------------

def _dispatch_decomposed(x, w, xr, y, plan, coll, pull=None, watched=None):
    """The local rows' matmuls at once; chunk c's exchange on the comm stream, then its matmuls. One fork,
    before the local matmuls: the exchanges read only x, so none of them waits for a matmul (a fork per chunk
    made chunk c's exchange wait for chunk c-1's matmuls: no overlap at all).
    pull (transport 'p2p', a RowPull): chunk c is copy-engine copies from the peers' symmetric copies of their x,
    enqueued after the local matmuls (their peer waits would otherwise hold the matmuls' launch in one hardware
    queue); watched: the op's watchdog record, for an eager call's wait on its peers."""
    engine = comm.comm_engine(x.device)
    capturing = comm.capturing(x.device)
    lo, hi, dst = plan.local
    if xr is not x:
        xr[dst:dst + hi - lo].copy_(x[lo:hi])
    if engine.stream is not None:
        engine.fork(engine.current(), capturing)
    expert_mm(xr, w, plan.gemm_groups[0], (y,))
    if pull is not None:
        current, raw, base, row_bytes = engine.current(), engine.raw, xr.data_ptr(), pull.row_bytes
        pull.start(raw, x, capturing)
        for exchange, pieces in zip(plan.exchanges, plan.gemm_groups[1:]):
            for peer, src_row, dst_row, rows in pulled_rows(plan.layout, exchange):
                pull.copy_rows(raw, base + dst_row * row_bytes, peer, src_row, rows)
            engine.join(current, capturing)
            expert_mm(xr, w, pieces, (y,))
        pull.finish(raw)
        engine.join(current, capturing)
        if not capturing and watched is not None:
            watched.record(current)
        return
    for exchange, pieces in zip(plan.exchanges, plan.gemm_groups[1:]):
        if engine.stream is None:
            _exchange(coll, exchange, x, xr, None)
        else:
            _exchange(coll, exchange, x, xr, engine.raw)
            engine.join(engine.current(), capturing)
        expert_mm(xr, w, pieces, (y,))


def _dispatch_signaled(x, w, xr, y, state: _ExpertState, coll, pull=None):
    """The persistent GEMM over the dispatch plan: local rows at once, each chunk behind its ready flag,
    which the comm stream raises after the chunk's exchange; the caller's stream lowers the flags after it.
    pull (transport 'p2p', a RowPull): the chunk is copy-engine copies of part c of every peer's block from the
    peer's copy of its x (RowPull's protocol), instead of NCCL's send / receive."""
    engine, plan = comm.comm_engine(x.device), state.plan
    lo, hi, dst = plan.local

    def transfers(stream):
        if pull is not None:
            base, row_bytes = xr.data_ptr(), pull.row_bytes
            pull.start(stream, x, engine.capturing())
            for c, copies in enumerate(state.copies):
                for peer, src_row, dst_row, rows in copies:
                    pull.copy_rows(stream, base + dst_row * row_bytes, peer, src_row, rows)
                engine.raise_flag(state.flags, c)
            pull.finish(stream)
            return
        for c, exchange in enumerate(plan.exchanges):
            _exchange(coll, exchange, x, xr, stream)
            engine.raise_flag(state.flags, c)

    def gemm():
        if xr is not x:
            xr[dst:dst + hi - lo].copy_(x[lo:hi])
        if plan.num_tiles:
            state.gemm(xr, w, y)

    engine.transfers_then_gemm(transfers, gemm, state.flags, state.watched, gemm_first=state.gemm_first)


def dispatch_gemm(x, counts, w, group, config, counts_agreed=False, state=None, device_counts=None):
    """a2a_gemm without autograd: (y [R, N], xr [R, H]). state: the signaled state of this call, prepared ahead
    (_dispatch_state), else looked up or built now. device_counts: as for routing()."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    route = routing(counts, ep, rank, "a2a_gemm", device_counts)
    lay = route.layout
    check_inputs("a2a_gemm", x, w, counts, lay.tokens, "sum of counts[rank]", "N")
    method = resolve_method("a2a_gemm", config, x, w)
    n, hidden = w.shape[1], x.shape[1]
    agree_routing(group, "a2a_gemm", route, n, hidden, x.dtype, config, counts_agreed)
    if method == "off":
        xr = all_to_all_rows(x, lay.rows, lay.xr_splits, lay.x_splits, group)
        y = torch.empty(lay.rows, n, dtype=x.dtype, device=x.device)
        expert_mm(xr, w, lay.segments, (y,))
        return y, xr
    # one rank: the received rows are x itself (the plan's local block is all of x, at row 0), not a copy
    xr = x if lay.ep == 1 else torch.empty(lay.rows, hidden, dtype=x.dtype, device=x.device)
    y = torch.empty(lay.rows, n, dtype=x.dtype, device=x.device)
    p2p = config.transport == "p2p"
    coll = None if p2p else comm.exchange_collectives(group, x.device, config.comm_sms)
    if method == "decompose":
        parts = route.parts(config.groups, hidden * x.element_size())
        pull, watched = _decomposed_rows("a2a_gemm", group, n, hidden, x.dtype, config, x.device, lay)
        _dispatch_decomposed(x, w, xr, y, dispatch_plan(lay, n, config.block_m, config.block_n, parts), coll, pull,
                             watched)
    else:
        state = state or _dispatch_state(route, n, hidden, x.dtype, config, group, x.device)
        pull = state.op.row_buffer("a2a_gemm", group, lay, hidden, x.dtype, x.device) if p2p and ep > 1 else None
        _dispatch_signaled(x, w, xr, y, state, coll, pull)
    return y, xr


def _dispatch_state(route: Routing, n: int, hidden: int, dtype, config, group, device) -> _ExpertState:
    """a2a_gemm's signaled state for this routing (built at its first use, then cached)."""
    parts = route.parts(config.groups, hidden * torch.finfo(dtype).bits // 8)
    return _state("a2a_gemm", dispatch_plan, route, n, config, parts, group, device)


# ---------------------------------------------------------------------------------------------------
# gemm_a2a: fc2 + combine
# ---------------------------------------------------------------------------------------------------

def _combine_decomposed(h, w, staging, z, plan, coll, push=None, watched=None):
    """Group g's matmuls, then its exchange on the comm stream while group g+1 is computed; the local
    rows' matmuls last, straight into z.
    push (transport 'p2p', a RowPush): group g's exchange is copy-engine copies of its staged rows into the peers'
    receive buffers (RowPush's protocol, as _combine_signaled), and after the join this rank copies what its peers
    pushed into z; watched: the op's watchdog record, for an eager call's wait on its peers."""
    engine = comm.comm_engine(h.device)
    capturing = comm.capturing(h.device)
    last = len(plan.exchanges) - 1
    for g, (pieces, exchange) in enumerate(zip(plan.gemm_groups, plan.exchanges)):
        expert_mm(h, w, pieces, (staging, z))
        if engine.stream is None:
            _exchange(coll, exchange, staging, z, None)
            continue
        engine.fork(engine.current(), capturing)
        if push is None:
            _exchange(coll, exchange, staging, z, engine.raw)
            continue
        if g == 0:
            push.begin(engine.raw, capturing)
        for peer, dst_row, src_row, rows in pushed_rows(plan.layout, exchange):
            push.push(engine.raw, peer, dst_row, staging.data_ptr() + src_row * push.row_bytes, rows)
        if g == last:
            push.end(engine.raw)
    expert_mm(h, w, plan.gemm_groups[-1], (staging, z))
    if engine.stream is not None:
        engine.join(engine.current(), capturing)
    if push is not None:
        _receive_pushed(push, plan.layout, z, engine, watched)


def _combine_signaled(h, w, staging, z, state: _ExpertState, coll, push=None):
    """The persistent GEMM over the combine plan; each group's exchange on the comm stream behind the
    group's counter. Remote rows go to `staging` (DST_BUF 0), local rows straight into z (DST_BUF 1).
    push (transport 'p2p', a RowPush): the group's exchange is copy-engine copies of the staged rows into each
    peer's receive buffer, at the rows the peer's z holds them; after the join this rank copies what its peers
    pushed into z (RowPush's protocol), instead of NCCL's send / receive."""
    engine, plan = comm.comm_engine(h.device), state.plan

    def gemm():
        if plan.num_tiles:
            state.gemm(h, w, staging)

    if push is None:
        def exchange(g, stream):
            _exchange(coll, plan.exchanges[g], staging, z, stream)
    else:
        base, row_bytes, last, pushes = staging.data_ptr(), push.row_bytes, len(plan.exchanges) - 1, state.copies
        capturing = engine.capturing()

        def exchange(g, stream):
            if g == 0:
                push.begin(stream, capturing)
            for peer, dst_row, src_row, rows in pushes[g]:
                push.push(stream, peer, dst_row, base + src_row * row_bytes, rows)
            if g == last:
                push.end(stream)

    engine.gemm_then_collectives(gemm, state.waits, exchange, state.watched)()
    if push is not None:
        _receive_pushed(push, plan.layout, z, engine, state.watched)


def _receive_pushed(push: RowPush, lay: Layout, z, engine, watched):
    """The peers' rows for this rank's tokens, from its receive buffer into z (RowPush.receive, on the caller's
    stream), and the eager call's watchdog record."""
    z_base = z.data_ptr()
    copies = [(z_base + lay.x_offsets[s] * push.row_bytes, lay.x_offsets[s], lay.x_splits[s])
              for s in range(lay.ep) if s != lay.rank and lay.x_splits[s]]
    current, capturing = engine.current(), engine.capturing()
    push.receive(current, copies, capturing)
    if not capturing and watched is not None:
        watched.record(current)


def gemm_combine(h, counts, w, group, config, counts_agreed=False, state=None, device_counts=None):
    """gemm_a2a without autograd: z [T, H]. state, device_counts: as for dispatch_gemm (_combine_state; the device
    counts serve the dispatch state its backward builds)."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    route = routing(counts, ep, rank, "gemm_a2a", device_counts)
    lay = route.layout
    check_inputs("gemm_a2a", h, w, counts, lay.rows, "sum over sources of counts[:, this rank's experts]", "H")
    method = resolve_method("gemm_a2a", config, h, w)
    n = w.shape[1]
    agree_routing(group, "gemm_a2a", route, n, h.shape[1], h.dtype, config, counts_agreed)
    if method == "off":
        out = torch.empty(lay.rows, n, dtype=h.dtype, device=h.device)
        expert_mm(h, w, lay.segments, (out,))
        return all_to_all_rows(out, lay.tokens, lay.x_splits, lay.xr_splits, group)
    staging_rows = _staging_rows(lay, n)
    buf = torch.empty(staging_rows + lay.tokens, n, dtype=h.dtype, device=h.device)
    staging, z = buf[:staging_rows], buf[staging_rows:]
    p2p = config.transport == "p2p"
    coll = None if p2p else comm.exchange_collectives(group, h.device, config.comm_sms)
    if method == "decompose":
        parts = route.parts(config.groups, n * h.element_size())
        push, watched = _decomposed_rows("gemm_a2a", group, n, n, h.dtype, config, h.device, lay)
        _combine_decomposed(h, w, staging, z, combine_plan(lay, n, config.block_m, config.block_n, parts), coll,
                            push, watched)
    else:
        state = state or _combine_state(route, n, h.shape[1], h.dtype, config, group, h.device)
        push = state.op.row_buffer("gemm_a2a", group, lay, n, h.dtype, h.device) if p2p and ep > 1 else None
        _combine_signaled(h, w, staging, z, state, coll, push)
    return z


def _staging_rows(lay: Layout, n: int) -> int:
    """The staging rows (the remote blocks: combine_plan's staging_rows) before z in gemm_a2a's one buffer, z a
    fixed number of elements (a multiple of 16: 16-byte stores) after the staging matrix, where the kernel
    addresses it: the offset belongs to the plan, not the call. At least one row: the kernel's base pointer."""
    rows = max(1, lay.rows - lay.xr_splits[lay.rank])
    while (rows * n) % OFFSET_ALIGNMENT:
        rows += 1
    return rows


def _combine_state(route: Routing, n: int, k: int, dtype, config, group, device) -> _ExpertState:
    """gemm_a2a's signaled state for this routing (built at its first use, then cached). k, the inner size, does
    not enter the plan (_dispatch_state's signature, for _backward_state)."""
    parts = route.parts(config.groups, n * torch.finfo(dtype).bits // 8)
    offsets = (0, _staging_rows(route.layout, n) * n)
    return _state("gemm_a2a", combine_plan, route, n, config, parts, group, device, offsets)


# ---------------------------------------------------------------------------------------------------
# Autograd and the public ops
# ---------------------------------------------------------------------------------------------------

def _backward_state(needed: bool, inp, build, counts, group, config, n: int, k: int):
    """The signaled state of the backward's mirrored op (GEMM N = n over inputs of k columns), built during the
    forward, where the host works while the GPU runs the forward's GEMM. Held by the autograd context: the
    per-routing cache keeps 16, fewer than the forward of a deep MoE model builds. None where the backward will
    not run the signaled kernel."""
    if not needed or config.method != "signal":
        return None
    route = routing(counts, dist.get_world_size(group), dist.get_rank(group), "the backward")
    return build(route, n, k, inp.dtype, config, group, inp.device)


class _A2AGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, counts, group, config, counts_agreed, device_counts):
        y, xr = dispatch_gemm(x, counts, w, group, config, counts_agreed, device_counts=device_counts)
        ctx.save_for_backward(xr, w)
        ctx.counts, ctx.group, ctx.config, ctx.counts_agreed = counts, group, config, counts_agreed
        ctx.mark_non_differentiable(xr)
        # the backward's gemm_a2a (dy @ w[l] back to the sources) prepared now, while the GPU runs this GEMM
        ctx.dx_state = _backward_state(ctx.needs_input_grad[0], x, _combine_state, counts, group, config,
                                       n=w.shape[2], k=w.shape[1])
        return y, xr

    @staticmethod
    def backward(ctx, dy, _):
        """dx = dy_seg @ w[l] sent back to the sources (gemm_a2a with w[l].T); dw[l] = dy_seg.T @ xr_seg."""
        xr, w = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = gemm_combine(dy, ctx.counts, transposed(w, ctx.config), ctx.group, ctx.config, ctx.counts_agreed,
                              ctx.dx_state)
        if ctx.needs_input_grad[1]:
            dw = expert_wgrad(dy, xr, routing(ctx.counts, dist.get_world_size(ctx.group), dist.get_rank(ctx.group),
                                              "a2a_gemm").layout)
        return dx, dw, None, None, None, None, None


class _GemmA2A(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, counts, group, config, counts_agreed, device_counts):
        ctx.save_for_backward(h, w)
        ctx.counts, ctx.group, ctx.config, ctx.counts_agreed = counts, group, config, counts_agreed
        z = gemm_combine(h, counts, w, group, config, counts_agreed, device_counts=device_counts)
        # the backward's a2a_gemm (dz back to the experts, @ w[l]) prepared now, while the GPU runs this GEMM
        ctx.dh_state = _backward_state(ctx.needs_input_grad[0], h, _dispatch_state, counts, group, config,
                                       n=w.shape[2], k=w.shape[1])
        return z

    @staticmethod
    def backward(ctx, dz):
        """dzr = dispatch(dz); dh = dzr_seg @ w[l] (a2a_gemm with w[l].T); dw[l] = dzr_seg.T @ h_seg."""
        h, w = ctx.saved_tensors
        dz = dz.contiguous()
        lay = routing(ctx.counts, dist.get_world_size(ctx.group), dist.get_rank(ctx.group), "gemm_a2a").layout
        dh = dw = None
        if ctx.needs_input_grad[0]:
            dh, dzr = dispatch_gemm(dz, ctx.counts, transposed(w, ctx.config), ctx.group, ctx.config,
                                    ctx.counts_agreed, ctx.dh_state)
        else:
            dzr = all_to_all_rows(dz, lay.rows, lay.xr_splits, lay.x_splits, ctx.group)
        if ctx.needs_input_grad[1]:
            dw = expert_wgrad(dzr, h, lay)
        return dh, dw, None, None, None, None, None


def a2a_gemm(x: torch.Tensor, counts: torch.Tensor, w: torch.Tensor, group=None, *,
             config: Optional[OverlapConfig] = None, return_received: bool = False, counts_agreed: bool = False,
             device_counts: Optional[torch.Tensor] = None):
    """Dispatch x's rows to their experts' ranks and apply fc1: y[R, N] (xr[R, H] too with return_received; with
    one rank, xr is x itself: nothing moves).
    counts_agreed=True: the caller guarantees counts equal on every rank (all-gathered), so the once-per-routing
    cross-rank check is skipped (agree_routing).
    device_counts: the caller guarantees these equal counts, on the GPU (OverlapMoELayer has them there first):
    the signaled method builds its tile table from them without copying counts up (one copy less on the host's
    path from the routing to the first expert GEMM)."""
    y, xr = _A2AGemm.apply(x, w, counts, comm.resolve_ep_group(group), resolve(config, "a2a_gemm", device=x.device),
                           counts_agreed, device_counts)
    return (y, xr) if return_received else y


def gemm_a2a(h: torch.Tensor, counts: torch.Tensor, w: torch.Tensor, group=None, *,
             config: Optional[OverlapConfig] = None, counts_agreed: bool = False,
             device_counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Apply fc2 to the received rows and send each back to its token's rank: z[T, H] in x's row order.
    counts_agreed, device_counts: as for a2a_gemm (the device counts serve its backward's dispatch)."""
    return _GemmA2A.apply(h, w, counts, comm.resolve_ep_group(group), resolve(config, "gemm_a2a", device=h.device),
                          counts_agreed, device_counts)
