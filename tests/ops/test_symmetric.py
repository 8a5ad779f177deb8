"""overlap_tp.ops.symmetric: every symmetric buffer counted by what it is for (torch's memory report cannot see
them: they are mapped outside its caching allocator)."""
from collections import Counter

import torch
from torch.distributed import _symmetric_memory as symm_mem

from overlap_tp.ops import symmetric


def test_buffers_are_counted_by_kind_and_summarised(monkeypatch):
    monkeypatch.setattr(symmetric, "_bytes", Counter())
    assert symmetric.allocated() == {} and symmetric.summary() == ""
    made = []

    def cpu_empty(rows, cols, dtype=None, device=None):   # the one-GPU harness swaps symm_mem.empty the same way
        made.append((rows, cols, dtype))
        return torch.empty(rows, cols, dtype=dtype)
    monkeypatch.setattr(symm_mem, "empty", cpu_empty)
    a = symmetric.empty(8192, 4096, dtype=torch.bfloat16, device="cpu", kind="gathered in place")
    alive = [symmetric.empty(8192, 4096, dtype=torch.bfloat16, device="cpu", kind="gathered in place"),
             symmetric.empty(2, 2, dtype=torch.int32, device="cpu", kind="signals"),
             symmetric.empty(4096, 1024, dtype=torch.bfloat16, device="cpu", kind="reduce-scatter slots")]
    assert a.shape == (8192, 4096) and a.dtype == torch.bfloat16 and len(made) == 4
    assert symmetric.allocated() == {"gathered in place": 2 * 8192 * 4096 * 2, "reduce-scatter slots": 4096 * 1024 * 2,
                                     "signals": 16}
    assert list(symmetric.allocated()) == ["gathered in place", "reduce-scatter slots", "signals"]   # largest first
    assert symmetric.summary() == "0.14 GB (gathered in place 0.13, reduce-scatter slots 0.01, signals 0.00)"
    del a   # a buffer dropped (a layer's buffer for an old shape) is no longer counted
    assert symmetric.allocated()["gathered in place"] == 8192 * 4096 * 2 and len(alive) == 3


def test_a_kind_whose_buffers_are_all_gone_is_not_listed(monkeypatch):
    monkeypatch.setattr(symmetric, "_bytes", Counter())
    monkeypatch.setattr(symm_mem, "empty", lambda rows, cols, dtype=None, device=None: torch.empty(rows, cols,
                                                                                                   dtype=dtype))
    buf = symmetric.empty(4, 4, dtype=torch.int32, device="cpu", kind="signals")
    assert symmetric.allocated() == {"signals": 64}
    del buf
    assert symmetric.allocated() == {} and symmetric.summary() == ""
