"""The tuner on the CPU: candidate space, predictor arithmetic, curve interpolation, cache, decision,
agreement across ranks (gloo) and the CPU path. The GPU measurements themselves are not run here."""
import json
import math
import os
import random

import pytest
import torch
import torch.distributed as dist

from overlap_tp.ops.config import OverlapConfig
from overlap_tp.ops.tile_plan import make_plan
from overlap_tp.tune import choose, clear_memo, decide, refit
from overlap_tp.tune.cache import TuneCache, cache_key, config_to_dict, default_path
from overlap_tp.tune.candidates import (MAX_PARTITIONS, Shape, candidates, config_from_label, label, layout,
                                        partitions, space_size, wave_boundaries, wave_tiles)
from overlap_tp.tune.predict import (NO_CONTENTION, CommCurve, Contention, Measurements, comm_then_gemm, gemm_finish,
                                     gemm_then_comm, interp_linear, overlap_timeline, predict, predict_max_over_ranks)
from distributed import run_distributed

# ---------------------------------------------------------------------------------------------------
# candidates
# ---------------------------------------------------------------------------------------------------


def test_wave_boundaries():
    # w = 4.125 units per wave: floor(4.125 j) = 4, 8, 12 (16 = all units is not a boundary)
    assert wave_boundaries(16, 4.125) == [4, 8, 12]
    # a unit longer than a wave: every unit is a boundary
    assert wave_boundaries(5, 0.5) == [1, 2, 3, 4]


def test_partitions_hand_worked():
    # 16 units, 4.125 units per wave: |G1| <= floor(2 * 4.125) = 8, |GP| <= floor(4 * 4.125) = 16,
    # boundaries on {4, 8, 12}
    assert sorted(partitions(16, 4.125)) == sorted([(4, 12), (4, 4, 8), (4, 8, 4), (4, 4, 4, 4), (8, 8), (8, 4, 4)])
    # 5 units, half a wave per unit: |G1| <= max(1, floor(1.0)) = 1, |GP| <= floor(2.0) = 2; first boundary 1,
    # last boundary 3 or 4, free boundaries in between
    assert sorted(partitions(5, 0.5)) == sorted([(1, 2, 2), (1, 1, 1, 2), (1, 3, 1), (1, 1, 2, 1), (1, 2, 1, 1),
                                                 (1, 1, 1, 1, 1)])
    # ag: no first-group limit, the single group counts
    assert (16,) in partitions(16, 4.125, first_waves=None, allow_single=True)


@pytest.mark.parametrize("units,w", [(16, 4.125), (64, 2.06), (512, 66.0), (200, 1.0), (7, 0.3), (33, 2.5)])
def test_partition_limits_and_coverage(units, w):
    parts = partitions(units, w)
    assert parts and len(parts) == len(set(parts)) and len(parts) <= MAX_PARTITIONS
    first_max, last_max = max(1, math.floor(2 * w + 1e-9)), max(1, math.floor(4 * w + 1e-9))
    bounds = set(wave_boundaries(units, w))
    for p in parts:
        assert sum(p) == units and all(g >= 1 for g in p) and 2 <= len(p) <= 8
        assert p[0] <= first_max and p[-1] <= last_max
        cuts = [sum(p[:i]) for i in range(1, len(p))]
        assert set(cuts) <= bounds, "group boundaries sit on wave ends"


def test_layouts_and_waves():
    # gemm_rs l8b.proj.s8192, t = 2, 128 x 256 tiles: M/t = 4096 -> 32 row-slices, N = 4096 -> 16 n-tiles,
    # a row-slice is 2 regions x 16 = 32 tiles, T = 1024; bytes of 4 slices = 2 * 512 rows * 4096 * 2 B = 8 MiB
    rs = layout(Shape("rs", 8192, 4096, 2048, 2), "row_slice", 128, 256)
    assert (rs.units, rs.unit_tiles, rs.total_tiles) == (32, 32, 1024)
    assert rs.group_bytes(0, 4) == 8 << 20
    te = layout(Shape("rs", 8192, 4096, 2048, 2), "tile_exact", 128, 256)
    assert (te.units, te.unit_tiles, te.group_bytes(0, 1)) == (512, 2, 2 * 128 * 256 * 2)
    ar = layout(Shape("ar", 8192, 4096, 2048, 2), "row_slice", 128, 256)
    assert (ar.units, ar.unit_tiles) == (64, 16)
    # ag l8b.qkv.s8192: 32 local slices, 12 n-tiles; local rows first (384 tiles), each slice 1 peer x 12
    ag = layout(Shape("ag", 8192, 3072, 4096, 2), "row_slice", 128, 256)
    assert (ag.units, ag.unit_tiles, ag.lead_tiles, ag.total_tiles) == (32, 12, 384, 768)
    assert ag.group_bytes(0, 2) == 2 * 256 * 4096 * 2      # the chunk's all-gather output
    # short last row-slice: M/t = 200 rows -> slices of 128 and 72 rows
    short = layout(Shape("rs", 400, 256, 64, 2), "row_slice", 128, 256)
    assert short.group_bytes(1, 2) == 2 * 72 * 256 * 2
    assert layout(Shape("rs", 400, 256, 64, 2), "tile_exact", 128, 256) is None
    assert wave_tiles(132, 16, 1024) == 116 and wave_tiles(132, 0, 50) == 50


def test_candidates_counts_and_validity():
    shape = Shape("rs", 8192, 4096, 2048, 2)
    configs = candidates(shape, 132)
    labels = [label(c) for c in configs]
    assert len(labels) == len(set(labels))
    kinds = [(c.method, c.transport) for c in configs]
    assert kinds.count(("off", "nccl")) == 1 and kinds.count(("decompose", "nccl")) == 6
    # the p2p transports: the signaled GEMM's epilogue stores and cuBLAS's (one GEMM per region: one candidate)
    assert kinds.count(("signal", "p2p")) == 1 and kinds.count(("decompose", "p2p")) == 1
    assert space_size(shape, 132)["decompose/p2p"] == 1
    signal = [c for c in configs if c.method == "signal" and c.transport == "nccl"]
    assert {c.comm_sms for c in signal} == {0, 8, 16} and {c.schedule for c in signal} == {"row_slice", "tile_exact"}
    assert len(signal) <= 6 * MAX_PARTITIONS
    # every partition is a valid plan (split_units semantics): build a few small ones for real
    small = Shape("rs", 1024, 512, 64, 2)
    for c in candidates(small, 8):
        if c.method == "signal" and c.transport == "nccl":
            plan = make_plan(c.schedule, small.m, small.n, 2, c.block_m, c.block_n, c.groups)
            assert plan.group_tiles == tuple(g * layout(small, c.schedule, 128, 256).unit_tiles for g in c.groups)
    # ag: nccl needs comm_sms >= 1, p2p's copy-engine pulls run on 0 (the modelled partitions), its SM pulls on 16 or
    # 32 (one candidate each, measured end to end, not predicted); no decompose-free tile_exact
    ag = candidates(Shape("ag", 8192, 3072, 4096, 2), 132)
    assert {c.comm_sms for c in ag if c.method == "signal" and c.transport == "nccl"} == {8, 16}
    assert {c.comm_sms for c in ag if c.method == "signal" and c.transport == "p2p"} == {0, 16, 32}
    sm_pulls = [c for c in ag if c.method == "signal" and c.transport == "p2p" and c.comm_sms]
    assert [label(c) for c in sm_pulls] == ["p2p/sm16", "p2p/sm32"] and all(c.groups == "auto" for c in sm_pulls)
    # the model predicts the copy-engine partitions from the curves and leaves the SM pulls to their measurement
    pts = [(b, 0.01 + b / 3e8) for b in (1 << 16, 1 << 20, 1 << 24, 1 << 27)]
    meas = Measurements(sms=132, gemm={"row_slice": {0: 0.3, 16: 0.33, 32: 0.36}}, comm={"ag_p2p": {0: pts}})
    shape = Shape("ag", 8192, 3072, 4096, 2)
    copy_engines = [c for c in ag if c.method == "signal" and c.transport == "p2p" and not c.comm_sms]
    assert copy_engines and all(predict(shape, c, meas) is not None for c in copy_engines)
    assert [predict(shape, c, meas) for c in sm_pulls] == [None, None]
    meas.direct["p2p/sm16"] = 0.25
    assert predict(shape, sm_pulls[0], meas) == 0.25
    # at t > 2 also the pulls one peer per chunk (chunk_by 'peer'), measured end to end; none at t = 2
    assert not [c for c in ag if c.chunk_by == "peer"]
    ag4 = candidates(Shape("ag", 8192, 1536, 4096, 4), 132)
    by_peer = [c for c in ag4 if c.chunk_by == "peer"]
    assert [label(c) for c in by_peer] == ["p2p/by-peer"] and by_peer[0].groups == "auto"
    assert (by_peer[0].method, by_peer[0].transport, by_peer[0].comm_sms) == ("signal", "p2p", 0)
    assert predict(Shape("ag", 8192, 1536, 4096, 4), by_peer[0], meas) is None
    # the modelled partitions keep row chunks (explicit groups: chunk_by 'auto' resolves to 'rows' for them)
    assert all(isinstance(c.groups, tuple) for c in ag4 if c.transport == "p2p" and c.method == "signal"
               and not c.comm_sms and c.chunk_by != "peer")
    ag_cublas_p2p = [c for c in ag if c.method == "decompose" and c.transport == "p2p"]
    assert sorted(c.chunks for c in ag_cublas_p2p) == [1, 2, 4] and {c.comm_sms for c in ag_cublas_p2p} == {0}
    assert "decompose-p2p/c2" in {label(c) for c in ag_cublas_p2p}
    # gemm_rs at t > 2: the p2p candidate (rs_transfer 'auto': the copy engines' pushes there) and the epilogue's
    # stores beside it, both measured end to end; at t = 2 the one p2p candidate (the epilogue there)
    rs4 = [c for c in candidates(Shape("rs", 8192, 4096, 1024, 4), 132) if c.method == "signal" and c.transport == "p2p"]
    assert sorted(label(c) for c in rs4) == ["p2p/epilogue", "p2p/sm0"]
    assert all(predict(Shape("rs", 8192, 4096, 1024, 4), c, meas) is None for c in rs4)
    # ... and cuBLAS's regions pushed by the copy engines beside the regions stored into the owners
    cublas4 = [c for c in candidates(Shape("rs", 8192, 4096, 1024, 4), 132) if c.method == "decompose"
               and c.transport == "p2p"]
    assert sorted(label(c) for c in cublas4) == ["decompose-p2p/c1", "decompose-p2p/c1/copy"]
    assert predict(Shape("rs", 8192, 4096, 1024, 4), cublas4[-1], meas) is None
    assert [c.rs_transfer for c in candidates(Shape("rs", 8192, 4096, 2048, 2), 132)
            if c.method == "decompose" and c.transport == "p2p"] == [None]   # unset: the ops' rule
    rs2 = [c for c in candidates(Shape("rs", 8192, 4096, 2048, 2), 132) if c.method == "signal" and c.transport == "p2p"]
    assert [c.rs_transfer for c in rs2] == [None]
    # gemm_ar's p2p transport: the signaled GEMM and cuBLAS per region, measured end to end
    ar_p2p = [c for c in candidates(Shape("ar", 8192, 4096, 2048, 2), 132) if c.transport == "p2p"]
    assert sorted(label(c) for c in ar_p2p) == ["decompose-p2p/c1", "p2p/sm0"]
    assert all(predict(Shape("ar", 8192, 4096, 2048, 2), c, meas) is None for c in ar_p2p)
    assert all(c.schedule == "row_slice" for c in ag)


# ---------------------------------------------------------------------------------------------------
# curves and predictor
# ---------------------------------------------------------------------------------------------------


def test_comm_curve_interpolation():
    c = CommCurve([(1e3, 1.0), (1e5, 10.0)])
    assert c(1e3) == pytest.approx(1.0) and c(1e5) == pytest.approx(10.0)
    # halfway in log space: slope log(10)/log(100) = 0.5, so 1e4 B -> 10 ** 0.5 ms
    assert c(1e4) == pytest.approx(10 ** 0.5)
    assert c(10) == pytest.approx(1.0)            # latency floor below the smallest point
    assert c(1e7) == pytest.approx(100.0)         # last slope 0.5 continued: 10 * 100 ** 0.5
    assert c(0) == 0.0
    steep = CommCurve([(1e3, 1.0), (1e4, 100.0)])  # slope 2 clamped to 1 beyond the last point
    assert steep(1e5) == pytest.approx(1000.0)
    assert CommCurve([(1e6, 0.1)])(4e6) == pytest.approx(0.4)


def test_interp_linear():
    pts = {0: 1.0, 8: 1.2, 16: 1.6}
    assert interp_linear(pts, 4) == pytest.approx(1.1)
    assert interp_linear(pts, 12) == pytest.approx(1.4)
    assert interp_linear(pts, 24) == pytest.approx(2.0)   # the last segment continued
    assert interp_linear({8: 3.0}, 0) == 3.0


# a bandwidth-bound curve: comm(b) = b / 1e7 ms between 1e6 and 1e7 bytes (log-log slope 1)
BW = CommCurve([(1e6, 0.1), (1e7, 1.0)])


def test_gemm_then_comm_hand_worked():
    # t_gemm 1, T = 100 tiles, groups of 20 / 30 / 50 tiles moving 2e6 / 3e6 / 5e6 B (0.2 / 0.3 / 0.5 ms)
    # linear: G1 stored at 0.2 -> sent 0.4; G2 stored 0.5 -> max(0.5, 0.4) + 0.3 = 0.8;
    #         G3 stored 1.0 -> max(1.0, 0.8) + 0.5 = 1.5
    assert gemm_then_comm(1.0, [20, 30, 50], [2e6, 3e6, 5e6], BW, 100, 30, "linear") == pytest.approx(1.5)
    # comm-heavy: 5e6 / 5e6 / 1e6 B = 0.5 / 0.5 / 0.1 ms
    # linear: 0.2 + 0.5 = 0.7; max(0.5, 0.7) + 0.5 = 1.2; max(1.0, 1.2) + 0.1 = 1.3
    assert gemm_then_comm(1.0, [20, 30, 50], [5e6, 5e6, 1e6], BW, 100, 30, "linear") == pytest.approx(1.3)
    # wave (W = 30 tiles, ceil(100/30) = 4 waves of 0.25): G1 (20 tiles) ready at the end of wave 1 = 0.25
    # -> 0.75; G2 (50 tiles) end of wave 2 = 0.5 -> max(0.5, 0.75) + 0.5 = 1.25; G3 1.0 -> 1.25 + 0.1 = 1.35
    assert gemm_then_comm(1.0, [20, 30, 50], [5e6, 5e6, 1e6], BW, 100, 30, "wave") == pytest.approx(1.35)
    # transfers faster than the GEMM: the GEMM end plus the last group's transfer
    assert gemm_then_comm(1.0, [50, 50], [1e6, 1e6], BW, 100, 100, "linear") == pytest.approx(1.1)


def test_comm_then_gemm_hand_worked():
    # AG: t_gemm 1, T = 100; local 50 tiles (0.5 ms, no wait); chunks of 25 tiles arriving after 0.3 and
    # 0.3 + 0.7 = 1.0 ms: chunk 1 starts at max(0.5, 0.3) -> 0.75; chunk 2 at max(0.75, 1.0) -> 1.25
    assert comm_then_gemm(1.0, 50, [25, 25], [3e6, 7e6], BW, 100) == pytest.approx(1.25)


def small_measurements(**changes):
    # shape rs M 1024, N 512, K 256, t 2, 128 x 256 tiles: 4 row-slices of 2 regions x 2 n-tiles = 4 tiles,
    # T = 16; 8 SMs -> W = 8 tiles = 2 units; a 2-slice group moves 2 * 256 rows * 512 * 2 B = 524288 B
    meas = Measurements(sms=8, gemm={"row_slice": {0: 1.0, 8: 2.0}},
                        comm={"rs": {0: [(262144, 0.1), (1048576, 0.4)]}}, cublas=0.8)
    for k, v in changes.items():
        setattr(meas, k, v)
    return meas


def test_predict_through_measurements():
    shape = Shape("rs", 1024, 512, 256, 2)
    meas = small_measurements()
    cfg = OverlapConfig(method="signal", schedule="row_slice", groups=(2, 2), comm_sms=0)
    # without contention: comm(524288) = 0.2 (slope 1); G1 at 8/16 tiles = 0.5 -> 0.7; G2 at 1.0 -> 1.2
    assert predict(shape, cfg, meas, contention=NO_CONTENTION) == pytest.approx(1.2)
    assert predict(shape, cfg, meas, "linear", NO_CONTENTION) == pytest.approx(1.2)
    # groups=2 means the same split (split_units)
    assert predict(shape, OverlapConfig(method="signal", schedule="row_slice", groups=2, comm_sms=0),
                   meas, contention=NO_CONTENTION) == pytest.approx(1.2)
    # the default (fitted) contention: at comm_sms 0 the collective crawls while the GEMM runs, so G1's
    # transfer mostly waits for the GEMM's end
    assert predict(shape, cfg, meas) > 1.2
    # 'off': cuBLAS 0.8 + the whole reduce-scatter (1 MiB: 0.4)
    assert predict(shape, OverlapConfig(method="off"), meas) == pytest.approx(1.2)
    # a direct measurement wins; p2p without one is not predicted
    assert predict(shape, OverlapConfig(method="off"), small_measurements(direct={"off": 0.9})) == 0.9
    assert predict(shape, OverlapConfig(method="signal", transport="p2p", comm_sms=0), meas) is None
    # tile_exact without its GEMM curve is not predicted
    assert predict(shape, OverlapConfig(method="signal", schedule="tile_exact", groups=2, comm_sms=0), meas) is None
    # MoE: max over ranks
    heavy = small_measurements(gemm={"row_slice": {0: 2.0, 8: 3.0}})
    assert predict_max_over_ranks([(shape, meas), (shape, heavy)], cfg) == pytest.approx(
        predict(shape, cfg, heavy))


def test_measurements_roundtrip():
    meas = small_measurements(direct={"off": 1.1, "decompose/c2/sm0": 1.3}, post={"tile_exact": 0.05})
    again = Measurements.from_dict(json.loads(json.dumps(meas.to_dict())))
    assert again == meas
    bumped = meas.with_numbers([x + 1 for x in meas.numbers()])
    assert bumped.cublas == pytest.approx(1.8) and bumped.direct["off"] == pytest.approx(2.1)
    assert bumped.comm["rs"][0][1] == (1048576, pytest.approx(1.4))


def test_decide_margin():
    shape = Shape("rs", 1024, 512, 256, 2)
    fast_comm = {"rs": {0: [(1000, 1e-4)]}, "ar": {}}
    # the signaled GEMM alone takes 0.5 and transfers are nearly free: a signal config wins over off = 1.0
    config, name, times = decide(shape, small_measurements(comm=fast_comm, gemm={"row_slice": {0: 0.5, 8: 0.6,
                                                                                               16: 0.7}},
                                                           direct={"off": 1.0}))
    assert config.method == "signal" and times[name] < 1.0
    # 0.995 is not 2% better than 1.0: off
    # (cuBLAS as slow as off, so the modelled decomposition does not win either)
    config, name, _ = decide(shape, small_measurements(comm=fast_comm, gemm={"row_slice": {0: 0.995, 8: 1.1}},
                                                       cublas=1.0, direct={"off": 1.0}))
    assert name == "off" and config.method == "off"
    # verification overrides the prediction: the verified time is what counts
    config, name, _ = decide(shape, small_measurements(comm=fast_comm, gemm={"row_slice": {0: 0.5, 8: 0.6}},
                                                       direct={"off": 1.0}),
                             verify=lambda cs: {label(c): 2.0 for c in cs})
    assert name == "off"


# ---------------------------------------------------------------------------------------------------
# contention model and its offline refit (refit.py)
# ---------------------------------------------------------------------------------------------------


def test_overlap_timeline_hand_worked():
    # t_gemm 1, groups ready at 0.5 / 1.0, 0.2 ms of transfer each; while the GEMM runs the collective moves
    # at 0.5 and the GEMM at 1 / (1 + 1 * 0.5) = 2/3; each collective waits 0.1 first.
    # 0.5: G1 ready, waits to 0.6 (GEMM alone: progress 0.6); moves 0.2 / 0.5 = 0.4 -> ends at 1.0, progress
    # 0.6 + 0.4 * 2/3; the GEMM alone reaches 1.0 at 1.0 + 0.4 / 3; G2 waits 0.1, moves at full speed 0.2
    end = overlap_timeline(1.0, [0.5, 1.0], [0.2, 0.2], comm_speed=0.5, gemm_slowdown=1.0, delay=0.1)
    assert end == pytest.approx(1.0 + 0.4 / 3 + 0.1 + 0.2)
    # a collective that cannot move while the GEMM runs starts its data at the GEMM's end
    assert overlap_timeline(1.0, [0.5, 1.0], [0.2, 0.2], comm_speed=0.0) == pytest.approx(1.4)


def original_recurrence(t_gemm, group_tiles, group_bytes, comm, total_tiles, wave, progress):
    """The predictor before the contention model (Alg. 1's closed recurrence), kept here as the reference."""
    t_m, done = 0.0, 0
    for tiles, nbytes in zip(group_tiles, group_bytes):
        done += tiles
        t_m = max(gemm_finish(t_gemm, done, total_tiles, wave, progress), t_m) + comm(nbytes)
    return max(t_m, t_gemm)


def test_no_contention_is_the_original_model():
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for _ in range(200):
        groups = rng.randint(1, 8)
        tiles = [rng.randint(1, 40) for _ in range(groups)]
        nbytes = [rng.randint(1 << 16, 1 << 26) for _ in range(groups)]
        curve = CommCurve([(1 << 16, rng.uniform(0.005, 0.03)), (1 << 26, rng.uniform(0.05, 1.0))])
        args = (rng.uniform(0.05, 2.0), tiles, nbytes, curve, sum(tiles), rng.randint(1, 60))
        for progress in ("wave", "linear"):
            assert gemm_then_comm(*args, progress, NO_CONTENTION, rng.choice((0, 8, 16))) == pytest.approx(
                original_recurrence(*args, progress), rel=1e-12, abs=0), f"seed {seed}"


def random_measurements(rng, sms):
    gemm = {s: {0: t, 8: t * rng.uniform(1.02, 1.1), 16: t * rng.uniform(1.1, 1.2)}
            for s, t in (("row_slice", rng.uniform(0.2, 0.8)), ("tile_exact", rng.uniform(0.2, 0.8)))}
    comm = {"rs": {cap: [(b, rng.uniform(0.01, 0.02) + b / rng.uniform(2e8, 4e8)) for b in (1 << 16, 1 << 20, 1 << 24,
                                                                                           1 << 27)]
                   for cap in (0, 8, 16)}}
    return Measurements(sms=sms, gemm=gemm, comm=comm, post={"tile_exact": rng.uniform(0.0, 0.05)})


def synthetic_run(rng, truth, specs=("a.s4096", "b.s8192"), per_shape=16):
    """A --validate-like record whose measured times come from the contention model with `truth`."""
    run = {"environment": {"command": "torchrun --nproc-per-node 2 -m overlap_tp.tune --op rs --validate x"},
           "summary": [], "points": [], "measurements": {}}
    for spec in specs:
        shape = Shape("rs", int(spec.rpartition(".s")[2]), rng.choice((1024, 2048)), 512, 2)
        meas = random_measurements(rng, 32)
        signal = [c for c in candidates(shape, meas.sms) if c.method == "signal" and c.transport == "nccl"]
        run["summary"].append({"shape": spec, "M": shape.m, "N": shape.n, "K": shape.k})
        run["measurements"][spec] = meas.to_dict()
        for config in rng.sample(signal, min(per_shape, len(signal))):
            run["points"].append({"shape": spec, "label": label(config),
                                  "measured": predict(shape, config, meas, "wave", truth),
                                  "pred_wave": predict(shape, config, meas, "wave", NO_CONTENTION)})
    return run


def test_config_from_label_roundtrip():
    for c in candidates(Shape("rs", 4096, 2048, 512, 2), 32):
        if c.method == "signal" and c.transport == "nccl":
            assert label(config_from_label(label(c))) == label(c)


def test_fit_recovers_known_parameters():
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    truth = Contention(comm_slowdown_sm0=rng.uniform(0.5, 0.9), comm_slowdown=rng.uniform(0.1, 0.4),
                       gemm_slowdown=rng.uniform(0.1, 0.5), group_overhead_ms=rng.uniform(0.005, 0.02))
    points = refit.points_of(synthetic_run(rng, truth, specs=("a.s4096", "b.s8192", "c.s8192"), per_shape=20))
    got = refit.fit(points)
    assert refit.loss(points, got) < 1e-5, f"seed {seed}"
    for name, tolerance in (("comm_slowdown_sm0", 0.01), ("comm_slowdown", 0.01), ("gemm_slowdown", 0.02),
                            ("group_overhead_ms", 0.0005)):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), abs=tolerance), (name, got, truth, seed)


def test_refit_cli_writes_both_files(tmp_path):
    truth = Contention(0.7, 0.2, 0.0, 0.01)
    path = tmp_path / "tune_validate.json"
    path.write_text(json.dumps(synthetic_run(random.Random(), truth, per_shape=8)))
    assert refit.main([str(path), "--out", str(tmp_path / "out")]) == 0
    result = json.loads((tmp_path / "out" / "tune_refit.json").read_text())
    assert "not a new GPU measurement" in (tmp_path / "out" / "tune_refit.md").read_text()
    assert result["points"] == 16 and result["old"]["n"] == 16
    assert result["variants"]["all four"]["in_sample"]["mean_abs_rel_err"] < 0.01
    assert {s["shape"] for s in result["shapes"]} == {"a.s4096", "b.s8192"}
    # a record the predictor does not reproduce is refused
    run = json.loads(path.read_text())
    run["points"][0]["pred_wave"] *= 1.5
    path.write_text(json.dumps(run))
    with pytest.raises(SystemExit, match="not reproduced"):
        refit.main([str(path), "--out", str(tmp_path / "out")])


def test_defaults_are_the_recorded_fit():
    # the fit of tests/data/tune_validate.json (gemm_rs, 2 x H200, t = 2) by
    # `python -m overlap_tp.tune.refit tests/data/tune_validate.json --out <dir>`
    record = os.path.join(os.path.dirname(__file__), "..", "data", "tune_refit.json")
    with open(record) as f:
        fitted = json.load(f)["variants"]["all four"]["fitted"]
    assert Contention() == Contention(**fitted)


# ---------------------------------------------------------------------------------------------------
# cache
# ---------------------------------------------------------------------------------------------------

STAMP = {"format": 1, "overlap_tp": "0.1.0", "torch": "2.11", "triton": "3.6.0", "nccl": "2.28.9", "device": "H200"}


def test_cache_roundtrip_and_invalidation(tmp_path):
    path = str(tmp_path / "sub" / "tune.json")
    cfg = OverlapConfig(method="signal", groups=(4, 8, 4), comm_sms=8)
    key = cache_key("H200", "rs", "bfloat16", 2, 8192, 4096, 2048)
    TuneCache(path, STAMP).put(key, cfg, label=label(cfg), times={"x": 1.0})
    TuneCache(path, STAMP).put(cache_key("H200", "ar", "bfloat16", 2, 8192, 4096, 2048), OverlapConfig(method="off"))
    assert TuneCache(path, STAMP).get_config(key) == cfg
    assert len(TuneCache(path, STAMP).entries()) == 2            # writes merge
    assert sorted(os.listdir(tmp_path / "sub")) == ["tune.json", "tune.json.lock"]   # no temp file left behind
    # another version: ignored and reported
    newer = TuneCache(path, dict(STAMP, torch="2.12"))
    with pytest.warns(UserWarning, match="torch"):
        assert newer.get_config(key) is None
    assert newer.ignored and newer.ignored[0][0] == key
    # another device: its key is not there; an entry filed under this key by another device is not used
    other = TuneCache(path, dict(STAMP, device="H100"))
    assert other.get_config(cache_key("H100", "rs", "bfloat16", 2, 8192, 4096, 2048)) is None
    with pytest.warns(UserWarning, match="device"):
        assert other.get_config(key) is None
    # a corrupt file is an empty cache
    with open(path, "w") as f:
        f.write("{not json")
    with pytest.warns(UserWarning, match="unreadable"):
        assert TuneCache(path, STAMP).get_config(key) is None


def test_cache_default_path(monkeypatch, tmp_path):
    monkeypatch.setenv("OVERLAP_TP_TUNE_CACHE", str(tmp_path / "x.json"))
    assert default_path() == str(tmp_path / "x.json")
    assert TuneCache(None, STAMP).path == str(tmp_path / "x.json")
    monkeypatch.delenv("OVERLAP_TP_TUNE_CACHE")
    assert default_path() is None                     # no file under the home directory nobody asked for
    with pytest.raises(ValueError, match="no path; pass one or set OVERLAP_TP_TUNE_CACHE"):
        TuneCache(None, STAMP)
    assert config_to_dict(OverlapConfig(groups=(1, 2)))["groups"] == [1, 2]


WRITER = """
import os, sys, time
from overlap_tp.ops.config import OverlapConfig
from overlap_tp.tune.cache import TuneCache
path, name, count, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
open(go + "." + name, "w").close()        # ready
while not os.path.exists(go):             # start together: the imports take seconds, the writes do not
    time.sleep(0.001)
for i in range(count):
    TuneCache(path, None).put(f"{name}|{i}", OverlapConfig(method="off"))
"""


def test_concurrent_writers_keep_every_entry(tmp_path):
    """Two processes put different entries into one file at the same time: every entry survives (the
    read-merge-write runs under the file lock; without it, one writer's replace drops the other's
    entries written since its read)."""
    import subprocess
    import sys
    import time
    path, go, count = str(tmp_path / "tune.json"), str(tmp_path / "go"), 60
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, path, name, str(count), go]) for name in ("a", "b")]
    try:
        deadline = time.monotonic() + 120
        while not all(os.path.exists(f"{go}.{name}") for name in ("a", "b")):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "a writer did not start"
            time.sleep(0.01)
        open(go, "w").close()
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    keys = set(TuneCache(path, None).entries())
    assert keys == {f"{name}|{i}" for name in ("a", "b") for i in range(count)}, len(keys)


def test_location_problems(tmp_path):
    from overlap_tp.tune.cache import location_problem
    assert location_problem(str(tmp_path / "new" / "t.json")) is None and not (tmp_path / "new").exists()
    assert "is a folder" in location_problem(str(tmp_path))
    (tmp_path / "f").write_text("")
    assert "is a file, so" in location_problem(str(tmp_path / "f" / "t.json"))
    assert location_problem(str(tmp_path / "f")) is None    # an existing writable file is fine


# ---------------------------------------------------------------------------------------------------
# choose(): CPU path, agreement across ranks, cache hit
# ---------------------------------------------------------------------------------------------------


def test_cpu_tensors_choose_off_without_measuring():
    a, w = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(48, 32, dtype=torch.bfloat16)
    assert choose("gemm_rs", a, w, None) == OverlapConfig(method="off")


class FakeMeasure:
    """Rank-dependent numbers: alone, rank 0 would pick the 0-SM plans and rank 1 the 16-SM ones."""

    def __init__(self, rank):
        self.rank, self.calls = rank, 0

    def curves(self, shape, group, device, base):
        self.calls += 1
        gemm = {0: 0.5, 8: 0.9, 16: 0.9} if self.rank == 0 else {0: 0.9, 8: 0.9, 16: 0.5}
        return Measurements(sms=8, gemm={"row_slice": gemm, "tile_exact": dict(gemm)},
                            comm={"rs": {c: [(1000, 0.01 + 0.001 * self.rank), (1 << 24, 0.05)] for c in (0, 8, 16)}},
                            cublas=0.8, direct={"off": 1.0 + 0.1 * self.rank, **{
                                f"decompose/c{c}/sm{cs}": 2.0 for c in (2, 4, 8) for cs in (0, 16)}})

    def end_to_end(self, shape, configs, group, device):
        self.calls += 1
        return {label(c): 0.6 + 0.01 * i + 0.05 * self.rank for i, c in enumerate(configs)}


def _choose_on_ranks(rank, world, path):
    fake = FakeMeasure(rank)
    a = torch.randn(1024, 128, dtype=torch.bfloat16)
    w = torch.randn(512, 128, dtype=torch.bfloat16)
    # alone, the ranks would decide differently (so agreement is needed and tested)
    local = decide(Shape("rs", 1024, 512, 128, 2), fake.curves(None, None, None, None))[1]
    fake.calls = 0
    locals_ = [None] * world
    dist.all_gather_object(locals_, local)
    assert locals_[0] != locals_[1], locals_
    config = choose("rs", a, w, dist.group.WORLD, cache=path, measure=fake)
    got = [None] * world
    dist.all_gather_object(got, config)
    assert all(g == got[0] for g in got), got
    assert config.method == "signal"
    dist.barrier()
    # a second process-fresh call finds rank 0's cache entry: same answer, nothing measured
    clear_memo()
    calls = fake.calls
    assert choose("rs", a, w, dist.group.WORLD, cache=path, measure=fake) == config
    assert fake.calls == calls
    # and the memo answers without the cache
    assert choose("rs", a, w, dist.group.WORLD, cache=path, measure=fake) == config


def test_choose_agrees_across_ranks(tmp_path):
    path = str(tmp_path / "tune.json")
    run_distributed(2, _choose_on_ranks, path)
    entries = json.load(open(path))["entries"]
    assert list(entries) == [cache_key("cpu", "rs", "bfloat16", 2, 1024, 512, 128)]
    assert entries[next(iter(entries))]["how"] == "predicted+verified"


def _choose_without_a_cache(rank, world):
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = choose("rs", torch.randn(1024, 128, dtype=torch.bfloat16), torch.randn(512, 128, dtype=torch.bfloat16),
                        dist.group.WORLD, measure=FakeMeasure(rank))
    assert config.method == "signal"
    said = [str(w.message) for w in caught if "no cache file named" in str(w.message)]
    assert len(said) == (1 if rank == 0 else 0), said


def test_choose_writes_no_file_unless_told(tmp_path, monkeypatch):
    """No cache=, no $OVERLAP_TP_TUNE_CACHE: the decision is made (and agreed) but nothing is written,
    in particular not under the home directory; rank 0 says so once."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("OVERLAP_TP_TUNE_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)
    run_distributed(2, _choose_without_a_cache)
    assert os.listdir(tmp_path) == []


def _choose_says_what_it_picked(rank, world, path):
    import contextlib, io
    a, w = torch.randn(1024, 128, dtype=torch.bfloat16), torch.randn(512, 128, dtype=torch.bfloat16)
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        config = choose("rs", a, w, dist.group.WORLD, cache=path, measure=FakeMeasure(rank))
        choose("rs", a, w, dist.group.WORLD, cache=path, measure=FakeMeasure(rank))   # the memo: said once
        clear_memo()
        choose("rs", a, w, dist.group.WORLD, cache=path, measure=FakeMeasure(rank))   # a fresh process: the cache
    lines = [line for line in said.getvalue().splitlines() if line.startswith("[overlap_tp] auto:")]
    if rank != 0:
        assert lines == []
        return
    shape = "rs M=1024 N=512 K=128 t=2 bfloat16"
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"[overlap_tp] auto: {shape}: {label(config)} (measured here: ")
    assert ", off 1.100 ms)" in lines[0]          # the slowest rank's off time (1.0 and 1.1)
    assert lines[1] == f"[overlap_tp] auto: {shape}: {label(config)} (from the cache)"


def test_choose_says_what_it_picked(tmp_path):
    """Rank 0 prints each decision once per process: the shape, the pick and where it came from (measured here,
    with its time beside off's; or the cache)."""
    run_distributed(2, _choose_says_what_it_picked, str(tmp_path / "tune.json"))


def _end_to_end_leaves_no_candidate_plan(rank, world):
    from overlap_tp import gemm_rs
    from overlap_tp.ops import plan_base
    from overlap_tp.tune import measure
    measure._timed = lambda fn, sets, reps, group: (fn(*sets[0]), 1.0)[1]   # a call, no CUDA events
    group = dist.group.WORLD
    a, w = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(48, 32, dtype=torch.bfloat16)
    kept = OverlapConfig(method="decompose", chunks=4)
    gemm_rs(a, w, group, config=kept)        # a plan the run built before tuning: it stays
    before = set(plan_base._plans)
    configs = [OverlapConfig(method="off"), OverlapConfig(method="decompose", chunks=2), kept]
    got = measure.end_to_end(Shape("rs", 64, 48, 32, world), configs, group, torch.device("cpu"), reps=1,
                             sets=[(a, w)])
    assert set(got) == {label(c) for c in configs}
    assert set(plan_base._plans) == before, "the candidates' plans outlived the measurement"
    rng = torch.get_rng_state()   # operands drawn by the tuner itself (no sets): the run's random stream untouched
    measure.end_to_end(Shape("rs", 64, 48, 32, world), configs[:1], group, torch.device("cpu"), reps=1)
    assert torch.equal(torch.get_rng_state(), rng)


def test_end_to_end_drops_the_candidates_plans():
    """The tuner's candidate plans (on the p2p transports each holds an [M, N] symmetric buffer) are dropped from the
    functional API's cache after the measurement; plans built before it stay. Its random operands leave the
    generators' states as they were."""
    run_distributed(2, _end_to_end_leaves_no_candidate_plan)


def test_decisions_are_cached_per_timing_regime(tmp_path):
    """A decision timed as graph replays has its own entry; eager entries keep the key they always had."""
    from overlap_tp.tune import timing
    eager = cache_key("H200", "rs", "bfloat16", 2, 8192, 4096, 2048)
    assert eager == "H200|rs|bfloat16|t2|8192x4096x2048" == cache_key("H200", "rs", "bfloat16", 2, 8192, 4096, 2048,
                                                                      "eager")
    assert cache_key("H200", "rs", "bfloat16", 2, 8192, 4096, 2048, "graphs") == eager + "|graphs"
    with pytest.raises(ValueError, match="timing regime"):
        timing.set_regime("replays")
    assert timing.regime() == "eager"


def _graph_timing_falls_back_together(rank, world):
    """Rank 1 cannot capture the call: both ranks time it eagerly (a rank alone in graph timing would wait in its
    barrier for ever); a call both can capture is timed from its replays."""
    from overlap_tp.tune import measure, timing

    class Captured:
        def __init__(self, fn, sets):
            if rank == 1 and fn is refused:
                raise RuntimeError("operation not permitted when stream is capturing")

        def samples(self, reps, group):
            return [2.0 + rank]

    def refused():
        pass

    def accepted():
        pass
    measure.CapturedCalls, measure.timed = Captured, lambda fn, sets, reps, group: 7.0 + rank
    measure.torch.cuda.current_device = lambda: 0
    measure._all_ok = lambda ok, group, device: _all_ok_on_cpu(ok, group)
    measure.slowest_median = lambda samples, group: _max_on_cpu(max(samples), group)
    timing.set_regime("graphs")
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert measure._timed(refused, [()], 5, dist.group.WORLD) == 7.0 + rank   # eager, on every rank
        assert measure._timed(accepted, [()], 5, dist.group.WORLD) == 3.0          # the slowest rank's replays
    assert any("could not be captured" in str(w.message) for w in caught)
    timing.set_regime("eager")
    assert measure._timed(accepted, [()], 5, dist.group.WORLD) == 7.0 + rank


def _all_ok_on_cpu(ok, group):
    flag = torch.tensor([0.0 if ok else 1.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return float(flag) == 0.0


def _max_on_cpu(value, group):
    value = torch.tensor([value])
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return float(value)


def test_graph_timing_falls_back_to_eager_on_every_rank_together():
    run_distributed(2, _graph_timing_falls_back_together)


def test_cli_needs_a_cache_to_record_into(monkeypatch, tmp_path, capsys):
    from overlap_tp.tune.__main__ import parse_args
    monkeypatch.delenv("OVERLAP_TP_TUNE_CACHE", raising=False)
    with pytest.raises(SystemExit):
        parse_args(["--op", "rs", "--mnk", "64,64,64", "--exhaustive"])
    assert "give --cache PATH or set OVERLAP_TP_TUNE_CACHE" in capsys.readouterr().err
    (tmp_path / "f").write_text("")
    with pytest.raises(SystemExit):
        parse_args(["--op", "rs", "--mnk", "64,64,64", "--cache", str(tmp_path / "f" / "t.json")])
    assert "tune cache:" in capsys.readouterr().err
    assert parse_args(["--op", "rs", "--mnk", "64,64,64", "--exhaustive", "--cache", str(tmp_path / "t.json")])
    assert parse_args(["--op", "rs", "--mnk", "64,64,64"]).cache is None   # prints decisions, records nothing


def test_cli_shapes_are_the_table_layer_at_the_runs_tp():
    from types import SimpleNamespace
    from overlap_tp.tune.shapes import AG_SHAPES, SHAPES
    from overlap_tp.tune.__main__ import shapes_from_args
    k2, n2 = SHAPES["l8b.proj"]
    (_, at2), = shapes_from_args(SimpleNamespace(op="rs", shapes="l8b.proj.s8192", mnk=[]), 2)
    (_, at4), = shapes_from_args(SimpleNamespace(op="rs", shapes="l8b.proj.s8192", mnk=[]), 4)
    assert (at2.m, at2.n, at2.k, at2.t) == (8192, n2, k2, 2)
    assert (at4.m, at4.n, at4.k, at4.t) == (8192, n2, k2 // 2, 4)   # row-parallel: K_local halves
    k2, n2 = AG_SHAPES["l8b.qkv"]
    (_, ag4), = shapes_from_args(SimpleNamespace(op="ag", shapes="l8b.qkv.s4096", mnk=[]), 4)
    assert (ag4.n, ag4.k) == (n2 // 2, k2)                           # column-parallel: N_local halves
    (_, raw), = shapes_from_args(SimpleNamespace(op="rs", shapes="", mnk=["8192,4096,2048"]), 4)
    assert (raw.m, raw.n, raw.k) == (8192, 4096, 2048)               # --mnk is the rank's GEMM as given
