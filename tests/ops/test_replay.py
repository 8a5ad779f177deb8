"""CallGraphs' policy (ops/replay.py) on stand-in graphs: a key's first call issues eagerly, its second is captured
and launched, later ones launch the captured graph, each launch followed by the plan's watched event; past MAX_GRAPHS new keys issue eagerly with one warning; a call
that raises under capture leaves no graph; OVERLAP_TP_EAGER_GRAPHS=0 and CPU devices turn replays off. The replays
themselves run on GPUs (tests/gpu/test_replay_gpu.py)."""
import warnings
from types import SimpleNamespace

import pytest
import torch

from overlap_tp.ops import replay


class StandIn(replay.CallGraphs):
    """CallGraphs whose capture runs the call and keeps what it was given, and whose launch counts."""

    def __init__(self):
        self.recorded = []
        super().__init__(torch.device("cuda", 0), SimpleNamespace(describe="gemm_rs(test)", record=self.recorded.append))
        self.captured, self.launched = [], []

    def capture(self, call, args):
        call(*args)
        graph = ("graph", args)
        self.captured.append(graph)
        return graph

    def launch(self, graph):
        self.launched.append(graph)


def test_first_sighting_eager_second_captured_then_replayed():
    graphs, issued = StandIn(), []
    outcomes = [graphs.replayed(key, 7, issued.append, key) for key in ("a", "b", "a", "a", "b", "c", "b")]
    assert outcomes == [False, False, True, True, True, False, True]
    assert graphs.captured == [("graph", ("a",)), ("graph", ("b",))]   # each key once, at its second call
    assert issued == ["a", "b"]                                            # the calls the captures issued
    # in call order: a's second (captured, then launched at once) and third, b's second and third
    assert graphs.launched == [("graph", ("a",))] * 2 + [("graph", ("b",))] * 2
    assert graphs.recorded == [7] * 4   # the plan's watched event behind every launch, on the call's stream
    assert sorted(graphs.graphs) == ["a", "b"]


def test_past_max_graphs_new_keys_issue_eagerly_with_one_warning(monkeypatch):
    monkeypatch.setattr(replay, "MAX_GRAPHS", 2)
    graphs = StandIn()
    for key in ("a", "a", "b", "b"):
        graphs.replayed(key, 7, lambda: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [graphs.replayed(key, 7, lambda: None) for key in ("c", "c", "c", "d")] == [False] * 4
    assert len(caught) == 1 and "2 sets of operand addresses" in str(caught[0].message)
    assert sorted(graphs.graphs) == ["a", "b"] and len(graphs.captured) == 2
    assert graphs.replayed("a", 7, lambda: None)   # the kept graphs still replay


def test_seen_keys_are_bounded(monkeypatch):
    monkeypatch.setattr(replay, "MAX_SEEN", 3)
    graphs = StandIn()
    for key in range(4):   # the fourth first sighting forgets the three before
        assert not graphs.replayed(key, 7, lambda: None)
    assert not graphs.replayed(0, 7, lambda: None)   # forgotten: a first sighting again
    assert graphs.replayed(3, 7, lambda: None)


def test_a_call_that_raises_under_capture_leaves_no_graph():
    class Failing(StandIn):
        def capture(self, call, args):
            call(*args)

    graphs = Failing()

    def boom():
        raise ValueError("bad operand")
    assert not graphs.replayed("k", 7, boom)
    with pytest.raises(ValueError, match="bad operand"):
        graphs.replayed("k", 7, boom)
    assert graphs.graphs == {} and graphs.launched == [] and graphs.recorded == []


def test_enabled_on_cuda_unless_turned_off(monkeypatch):
    monkeypatch.delenv(replay.ENV, raising=False)
    assert replay.enabled(torch.device("cuda", 0))
    assert not replay.enabled(torch.device("cpu"))
    for value, on in (("1", True), ("", True), ("0", False)):
        monkeypatch.setenv(replay.ENV, value)
        assert replay.enabled(torch.device("cuda", 0)) == on, value
    monkeypatch.setenv(replay.ENV, "no")   # not silently on: a plan's build fails naming the variable
    with pytest.raises(ValueError, match="OVERLAP_TP_EAGER_GRAPHS='no': expected 1"):
        replay.enabled(torch.device("cuda", 0))


def test_a_dense_plans_call_issues_or_launches_by_its_operands_key():
    graphs, issued = StandIn(), []

    def tensor(address):
        return SimpleNamespace(data_ptr=lambda: address, stride=lambda dim: 64 if dim == 0 else 1)

    def issue(stream, a, w, bias, out, capturing):
        issued.append((stream, capturing))
    a, w, out = tensor(256), tensor(512), tensor(1024)
    graphs.call(issue, 5, True, a, w, None, out)     # under the user's capture: issued into it, no graph of ours
    graphs.call(issue, 5, False, a, w, None, out)    # the key's first sighting: issued eagerly
    assert issued == [(5, True), (5, False)] and graphs._seen == {replay.operands_key(a, w, out, None)}
    graphs.graphs[replay.operands_key(a, w, out, None)] = "graph"
    graphs.call(issue, 5, False, a, w, None, out)    # a key with a graph: launched, nothing issued
    assert issued == [(5, True), (5, False)] and graphs.launched == ["graph"] and graphs.recorded == [5]
    graphs.call(issue, 5, False, a, w, None, tensor(2048))   # another output address: another key
    assert issued[-1] == (5, False) and graphs.launched == ["graph"]
    assert replay.operands_key(a, w, out, tensor(4096)) != replay.operands_key(a, w, out, None)
