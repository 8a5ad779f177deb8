"""Per-shape tuner: which OverlapConfig an op should run for a shape (docs/tuner.md).

    config = choose("rs", a, w, group)            # gemm_rs / gemm_ar / ag_gemm operands as the op gets them

Decision for one (device, op, dtype, t, M, N, K):
  1. this process's memo (no communication after the first call of a shape);
  2. the disk cache (cache.py), where one was named (cache=, $OVERLAP_TP_TUNE_CACHE; training runs:
     --overlap-tp-tune-cache or Megatron's --save folder): every rank reads it, rank 0's entry is
     broadcast, so ranks that see different files (per-node folders) still agree;
  3. else, on CUDA: measure once collectively (measure.curves; every number is the slowest rank's, via
     an all-reduce MAX), predict every candidate (predict.py), time the `verify` best predicted ones end
     to end, and pick the fastest measured time; overlap must beat `off` by `margin` (relative) or the
     decision is `off`. Every rank computes the decision from the same all-reduced numbers, and rank
     0's result is broadcast anyway (a config that differed across ranks would hang the collectives).
     Rank 0 writes the cache (if one was named: no file is written anywhere else).
  Rank 0 of the group prints each decision once per process (`[overlap_tp] auto: ...`: the shape, the pick, where
  it came from and, when measured here, its time beside off's), so a run's log says which path every op runs.
  On CPU tensors (gloo) the answer is OverlapConfig(method='off') with no measurement: the Triton
  interpreter's timings mean nothing.
"""
import warnings

import torch
import torch.distributed as dist

from overlap_tp.ops.config import OverlapConfig
from overlap_tp.ops.tile_rule import given_tile
from overlap_tp.ops.tuner_hook import set_auto_resolver
from overlap_tp.tune.cache import (ENV_VAR, TuneCache, cache_key, config_from_dict, config_to_dict, default_path,
                                   software_stamp)
from overlap_tp.tune.candidates import Shape, candidates, label, op_name
from overlap_tp.tune.predict import DEFAULT_PROGRESS, Measurements, rank
from overlap_tp.tune.timing import regime, set_regime

__all__ = ["choose", "choose_shape", "decide", "resolve_auto", "set_regime", "shape_of", "TuneCache", "Shape",
           "Measurements"]

DEFAULT_MARGIN = 0.02
DEFAULT_VERIFY = 2
_memo = {}
_warned_no_cache = []


def shape_of(op: str, a: torch.Tensor, w: torch.Tensor, t: int) -> Shape:
    """The tuner's shape of an op call (ag: `a` is this rank's shard, M = t * rows)."""
    op = op_name(op)
    m = a.shape[0] * t if op == "ag" else a.shape[0]
    return Shape(op, m, w.shape[0], a.shape[1], t, str(a.dtype).replace("torch.", ""))


def decide(shape: Shape, meas: Measurements, base: OverlapConfig = OverlapConfig(), *, margin: float = DEFAULT_MARGIN,
           progress: str = DEFAULT_PROGRESS, verify=None, verify_count: int = DEFAULT_VERIFY):
    """(config, label, times): the decision from `meas` (same result for the same numbers).

    verify(configs) -> {label: ms} times the `verify_count` best predicted candidates end to end; then
    the pick is the fastest measured one (meas.direct + verified): predictions only choose what to
    verify. Without verify, a predicted-only winner must beat the best measured one by `margin`.
    Either way the pick must beat `off` by `margin`, else it is `off`."""
    ranked = rank(shape, candidates(shape, meas.sms, base), meas, progress)
    measured = dict(meas.direct)
    verified = False
    if verify is not None and verify_count > 0:
        todo = [c for _, name, c in ranked if name not in measured][:verify_count]
        if todo:
            measured.update(verify(todo))
            verified = True
    off = OverlapConfig(method="off", **given_tile(base))
    times = {name: ms for ms, name, _ in ranked}
    times.update(measured)
    by_label = {name: c for _, name, c in ranked}
    by_label.setdefault("off", off)
    t_off = times.get("off")
    best_measured = min(((ms, name) for name, ms in measured.items() if name in by_label), default=None)
    best_predicted = None if verified else min(
        ((ms, name) for name, ms in times.items() if name not in measured), default=None)
    pick = best_measured
    if best_predicted is not None and (pick is None or best_predicted[0] < pick[0] * (1 - margin)):
        pick = best_predicted
    if pick is None or (t_off is not None and pick[1] != "off" and not pick[0] < t_off * (1 - margin)):
        pick = (t_off, "off")
    return by_label[pick[1]], pick[1], times


def _agree(meas: Measurements, group, device) -> Measurements:
    """Every rank gets the element-wise max of the ranks' numbers (all ranks measured the same things)."""
    values = torch.tensor(meas.numbers(), dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return meas.with_numbers(values.tolist())


def _broadcast(obj, group):
    """Rank 0's (of `group`) picklable obj on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def _cache_location(cache):
    """What `cache` names: False (no disk), a TuneCache, or a path (None: $OVERLAP_TP_TUNE_CACHE, else no disk)."""
    if cache is None:
        return default_path() or False
    return cache


def _open_cache(cache, device_name, rank):
    if cache is False:
        if rank == 0 and not _warned_no_cache:
            _warned_no_cache.append(True)
            warnings.warn(f"overlap_tp tuner: no cache file named (cache=, {ENV_VAR}, --overlap-tp-tune-cache "
                          "or Megatron's --save), so this process's decisions are not kept on disk and the "
                          "next run measures its shapes again")
        return None
    if isinstance(cache, TuneCache):
        return cache
    return TuneCache(cache, software_stamp(device_name))


def choose(op: str, a: torch.Tensor, w: torch.Tensor, group=None, *, cache=None,
           base: OverlapConfig = OverlapConfig(), margin: float = DEFAULT_MARGIN, verify_count: int = DEFAULT_VERIFY,
           progress: str = DEFAULT_PROGRESS, measure=None) -> OverlapConfig:
    """The OverlapConfig to run `op` ("rs"/"gemm_rs", "ar"/"gemm_ar", "ag"/"ag_gemm") with these operands
    (choose_shape on their shape). On CPU tensors: 'off', with no measurement and no group needed."""
    if not a.is_cuda and measure is None:
        return OverlapConfig(method="off", **given_tile(base))
    from overlap_tp.ops import comm
    group = comm.resolve_group(group)
    return choose_shape(shape_of(op, a, w, dist.get_world_size(group)), group, a.device, cache=cache, base=base,
                        margin=margin, verify_count=verify_count, progress=progress, measure=measure)


def choose_shape(shape: Shape, group, device: torch.device, *, cache=None, base: OverlapConfig = OverlapConfig(),
                 margin: float = DEFAULT_MARGIN, verify_count: int = DEFAULT_VERIFY,
                 progress: str = DEFAULT_PROGRESS, measure=None) -> OverlapConfig:
    """The OverlapConfig to run the op of `shape` with, on `group` (a process group of shape.t ranks).

    Collective over `group` on a cache miss (every rank must call it for the same shape, as for the
    op itself). cache: None = $OVERLAP_TP_TUNE_CACHE if set, else no disk (warned once: the decisions
    live in this process only); a path, a TuneCache, or False (no disk). base: block sizes / stages
    every candidate keeps. measure: an object with curves(shape, group, device, base) and
    end_to_end(shape, configs, group, device) (default: overlap_tp.tune.measure; tests pass a fake to
    run the decision path on CPU).
    """
    if device.type != "cuda" and measure is None:
        return OverlapConfig(method="off", **given_tile(base))
    t = shape.t
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    cache = _cache_location(cache)
    timing_regime = regime()
    memo_key = (device_name, shape, tuple(dist.get_process_group_ranks(group)), base, margin, verify_count,
                progress, str(cache) if not isinstance(cache, TuneCache) else cache.path, timing_regime)
    if memo_key in _memo:
        return _memo[memo_key]
    store = _open_cache(cache, device_name, dist.get_rank(group))
    key = cache_key(device_name, shape.op, shape.dtype, t, shape.m, shape.n, shape.k, timing_regime)
    cached = store.get(key) if store is not None else None
    cached = _broadcast(cached["config"] if cached else None, group)
    if cached is not None:
        config = config_from_dict(cached)
        how = "from the cache"
    else:
        if measure is None:
            from overlap_tp.tune import measure
        meas = _agree(measure.curves(shape, group, device, base), group, device)

        def verify(configs):
            return measure.end_to_end(shape, configs, group, device)

        config, name, times = decide(shape, meas, base, margin=margin, progress=progress, verify=verify,
                                     verify_count=verify_count)
        config = config_from_dict(_broadcast(config_to_dict(config), group))
        how = _timed(label(config), times)
        if store is not None and dist.get_rank(group) == 0:
            top = dict(sorted(times.items(), key=lambda kv: kv[1])[:16])
            store.put(key, config, label=label(config), how="predicted+verified" if verify_count else "predicted",
                      times=top, measurements=meas.to_dict())
    _memo[memo_key] = config
    if dist.get_rank(group) == 0:
        print(f"[overlap_tp] auto: {shape.op} M={shape.m} N={shape.n} K={shape.k} t={t} {shape.dtype}: "
              f"{label(config)} ({how})", flush=True)
    return config


def _timed(name: str, times: dict) -> str:
    """Where a measured decision came from: its time (measured or predicted, ms) beside off's."""
    if name not in times:
        return "measured here"
    off = times.get("off")
    if name == "off" or off is None:
        return f"measured here: {times[name]:.3f} ms"
    return f"measured here: {times[name]:.3f} ms, off {off:.3f} ms"


def resolve_auto(op: str, m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, group,
                 base: OverlapConfig) -> OverlapConfig:
    """The op layer's resolver of method='auto' (registered below): the tuner's choice for an op of this shape
    (m: the op's output rows, every rank's rows for ag_gemm)."""
    shape = Shape(op_name(op), m, n, k, dist.get_world_size(group), str(dtype).replace("torch.", ""))
    return choose_shape(shape, group, device, base=base)


def clear_memo():
    """Forget this process's decisions (tests; a new cache file)."""
    _memo.clear()


set_auto_resolver(resolve_auto)   # the op layer asks the tuner for method='auto' through this hook
