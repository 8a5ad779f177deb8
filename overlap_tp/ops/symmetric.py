"""Symmetric memory, allocated and counted: every buffer the p2p transports allocate with torch's symmetric memory
comes through `empty`, which tallies its bytes by what the buffer is for.

Why count: symmetric memory is mapped by its own allocator (cuMemCreate), outside torch's caching allocator, so
torch.cuda.memory_allocated(), Megatron's memory report and its `max allocated` do not include it. `allocated()`
says how much this process holds (the training log prints it once: overlap_tp/training/throughput.py); the
largest user is gathering in place (OverlapSettings.gather_in_place: a gathered buffer per column-parallel layer)."""
import weakref
from collections import Counter

import torch

_bytes = Counter()   # what the buffers are for -> bytes of this process's live buffers


def empty(rows: int, cols: int, *, dtype, device, kind: str) -> torch.Tensor:
    """torch's symmetric memory [rows, cols] (symm_mem.empty, looked up per call: a test harness may replace it),
    counted under `kind`."""
    from torch.distributed import _symmetric_memory as symm_mem
    buf = symm_mem.empty(rows, cols, dtype=dtype, device=device)
    nbytes = buf.numel() * buf.element_size()
    _bytes[kind] += nbytes
    weakref.finalize(buf, _release, kind, nbytes)   # a plan or a layer's buffer dropped (a new shape) counts no more
    return buf


def _release(kind: str, nbytes: int):
    _bytes[kind] -= nbytes
    if _bytes[kind] <= 0:
        del _bytes[kind]


def allocated() -> dict:
    """{kind: bytes} of the symmetric memory this process holds (its buffers still alive), largest first."""
    return dict(_bytes.most_common())


def total() -> int:
    """Bytes of symmetric memory this process holds, every kind together."""
    return sum(_bytes.values())


def summary() -> str:
    """One line: the total and each kind, in GB (empty when nothing was allocated)."""
    counts = allocated()
    if not counts:
        return ""
    parts = ", ".join(f"{kind} {count / 1e9:.2f}" for kind, count in counts.items())
    return f"{total() / 1e9:.2f} GB ({parts})"
