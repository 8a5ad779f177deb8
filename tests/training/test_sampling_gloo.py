"""Overlap statistics sampling (overlap_tp.training.sampling) under gloo: armed calls are stamped and recorded
against a reference measured once per shape on every rank; results are unchanged; calls that do not come
through the observer (async ones), disarmed calls and calls on a group of one rank are not stamped."""
import pytest
import torch
import torch.distributed as dist

from overlap_tp import OverlapConfig, ag_gemm, gemm_ar, gemm_rs
from overlap_tp.training.sampling import SAMPLER, OpSampler, OpShape, Reference, Sample, measure_reference, sample_iteration
from overlap_tp.training.throughput import OverlapStats
from distributed import run_distributed
from problems import SMALL_TILES, dense_problem

SIGNAL = OverlapConfig(method="signal", schedule="row_slice", groups=2, **SMALL_TILES)
OFF = OverlapConfig(method="off")


def _check_sampling(rank, world):
    a, w, _ = dense_problem(64, 48, 32, seed=3, bias=False)
    shard = slice(rank * 32 // world, (rank + 1) * 32 // world)
    a_k, w_k = a[:, shard].contiguous(), w[:, shard].contiguous()
    a_rows = a[rank * 64 // world:(rank + 1) * 64 // world].contiguous()
    unsampled = [gemm_rs(a_k, w_k, config=SIGNAL), gemm_ar(a_k, w_k, config=OFF), ag_gemm(a_rows, w, config=SIGNAL)]

    measured = []

    def measure(shape):
        measured.append(shape.kind)
        return measure_reference(shape)

    SAMPLER.measure, SAMPLER.samples, SAMPLER.references = measure, [], {}
    stats = OverlapStats()
    rng = torch.get_rng_state()
    observe = SAMPLER.observe   # what the layers call (overlap_tp.megatron.linear_functions.set_op_observer)
    SAMPLER.armed = True
    try:
        for _ in range(2):   # two calls of each shape: one reference each
            sampled = [observe("gemm_rs", lambda: gemm_rs(a_k, w_k, config=SIGNAL), a_k, w_k, None),
                       observe("gemm_ar", lambda: gemm_ar(a_k, w_k, config=OFF), a_k, w_k, None),
                       observe("ag_gemm", lambda: ag_gemm(a_rows, w, config=SIGNAL), a_rows, w, None)]
            for got, ref in zip(sampled, unsampled):
                assert torch.equal(got, ref)
        gemm_rs(a_k, w_k, config=SIGNAL, async_op=True).wait()   # async: the layers do not observe it
    finally:
        SAMPLER.armed = False
    observe("gemm_rs", lambda: gemm_rs(a_k, w_k, config=SIGNAL), a_k, w_k, None)   # disarmed: not stamped
    assert SAMPLER.collect(stats) == 6
    assert measured == ["gemm_rs", "gemm_ar", "ag_gemm"]
    # the references' random operands come from their own generator: training's random stream is untouched
    assert torch.equal(torch.get_rng_state(), rng)
    summary = stats.summary()
    assert set(summary["by_kind"]) == {"gemm_rs", "gemm_ar", "ag_gemm"}
    for kind, totals in summary["by_kind"].items():
        assert totals["calls"] == 2, kind
        assert totals["op_ms"] > 0 and totals["gemm_ms"] > 0 and totals["comm_ms"] > 0, kind
        assert totals["exposed_comm_ms"] >= 0 and 0 <= totals["comm_hidden"] <= 1, kind
    assert all(not record[4] for record in stats.records)   # host clocks: no GPU to wait
    assert SAMPLER.collect(stats) == 0   # the stamps were consumed
    # a call on a group of one rank (TP 1) moves nothing between ranks: run, not stamped
    alone = [dist.new_group([r]) for r in range(world)][rank]
    SAMPLER.armed = True
    try:
        got = observe("gemm_rs", lambda: torch.mm(a_k, w_k.t()), a_k, w_k, alone)
    finally:
        SAMPLER.armed = False
    assert torch.equal(got, torch.mm(a_k, w_k.t())) and SAMPLER.samples == []


@pytest.mark.parametrize("world", [2])
def test_armed_calls_are_recorded_against_a_reference_per_shape(world):
    run_distributed(world, _check_sampling)


def test_collect_records_each_sample_with_its_shapes_reference():
    measured = []
    sampler = OpSampler(measure=lambda shape: measured.append(shape) or Reference(gemm_ms=0.5, comm_ms=0.25))
    shape = OpShape("gemm_rs", (8, 4), (4, 4), torch.bfloat16, torch.device("cpu"), None)
    sampler.samples = [Sample(shape, 0.0, 0.001), Sample(shape, 1.0, 1.003, gpu_waited=True)]
    stats = OverlapStats()
    assert sampler.collect(stats) == 2
    assert measured == [shape]   # once per shape
    assert [(r[0], round(r[1], 6), r[2:]) for r in stats.records] == [
        ("gemm_rs", 1.0, (0.5, 0.25, False)), ("gemm_rs", 3.0, (0.5, 0.25, True))]


def test_was_armed_tells_a_sampled_step_from_an_unsampled_one():
    sampler = OpSampler(measure=None)
    assert not sampler.was_armed
    sampler.armed = True
    sampler.armed = False
    assert sampler.was_armed and sampler.collect(OverlapStats()) == 0
    assert not sampler.was_armed   # cleared by collect


def test_sample_iteration_is_the_logged_step():
    # train_step(iteration=k) runs the step Megatron then logs as k + 1
    assert [k for k in range(12) if sample_iteration(k, 5)] == [4, 9]
    assert [k for k in range(3) if sample_iteration(k, 1)] == [0, 1, 2]
    assert not sample_iteration(None, 1)


def test_attach_routes_the_models_op_calls_through_the_sampler():
    pytest.importorskip("megatron.core", reason="the layers need megatron-core")
    from overlap_tp.megatron import linear_functions
    from overlap_tp.megatron.layers import OverlapRowParallelLinear
    linear = OverlapRowParallelLinear.__new__(OverlapRowParallelLinear)   # the class is what the walk matches
    torch.nn.Module.__init__(linear)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), linear)
    other = torch.nn.Sequential(OverlapRowParallelLinear.__new__(OverlapRowParallelLinear))
    torch.nn.Module.__init__(other[0])
    assert linear.op_observer is None
    assert SAMPLER.attach([model]) == 1 and linear.op_observer == SAMPLER.observe
    assert SAMPLER.attach(model) == 0                  # a chunk once
    assert other[0].op_observer is None                # another model is not observed
    calls = []
    args = linear_functions._LinearArgs.__new__(linear_functions._LinearArgs)
    args.observer, args.group = linear.op_observer, None
    assert args.observe("gemm_rs", lambda: calls.append(1) or "out", None, None) == "out"
    assert calls == [1] and SAMPLER.samples == []      # disarmed: called straight through
    args.observer = None
    assert args.observe("gemm_rs", lambda: "direct", None, None) == "direct"


