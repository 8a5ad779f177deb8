"""method='auto' of the MoE layer (overlap_tp/megatron/moe_auto.py): the trial schedule, the decision the EP
group agrees on, and the fallback under CUDA graph capture; 2 gloo processes with timers that report set times.
The layer itself under auto: tests/megatron/test_moe_layer.py."""
import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core==0.16.1)")

from distributed import run_distributed  # noqa: E402


class _SetTimer:
    def __init__(self, ms):
        self._ms, self.started, self.ended = ms, False, False

    def record_start(self):
        self.started = True

    def record_end(self):
        self.ended = True

    def ms(self):
        assert self.started and self.ended
        return self._ms


def _check_decision(rank, world):
    import torch.distributed as dist

    from overlap_tp.megatron.moe_auto import MethodTrial
    # rank 0: off 1 ms, signal 2 ms; rank 1: off 3 ms, signal 2.5 ms -> the slowest ranks' medians: off 3, signal
    # 2.5: signal, although rank 0 alone would pick off
    methods = ("off", "signal")
    times = {0: {"off": 1.0, "signal": 2.0}, 1: {"off": 3.0, "signal": 2.5}}[rank]
    made = []

    def factory():
        method = methods[(2 + len(made)) % 2]   # timed calls come after one untimed call per method
        made.append(_SetTimer(times[method] + 0.01 * len(made)))
        return made[-1]

    said = []
    trial = MethodTrial(dist.group.WORLD, torch.device("cpu"), warn=said.append, warmup=1, trials=3,
                        timer_factory=factory, methods=methods)
    seen = []
    for _ in range(trial.schedule_length):
        method, timer = trial.next_call()
        seen.append((method, timer is not None))
        if timer is not None:
            timer.record_start()
            timer.record_end()
    assert seen == [("off", False), ("signal", False)] + [("off", True), ("signal", True)] * 3
    assert trial.chosen is None and not said
    for _ in range(3):   # the decision at the first call after the schedule, then the same method untimed
        assert trial.next_call() == ("signal", None)
    assert trial.medians == pytest.approx({"off": 3.03, "signal": 2.54}, abs=0.02)
    assert len(said) == 1 and "runs 'signal' from now on" in said[0] and "off 3.0" in said[0]
    chosen = [None] * world
    dist.all_gather_object(chosen, trial.chosen)
    assert chosen == ["signal"] * world


def test_the_ep_group_keeps_the_method_faster_on_its_slowest_rank():
    run_distributed(2, _check_decision)


def test_a_capture_before_the_decision_runs_off_and_says_so(monkeypatch):
    from overlap_tp.megatron import moe_auto
    said = []
    trial = moe_auto.MethodTrial(None, torch.device("cuda", 0), warn=said.append, timer_factory=lambda: None)
    monkeypatch.setattr(moe_auto.comm, "capturing", lambda device: True)
    assert trial.next_call() == ("off", None) and trial.next_call() == ("off", None)
    assert len(said) == 1 and "CUDA graph" in said[0] and "method 'off'" in said[0]
    assert trial.calls == 0 and trial.chosen is None   # the trial resumes once eager calls come


def _check_margin(rank, world):
    import torch.distributed as dist

    from overlap_tp.megatron.moe_auto import METHODS, MethodTrial
    assert METHODS == ("off", "signal", "decompose")
    # (signal ms, decompose ms, the pick) against off's 1 ms: 1% faster is within the margin, 3% is not; the faster
    # overlapped method is the candidate
    for signal_ms, decompose_ms, want in ((0.99, 0.995, "off"), (0.97, 1.2, "signal"), (0.97, 0.95, "decompose"),
                                          (1.3, 0.99, "off")):
        made = []
        times = {"off": 1.0, "signal": signal_ms, "decompose": decompose_ms}

        def factory():
            method = METHODS[len(made) % len(METHODS)]
            made.append(_SetTimer(times[method]))
            return made[-1]

        said = []
        trial = MethodTrial(dist.group.WORLD, torch.device("cpu"), warn=said.append, warmup=0, trials=3,
                            timer_factory=factory, margin=0.02)
        for _ in range(trial.schedule_length):
            timer = trial.next_call()[1]
            timer.record_start()
            timer.record_end()
        assert trial.next_call() == (want, None), (signal_ms, decompose_ms, trial.medians)
        assert "must win by 2%" in said[0]


def test_the_fastest_overlapped_method_must_beat_off_by_the_margin():
    run_distributed(2, _check_margin)


def test_the_trial_starts_with_the_baseline():
    from overlap_tp.megatron.moe_auto import MethodTrial
    with pytest.raises(ValueError, match="start with 'off'"):
        MethodTrial(None, torch.device("cpu"), methods=("signal", "off"))


def _check_one_rank(rank, world):
    import torch.distributed as dist

    from overlap_tp.megatron.moe_auto import MethodTrial
    said = []
    trial = MethodTrial(dist.group.WORLD, torch.device("cpu"), warn=said.append, timer_factory=lambda: 1 / 0)
    assert [trial.next_call() for _ in range(3)] == [("off", None)] * 3   # no trial call, no timer made
    assert len(said) == 1 and "one EP rank" in said[0]


def test_one_ep_rank_runs_off_without_a_trial():
    run_distributed(1, _check_one_rank)
