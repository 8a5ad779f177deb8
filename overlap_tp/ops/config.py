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
    """How one overlapped op (gemm_rs, gemm_ar, ...) runs.

    method:
      signal     the persistent Triton GEMM signals per group of tiles; each group's collective starts
                 on the comm stream as soon as its tiles are stored.
      decompose  the GEMM split along M into `chunks` cuBLAS calls, each chunk's collective on the comm
                 stream (what Megatron/TE call pipelining); a baseline and a fallback. With transport 'p2p'
                 (gemm_rs and ag_gemm, CUDA): cuBLAS GEMMs over the p2p transports below, no SM spent on
                 communication and no Triton GEMM (gemm_rs: one GEMM per owner's region, written straight
                 into its symmetric buffer; ag_gemm: the local rows' GEMM from the shard itself while the copy
                 engines pull the peers' rows in `chunks`, then each chunk's GEMM).
      off        cuBLAS then the collective, on one stream (Megatron's default path).
      auto       the wave-group tuner's choice for the shape (overlap_tp.tune.choose, docs/tuner.md): read
                 from the tuning cache, else measured once on every rank of the group together at the
                 first call of the shape and cached; `off` where overlap does not beat it. CPU tensors
                 run `off` (with a warning).
    schedule:    tile order of the signaled GEMM+collective. `row_slice` writes every group straight into
                 the layout the collective needs, so the result lands in Megatron's standard layout;
                 `tile_exact` follows the tile raster and leaves tiles in execution order, undone after the
                 collective. ag_gemm has one schedule (local rows first, then the peers' chunks).
    groups:      "auto" (a first rule: about 16 MB of output per group, 2 to 8 groups), an int (that many
                 near-equal groups) or a tuple of per-group sizes in schedule units (row_slice: row-slices
                 of block_m rows of every rank's region; tile_exact: tile positions of a rank's region;
                 ag_gemm: the chunks in which the peers' rows arrive, in row-slices of the local rows).
    transport:   how `signal` and `decompose` move the data. `nccl`: one NCCL collective per group (chunk)
                 on the comm stream. `p2p` (gemm_rs and ag_gemm, CUDA only): no collective. gemm_rs: the
                 GEMM's epilogue stores each region's rows straight into the owner's symmetric-memory buffer
                 over NVLink, then a barrier and one add per rank (schedule and groups do not apply). ag_gemm:
                 `nccl` broadcasts each chunk in place (signal needs comm_sms >= 1); `p2p` pulls the peers'
                 rows with copy-engine copies from their symmetric gathered buffers (no SM), or, for `signal`
                 with comm_sms > 0, with one kernel per call on those SMs that also does the call's handshakes
                 (kernels/peer_copy.py: the fixed cost of small AllGathers, session 34).
    comm_sms:    SMs left to the collective: the GEMM grid is (SMs - comm_sms) and NCCL runs on a
                 communicator capped at comm_sms CTAs. 0 gives the GEMM every SM and leaves NCCL uncapped.
                 ag_gemm's signal over p2p: the CTAs of its pull kernel (0: the copy engines pull).
    chunks:      M-chunks of the `decompose` method (gemm_rs over p2p: one GEMM per region, chunks unused).
    copy_lanes:  streams the p2p AllGather's copy-engine pulls are split over (ag_gemm and gather_rows, transport
                 'p2p'): each chunk's rows in `copy_lanes` near-equal parts, one per stream, each lane starting at a
                 different peer, so that several copy engines can move them at once. Measured on four H200s
                 (docs/perf/s22): no faster, the copy engines together move 210-270 GB/s per rank however they are
                 driven. 1: every pull on the comm stream. Not with the SM pulls (comm_sms > 0): a ValueError.
    chunk_by:    how ag_gemm's copy-engine pulls (transport 'p2p', comm_sms 0, one copy lane) cut the peers' rows
                 into chunks. 'rows': chunk c is the same run of row-slices of every peer's region (t - 1 copies and
                 one ready flag per chunk; `groups` counts chunks). 'peer': chunk c is a run of row-slices of one
                 peer's region, the peers in ring order (one copy and one flag per chunk; `groups` counts chunks per
                 peer, 'auto' aiming at the same ~16 MB per chunk: one per peer at the 8B shapes at t = 4), as
                 PyTorch's async-TP pulls whole shards: t - 1 copies where 'rows' needs (t - 1) x chunks. Method
                 'decompose' the same: `chunks` per peer, each pulled, then multiplied, peer by peer.
                 'auto' (the default; chunk_by_for): 'peer' for method 'signal' on those copy-engine pulls with
                 `groups` 'auto' where the group has more than two ranks, else 'rows'. Measured under graphs at
                 t = 4 (four H100s, session 35): 'peer' faster on all four AllGather shapes of `bench ops` (l8b.qkv
                 0.298 -> 0.242 ms, l70b.qkv 0.602 -> 0.518; async-TP 0.226 / 0.494), one 8B layer 1.061 -> 1.037
                 of the no-communication counterfactual, the 70B layer 1.024 -> 1.005, llama3-8b at TP 4 -0.6% per
                 iteration (docs/perf/s35): one whole peer region is copied at ~350 GB/s, a third of it at ~280 with
                 2-5 us after each copy. At t = 2 (one peer) the two cut the
                 same rows and tie (session 34), so 'auto' keeps 'rows' there; explicit `groups` (the tuner's
                 partitions) mean row chunks, as the tuner's model of them does.
    rs_transfer: how gemm_rs on the p2p transport moves the peers' partial sums into their owners' receive
                 buffers. 'epilogue': the GEMM's epilogue stores each peer's tiles over NVLink as it computes them
                 (the SMs move the bytes, so the GEMM lasts as long as the transfer). 'copy': the GEMM stores them
                 locally, one peer's region after another in ring order and its own region last, and the copy
                 engines push each region as soon as its tiles are stored (ops/p2p.py, P2PReduceScatter): the GEMM
                 runs at its own speed and whatever follows it on the stream (the backward's wgrad GEMM before the
                 norm sums the slots) runs beside the pushes. `groups` counts pushes per peer ('auto': ~16 MB each,
                 one per peer where t > 2). Method 'signal': one persistent GEMM raising a counter per push, one SM
                 left to the comm stream's waits (a captured graph waits with one-thread kernels); method
                 'decompose': one cuBLAS GEMM per push (the cuBLAS kernels' speed, each push behind a stream
                 dependency, no wait kernel). 'auto' (the default; rs_transfer_for): 'copy' for method 'signal' where
                 the group has more than two ranks, else 'epilogue' (method 'decompose' with 'copy' is explicit, and a
                 tuner candidate where t > 2: the fastest op on three of four shapes in session 37, a tie in the
                 layer). Measured under graphs on four H200s (docs/perf/s36): 'copy' faster at t = 4
                 on l8b.fc2 (0.395 -> 0.372 ms), l70b.proj (0.485 -> 0.463) and l70b.fc2 (1.455 -> 1.359), slower on
                 l8b.proj (0.224 -> 0.246: its 48 MB outlast its 0.1 ms GEMM, and the copies move them slower than
                 the stores); one 8B / 70B layer 1.045 / 1.009 -> 1.034 / 0.984 of the no-communication
                 counterfactual; the 70B proxy at TP 4 -1.0 / -1.3% per iteration, llama3-8b -0.2%. At t = 2 a tie
                 or a loss (the 70B layer 0.984 -> 0.998), so 'auto' keeps the epilogue there.
    block_*, num_stages, num_warps: the GEMM's tile shape and pipelining.
    tile_by_shape: with the default tile (128x256x64, 3 stages, 8 warps), a signaled plan takes the narrow
                 tile 128x128x64 / 4 stages / 4 warps instead where the GEMM's tiles fill the GPU's waves so much
                 better that it wins (tile_for_shape: small GEMMs such as the smoke recipe's backward ones);
                 under method 'auto' too (the tuner picks method, schedule, groups and SMs for the default
                 tile; the rule then picks the tile). Any other tile, or tile_by_shape=False, keeps the tile.
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
# The time of one wave of narrow tiles relative to one wave of default tiles: half the FLOPs per tile at ~92% of
# the default tile's throughput (l8b's GEMMs at s 8192, where both fill many waves: 128x128 ran at 0.897 of cuBLAS,
# 128x256 at 0.978; docs/perf/s14/README.md).
NARROW_WAVE_COST = 0.55


def tile_for_shape(config: "OverlapConfig", m: int, n: int, programs: int) -> "OverlapConfig":
    """The config with the tile its signaled GEMM C[m, n] runs on `programs` persistent programs (see
    OverlapConfig.tile_by_shape): the narrow tile where its waves cost less than the default tile's,

        ceil(tiles_narrow / programs) * NARROW_WAVE_COST < ceil(tiles_default / programs)

    (a wave's time is its slowest program's, so a last wave half full costs a whole one). At the smoke
    recipe's backward GEMMs (M 4096, N 512 or 1408) the default tile leaves half the SMs idle or runs a second
    wave 45% full; at BENCHMARKS.md's 8B and 70B shapes the rule keeps the default tile."""
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
# NVLink the all-to-all is 3-10% of the grouped GEMM, so 16 SMs taken from the GEMM cost more than the
# exchange hides; 2-4 SMs and 2-4 parts per peer were the best corners of the sweep (docs/perf/moe_ops.md).
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
