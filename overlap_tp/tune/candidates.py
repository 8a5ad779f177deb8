"""The candidate plans the tuner predicts (and, in exhaustive mode, measures) for one shape.

Per op:
  rs (gemm_rs), ar (gemm_ar)
      off; decompose with chunks in {2, 4, 8} x comm_sms in {0, 16}; signal/nccl with schedule in
      {row_slice, tile_exact} x comm_sms in {0, 8, 16} x group partitions; signal/p2p and decompose/p2p
      (no groups or chunks, comm_sms 0; CUDA only; ar's measured end to end, ar_p2p).
  ag (ag_gemm)
      off; decompose as above, and over p2p with chunks in {1, 2, 4} (CUDA only); signal with transport
      nccl (comm_sms in {8, 16}: a GEMM that spins on a chunk's flag on every SM would starve NCCL) or p2p
      (copy engine, comm_sms 0) x chunk partitions; signal/p2p with its pulls on {16, 32} SMs (sm_pulls) and, where
      t > 2, with one peer's rows per chunk (peer_pulls): both measured end to end, not modelled.

Partitions (FlashOverlap Alg. 1, adapted). Group sizes are in schedule units, as OverlapConfig.groups
and overlap_tp.ops.tile_plan.split_units take them: row_slice = row-slices of block_m rows (of every rank's
region for rs), tile_exact = tile positions, ag = row-slices of the local rows (chunk c = the same
rows of every peer). A wave is the tiles one grid of (SMs - comm_sms) programs computes at once; in
units that is  w = wave_tiles / unit_tiles  (rs row_slice: unit_tiles = t * ceil(N / block_n)).
Group boundaries sit on wave ends, floor(j * w) units (every unit when w < 1), because tiles of one
wave finish together: a boundary inside a wave only delays the group. Limits:
  |G1| <= 2 waves and |GP| <= 4 waves (rs/ar; at least one unit), P in 2..8;
  ag: the first chunk is hidden behind the local rows' GEMM, so only |GP| <= 4 waves, and P = 1 counts;
  middle groups are whole waves; when that gives more than `max_partitions` partitions, the middle
  boundaries are thinned to every s-th wave (smallest s that fits), deterministically.
Sizes of the space at the BENCHMARKS.md shapes: docs/tuner.md (`space_size` prints them).
"""
import dataclasses
import math
from dataclasses import dataclass
from itertools import combinations
from typing import Dict, List, Optional, Sequence, Tuple

from overlap_tp.ops.config import OverlapConfig
from overlap_tp.ops.resolve import common_defaults
from overlap_tp.ops.tile_rule import tile_of

OPS = ("rs", "ar", "ag")
OP_ALIASES = {"rs": "rs", "gemm_rs": "rs", "ar": "ar", "gemm_ar": "ar", "ag": "ag", "ag_gemm": "ag"}
COMM_SMS = (0, 8, 16)
AG_NCCL_COMM_SMS = (8, 16)
DECOMPOSE_CHUNKS = (2, 4, 8)
DECOMPOSE_COMM_SMS = (0, 16)
DECOMPOSE_P2P_CHUNKS = (1, 2, 4)   # ag_gemm's pulls per peer region (gemm_rs over p2p: one GEMM per region)
# ag_gemm's pulls by a kernel on the SMs the signaled GEMM leaves (handshakes inside it): the fixed cost per call is
# what it saves, so it pays where the op is short (the smoke recipe's shapes)
AG_SM_PULL_SMS = (16, 32)
MAX_GROUPS = 8
FIRST_WAVES = 2
LAST_WAVES = 4
MAX_PARTITIONS = 512        # per (schedule, transport, comm_sms)
ELEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def op_name(op: str) -> str:
    if op not in OP_ALIASES:
        raise ValueError(f"op {op!r}: expected one of {sorted(OP_ALIASES)}")
    return OP_ALIASES[op]


@dataclass(frozen=True)
class Shape:
    """One op call as the tuner sees it. The rank's GEMM is always m x n x k:
    rs/ar: a[m, k] (k = K_local) @ w[n, k].T;  ag: all_gather(a_shard[m/t, k]) @ w[n, k].T."""
    op: str
    m: int
    n: int
    k: int
    t: int
    dtype: str = "bfloat16"

    def __post_init__(self):
        object.__setattr__(self, "op", op_name(self.op))
        if self.m % self.t:
            raise ValueError(f"M={self.m} is not divisible by t={self.t}")

    @property
    def elem_bytes(self) -> int:
        return ELEM_BYTES[self.dtype]

    @property
    def m_local(self) -> int:
        return self.m // self.t


def _cdiv(a, b):
    return -(-a // b)


@dataclass(frozen=True)
class Layout:
    """How one (op, schedule) cuts the GEMM into schedule units.

    units: schedule units; unit_tiles: GEMM tiles per unit; lead_tiles: tiles computed before the
    first unit (ag: the local rows, which wait for nothing); total_tiles = lead + units * unit_tiles.
    Bytes of a group of units [j0, j1) (the collective's buffer per rank: the reduce-scatter's input,
    the all-reduce's tensor, the all-gather's output): row-slice kinds  mult * rows(j0, j1) * row_bytes
    with rows clipped at `rows_total`; tile_exact  (j1 - j0) * unit_bytes."""
    units: int
    unit_tiles: int
    lead_tiles: int
    block_m: int
    rows_total: Optional[int]   # row-slice kinds: rows the units cover (the last slice may be short)
    mult: int                   # regions (t for rs and ag, 1 for ar)
    row_bytes: int
    unit_bytes: int             # bytes of one full unit as the plan's split_units("auto") counts them

    @property
    def total_tiles(self) -> int:
        return self.lead_tiles + self.units * self.unit_tiles

    def group_bytes(self, j0: int, j1: int) -> int:
        if self.rows_total is None:
            return (j1 - j0) * self.unit_bytes
        rows = min(j1 * self.block_m, self.rows_total) - min(j0 * self.block_m, self.rows_total)
        return self.mult * rows * self.row_bytes

    def sizes_bytes_tiles(self, sizes: Sequence[int]) -> Tuple[List[int], List[int]]:
        nbytes, tiles, j0 = [], [], 0
        for size in sizes:
            nbytes.append(self.group_bytes(j0, j0 + size))
            tiles.append(size * self.unit_tiles)
            j0 += size
        return nbytes, tiles


def layout(shape: Shape, schedule: str, block_m: int, block_n: int) -> Optional[Layout]:
    """The unit structure of (shape, schedule), or None where the schedule cannot run the shape."""
    eb, t = shape.elem_bytes, shape.t
    n_tiles = _cdiv(shape.n, block_n)
    if shape.op == "ag":   # chunks of the local rows; the local rows' tiles go first
        slices = _cdiv(shape.m_local, block_m)
        return Layout(slices, (t - 1) * n_tiles, slices * n_tiles, block_m, shape.m_local, t, shape.k * eb,
                      (t - 1) * block_m * shape.k * eb)   # plan.ag_plan's unit bytes for groups='auto'
    regions, rows = (t, shape.m_local) if shape.op == "rs" else (1, shape.m)
    if schedule == "row_slice":
        return Layout(_cdiv(rows, block_m), regions * n_tiles, 0, block_m, rows, regions, shape.n * eb,
                      regions * block_m * shape.n * eb)
    if rows % block_m or shape.n % block_n:
        return None
    return Layout((rows // block_m) * n_tiles, regions, 0, block_m, None, regions, 0,
                  regions * block_m * block_n * eb)


def wave_tiles(sms: int, comm_sms: int, total_tiles: int) -> int:
    """Tiles per wave: the persistent grid is max(1, SMs - comm_sms) programs, at most one per tile."""
    return max(1, min(sms - comm_sms, total_tiles))


def wave_boundaries(units: int, wave_units: float) -> List[int]:
    """Unit counts at the end of waves 1, 2, ... (every unit when a unit is more than a wave)."""
    bounds, j = set(), 1
    while True:
        b = max(1, math.floor(j * wave_units + 1e-9))
        if b >= units:
            break
        bounds.add(b)
        j += 1
    return sorted(bounds)


def _count(first, last, mids_between, max_groups, allow_single):
    """How many partitions `_enumerate` yields (without building them)."""
    total = 1 if allow_single else 0
    for f in first:
        for l in last:
            if l < f:
                continue
            if l == f:
                total += 1      # two groups
                continue
            inner = mids_between(f, l)
            total += sum(math.comb(inner, p - 3) for p in range(3, max_groups + 1))
    return total


def partitions(units: int, wave_units: float, *, first_waves: Optional[float] = FIRST_WAVES,
               last_waves: float = LAST_WAVES, max_groups: int = MAX_GROUPS, allow_single: bool = False,
               max_partitions: int = MAX_PARTITIONS) -> List[Tuple[int, ...]]:
    """Group sizes (tuples summing to `units`) whose boundaries sit on wave ends, |G1| <= first_waves
    waves (None: no limit), |GP| <= last_waves waves, 2..max_groups groups (plus the one-group
    partition if allow_single). Deterministic order."""
    bounds = wave_boundaries(units, wave_units)
    first_max = units if first_waves is None else max(1, math.floor(first_waves * wave_units + 1e-9))
    last_max = max(1, math.floor(last_waves * wave_units + 1e-9))
    last = [b for b in bounds if units - b <= last_max]
    stride = 1
    while True:
        free = [b for i, b in enumerate(bounds) if (i + 1) % stride == 0]
        first = [b for b in (free if first_waves is None else bounds) if b <= first_max]

        def mids_between(f, l):
            return sum(1 for b in free if f < b < l)

        count = _count(first, last, mids_between, max_groups, allow_single)
        if count <= max_partitions or stride >= max(1, len(bounds)):
            break
        stride += 1
    out = [(units,)] if allow_single else []
    for f in first:
        for l in last:
            if l < f:
                continue
            if l == f:
                out.append((f, units - f))
                continue
            inner = [b for b in free if f < b < l]
            for p in range(3, max_groups + 1):
                for mid in combinations(inner, p - 3):
                    cuts = (0, f) + mid + (l, units)
                    out.append(tuple(b - a for a, b in zip(cuts, cuts[1:])))
    return out


def label(config: OverlapConfig) -> str:
    """A short, unique, stable name of a candidate (used as a key in measurements and reports)."""
    config = common_defaults(config)   # unset schedule, chunks, ...: the ops' defaults
    if config.method == "off":
        return "off"
    if config.method == "decompose" and config.transport == "p2p":
        return f"decompose-p2p/c{config.chunks}" + ("/copy" if config.rs_transfer == "copy" else "")
    if config.method == "decompose":
        return f"decompose/c{config.chunks}/sm{config.comm_sms}"
    groups = "auto" if config.groups is None else config.groups   # unset: the ops' 'auto'
    g = "-".join(map(str, groups)) if isinstance(groups, tuple) else str(groups)
    if config.chunk_by == "peer":
        return "p2p/by-peer" + ("" if groups == "auto" else f"/g{g}")
    if config.rs_transfer == "epilogue":
        return "p2p/epilogue"
    if config.transport == "p2p" and not isinstance(groups, tuple):
        return f"p2p/sm{config.comm_sms}"
    return f"{config.schedule}/{config.transport}/sm{config.comm_sms}/g{g}"


def config_from_label(name: str) -> OverlapConfig:
    """The inverse of label() for a signal config with explicit groups, e.g. row_slice/nccl/sm16/g1-15-5-6-2-3."""
    schedule, transport, sms, groups = name.split("/")
    return OverlapConfig(method="signal", schedule=schedule, transport=transport, comm_sms=int(sms[2:]),
                         groups=tuple(int(g) for g in groups[1:].split("-")))


def candidates(shape: Shape, sms: int, base: OverlapConfig = OverlapConfig(), *,
               comm_sms: Sequence[int] = COMM_SMS, max_partitions: int = MAX_PARTITIONS) -> List[OverlapConfig]:
    """Every candidate config for `shape` on a GPU with `sms` SMs; block sizes and stages from `base`. Each names its
    method, transport and comm_sms and has the op-independent defaults filled (groups 'auto' where it has no
    partition); chunk_by and rs_transfer are left to the ops' rules where a candidate does not set them."""
    return [dataclasses.replace(common_defaults(c), groups="auto") if c.groups is None else common_defaults(c)
            for c in _candidates(shape, sms, base, comm_sms, max_partitions)]


def _candidates(shape: Shape, sms: int, base: OverlapConfig, comm_sms: Sequence[int], max_partitions: int):
    fix = tile_of(base)   # the base's tile (unset: the default tile, as the ops resolve it)
    base = OverlapConfig(**fix)
    out = [OverlapConfig(method="off", transport="nccl", **fix)]
    for cs in DECOMPOSE_COMM_SMS:
        for chunks in DECOMPOSE_CHUNKS:
            out.append(OverlapConfig(method="decompose", transport="nccl", chunks=chunks, comm_sms=cs, **fix))
    out += measured_only(shape, fix)
    if shape.op == "ag":
        lay = layout(shape, "row_slice", base.block_m, base.block_n)
        for transport, sms_options in (("nccl", [c for c in AG_NCCL_COMM_SMS if c in comm_sms or not comm_sms]),
                                       ("p2p", [0])):
            for cs in sms_options:
                wu = wave_tiles(sms, cs, lay.total_tiles) / lay.unit_tiles if lay.unit_tiles else lay.units
                for sizes in partitions(lay.units, wu, first_waves=None, allow_single=True,
                                        max_partitions=max_partitions):
                    out.append(OverlapConfig(method="signal", schedule="row_slice", transport=transport,
                                             comm_sms=cs, groups=sizes, **fix))
        return out
    for schedule in ("row_slice", "tile_exact"):
        lay = layout(shape, schedule, base.block_m, base.block_n)
        if lay is None:
            continue
        for cs in comm_sms:
            wu = wave_tiles(sms, cs, lay.total_tiles) / lay.unit_tiles
            for sizes in partitions(lay.units, wu, max_partitions=max_partitions):
                out.append(OverlapConfig(method="signal", schedule=schedule, transport="nccl", comm_sms=cs,
                                         groups=sizes, **fix))
    if shape.op == "rs":
        out.append(OverlapConfig(method="signal", transport="p2p", comm_sms=0, **fix))
    return out


def measured_only(shape: Shape, fix) -> List[OverlapConfig]:
    """The candidates with no model, which measure.end_to_end times (predict returns None for them): cuBLAS over
    p2p, the AllGather's pulls on SMs and, at t > 2, its pulls one peer per chunk and the ReduceScatter's other
    transfer of each GEMM."""
    return (decompose_p2p(shape, fix) + sm_pulls(shape, fix) + peer_pulls(shape, fix) + rs_transfers(shape, fix)
            + ar_p2p(shape, fix))


def decompose_p2p(shape: Shape, fix) -> List[OverlapConfig]:
    """cuBLAS over the p2p transports (measured end to end: no model): gemm_rs one GEMM per region, ag_gemm the
    pulls in DECOMPOSE_P2P_CHUNKS chunks (gemm_ar's: ar_p2p)."""
    chunks = {"rs": (1,), "ag": DECOMPOSE_P2P_CHUNKS}.get(shape.op, ())
    return [OverlapConfig(method="decompose", transport="p2p", comm_sms=0, chunks=c, **fix) for c in chunks]


def sm_pulls(shape: Shape, fix) -> List[OverlapConfig]:
    """ag_gemm signaled with its pulls on SMs (measured end to end: no model); none for the other ops."""
    sms = AG_SM_PULL_SMS if shape.op == "ag" else ()
    return [OverlapConfig(method="signal", transport="p2p", comm_sms=cs, **fix) for cs in sms]


def peer_pulls(shape: Shape, fix) -> List[OverlapConfig]:
    """ag_gemm signaled, its copy-engine pulls one peer's rows per chunk (chunk_by 'peer'), where t > 2 (at t = 2 the
    one peer's chunks are the row chunks): measured end to end (no model); none for the other ops."""
    if shape.op != "ag" or shape.t <= 2:
        return []
    return [OverlapConfig(method="signal", transport="p2p", comm_sms=0, chunk_by="peer", **fix)]


def rs_transfers(shape: Shape, fix) -> List[OverlapConfig]:
    """gemm_rs over p2p with the transfer rs_transfer 'auto' does not pick for its GEMM, where t > 2 (at t = 2 both
    GEMMs store into the owners): the signaled GEMM's partials stored by its epilogue (the p2p candidate pushes them
    with the copy engines there), and cuBLAS per region into a local staging matrix, each region pushed by the copy
    engines after its GEMM (the decompose-p2p candidate stores into the owners; cuBLAS's speed beside the copy
    engines makes it the fastest op on some of the s 8192 shapes: docs/performance.md). Measured end to end (no
    model); none for the other ops."""
    if shape.op != "rs" or shape.t <= 2:
        return []
    return [OverlapConfig(method="signal", transport="p2p", comm_sms=0, rs_transfer="epilogue", **fix),
            OverlapConfig(method="decompose", transport="p2p", comm_sms=0, chunks=1, rs_transfer="copy", **fix)]


def ar_p2p(shape: Shape, fix) -> List[OverlapConfig]:
    """gemm_ar over p2p (ops/p2p_reduction.py P2PAllReduce: the p2p ReduceScatter, then the copy engines' pulls of
    the summed regions), with the signaled GEMM's epilogue stores and with cuBLAS per region: measured end to end (no
    model); none for the other ops. Faster than the NCCL signal where the GEMM is short, slower where it is long (8B /
    70B proj at t = 2: docs/performance.md), so the tuner measures it per shape."""
    if shape.op != "ar":
        return []
    return [OverlapConfig(method="signal", transport="p2p", comm_sms=0, **fix),
            OverlapConfig(method="decompose", transport="p2p", comm_sms=0, chunks=1, **fix)]


def space_size(shape: Shape, sms: int, base: OverlapConfig = OverlapConfig()) -> Dict[str, int]:
    """Candidates per kind (off / decompose / decompose/p2p / signal/nccl / signal/p2p) for the docs and the CLI."""
    counts: Dict[str, int] = {}
    for c in candidates(shape, sms, base):
        kind = "off" if c.method == "off" else c.method if c.method == "decompose" and c.transport == "nccl" else \
            f"{c.method}/{c.transport}"
        counts[kind] = counts.get(kind, 0) + 1
    counts["total"] = sum(counts.values())
    return counts

