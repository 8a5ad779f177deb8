"""OverlapConfig: everything an overlapped op has to choose, validated up front; and the hook through which
the tuner resolves method='auto'."""
from dataclasses import dataclass, replace
from typing import Callable, Optional, Tuple, Union

METHODS = ("signal", "decompose", "off", "auto")
SCHEDULES = ("row_slice", "tile_exact")
TRANSPORTS = ("nccl", "p2p")
CHUNK_BY = ("auto", "rows", "peer")
RS_TRANSFERS = ("auto", "epilogue", "copy")


@dataclass(frozen=True)
class OverlapConfig:
    """How one overlapped op (gemm_rs, gemm_ar, ag_gemm, the expert ops) runs. Frozen; every field is validated
    when the config is built (a ValueError naming the field). Fields left at 'auto' are resolved when a plan is
    built (method by the tuner, chunk_by by chunk_by_for, rs_transfer by rs_transfer_for, the tile by
    tile_for_shape), so one config can serve every group size and shape.

    method:
      signal     the persistent Triton GEMM signals per group of tiles; each group's transfer starts as soon
                 as its tiles are stored.
      decompose  the GEMM split into cuBLAS calls, each part's transfer on the comm stream (Megatron/TE's
                 pipelining). With transport 'p2p' (gemm_rs and ag_gemm, CUDA): no SM spent on communication
                 and no Triton GEMM (gemm_rs: one GEMM per owner's region, written into its symmetric buffer;
                 ag_gemm: the local rows' GEMM from the shard itself while the copy engines pull the peers'
                 rows in `chunks`, then each chunk's GEMM).
      off        cuBLAS then the collective, on one stream (Megatron's path).
      auto       the tuner's choice for the shape (overlap_tp.tune.choose, docs/tuner.md): from the tuning
                 cache, else measured once on every rank of the group together and cached; `off` where no
                 overlap beats it. CPU tensors run `off` (with a warning).
    schedule:    tile order of the signaled GEMM + NCCL collectives. `row_slice` writes every group straight into
                 the layout the collective needs (the result lands in Megatron's standard layout); `tile_exact`
                 follows the tile raster and leaves tiles in execution order, undone after the collective.
                 ag_gemm has one schedule (local rows first, then the peers' chunks).
    groups:      "auto" (about 16 MB of output per group, 2 to 8 groups), an int (that many near-equal groups)
                 or a tuple of per-group sizes in schedule units (row_slice: row-slices of block_m rows of every
                 rank's region; tile_exact: tile positions of a rank's region; ag_gemm: chunks of the peers'
                 rows, in row-slices of the local rows).
    transport:   how `signal` and `decompose` move the data. `nccl`: one NCCL collective per group (chunk) on
                 the comm stream (ag_gemm: each chunk broadcast in place; signal needs comm_sms >= 1). `p2p`
                 (gemm_rs, gemm_ar and ag_gemm, CUDA, one NVLink domain): no collective. gemm_rs: the partial
                 sums go straight into the owners' symmetric receive buffers (rs_transfer), then each rank sums
                 its t slots. ag_gemm: the copy engines pull the peers' rows from their symmetric gathered
                 buffers (no SM), or, for `signal` with comm_sms > 0, one kernel per call on those SMs pulls
                 them and does the call's handshakes itself (kernels/peer_copy.py: cheaper fixed costs, for
                 short ops).
    comm_sms:    SMs left to communication: the GEMM grid is (SMs - comm_sms) and NCCL runs on a communicator
                 capped at comm_sms CTAs; 0 gives the GEMM every SM and leaves NCCL uncapped. ag_gemm's signal
                 over p2p: the CTAs of its pull kernel (0: the copy engines pull).
    chunks:      parts of the `decompose` method (gemm_rs over p2p: one GEMM per region, chunks unused).
    copy_lanes:  streams the p2p AllGather's copy-engine pulls are split over (ag_gemm and gather_rows): each
                 chunk's rows in `copy_lanes` near-equal parts, one per stream, each lane starting at a different
                 peer. 1 (the default): every pull on the comm stream; more lanes measured no faster, as the copy
                 engines share one ceiling per rank (docs/performance.md). With the SM pulls (comm_sms > 0): a
                 ValueError.
    chunk_by:    how ag_gemm's copy-engine pulls (transport 'p2p', comm_sms 0, one copy lane) cut the peers' rows
                 into chunks. 'rows': chunk c is the same row-slices of every peer's region (t - 1 copies per
                 chunk). 'peer': chunk c is row-slices of one peer's region, the peers in ring order (one copy per
                 chunk; `groups` counts chunks per peer), as PyTorch's async-TP pulls; 'decompose' then pulls and
                 multiplies peer by peer. 'auto' (chunk_by_for): 'peer' for 'signal' with `groups` 'auto' where
                 t > 2, else 'rows' (explicit `groups`, the tuner's partitions, mean row chunks). Why: a copy
                 engine moves one large copy faster than several small ones, and at t > 2 the pulls set the op's
                 time (docs/performance.md); at t = 2 the two cut the same rows.
    rs_transfer: how gemm_rs on the p2p transport moves the peers' partial sums into their owners' receive
                 buffers. 'epilogue': the GEMM's epilogue stores them over NVLink as it computes them (the SMs
                 move the bytes). 'copy': the GEMM stores them locally, the peers' regions in ring order and its
                 own last, and the copy engines push each region as soon as it is stored (ops/p2p.py
                 P2PReduceScatter; `groups` counts pushes per peer): the SMs stay with the GEMM and with what
                 follows it on the stream (the backward's wgrad). 'signal' leaves one SM to the comm stream's
                 waits; 'decompose' runs one cuBLAS GEMM per push. 'auto' (rs_transfer_for): 'copy' for 'signal'
                 where t > 2, else 'epilogue' ('decompose' with 'copy' is explicit, and a tuner candidate). Why:
                 at t > 2 the transfers outlast the GEMM; at t = 2 the epilogue is as fast or faster
                 (docs/performance.md).
    block_*, num_stages, num_warps: the GEMM's tile shape and pipelining.
    tile_by_shape: with the default tile (128x256x64, 3 stages, 8 warps), a signaled plan takes the narrow tile
                 128x128x64 / 4 stages / 4 warps instead where that fills the GPU's waves enough better to win
                 (tile_for_shape: small GEMMs such as the smoke recipe's backward ones); under method 'auto' too
                 (the tuner picks method, schedule, groups and SMs for the default tile; the rule then picks the
                 tile). Any other tile, or tile_by_shape=False, keeps the tile.
    """

    method: str = "auto"
    schedule: str = "row_slice"
    groups: Union[str, int, Tuple[int, ...]] = "auto"
    transport: str = "nccl"
    comm_sms: int = 16
    chunks: int = 4
    copy_lanes: int = 1
    chunk_by: str = "auto"
    rs_transfer: str = "auto"
    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    num_stages: int = 3
    num_warps: int = 8
    tile_by_shape: bool = True

    def __post_init__(self):
        def choice(name, value, allowed):
            if value not in allowed:
                raise ValueError(f"OverlapConfig.{name}={value!r}: expected one of {allowed}")

        choice("method", self.method, METHODS)
        choice("schedule", self.schedule, SCHEDULES)
        choice("transport", self.transport, TRANSPORTS)
        choice("chunk_by", self.chunk_by, CHUNK_BY)
        choice("rs_transfer", self.rs_transfer, RS_TRANSFERS)
        groups = self.groups
        if isinstance(groups, list):
            groups = tuple(groups)
            object.__setattr__(self, "groups", groups)
        if isinstance(groups, bool) or not (groups == "auto" or isinstance(groups, (int, tuple))):
            raise ValueError(f"OverlapConfig.groups={groups!r}: expected 'auto', an int or a tuple of ints")
        if isinstance(groups, int) and groups < 1:
            raise ValueError(f"OverlapConfig.groups={groups}: need at least one group")
        if isinstance(groups, tuple) and (not groups or any(
                isinstance(g, bool) or not isinstance(g, int) or g < 1 for g in groups)):
            raise ValueError(f"OverlapConfig.groups={groups!r}: a tuple of positive ints is expected")
        for name in ("comm_sms",):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"OverlapConfig.{name}={getattr(self, name)!r}: expected an int >= 0")
        for name in ("chunks", "copy_lanes", "num_stages", "num_warps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"OverlapConfig.{name}={getattr(self, name)!r}: expected an int >= 1")
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"OverlapConfig.{name}={value!r}: expected a power of two >= 16")
        if self.num_warps & (self.num_warps - 1):
            raise ValueError(f"OverlapConfig.num_warps={self.num_warps}: expected a power of two")


DEFAULT_TILE = dict(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8)
NARROW_TILE = dict(block_n=128, num_stages=4, num_warps=4)
# The time of one wave of narrow tiles relative to one wave of default tiles: half the FLOPs per tile at a
# somewhat lower throughput than the default tile's, measured at the 8B GEMMs where both fill many waves
# (docs/performance.md).
NARROW_WAVE_COST = 0.55


def tile_for_shape(config: "OverlapConfig", m: int, n: int, programs: int) -> "OverlapConfig":
    """The config with the tile its signaled GEMM C[m, n] runs on `programs` persistent programs (see
    OverlapConfig.tile_by_shape): the narrow tile where its waves cost less than the default tile's,

        ceil(tiles_narrow / programs) * NARROW_WAVE_COST < ceil(tiles_default / programs)

    (a wave's time is its slowest program's, so a last wave half full costs a whole one). At the smoke
    recipe's backward GEMMs (M 4096, N 512 or 1408) the default tile leaves half the SMs idle or runs a second
    wave under half full; at the public 8B and 70B shapes (overlap_tp/tune/shapes.py) the rule keeps the default
    tile."""
    if not config.tile_by_shape or any(getattr(config, k) != v for k, v in DEFAULT_TILE.items()) or m == 0 or n == 0:
        return config
    rows = -(-m // DEFAULT_TILE["block_m"])

    def waves(block_n):
        return -(-rows * -(-n // block_n) // programs)

    if waves(NARROW_TILE["block_n"]) * NARROW_WAVE_COST < waves(DEFAULT_TILE["block_n"]):
        return replace(config, **NARROW_TILE)
    return config



def chunk_by_for(config: "OverlapConfig", t: int) -> "OverlapConfig":
    """The config with chunk_by 'auto' resolved for a group of t ranks (see OverlapConfig.chunk_by): 'peer' where
    the signaled AllGather+GEMM pulls with the copy engines (transport 'p2p', comm_sms 0, one copy lane) in the
    default groups and t > 2, else 'rows'. Any explicit chunk_by is kept."""
    if config.chunk_by != "auto":
        return config
    by_peer = (t > 2 and config.method == "signal" and config.transport == "p2p" and config.comm_sms == 0
               and config.copy_lanes == 1 and config.groups == "auto")
    return replace(config, chunk_by="peer" if by_peer else "rows")


def rs_transfer_for(config: "OverlapConfig", t: int) -> "OverlapConfig":
    """The config with rs_transfer 'auto' resolved for a gemm_rs of t ranks (see OverlapConfig.rs_transfer): 'copy'
    for method 'signal' on transport 'p2p' where t > 2, else 'epilogue'. Any explicit rs_transfer is kept."""
    if config.rs_transfer != "auto":
        return config
    copy = t > 2 and config.method == "signal" and config.transport == "p2p"
    return replace(config, rs_transfer="copy" if copy else "epilogue")

# The expert ops' (a2a_gemm, gemm_a2a) defaults where they differ from OverlapConfig's: at EP = 2 over
# NVLink the all-to-all is a small share of the grouped GEMM, so 16 SMs taken from the GEMM cost more than the
# exchange hides; a few SMs and a few parts per peer measured best (docs/performance.md).
EXPERT_OP_DEFAULTS = dict(groups=2, comm_sms=4)
DEFAULT_EXPERT_CONFIG = OverlapConfig(**EXPERT_OP_DEFAULTS)


# method='auto' is resolved by the tuner (overlap_tp.tune), which sits above the op layer: it registers its
# resolver here when imported (overlap_tp's package __init__ imports it), so the op layer imports nothing above.
_auto_resolver: Optional[Callable] = None


def set_auto_resolver(resolver: Optional[Callable]):
    """resolver(op, m, n, k, dtype, device, group, base) -> OverlapConfig with a method other than 'auto'."""
    global _auto_resolver
    _auto_resolver = resolver


def resolve_auto(op: str, m: int, n: int, k: int, dtype, device, group, base: "OverlapConfig") -> "OverlapConfig":
    """method='auto' resolved for an op of this shape (m: the output rows). Raises where no tuner is loaded."""
    if _auto_resolver is None:
        raise RuntimeError(f"overlap_tp {op}: method='auto' needs the tuner: import overlap_tp (or overlap_tp.tune) "
                           f"before building the op, or pass a config with another method")
    config = _auto_resolver(op, m, n, k, dtype, device, group, base)
    if config.method == "auto":
        raise RuntimeError(f"overlap_tp {op}: the auto resolver returned method='auto'")
    return config
