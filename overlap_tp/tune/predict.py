"""The predictor (FlashOverlap Alg. 1, adapted): a candidate's latency from measured curves.

GEMM+collective (rs, ar), one collective per group on the comm stream, group by group:

    t_p_acc = finish(tiles of groups 1..i)          the GEMM has stored group i's tiles
    t_m     = max(t_p_acc, t_m_acc) + comm(bytes_i)  group i's transfer ends (t_m_acc: group i-1's end)
    total   = max(t_m of the last group, t_gemm) + post

That recurrence assumes the GEMM and the collective never slow each other. `Contention` (signal/nccl
only) replaces it by a timeline where they do: while the GEMM runs, a collective moves data at (1 - x) of
its alone speed (x = `comm_slowdown_sm0` when comm_sms = 0: the persistent GEMM occupies every SM, so
NCCL's CTAs find little room; `comm_slowdown` otherwise: shared HBM / L2); while it moves at speed s,
the GEMM runs at 1 / (1 + c * s) of its alone speed (c = `gemm_slowdown`); every group's collective
starts `group_overhead_ms` late (stream wait + kernel launch; no bandwidth used). All zero = the
recurrence above. The fitted values come from `python -m overlap_tp.tune.refit` (docs/tuner.md).

finish(): `linear` is the brief's  t_gemm(sms) * tiles / T;  `wave` rounds up to the end of the wave
that holds the group's last tile,  t_gemm * ceil(tiles / W) / ceil(T / W)  (W = tiles per wave): a
persistent grid computes W tiles at once, so a group ending mid-wave is only ready at the wave's end.
The default is `wave`; --validate reports the error of both, and the better one should become the
default. t_gemm(sms) is the signaled GEMM alone with (SMs - comm_sms) programs (measured at a few
budgets, linearly interpolated): the slowdown from SMs left to the collective lives there. comm(bytes)
is log-log linear between measured points of the collective's latency-vs-bytes curve for (kind,
max_ctas); below the smallest point it is the smallest point's latency (the latency floor). post: work
after the collectives (the tile_exact reorder).

AllGather+GEMM (ag): the chunks' transfers run back to back on the comm stream from the start; the
local rows' tiles need no data; chunk c's tiles cannot start before its transfer ends:

    arrive_c = arrive_{c-1} + comm(bytes_c);   t_p = max(t_p, arrive_c) + t_gemm * tiles_c / T

MoE (load imbalance): `predict_max_over_ranks` predicts every rank's own shape and takes the max
(a step waits for the slowest rank).

Candidates that cannot be predicted from the curves (the p2p reduce-scatter transport; anything whose
curve was not measured) come back as None unless `Measurements.direct` holds an end-to-end time.
"""
import bisect
import math
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from overlap_tp.ops.config import OverlapConfig
from overlap_tp.ops.resolve import common_defaults
from overlap_tp.ops.tile_plan import split_units
from overlap_tp.tune.candidates import Layout, Shape, label, layout, wave_tiles

PROGRESS = ("wave", "linear")
DEFAULT_PROGRESS = "wave"


class CommCurve:
    """Latency (ms) vs bytes, log-log linear between points; the smallest point's latency below it; the
    last segment's log-log slope (clamped to [0, 1]) above the largest point."""

    def __init__(self, points: Iterable[Tuple[float, float]]):
        pts = sorted((float(b), float(ms)) for b, ms in points if b > 0 and ms > 0)
        if not pts:
            raise ValueError("a comm curve needs at least one (bytes > 0, ms > 0) point")
        self.xs = [math.log(b) for b, _ in pts]
        self.ys = [math.log(ms) for _, ms in pts]

    def __call__(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        x, xs, ys = math.log(nbytes), self.xs, self.ys
        if x <= xs[0]:
            return math.exp(ys[0])
        if len(xs) == 1:
            return math.exp(ys[0] + (x - xs[0]))        # bandwidth-bound above the only point
        i = min(bisect.bisect_right(xs, x), len(xs) - 1)
        slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
        if x > xs[-1]:
            return math.exp(ys[-1] + min(1.0, max(0.0, slope)) * (x - xs[-1]))
        return math.exp(ys[i - 1] + slope * (x - xs[i - 1]))


def interp_linear(points: Dict[int, float], x: float) -> float:
    """Piecewise-linear through {x: y}, extended linearly beyond the ends (constant for one point)."""
    xs = sorted(points)
    if not xs:
        raise ValueError("no points to interpolate")
    if len(xs) == 1:
        return points[xs[0]]
    i = min(max(bisect.bisect_right(xs, x), 1), len(xs) - 1)
    x0, x1 = xs[i - 1], xs[i]
    return points[x0] + (points[x1] - points[x0]) * (x - x0) / (x1 - x0)


@dataclass
class Measurements:
    """What the predictor needs for one shape on one device; identical on every rank (all-reduced MAX).

    gemm:   schedule -> {comm_sms: ms} of the signaled GEMM alone (ag: under "row_slice")
    comm:   kind -> {max_ctas: [(bytes, ms), ...]}; kinds: rs (reduce-scatter input bytes), ar, ag
            (all-gather output bytes, NCCL), ag_p2p (the same through copy-engine pulls); max_ctas 0 =
            uncapped
    post:   schedule -> ms of work after the collectives (tile_exact: the reorder back to rows)
    cublas: ms of the cuBLAS GEMM (the decompose model)
    direct: candidate label -> ms measured end to end (off, decompose, p2p, verified picks)
    """
    sms: int
    gemm: Dict[str, Dict[int, float]] = field(default_factory=dict)
    comm: Dict[str, Dict[int, List[Tuple[int, float]]]] = field(default_factory=dict)
    post: Dict[str, float] = field(default_factory=dict)
    cublas: Optional[float] = None
    direct: Dict[str, float] = field(default_factory=dict)

    def curve(self, kind: str, max_ctas: int) -> Optional[CommCurve]:
        """The (kind, max_ctas) curve; the uncapped one stands in where only it was measured."""
        by_cap = self.comm.get(kind, {})
        points = by_cap.get(max_ctas) or by_cap.get(0)
        return CommCurve(points) if points else None

    def t_gemm(self, schedule: str, comm_sms: int) -> Optional[float]:
        points = self.gemm.get(schedule)
        return interp_linear(points, comm_sms) if points else None

    # JSON: int keys become strings, tuples lists
    def to_dict(self) -> dict:
        return {"sms": self.sms,
                "gemm": {s: {str(c): v for c, v in d.items()} for s, d in self.gemm.items()},
                "comm": {k: {str(c): [list(p) for p in pts] for c, pts in d.items()} for k, d in self.comm.items()},
                "post": dict(self.post), "cublas": self.cublas, "direct": dict(self.direct)}

    @classmethod
    def from_dict(cls, d: dict) -> "Measurements":
        return cls(sms=int(d["sms"]),
                   gemm={s: {int(c): float(v) for c, v in x.items()} for s, x in d.get("gemm", {}).items()},
                   comm={k: {int(c): [(int(b), float(ms)) for b, ms in pts] for c, pts in x.items()}
                         for k, x in d.get("comm", {}).items()},
                   post={s: float(v) for s, v in d.get("post", {}).items()},
                   cublas=None if d.get("cublas") is None else float(d["cublas"]),
                   direct={k: float(v) for k, v in d.get("direct", {}).items()})

    def numbers(self) -> List[float]:
        """Every measured number in a fixed order (what the ranks all-reduce)."""
        out = [float(self.cublas) if self.cublas is not None else -1.0]
        out += [v for s in sorted(self.gemm) for _, v in sorted(self.gemm[s].items())]
        out += [ms for k in sorted(self.comm) for _, pts in sorted(self.comm[k].items()) for _, ms in pts]
        out += [self.post[s] for s in sorted(self.post)] + [self.direct[k] for k in sorted(self.direct)]
        return out

    def with_numbers(self, values: Sequence[float]) -> "Measurements":
        """A copy holding `values` (from numbers(), e.g. after an all-reduce) in place of its own."""
        it = iter(values)
        cublas = next(it)
        gemm = {s: {c: next(it) for c, _ in sorted(self.gemm[s].items())} for s in sorted(self.gemm)}
        comm = {k: {c: [(b, next(it)) for b, _ in pts] for c, pts in sorted(self.comm[k].items())}
                for k in sorted(self.comm)}
        post = {s: next(it) for s in sorted(self.post)}
        direct = {k: next(it) for k in sorted(self.direct)}
        return Measurements(self.sms, gemm, comm, post, None if cublas < 0 else cublas, direct)


def comm_kind(shape: Shape, config: OverlapConfig) -> str:
    if shape.op == "ag":
        return "ag_p2p" if config.transport == "p2p" else "ag"
    return shape.op


def gemm_finish(t_gemm: float, tiles_done: int, total_tiles: int, wave: int, progress: str) -> float:
    """When the GEMM has stored its first `tiles_done` tiles (execution order)."""
    if tiles_done <= 0:
        return 0.0
    if progress == "linear":
        return t_gemm * tiles_done / total_tiles
    if progress != "wave":
        raise ValueError(f"progress={progress!r}: expected one of {PROGRESS}")
    return t_gemm * math.ceil(tiles_done / wave) / math.ceil(total_tiles / wave)


@dataclass(frozen=True)
class Contention:
    """How a running GEMM and a running collective slow each other (the module docstring's timeline).

    comm_slowdown_sm0: fraction of a collective's speed lost while the GEMM runs, comm_sms = 0
    comm_slowdown:     the same, comm_sms > 0
    gemm_slowdown:     c: the GEMM runs at 1 / (1 + c * s) of its speed while a collective moves at speed s
    group_overhead_ms: delay before every group's collective moves data

    The defaults are the least-squares fit (relative error) to the signal/nccl points of one recorded `--validate`
    run (gemm_rs, t = 2), by `python -m overlap_tp.tune.refit`, which also reports its leave-one-shape-out
    cross-validation (docs/tuner.md). Not fitted on gemm_ar (applied to it unvalidated), other GPUs or other t."""
    comm_slowdown_sm0: float = 0.8173
    comm_slowdown: float = 0.0862
    gemm_slowdown: float = 0.0
    group_overhead_ms: float = 0.0117

    def comm_speed(self, comm_sms: int) -> float:
        """A collective's speed while the GEMM runs, relative to its measured curve."""
        return 1.0 - (self.comm_slowdown_sm0 if comm_sms == 0 else self.comm_slowdown)


NO_CONTENTION = Contention(0.0, 0.0, 0.0, 0.0)      # the original model


def overlap_timeline(t_gemm: float, ready: Sequence[float], comm_ms: Sequence[float], comm_speed: float = 1.0,
                     gemm_slowdown: float = 0.0, delay: float = 0.0) -> float:
    """When both the GEMM and the last collective have ended (event by event).

    The GEMM's progress is counted in ms of it running alone; group i's collective may start once that
    progress reaches ready[i] and collective i-1 has ended; it waits `delay`, then moves comm_ms[i] (ms
    alone) at `comm_speed` while the GEMM runs, at full speed after it; while data moves at speed s the
    GEMM runs at 1 / (1 + gemm_slowdown * s)."""
    ready = [min(r, t_gemm) for r in ready]   # the last group is ready when the GEMM ends, whatever rounding
    now = progress = 0.0
    group, wait, left = 0, 0.0, None          # the collective in flight: its remaining delay and work
    while True:
        if left is None and group < len(ready) and progress >= ready[group]:
            wait, left = delay, comm_ms[group]
        gemm_on = progress < t_gemm
        if left is None and not gemm_on:
            return now
        moving = left is not None and wait <= 0
        c_speed = (comm_speed if gemm_on else 1.0) if moving else 0.0
        g_speed = 1.0 / (1.0 + gemm_slowdown * c_speed)
        # the next event: the GEMM reaches the next group (or its end), the delay ends, or the transfer ends
        target = ready[group] if left is None and group < len(ready) else t_gemm
        steps = [(target - progress) / g_speed if gemm_on else math.inf,
                 wait if left is not None and wait > 0 else math.inf,
                 left / c_speed if c_speed > 0 else math.inf]
        dt = min(steps)
        now += dt
        if gemm_on:
            progress = target if dt == steps[0] else progress + g_speed * dt
        if left is not None and wait > 0:
            wait -= dt
        elif moving and dt == steps[2]:
            left, group = None, group + 1
        elif moving:
            left -= c_speed * dt


def gemm_then_comm(t_gemm: float, group_tiles: Sequence[int], group_bytes: Sequence[int], comm, total_tiles: int,
                   wave: int, progress: str, contention: Contention = NO_CONTENTION, comm_sms: int = 0) -> float:
    """Alg. 1 for GEMM+collective; the predicted end of the last transfer (or the GEMM). Without
    contention it is the recurrence of the module docstring."""
    ready, done = [], 0
    for tiles in group_tiles:
        done += tiles
        ready.append(gemm_finish(t_gemm, done, total_tiles, wave, progress))
    return overlap_timeline(t_gemm, ready, [comm(b) for b in group_bytes], contention.comm_speed(comm_sms),
                            contention.gemm_slowdown, contention.group_overhead_ms)


def comm_then_gemm(t_gemm: float, lead_tiles: int, chunk_tiles: Sequence[int], chunk_bytes: Sequence[int], comm,
                   total_tiles: int) -> float:
    """The AG+GEMM analogue: transfers back to back from t = 0; chunk c computes after it arrived."""
    t_p = t_gemm * lead_tiles / total_tiles
    arrive = 0.0
    for tiles, nbytes in zip(chunk_tiles, chunk_bytes):
        arrive += comm(nbytes)
        t_p = max(t_p, arrive) + t_gemm * tiles / total_tiles
    return t_p


def _group_sizes(lay: Layout, groups) -> List[int]:
    return split_units(lay.units, groups, lay.unit_bytes)


def _decompose(shape: Shape, config: OverlapConfig, meas: Measurements) -> Optional[float]:
    """M-chunked cuBLAS with chunk collectives behind it (ag: local rows first, then per chunk)."""
    curve = meas.curve(comm_kind(shape, config), config.comm_sms)
    if meas.cublas is None or curve is None:
        return None
    eb, t = shape.elem_bytes, shape.t
    rows = shape.m_local if shape.op in ("rs", "ag") else shape.m
    chunks = max(1, min(config.chunks, rows))
    sizes = [rows // chunks + (i < rows % chunks) for i in range(chunks)]
    if shape.op == "ag":   # the local rows (1/t of the GEMM) need no data; chunk i computes (t-1) * rows_i
        tiles = [(t - 1) * r for r in sizes]
        return comm_then_gemm(meas.cublas, rows, tiles, [t * r * shape.k * eb for r in sizes], curve, t * rows)
    mult = t if shape.op == "rs" else 1
    return gemm_then_comm(meas.cublas, sizes, [mult * r * shape.n * eb for r in sizes], curve, rows, 1, "linear")


def predict(shape: Shape, config: OverlapConfig, meas: Measurements, progress: str = DEFAULT_PROGRESS,
            contention: Contention = Contention()) -> Optional[float]:
    """Predicted latency (ms) of `config` on `shape`, or None where the measurements cannot tell.
    A direct (end-to-end) measurement of the same candidate wins over the model. `contention` applies
    to signal/nccl rs and ar (fitted on rs); decompose and ag keep the contention-free recurrences."""
    name = label(config)
    if name in meas.direct:
        return meas.direct[name]
    config = common_defaults(config)   # unset schedule, chunks, tile: the ops' defaults
    if config.method == "off":
        curve = meas.curve(comm_kind(shape, config), 0)
        if meas.cublas is None or curve is None:
            return None
        eb = shape.elem_bytes
        return meas.cublas + curve(shape.m * (shape.k if shape.op == "ag" else shape.n) * eb)
    if config.method == "decompose" and config.transport == "p2p":
        return None   # measured end to end only (candidates.decompose_p2p)
    if config.method == "decompose":
        return _decompose(shape, config, meas)
    if config.method != "signal":
        raise ValueError(f"cannot predict method={config.method!r}")
    if shape.op in ("rs", "ar") and config.transport == "p2p":
        return None   # no collective to model: measured end to end only
    if shape.op == "ag" and config.transport == "p2p" and config.comm_sms:
        return None   # the pulls on SMs, handshakes inside their kernel: measured end to end only (candidates.sm_pulls)
    if shape.op == "ag" and config.chunk_by == "peer":
        return None   # one peer's rows per chunk: measured end to end only (candidates.peer_pulls)
    schedule = "row_slice" if shape.op == "ag" else config.schedule
    lay = layout(shape, schedule, config.block_m, config.block_n)
    t_gemm = meas.t_gemm(schedule, config.comm_sms)
    cap = 0 if config.transport == "p2p" else config.comm_sms
    curve = meas.curve(comm_kind(shape, config), cap)
    if lay is None or t_gemm is None or curve is None:
        return None
    sizes = _group_sizes(lay, config.groups)
    nbytes, tiles = lay.sizes_bytes_tiles(sizes)
    if shape.op == "ag":
        return comm_then_gemm(t_gemm, lay.lead_tiles, tiles, nbytes, curve, lay.total_tiles)
    wave = wave_tiles(meas.sms, config.comm_sms, lay.total_tiles)
    return (gemm_then_comm(t_gemm, tiles, nbytes, curve, lay.total_tiles, wave, progress, contention, config.comm_sms)
            + meas.post.get(schedule, 0.0))


def predict_max_over_ranks(per_rank: Iterable[Tuple[Shape, Measurements]], config: OverlapConfig,
                           progress: str = DEFAULT_PROGRESS,
                           contention: Contention = Contention()) -> Optional[float]:
    """MoE entry point: every rank's own shape (its token count) and measurements; a step waits for the
    slowest rank, so the prediction is the max. None if any rank cannot be predicted."""
    times = [predict(shape, config, meas, progress, contention) for shape, meas in per_rank]
    return None if not times or any(x is None for x in times) else max(times)


def rank(shape: Shape, configs: Iterable[OverlapConfig], meas: Measurements, progress: str = DEFAULT_PROGRESS,
         contention: Contention = Contention()) -> List[Tuple[float, str, OverlapConfig]]:
    """(predicted ms, label, config), fastest first; equal predictions (to 1e-9 ms, common under the wave
    model) prefer fewer groups (less per-group host and launch cost), then the label; unpredictable
    ones dropped."""
    out = []
    for config in configs:
        ms = predict(shape, config, meas, progress, contention)
        if ms is not None:
            out.append((ms, label(config), config))

    def groups(config):
        return len(config.groups) if isinstance(config.groups, tuple) else 0

    out.sort(key=lambda x: (round(x[0], 9), groups(x[2]), x[1]))
    return out
