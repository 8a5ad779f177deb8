"""`python -m overlap_tp.tune`: tune, exhaustively measure, or validate the predictor (under torchrun).

    torchrun --nproc-per-node 2 -m overlap_tp.tune --op rs --shapes l8b.proj.s8192,l70b.proj.s8192
    torchrun --nproc-per-node 2 -m overlap_tp.tune --op ar --mnk 8192,4096,2048 --exhaustive --cache tune.json
    torchrun --nproc-per-node 2 -m overlap_tp.tune --op rs --shapes ... --validate OUT_DIR --points 30 --reps 10

Shapes: NAME.sTOKENS with NAME from overlap_tp.bench.ops.SHAPES (rs, ar) or AG_SHAPES (ag), TP = 2 shards
scaled to the run's t like the ops benchmark does (bench.ops.at_tp), or
--mnk M,N,K (repeatable; the rank's GEMM: rs/ar a[M, K_local], ag gathered [M, K]).
Modes:
  (default)     choose(): the cached decision, or measure + predict + verify, written to the cache
  --exhaustive  every candidate (or --points of them) end to end; the measured best goes to the cache
  --validate D  predicted (both progress models) vs measured for --points candidates per shape: the
                predictor's top picks plus a spread over its ranking, the baselines measured anyway;
                writes D/tune_validate.{json,md}: mean/max prediction error, pick vs best measured
"""
import argparse
import dataclasses
import os
import statistics
import sys

import torch
import torch.distributed as dist

from overlap_tp.tune import choose, decide
from overlap_tp.tune.cache import ENV_VAR, TuneCache, cache_key, default_path, location_problem, software_stamp
from overlap_tp.tune.candidates import Shape, candidates, label
from overlap_tp.tune.predict import PROGRESS, predict, rank
from overlap_tp.tune.timing import regime, set_regime


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m overlap_tp.tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", default="rs", choices=("rs", "ar", "ag"))
    p.add_argument("--shapes", default="", help="comma list of NAME.sTOKENS, e.g. l8b.proj.s8192")
    p.add_argument("--mnk", action="append", default=[], help="M,N,K of the rank's GEMM (repeatable)")
    p.add_argument("--exhaustive", action="store_true")
    p.add_argument("--validate", metavar="OUT_DIR")
    p.add_argument("--cache", help="cache file the decisions go to (default $OVERLAP_TP_TUNE_CACHE; without "
                                   "either, the default mode only prints them and --exhaustive refuses to run)")
    p.add_argument("--reps", type=int, default=20, help="timed repetitions per measurement")
    p.add_argument("--points", type=int, default=30,
                   help="end-to-end measured candidates per shape (--validate, --exhaustive); 0 = all")
    p.add_argument("--top", type=int, default=8, help="--validate: how many of the predictor's best to measure")
    p.add_argument("--graphs", action="store_true",
                   help="time every candidate as replays of a captured CUDA graph (the regime of a run under "
                        "--cuda-graph-impl; its decisions are cached apart from eager ones)")
    args = p.parse_args(argv)
    cache = args.cache or default_path()
    if args.exhaustive and not args.validate and not cache:   # --validate wins over --exhaustive in main()
        p.error(f"--exhaustive records its result in the tune cache: give --cache PATH or set {ENV_VAR}")
    problem = cache and location_problem(cache)
    if problem:
        p.error(f"tune cache: {problem}")
    return args


def shapes_from_args(args, t):
    from overlap_tp.tune.shapes import AG_SHAPES, SHAPES, at_tp
    table = AG_SHAPES if args.op == "ag" else SHAPES
    out = []
    for spec in filter(None, args.shapes.split(",")):
        name, _, tokens = spec.rpartition(".s")
        if name not in table or not tokens.isdigit():
            raise SystemExit(f"unknown shape {spec!r}: expected NAME.sTOKENS with NAME in {sorted(table)}")
        k, n = at_tp(args.op, *table[name], t)  # the table holds TP = 2 shards: the same layer at TP = t
        out.append((spec, Shape(args.op, int(tokens), n, k, t)))
    for spec in args.mnk:
        m, n, k = map(int, spec.split(","))
        out.append((f"{args.op}.{m}x{n}x{k}", Shape(args.op, m, n, k, t)))
    if not out:
        raise SystemExit("give --shapes or --mnk")
    return out


def subset(ranked, direct, points, top):
    """Labels to measure: the predictor's `top` best by each progress model, then a spread over the whole
    ranking (best to worst) up to `points` labels (0: all)."""
    order = [name for _, name, _ in ranked[PROGRESS[0]] if name not in direct]
    if points <= 0:
        return order
    chosen = []
    for by_model in ranked.values():
        chosen += [name for _, name, _ in by_model if name not in direct][:top]
    chosen = list(dict.fromkeys(chosen))
    rest = [name for name in order if name not in set(chosen)]
    room = max(0, points - len(chosen))
    if rest and room:
        step = len(rest) / room
        chosen += list(dict.fromkeys(rest[min(len(rest) - 1, int(i * step))] for i in range(room)))
    return chosen


def validate_shape(spec, shape, group, device, args, measure):
    meas = measure.curves(shape, group, device, reps=args.reps)
    configs = candidates(shape, meas.sms)
    by_label = {label(c): c for c in configs}
    bare = dataclasses.replace(meas, direct={})   # predictions must not read the end-to-end numbers
    ranked = {p: rank(shape, configs, bare, p) for p in PROGRESS}
    names = subset(ranked, meas.direct, args.points, args.top)
    errors = {}
    measured = dict(meas.direct)
    measured.update(measure.end_to_end(shape, [by_label[n] for n in names], group, device, reps=args.reps,
                                       errors=errors))
    points = []
    for name, ms in sorted(measured.items(), key=lambda kv: kv[1]):
        row = {"shape": spec, "label": name, "measured": ms}
        for p in PROGRESS:
            row[f"pred_{p}"] = predict(shape, by_label[name], bare, p) if name in by_label else None
        points.append(row)
    summary = {"shape": spec, "M": shape.m, "N": shape.n, "K": shape.k, "candidates": len(configs),
               "measured": len(measured), "errors": errors}
    best_name = min(measured, key=measured.get)
    summary.update(best=best_name, best_ms=measured[best_name], off_ms=measured.get("off"))
    for p in PROGRESS:   # the predictor's pick over the whole space (baselines at their measured times)
        cfg, name, _ = decide(shape, meas, progress=p, margin=0.0)
        summary[f"pick_{p}"] = name
        summary[f"pick_{p}_ms"] = measured.get(name)
        if name in measured:
            summary[f"best_over_pick_{p}"] = measured[best_name] / measured[name]
    # what choose() would run: top-2 verified, 2% margin against off (from the same numbers)
    cfg, name, _ = decide(shape, meas, verify=lambda cs: {label(c): measured[label(c)] for c in cs
                                                          if label(c) in measured})
    summary.update(choose=name, choose_ms=measured.get(name))
    return summary, points, meas


def _stats(points, p):
    errs = [abs(r[f"pred_{p}"] - r["measured"]) / r["measured"] for r in points
            if r[f"pred_{p}"] is not None and not r["label"].startswith(("off", "decompose", "p2p"))]
    if not errs:
        return {"n": 0}
    return {"n": len(errs), "mean_abs_rel_err": statistics.fmean(errs), "max_abs_rel_err": max(errs)}


def write_validation(out_dir, summaries, points, measurements, argv):
    from overlap_tp.tune import report
    stats = {p: _stats(points, p) for p in PROGRESS}
    share = {}
    for p in PROGRESS:
        ok = [s.get(f"best_over_pick_{p}", 0.0) >= 0.99 for s in summaries]
        share[p] = sum(ok) / len(ok) if ok else 0.0
    notes = ["Prediction error |pred - measured| / measured over the signal/nccl points (baselines are measured "
             "end to end, not predicted):"]
    for p in PROGRESS:
        s = stats[p]
        if s["n"]:
            notes.append(f"- {p}: n = {s['n']}, mean {100 * s['mean_abs_rel_err']:.1f}%, "
                         f"max {100 * s['max_abs_rel_err']:.1f}%; pick >= 99% of best measured on "
                         f"{100 * share[p]:.0f}% of shapes")
    notes.append("'best' is the best measured over the baselines and the measured subset of the space "
                 "(the predictor's top picks + a spread over its ranking), not necessarily the whole space.")
    columns = [("shape", "shape", "{}"), ("candidates", "space", "{}"), ("measured", "measured", "{}"),
               ("off_ms", "off", "{:.3f}"), ("best", "best measured", "{}"), ("best_ms", "ms", "{:.3f}"),
               ("pick_wave", "pick (wave)", "{}"), ("pick_wave_ms", "ms", "{:.3f}"),
               ("best_over_pick_wave", "best/pick", "{:.3f}"), ("pick_linear", "pick (linear)", "{}"),
               ("best_over_pick_linear", "best/pick", "{:.3f}"), ("choose", "choose()", "{}"),
               ("choose_ms", "ms", "{:.3f}")]
    command = "torchrun --nproc-per-node %d -m overlap_tp.tune %s" % (dist.get_world_size(), " ".join(argv))
    env = report.write(out_dir, "tune_validate", "Tuner: predicted vs measured (t = %d)" % dist.get_world_size(),
                       summaries, columns, "\n".join(notes), command=command)
    import json
    with open(os.path.join(out_dir, "tune_validate.json"), "w") as f:
        json.dump({"environment": env, "summary": summaries, "stats": stats, "pick_share": share,
                   "points": points, "measurements": measurements}, f, indent=1)
    point_cols = [("shape", "shape", "{}"), ("label", "candidate", "{}"), ("measured", "measured", "{:.3f}"),
                  ("pred_wave", "pred wave", "{:.3f}"), ("pred_linear", "pred linear", "{:.3f}")]
    with open(os.path.join(out_dir, "tune_validate.md"), "a") as f:
        f.write("\n## Points\n\n" + report.markdown_table(points, point_cols) + "\n")
    print("\n".join(notes))


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("run under torchrun: torchrun --nproc-per-node 2 -m overlap_tp.tune ...")
        return 2
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:   # the plans time collectives over the group
        print("overlap_tp.tune needs a group of 2 or more ranks: torchrun --nproc-per-node 2 -m overlap_tp.tune ...")
        return 2
    if not torch.cuda.is_available():   # before set_device, which fails deep in torch on CPU-only builds
        print("overlap_tp.tune needs CUDA GPUs (torch.cuda.is_available() is False)")
        return 2
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    group = dist.group.WORLD
    try:
        from torch.distributed import _symmetric_memory as symm
        symm.enable_symm_mem_for_group(group.group_name)
    except (ImportError, AttributeError, RuntimeError):
        pass
    torch.manual_seed(1234 + dist.get_rank())
    set_regime("graphs" if args.graphs else "eager")
    from overlap_tp.tune import measure
    rank0 = dist.get_rank() == 0
    shapes = shapes_from_args(args, dist.get_world_size())
    summaries, points, measurements = [], [], {}
    for spec, shape in shapes:
        if args.validate:
            summary, rows, meas = validate_shape(spec, shape, group, device, args, measure)
            summaries.append(summary)
            points += rows
            measurements[spec] = meas.to_dict()
            if rank0:
                print({k: v for k, v in summary.items() if k != "errors"}, flush=True)
        elif args.exhaustive:
            configs = candidates(shape, torch.cuda.get_device_properties(device).multi_processor_count)
            if args.points > 0:   # the baselines, then an even spread over the partitions
                fixed = [c for c in configs if not isinstance(c.groups, tuple)]
                parts = [c for c in configs if isinstance(c.groups, tuple)]
                configs = fixed + parts[::max(1, len(parts) // args.points)]
            times = measure.end_to_end(shape, configs, group, device, reps=args.reps)
            best = min(times, key=times.get)
            config = {label(c): c for c in configs}[best]
            if rank0:
                name = torch.cuda.get_device_name(device)
                store = TuneCache(args.cache, software_stamp(name))
                store.put(cache_key(name, shape.op, shape.dtype, shape.t, shape.m, shape.n, shape.k, regime()), config,
                          label=best, how="exhaustive", times=dict(sorted(times.items(), key=lambda kv: kv[1])))
                print(f"{spec}: best {best} {times[best]:.3f} ms (off {times.get('off', float('nan')):.3f})",
                      flush=True)
        else:
            dtype = getattr(torch, shape.dtype)
            rows = shape.m_local if shape.op == "ag" else shape.m
            a = torch.randn(rows, shape.k, device=device, dtype=dtype)
            w = torch.randn(shape.n, shape.k, device=device, dtype=dtype)
            config = choose(shape.op, a, w, group, cache=args.cache)
            if rank0:
                print(f"{spec}: {label(config)}  {config}", flush=True)
    if args.validate and rank0:
        write_validation(args.validate, summaries, points, measurements, argv)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
