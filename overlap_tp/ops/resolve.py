"""The one resolver of an op's OverlapConfig: every field the caller left unset (None) filled from the op kind, the
shape, the group's size and the device. The functional API and the plans (OpPlan), the expert ops, the Megatron
layers and the flags all go through it, so the same intent gives the same op.

    config = resolve(config, "gemm_rs", device=device, t=t, group=group, m=m, n=n, k=k, dtype=dtype, programs=grid)

A field given is kept (method 'auto' excepted: the tuner replaces it; an empty operand, and 'auto' on CPU tensors,
run 'off'). What each unset field becomes, and the measurement behind it, is said on OverlapConfig's fields; the
rules are here:

    method       'auto'                       (the tuner's choice per shape; the expert ops run 'auto' as 'off')
    transport    transport_for                (p2p for ag_gemm / gemm_rs with signal or decompose on CUDA, else nccl)
    comm_sms     comm_sms_for                 (0 on p2p; on nccl 16 dense, 4 expert)
    groups       'auto' dense, 2 expert
    chunk_by     chunk_by_for (ag_gemm)       rs_transfer   rs_transfer_for (gemm_rs, gemm_ar)
    the tile     tile_rule.tile_for_shape     (signal on CUDA, where `programs` is given), else the default tile
    schedule 'row_slice', chunks 4, copy_lanes 1, tile_by_shape True
"""
import dataclasses
import warnings
from typing import Callable, Optional

import torch

from overlap_tp.ops.config import OverlapConfig
from overlap_tp.ops.tile_rule import DEFAULT_TILE, tile_for_shape
from overlap_tp.ops.tuner_hook import resolve_auto

DENSE_OPS = ("ag_gemm", "gemm_rs", "gemm_ar")
EXPERT_OPS = ("a2a_gemm", "gemm_a2a")
OP_KINDS = DENSE_OPS + EXPERT_OPS

# the fields whose default depends on nothing
COMMON_DEFAULTS = dict(schedule="row_slice", chunks=4, copy_lanes=1, tile_by_shape=True, **DEFAULT_TILE)
# comm_sms on the NCCL transport: the dense ops leave NCCL 16 CTAs (its bandwidth needs about that many); at EP 2 over
# NVLink the expert ops' all-to-all is a small share of the grouped GEMM, so 16 SMs taken from the GEMM cost more than
# the exchange hides, and a few SMs in a few parts per peer measured best (docs/performance.md)
NCCL_COMM_SMS = {"dense": 16, "expert": 4}
EXPERT_GROUPS = 2

_warned = set()


def _warn_once(message: str):
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=4)


def _check_op(op: str):
    if op not in OP_KINDS:
        raise ValueError(f"overlap_tp: unknown op kind {op!r}; expected one of {OP_KINDS}")


def transport_for(config: OverlapConfig, op: str, device: torch.device) -> str:
    """config.transport, or where unset: 'p2p' for ag_gemm and gemm_rs running signal or decompose on CUDA tensors (no
    NCCL kernel beside a sequence-parallel GEMM: the combination that measured fastest under graphs at TP 2 for both
    methods, docs/performance.md "Layer defaults"), else 'nccl' (gemm_ar, whose p2p transport is a tuner candidate;
    the expert ops; CPU tensors, where symmetric memory does not exist)."""
    if config.transport is not None:
        return config.transport
    p2p = op in ("ag_gemm", "gemm_rs") and config.method in ("signal", "decompose") and device.type == "cuda"
    return "p2p" if p2p else "nccl"


def comm_sms_for(config: OverlapConfig, op: str, transport: str) -> int:
    """config.comm_sms, or where unset: 0 on the p2p transport (the GEMMs on every SM; ag_gemm's pulls on the copy
    engines), NCCL_COMM_SMS on nccl."""
    if config.comm_sms is not None:
        return config.comm_sms
    return 0 if transport == "p2p" else NCCL_COMM_SMS["expert" if op in EXPERT_OPS else "dense"]


def chunk_by_for(config: OverlapConfig, t: int) -> OverlapConfig:
    """The config with chunk_by resolved for an ag_gemm of t ranks (see OverlapConfig.chunk_by): 'peer' where the
    signaled AllGather+GEMM pulls with the copy engines (transport 'p2p', comm_sms 0, one copy lane) in the default
    groups and t > 2, else 'rows'. An explicit chunk_by is kept; nothing else changes (unset copy_lanes and groups
    count as their defaults, 1 and 'auto')."""
    if config.chunk_by is not None:
        return config
    by_peer = (t > 2 and config.method == "signal" and config.transport == "p2p" and config.comm_sms == 0
               and config.copy_lanes in (None, 1) and config.groups in (None, "auto"))
    return dataclasses.replace(config, chunk_by="peer" if by_peer else "rows")


def rs_transfer_for(config: OverlapConfig, t: int) -> OverlapConfig:
    """The config with rs_transfer resolved for a gemm_rs (or gemm_ar's p2p ReduceScatter) of t ranks (see
    OverlapConfig.rs_transfer): 'copy' for method 'signal' on transport 'p2p' where t > 2, else 'epilogue'. An explicit
    rs_transfer is kept; nothing else changes."""
    if config.rs_transfer is not None:
        return config
    copy = t > 2 and config.method == "signal" and config.transport == "p2p"
    return dataclasses.replace(config, rs_transfer="copy" if copy else "epilogue")


def _fill(config: OverlapConfig, defaults: dict) -> OverlapConfig:
    unset = {name: value for name, value in defaults.items() if getattr(config, name) is None}
    return dataclasses.replace(config, **unset) if unset else config


def common_defaults(config: OverlapConfig) -> OverlapConfig:
    """The config with the fields whose default depends on no op, shape or device filled (COMMON_DEFAULTS: schedule,
    chunks, copy_lanes, tile_by_shape, the tile) where unset."""
    return _fill(config, COMMON_DEFAULTS)


def fill_defaults(config: Optional[OverlapConfig], op: str, device, t: int) -> OverlapConfig:
    """Every unset field filled by the rules that need no shape and no tuner (method unset becomes 'auto' and stays
    so; the tile is the default one). For callers that only ask how a config moves data (gather_rows) and for the
    last step of `resolve`."""
    _check_op(op)
    config = OverlapConfig() if config is None else config
    if not isinstance(config, OverlapConfig):
        raise TypeError(f"overlap_tp {op}: config must be an OverlapConfig, got {type(config).__name__}")
    device = torch.device(device)
    config = _fill(config, dict(COMMON_DEFAULTS, method="auto",
                                groups=EXPERT_GROUPS if op in EXPERT_OPS else "auto"))
    transport = transport_for(config, op, device)
    config = _fill(config, dict(transport=transport, comm_sms=comm_sms_for(config, op, transport)))
    config = chunk_by_for(config, t) if op == "ag_gemm" else _fill(config, dict(chunk_by="rows"))
    return rs_transfer_for(config, t) if op in ("gemm_rs", "gemm_ar") else _fill(config, dict(rs_transfer="epilogue"))


def resolve(config: Optional[OverlapConfig], op: str, *, device, t: int = 1, group=None, m: int = 0, n: int = 0,
            k: int = 0, dtype=None, programs: Optional[Callable[[OverlapConfig], int]] = None) -> OverlapConfig:
    """`config` (None: every field unset) with every field resolved for op kind `op` (DENSE_OPS, EXPERT_OPS) on
    `device`. The dense ops need the shape and the group: t its size, m the GEMM's output rows (ag_gemm: every rank's
    rows), n, k the weight's [N, K], dtype; method 'auto' asks the tuner (collectively over `group`, once per shape:
    the tuner keeps its decision). programs(config): the persistent GEMM's grid for a config (ops.plan_base.gemm_programs on the
    plan's device); given, a signaled config on CUDA gets the tile for its shape (tile_rule.tile_for_shape)."""
    _check_op(op)
    config = OverlapConfig() if config is None else config
    device = torch.device(device)
    if op in EXPERT_OPS:
        return fill_defaults(config, op, device, 1)
    method = config.method or "auto"
    if m == 0 or n == 0 or k == 0:
        if method != "off":
            _warn_once(f"overlap_tp {op}: an empty operand (M={m}, N={n}, K={k}) runs method 'off' (nothing to "
                       f"overlap)")
        method = "off"
    elif method == "auto" and device.type != "cuda":
        _warn_once(f"overlap_tp {op}: method='auto' runs 'off' on CPU tensors (the tuner measures on GPUs only)")
        method = "off"
    config = dataclasses.replace(config, method=method)
    if method == "auto":
        config = resolve_auto(op, m, n, k, dtype, device, group, config)
    config = fill_defaults(config, op, device, t)
    if config.method == "signal" and device.type == "cuda" and programs is not None:
        config = tile_for_shape(config, m, n, programs(config))
    return config
