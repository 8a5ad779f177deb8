"""GPU measurements for the tuner (CUDA + NCCL only; every rank of the group calls every function).

curves():      the predictor's inputs for one shape: the signaled GEMM alone per SM budget and schedule,
               cuBLAS, the tile_exact reorder, the collective's latency vs bytes at the CTA caps the
               ops use (through overlap_tp.ops.comm.collectives, the communicator the ops issue on), and the
               few candidates with no model measured end to end (off, decompose, the p2p transport).
end_to_end():  candidates timed through the public ops, each checked against method='off' first
               (the exhaustive mode and the verification of the predictor's picks).

Timing: overlap_tp.tune.timing.timed (CUDA events, warm-up, barrier, median, all-reduce MAX), so every
rank holds the slowest rank's numbers and every decision made from them is the same on every rank.
Anything that decides whether a collective runs (a candidate's check, an optional curve) is agreed
across ranks first, so a rank-local failure cannot leave the others waiting in a collective.
"""
import dataclasses
from typing import Dict, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from overlap_tp.ops import comm
from overlap_tp.ops.ag_gemm import ag_gemm
from overlap_tp.ops.plan_base import transient_plans, warn_once
from overlap_tp.ops.config import OverlapConfig
from overlap_tp.ops.tile_rule import given_tile, tile_of
from overlap_tp.ops.gemm_ar import gemm_ar
from overlap_tp.ops.gemm_rs import gemm_rs
from overlap_tp.tune.candidates import (COMM_SMS, DECOMPOSE_CHUNKS, DECOMPOSE_COMM_SMS, Shape, label, layout,
                                       measured_only)
from overlap_tp.tune.predict import Measurements
from overlap_tp.tune.timing import CapturedCalls, regime, slowest_median, timed

CURVE_POINTS = 8          # bytes halve from the whole collective down to 1/128 of it
INPUT_SETS = 2


def _timed(fn, sets, reps, group):
    """The slowest rank's median ms of fn(*set), in the tuner's timing regime (timing.regime()): eagerly, or as
    replays of a captured CUDA graph. A call some rank cannot capture is timed eagerly on every rank (agreed first: the
    timing is collective), with a warning."""
    if regime() == "eager":
        return timed(fn, sets, reps, group)
    device = torch.device("cuda", torch.cuda.current_device())
    try:
        captured, why = CapturedCalls(fn, sets), None
    except RuntimeError as error:
        captured, why = None, str(error).splitlines()[0][:160]
    if not _all_ok(why is None, group, device):
        where = why or "on a peer"
        warn_once(f"overlap_tp.tune: a candidate could not be captured in a CUDA graph ({where}); such candidates are "
                  f"timed eagerly")
        return timed(fn, sets, reps, group)
    samples = captured.samples(reps, group)
    del captured
    return slowest_median(samples, group)


def _all_ok(ok: bool, group, device) -> bool:
    """True on every rank iff true on every rank."""
    flag = torch.tensor([0.0 if ok else 1.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return float(flag) == 0.0


def _inputs(shape: Shape, device, sets=INPUT_SETS):
    dtype = getattr(torch, shape.dtype)
    rows = shape.m_local if shape.op == "ag" else shape.m
    return [(torch.randn(rows, shape.k, device=device, dtype=dtype),
             torch.randn(shape.n, shape.k, device=device, dtype=dtype) / shape.k ** 0.5) for _ in range(sets)]


def _run(shape: Shape):
    return {"rs": gemm_rs, "ar": gemm_ar, "ag": ag_gemm}[shape.op]


def _rng_left_as_found(device):
    """Around a measurement: its random operands come from the CPU and `device` generators, whose states are put back
    after it. A run's random streams (dropout, router jitter on the default generator) must not depend on whether, or
    when, the tuner measured (under --overlap-tp auto it does so in training, at a shape's first call)."""
    device = torch.device(device)
    cuda = [torch.cuda.current_device() if device.index is None else device.index] if device.type == "cuda" else []
    return torch.random.fork_rng(devices=cuda)


def end_to_end(shape: Shape, configs: Iterable[OverlapConfig], group, device, *, reps: int = 20,
               sets=None, errors: Optional[Dict[str, str]] = None) -> Dict[str, float]:
    """label -> ms (slowest rank's median) of each config through the public op. A config that raises a
    ValueError/NotImplementedError (on every rank alike: it cannot run this shape) or disagrees with
    method='off' (relative error >= 1e-2 on any rank) is left out and named in `errors`."""
    # the candidates' plans (and their buffers) do not outlive the measurement
    with _rng_left_as_found(device), transient_plans():
        return _end_to_end(shape, configs, group, device, reps, sets or _inputs(shape, device), errors, _run(shape))


def _end_to_end(shape, configs, group, device, reps, sets, errors, run):
    ref = run(*sets[0], group, config=OverlapConfig(method="off")).float()
    out = {}
    for config in configs:
        name = label(config)
        try:
            got = run(*sets[0], group, config=config)
            err = float((got.float() - ref).norm() / ref.norm())
        except (ValueError, NotImplementedError) as e:
            got, err = None, float("inf")
            if errors is not None:
                errors[name] = f"{type(e).__name__}: {e}"
        if not _all_ok(err < 1e-2, group, device):
            if errors is not None and name not in errors:
                errors[name] = f"relative error {err:.3g} vs off (max over ranks >= 1e-2)"
            continue
        out[name] = _timed(lambda a, w: run(a, w, group, config=config), sets, reps, group)
    return out


def _gemm_alone(shape: Shape, schedule: str, base: OverlapConfig, comm_sms: Sequence[int], a, w, reps, group):
    """{comm_sms: ms} of the signaled GEMM with (SMs - comm_sms) programs, no communication."""
    from overlap_tp.kernels.signaled_gemm import signaled_gemm
    from overlap_tp.ops.plan_base import gemm_programs
    from overlap_tp.ops.collective_reduction import device_plan
    world = shape.t if shape.op == "rs" else 1
    out = {}
    for cs in comm_sms:
        cfg = dataclasses.replace(base, method="signal", schedule=schedule, comm_sms=cs, groups=1)
        state = device_plan(schedule, a.shape[0], shape.n, world, cfg, a.element_size(), a.device)
        staging = torch.empty(state.plan.staging_shape, device=a.device, dtype=a.dtype)
        counters = torch.zeros_like(state.counters)
        programs = gemm_programs(a.device, cfg)
        out[cs] = _timed(lambda: signaled_gemm(a, w, staging, state.tiles, counters, programs, cfg), [()], reps,
                         group)
    return out


def _sizes(total_rows: int, points: int):
    rows = sorted({max(1, total_rows >> i) for i in range(points)})
    return rows


def _comm_curve(shape: Shape, kind: str, cap: int, group, device, reps, points):
    """[(bytes, ms)] of the collective of `kind` on the communicator capped at `cap` CTAs."""
    dtype, t, eb = getattr(torch, shape.dtype), shape.t, shape.elem_bytes
    coll = comm.collectives(group, device, cap)
    pts = []
    if kind == "rs":
        for r in _sizes(shape.m_local, points):
            inp, out = torch.randn(t * r, shape.n, device=device, dtype=dtype), torch.empty(r, shape.n, device=device,
                                                                                          dtype=dtype)
            pts.append((t * r * shape.n * eb, _timed(lambda: coll.reduce_scatter(out, inp), [()], reps, group)))
    elif kind == "ar":
        for r in _sizes(shape.m, points):
            x = torch.randn(r, shape.n, device=device, dtype=dtype)
            pts.append((r * shape.n * eb, _timed(lambda: coll.all_reduce(x), [()], reps, group)))
    elif kind == "ag":
        shard = torch.randn(shape.m_local, shape.k, device=device, dtype=dtype)
        gathered = torch.empty(shape.m, shape.k, device=device, dtype=dtype)
        for r in _sizes(shape.m_local, points):
            if hasattr(coll, "all_gather_rows"):
                fn = lambda: coll.all_gather_rows(gathered, shard, 0, r)   # noqa: E731
            else:   # torch.distributed, uncapped (recorded under the cap asked for; docs/tuner.md)
                view, part = gathered[:t * r], shard[:r]
                fn = lambda: dist.all_gather_into_tensor(view, part, group=group)   # noqa: E731
            pts.append((t * r * shape.k * eb, _timed(fn, [()], reps, group)))
    elif kind == "ag_p2p":
        pts = _p2p_pull_curve(shape, group, device, reps, points)
    return pts


def _p2p_pull_curve(shape: Shape, group, device, reps, points):
    """Copy-engine pulls of every peer's rows [0, r) from symmetric memory (the ag p2p transport)."""
    from torch.distributed import _symmetric_memory as symm
    dtype, t, rank = getattr(torch, shape.dtype), shape.t, dist.get_rank(group)
    local = symm.empty(shape.m_local, shape.k, dtype=dtype, device=device)
    local.normal_()
    handle = symm.rendezvous(local, group.group_name)
    peers = {p: handle.get_buffer(p, [shape.m_local, shape.k], dtype) for p in range(t) if p != rank}
    gathered = torch.empty(t, shape.m_local, shape.k, device=device, dtype=dtype)
    pts = []
    for r in _sizes(shape.m_local, points):
        def pull():
            for p, buf in peers.items():
                gathered[p, :r].copy_(buf[:r])
        pts.append((t * r * shape.k * shape.elem_bytes, _timed(pull, [()], reps, group)))
    handle.barrier()
    return pts


def curves(shape: Shape, group, device, base: OverlapConfig = OverlapConfig(), *, reps: int = 20,
           comm_sms: Sequence[int] = COMM_SMS, points: int = CURVE_POINTS, direct: bool = True) -> Measurements:
    """Everything predict() needs for `shape`; identical on every rank."""
    with _rng_left_as_found(device):
        return _curves(shape, group, device, dataclasses.replace(base, **tile_of(base)), reps, comm_sms, points,
                       direct)


def _curves(shape, group, device, base, reps, comm_sms, points, direct):
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    sets = _inputs(shape, device)
    a, w = sets[0]
    full = a if shape.op != "ag" else torch.randn(shape.m, shape.k, device=device, dtype=a.dtype)
    meas = Measurements(sms=sms)
    meas.cublas = _timed(lambda: full @ w.t(), [()], reps, group)
    schedules = ["row_slice"] if shape.op == "ag" else [
        s for s in ("row_slice", "tile_exact") if layout(shape, s, base.block_m, base.block_n) is not None]
    for schedule in schedules:
        meas.gemm[schedule] = _gemm_alone(shape, schedule, base, comm_sms, full, w, reps, group)
    if "tile_exact" in schedules:   # the reorder gemm_rs / gemm_ar run after the collectives
        from overlap_tp.ops.collective_reduction import device_plan
        world = shape.t if shape.op == "rs" else 1
        state = device_plan("tile_exact", shape.m, shape.n, world, dataclasses.replace(base, groups=1),
                           shape.elem_bytes, device)
        buf = torch.randn(state.plan.out_shape, device=device, dtype=a.dtype)
        meas.post["tile_exact"] = _timed(lambda: state.tile_order.undo(buf), [()], reps, group)
    kinds = ["ag", "ag_p2p"] if shape.op == "ag" else [shape.op]
    for kind in kinds:
        caps = [0] if kind == "ag_p2p" else sorted(set(comm_sms) | {0} | set(DECOMPOSE_COMM_SMS))
        for cap in caps:
            try:
                pts = _comm_curve(shape, kind, cap, group, device, reps, points)
                ok = True
            except (ImportError, AttributeError, RuntimeError, TypeError, ValueError) as e:   # optional only
                if kind != "ag_p2p":
                    raise
                pts, ok = [], False
                print(f"overlap_tp.tune: no {kind} curve ({type(e).__name__}: {e})", flush=True)
            if _all_ok(ok, group, device) and pts:
                meas.comm.setdefault(kind, {})[cap] = pts
    if direct:
        fix = given_tile(base)
        configs = [OverlapConfig(method="off", **fix)]
        configs += [OverlapConfig(method="decompose", transport="nccl", chunks=c, comm_sms=cs, **fix)
                    for cs in DECOMPOSE_COMM_SMS for c in DECOMPOSE_CHUNKS]
        if shape.op == "rs":
            configs.append(OverlapConfig(method="signal", transport="p2p", comm_sms=0, **fix))
        configs += measured_only(shape, fix)
        meas.direct.update(end_to_end(shape, configs, group, device, reps=reps, sets=sets))
    return meas
