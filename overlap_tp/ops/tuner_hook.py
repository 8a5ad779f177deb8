"""The hook through which the tuner resolves method='auto'. The tuner (overlap_tp.tune) sits above the op layer: it
registers its resolver here when imported (overlap_tp's package __init__ imports it), so the op layer imports
nothing above it."""
from typing import Callable, Optional

from overlap_tp.ops.config import OverlapConfig

_auto_resolver: Optional[Callable] = None


def set_auto_resolver(resolver: Optional[Callable]):
    """resolver(op, m, n, k, dtype, device, group, base) -> OverlapConfig with a method other than 'auto'."""
    global _auto_resolver
    _auto_resolver = resolver


def resolve_auto(op: str, m: int, n: int, k: int, dtype, device, group, base: OverlapConfig) -> OverlapConfig:
    """method='auto' resolved for an op of this shape (m: the output rows). Raises where no tuner is loaded."""
    if _auto_resolver is None:
        raise RuntimeError(f"overlap_tp {op}: method='auto' needs the tuner: import overlap_tp (or overlap_tp.tune) "
                           f"before building the op, or pass a config with another method")
    config = _auto_resolver(op, m, n, k, dtype, device, group, base)
    if config.method == "auto":
        raise RuntimeError(f"overlap_tp {op}: the auto resolver returned method='auto'")
    return config
