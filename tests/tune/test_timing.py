"""tune.timing's host-time runs without a GPU: the CUDA calls and the collectives stubbed (one rank, so the
slowest rank's figure is its own), the host's clock driven by the timed function itself."""
import torch

from overlap_tp.tune import timing


def test_enqueue_us_times_the_calls_after_the_warm_ones_behind_a_sleep_sized_by_the_first_run(monkeypatch):
    clock, sleeps, calls = [0.0], [], []
    cost_us = {"warm": 50.0, "timed": 10.0}   # the first calls of a run are slower, as on the H200 hosts

    def fn(x):
        calls.append(x)
        first_of_run = (len(calls) - 1) % 32 < 8   # runs of 8 warm + 24 timed calls
        clock[0] += (cost_us["warm"] if first_of_run else cost_us["timed"]) / 1e6
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None, raising=False)
    monkeypatch.setattr(timing.torch.cuda, "_sleep", lambda cycles: sleeps.append(cycles), raising=False)
    monkeypatch.setattr(timing, "sleep_cycles_per_ms", lambda: 1000.0)
    monkeypatch.setattr(timing.dist, "barrier", lambda group: None)
    monkeypatch.setattr(timing.dist, "all_reduce", lambda tensor, op=None, group=None: None)
    got = timing.enqueue_us(fn, [(0,), (1,), (2,)], None, calls=24, warm=8, rounds=3, device=torch.device("cpu"))
    assert abs(got - 10.0) < 1e-6                      # the 24 timed calls only
    assert len(calls) == 4 * 32                         # the first, unslept run was redone
    run_ms = (8 * 50.0 + 24 * 10.0) / 1e3
    assert len(sleeps) == 3 and all(abs(c - 4 * run_ms * 1000.0) <= 1 for c in sleeps)   # 4x the first run, in cycles
    assert calls[:32] == [i % 3 for i in range(32)]   # the sets in turn through warm and timed calls
