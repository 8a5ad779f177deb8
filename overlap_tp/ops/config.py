"""OverlapConfig: everything an overlapped op has to choose, each field validated up front and left unset (None)
where the caller has no opinion. ops/resolve.py fills the unset fields for an op kind, shape, group and device."""
from dataclasses import dataclass
from typing import Optional, Tuple, Union

METHODS = ("signal", "decompose", "off", "auto")
SCHEDULES = ("row_slice", "tile_exact")
TRANSPORTS = ("nccl", "p2p")
CHUNK_BY = ("rows", "peer")
RS_TRANSFERS = ("epilogue", "copy")


@dataclass(frozen=True)
class OverlapConfig:
    """How one overlapped op (gemm_rs, gemm_ar, ag_gemm, the expert ops) runs. Frozen; every field is validated
    when the config is built (a ValueError naming the field). Every field defaults to None, "unset": the resolver
    (ops/resolve.py `resolve`) fills each unset field when a plan is built, from the op kind, the shape, the group's
    size and the device (and method 'auto' through the tuner), so one config can serve every group size and shape;
    a field given is kept. For chunk_by and rs_transfer 'auto' is accepted and means unset. What each field
    resolves to when unset is said below ("unset:").

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
                 overlap beats it. CPU tensors run `off` (with a warning). The expert ops do not tune: 'auto'
                 runs 'off' there (OverlapMoELayer times off, signal and decompose itself). Unset: 'auto'.
    schedule:    tile order of the signaled GEMM + NCCL collectives. `row_slice` writes every group straight into
                 the layout the collective needs (the result lands in Megatron's standard layout); `tile_exact`
                 follows the tile raster and leaves tiles in execution order, undone after the collective.
                 ag_gemm has one schedule (local rows first, then the peers' chunks). Unset: 'row_slice'.
    groups:      "auto" (about 16 MB of output per group, 2 to 8 groups), an int (that many near-equal groups)
                 or a tuple of per-group sizes in schedule units (row_slice: row-slices of block_m rows of every
                 rank's region; tile_exact: tile positions of a rank's region; ag_gemm: chunks of the peers'
                 rows, in row-slices of the local rows). Unset: 'auto' for the dense ops, 2 for the expert ops
                 (a few parts per peer measured best at EP 2: docs/performance.md).
    transport:   how `signal` and `decompose` move the data. `nccl`: one NCCL collective per group (chunk) on
                 the comm stream (ag_gemm: each chunk broadcast in place; signal needs comm_sms >= 1). `p2p`
                 (gemm_rs, gemm_ar and ag_gemm, CUDA, one NVLink domain): no collective. gemm_rs: the partial
                 sums go straight into the owners' symmetric receive buffers (rs_transfer), then each rank sums
                 its t slots. ag_gemm: the copy engines pull the peers' rows from their symmetric gathered
                 buffers (no SM), or, for `signal` with comm_sms > 0, one kernel per call on those SMs pulls
                 them and does the call's handshakes itself (kernels/peer_copy.py: cheaper fixed costs, for
                 short ops). Unset: 'p2p' for ag_gemm and gemm_rs with method signal or decompose on CUDA tensors
                 (no NCCL kernel beside a sequence-parallel GEMM: fastest under graphs at TP 2 for both methods,
                 docs/performance.md "Layer defaults"), else 'nccl' (gemm_ar, the expert ops, CPU tensors).
    comm_sms:    SMs left to communication: the GEMM grid is (SMs - comm_sms) and NCCL runs on a communicator
                 capped at comm_sms CTAs; 0 gives the GEMM every SM and leaves NCCL uncapped. ag_gemm's signal
                 over p2p: the CTAs of its pull kernel (0: the copy engines pull). Unset: 0 on the p2p transport
                 (the GEMMs on every SM); on nccl 16 for the dense ops and 4 for the expert ops (at EP 2 the
                 all-to-all is a small share of the grouped GEMM: docs/performance.md).
    chunks:      parts of the `decompose` method (gemm_rs over p2p: one GEMM per region, chunks unused). Unset: 4.
    copy_lanes:  streams the p2p AllGather's copy-engine pulls are split over (ag_gemm and gather_rows): each
                 chunk's rows in `copy_lanes` near-equal parts, one per stream, each lane starting at a different
                 peer. 1 (unset): every pull on the comm stream; more lanes measured no faster, as the copy
                 engines share one ceiling per rank (docs/performance.md). With the SM pulls (comm_sms > 0): a
                 ValueError.
    chunk_by:    how ag_gemm's copy-engine pulls (transport 'p2p', comm_sms 0, one copy lane) cut the peers' rows
                 into chunks. 'rows': chunk c is the same row-slices of every peer's region (t - 1 copies per
                 chunk). 'peer': chunk c is row-slices of one peer's region, the peers in ring order (one copy per
                 chunk; `groups` counts chunks per peer), as PyTorch's async-TP pulls; 'decompose' then pulls and
                 multiplies peer by peer. Unset (resolve.chunk_by_for): 'peer' for 'signal' with `groups` 'auto' where
                 t > 2, else 'rows' (explicit `groups`, the tuner's partitions, mean row chunks). Why: a copy
                 engine moves one large copy faster than several small ones, and at t > 2 the pulls set the op's
                 time (docs/performance.md); at t = 2 the two cut the same rows.
    rs_transfer: how gemm_rs on the p2p transport moves the peers' partial sums into their owners' receive
                 buffers. 'epilogue': the GEMM's epilogue stores them over NVLink as it computes them (the SMs
                 move the bytes). 'copy': the GEMM stores them locally, the peers' regions in ring order and its
                 own last, and the copy engines push each region as soon as it is stored (ops/p2p_reduction.py
                 P2PReduceScatter; `groups` counts pushes per peer): the SMs stay with the GEMM and with what
                 follows it on the stream (the backward's wgrad). 'signal' leaves one SM to the comm stream's
                 waits; 'decompose' runs one cuBLAS GEMM per push. Unset (resolve.rs_transfer_for): 'copy' for 'signal'
                 where t > 2, else 'epilogue' ('decompose' with 'copy' is explicit, and a tuner candidate). Why:
                 at t > 2 the transfers outlast the GEMM; at t = 2 the epilogue is as fast or faster
                 (docs/performance.md).
    block_*, num_stages, num_warps: the GEMM's tile shape and pipelining. Unset: the default tile
                 (tile_rule.DEFAULT_TILE).
    tile_by_shape: (unset: True) with the default tile (128x256x64, 3 stages, 8 warps), a signaled plan takes the narrow tile
                 128x128x64 / 4 stages / 4 warps instead where that fills the GPU's waves enough better to win
                 (tile_rule.tile_for_shape: small GEMMs such as the smoke recipe's backward ones); under method 'auto' too
                 (the tuner picks method, schedule, groups and SMs for the default tile; the rule then picks the
                 tile). Any other tile, or tile_by_shape=False, keeps the tile.
    """

    method: Optional[str] = None
    schedule: Optional[str] = None
    groups: Union[None, str, int, Tuple[int, ...]] = None
    transport: Optional[str] = None
    comm_sms: Optional[int] = None
    chunks: Optional[int] = None
    copy_lanes: Optional[int] = None
    chunk_by: Optional[str] = None
    rs_transfer: Optional[str] = None
    block_m: Optional[int] = None
    block_n: Optional[int] = None
    block_k: Optional[int] = None
    num_stages: Optional[int] = None
    num_warps: Optional[int] = None
    tile_by_shape: Optional[bool] = None

    def __post_init__(self):
        for name in ("chunk_by", "rs_transfer"):   # 'auto': the resolver decides, as for a field left unset
            if getattr(self, name) == "auto":
                object.__setattr__(self, name, None)

        def given(name):
            return getattr(self, name) is not None

        def choice(name, allowed):
            if given(name) and getattr(self, name) not in allowed:
                raise ValueError(f"OverlapConfig.{name}={getattr(self, name)!r}: expected one of {allowed}")

        choice("method", METHODS)
        choice("schedule", SCHEDULES)
        choice("transport", TRANSPORTS)
        choice("chunk_by", CHUNK_BY)
        choice("rs_transfer", RS_TRANSFERS)
        groups = self.groups
        if isinstance(groups, list):
            groups = tuple(groups)
            object.__setattr__(self, "groups", groups)
        if groups is not None:
            if isinstance(groups, bool) or not (groups == "auto" or isinstance(groups, (int, tuple))):
                raise ValueError(f"OverlapConfig.groups={groups!r}: expected 'auto', an int or a tuple of ints")
            if isinstance(groups, int) and groups < 1:
                raise ValueError(f"OverlapConfig.groups={groups}: need at least one group")
            if isinstance(groups, tuple) and (not groups or any(
                    isinstance(g, bool) or not isinstance(g, int) or g < 1 for g in groups)):
                raise ValueError(f"OverlapConfig.groups={groups!r}: a tuple of positive ints is expected")
        for name, least in (("comm_sms", 0), ("chunks", 1), ("copy_lanes", 1), ("num_stages", 1), ("num_warps", 1)):
            value = getattr(self, name)
            if given(name) and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise ValueError(f"OverlapConfig.{name}={value!r}: expected an int >= {least}")
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if given(name) and (isinstance(value, bool) or not isinstance(value, int) or value < 16
                                or value & (value - 1)):
                raise ValueError(f"OverlapConfig.{name}={value!r}: expected a power of two >= 16")
        if given("num_warps") and self.num_warps & (self.num_warps - 1):
            raise ValueError(f"OverlapConfig.num_warps={self.num_warps}: expected a power of two")
        if given("tile_by_shape") and not isinstance(self.tile_by_shape, bool):
            raise ValueError(f"OverlapConfig.tile_by_shape={self.tile_by_shape!r}: expected True or False")

    def unset(self) -> Tuple[str, ...]:
        """The names of the fields left unset (None), in field order."""
        return tuple(name for name in self.__dataclass_fields__ if getattr(self, name) is None)
