"""`python -m overlap_tp.tune.refit RUN_DIR/tune_validate.json --out OUT_DIR`: fit predict.Contention
offline to a recorded `--validate` run and say how much it helps, cross-validated by shape.

No GPU and no new measurement: the predictions are recomputed from the run's recorded curves
(`measurements`: GEMM time per comm_sms, collective latency vs bytes, post), the targets are its recorded
end-to-end times. The points are the signal/nccl candidates with a recorded prediction (the tuner
measures off / decompose / p2p end to end and never predicts them); the progress model is `wave` (the
tuner's default). Before fitting, the original model's recomputed predictions must equal the recorded ones.

Fit: least squares on the relative error, a coarse grid over BOUNDS, then a pattern search. Evaluation:
in sample (fit on every shape) and leave one shape out (fit on the other shapes, predict the held-out
one). Picks: per shape, the candidate the model ranks first among the *measured* signal/nccl candidates
(not the whole space) against the best measured of those. Variants fit subsets of the parameters (the
others 0) to show which one carries the gain. Writes OUT/tune_refit.{json,md}.
"""
import argparse
import dataclasses
import itertools
import json
import os
import re
import statistics
import sys
from dataclasses import dataclass
from typing import Dict, List, Sequence

from overlap_tp.tune.report import markdown_table
from overlap_tp.ops.config import OverlapConfig
from overlap_tp.tune.candidates import Shape, candidates, config_from_label, label
from overlap_tp.tune.predict import NO_CONTENTION, Contention, Measurements, predict, rank

PROGRESS = "wave"
BOUNDS = {"comm_slowdown_sm0": (0.0, 1.0), "comm_slowdown": (0.0, 1.0), "gemm_slowdown": (0.0, 2.0),
          "group_overhead_ms": (0.0, 0.05)}
VARIANTS = {"all four": tuple(BOUNDS), "comm_slowdown_sm0 only": ("comm_slowdown_sm0",),
            "group_overhead_ms only": ("group_overhead_ms",)}
GRID_STEPS = 5          # coarse grid points per parameter
TOLERANCE = 1e-4        # pattern search stops at steps below this fraction of a parameter's range
RECOMPUTE_TOLERANCE_MS = 1e-9


@dataclass(frozen=True)
class Point:
    spec: str               # the shape's name in the run, e.g. l8b.proj.s8192
    shape: Shape
    config: OverlapConfig
    meas: Measurements      # the shape's recorded curves, without end-to-end times (the model must not read them)
    measured: float         # ms end to end
    recorded: float         # ms the original model predicted in the run


def _command_option(command: str, option: str, default: str) -> str:
    found = re.search(rf"{option}[ =](\S+)", command)
    return found.group(1) if found else default


def points_of(run: dict) -> List[Point]:
    """A run's signal/nccl points with a recorded prediction (the only ones the model predicts: off,
    decompose and p2p are measured end to end); op and t from the run's command line."""
    command = run["environment"]["command"]
    op, t = _command_option(command, "--op", "rs"), int(_command_option(command, "--nproc-per-node", "2"))
    if op == "ag":
        raise SystemExit("the contention model covers GEMM+collective (rs, ar); an ag run has nothing to fit")
    shapes = {s["shape"]: Shape(op, s["M"], s["N"], s["K"], t) for s in run["summary"]}
    meas = {spec: dataclasses.replace(Measurements.from_dict(d), direct={}) for spec, d in run["measurements"].items()}
    return [Point(r["shape"], shapes[r["shape"]], config_from_label(r["label"]), meas[r["shape"]], r["measured"],
                  r[f"pred_{PROGRESS}"])
            for r in run["points"] if r[f"pred_{PROGRESS}"] is not None and "/nccl/" in r["label"]]


def prediction(point: Point, contention: Contention) -> float:
    return predict(point.shape, point.config, point.meas, PROGRESS, contention)


def rel_error(point: Point, contention: Contention) -> float:
    return (prediction(point, contention) - point.measured) / point.measured


def loss(points: Sequence[Point], contention: Contention) -> float:
    return sum(rel_error(p, contention) ** 2 for p in points)


def check_recomputation(points: Sequence[Point]) -> float:
    """Largest |recomputed - recorded| of the original model (ms); raises if it does not reproduce the run."""
    worst = max(abs(prediction(p, NO_CONTENTION) - p.recorded) for p in points)
    if worst > RECOMPUTE_TOLERANCE_MS:
        raise SystemExit(f"the recorded predictions are not reproduced (max diff {worst:.3g} ms): a different "
                         "predictor or candidate layout than the run's; the refit would be meaningless")
    return worst


def fit(points: Sequence[Point], free: Sequence[str] = tuple(BOUNDS)) -> Contention:
    """The `free` parameters (the others 0) minimising the squared relative error: the best point of a
    GRID_STEPS grid over BOUNDS, then a Hooke-Jeeves pattern search (moves of +- a step per parameter,
    a jump along every improvement since the parameters trade off against each other, the steps halved
    when nothing improves) down to TOLERANCE of each range."""
    ranges = [BOUNDS[name] for name in free]

    def cost(values):
        return loss(points, dataclasses.replace(NO_CONTENTION, **dict(zip(free, values))))

    def clip(values):
        return tuple(min(hi, max(lo, v)) for v, (lo, hi) in zip(values, ranges))

    def explore(start, start_cost, steps):
        best, best_cost = start, start_cost
        for i, step in enumerate(steps):
            for sign in (1, -1):
                trial = clip(best[:i] + (best[i] + sign * step,) + best[i + 1:])
                trial_cost = cost(trial)
                if trial_cost < best_cost:
                    best, best_cost = trial, trial_cost
                    break
        return best, best_cost

    grid = [[lo + (hi - lo) * i / (GRID_STEPS - 1) for i in range(GRID_STEPS)] for lo, hi in ranges]
    base = min(itertools.product(*grid), key=cost)
    base_cost = cost(base)
    steps = [(hi - lo) / (GRID_STEPS - 1) / 2 for lo, hi in ranges]
    while any(s > TOLERANCE * (hi - lo) for s, (lo, hi) in zip(steps, ranges)):
        new, new_cost = explore(base, base_cost, steps)
        if not new_cost < base_cost:
            steps = [s / 2 for s in steps]
            continue
        while new_cost < base_cost:       # jump on in the direction that helped, while it helps
            jump = clip(tuple(2 * n - b for n, b in zip(new, base)))
            base, base_cost = new, new_cost
            new, new_cost = explore(jump, cost(jump), steps)
    return dataclasses.replace(NO_CONTENTION, **dict(zip(free, base)))


def cross_validate(points: Sequence[Point], free: Sequence[str]) -> Dict[str, Contention]:
    """Leave one shape out: per shape, the parameters fitted on the other shapes' points."""
    specs = list(dict.fromkeys(p.spec for p in points))
    return {spec: fit([p for p in points if p.spec != spec], free) for spec in specs}


def error_stats(points: Sequence[Point], contention_of) -> dict:
    """Mean / max |relative error|; contention_of(point) -> the Contention that predicts it."""
    errors = [abs(rel_error(p, contention_of(p))) for p in points]
    return {"n": len(errors), "mean_abs_rel_err": statistics.fmean(errors), "max_abs_rel_err": max(errors)}


def pick(points: Sequence[Point], contention: Contention) -> dict:
    """One shape: the model's first among its measured candidates vs the best measured of them."""
    by_config = {p.config: p for p in points}
    first = by_config[rank(points[0].shape, list(by_config), points[0].meas, PROGRESS, contention)[0][2]]
    best = min(points, key=lambda p: p.measured)
    ratio = best.measured / first.measured
    return {"pick": label(first.config), "pick_ms": first.measured, "best_over_pick": ratio,
            "within_1pct": ratio >= 0.99, "within_5pct": ratio >= 0.95}


def space_pick(points: Sequence[Point], contention: Contention) -> dict:
    """One shape: the model's first among the whole signal/nccl space, and its time if it was measured."""
    shape, meas = points[0].shape, points[0].meas
    space = [c for c in candidates(shape, meas.sms) if c.method == "signal" and c.transport == "nccl"]
    first = label(rank(shape, space, meas, PROGRESS, contention)[0][2])
    measured = {label(p.config): p.measured for p in points}
    return {"space_pick": first, "space_pick_ms": measured.get(first)}


def _values(contention: Contention) -> Dict[str, float]:
    return {k: round(v, 4) for k, v in dataclasses.asdict(contention).items()}


MODELS = ("old", "new_in_sample", "new_cross_validated")   # per shape: original, "all four" in sample / left out


def evaluate(points: Sequence[Point]) -> dict:
    """Every variant fitted in sample and cross-validated; per shape the errors and picks of the original
    model and of the full one ("all four") in sample and cross-validated."""
    fits = {name: (fit(points, free), cross_validate(points, free)) for name, free in VARIANTS.items()}
    variants = {name: {"free": list(VARIANTS[name]), "fitted": _values(fitted),
                       "folds": {spec: _values(c) for spec, c in folds.items()},
                       "in_sample": error_stats(points, lambda p: fitted),
                       "cross_validated": error_stats(points, lambda p: folds[p.spec])}
                for name, (fitted, folds) in fits.items()}
    fitted, folds = fits["all four"]
    contention_of = {"old": lambda spec: NO_CONTENTION, "new_in_sample": lambda spec: fitted,
                     "new_cross_validated": lambda spec: folds[spec]}
    shapes = []
    for spec in dict.fromkeys(p.spec for p in points):
        mine = [p for p in points if p.spec == spec]
        best = min(mine, key=lambda p: p.measured)
        row = {"shape": spec, "n": len(mine), "best": label(best.config), "best_ms": best.measured}
        for model in MODELS:
            contention = contention_of[model](spec)
            row[model] = dict(error_stats(mine, lambda p: contention), **pick(mine, contention),
                              **space_pick(mine, contention))
        shapes.append(row)
    per_point = [{"shape": p.spec, "label": label(p.config), "measured": p.measured,
                  **{model: prediction(p, contention_of[model](p.spec)) for model in MODELS}} for p in points]
    return {"old": error_stats(points, lambda p: NO_CONTENTION), "variants": variants, "shapes": shapes,
            "per_point": per_point}


NOTE = ("Offline refit on one recorded run ({source}: {date}, {device} x {t}, commit {commit}), not a new GPU "
        "measurement: predictions are recomputed from the run's recorded curves (the original model reproduces "
        "the recorded predictions to {diff:.1g} ms) and compared with its recorded end-to-end times. Picks are "
        "over the measured signal/nccl candidates of each shape ({n} per shape on average, chosen by the original "
        "model: its top 8 plus a spread over its ranking), not the whole space; 'best' is the best of those, "
        "not of the baselines (p2p, off, decompose).")
MODEL_TEXT = ("Model (predict.Contention): while the GEMM runs, a collective moves at (1 - x) of its alone speed "
              "(x = comm_slowdown_sm0 at comm_sms 0, comm_slowdown otherwise); while a collective moves at speed "
              "s, the GEMM runs at 1 / (1 + gemm_slowdown * s); every group's collective starts "
              "group_overhead_ms late. All 0 = the original model.")
MODEL_NAMES = {"old": "original", "new_in_sample": "new, in sample", "new_cross_validated": "new, shape left out"}


def _ms(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _error_tables(result: dict) -> List[str]:
    rows = [{"model": "original", "in": result["old"]["mean_abs_rel_err"], "in_max": result["old"]["max_abs_rel_err"]}]
    for name, v in result["variants"].items():
        rows.append({"model": name, "params": ", ".join(f"{k} {v['fitted'][k]:g}" for k in v["free"]),
                     "in": v["in_sample"]["mean_abs_rel_err"], "in_max": v["in_sample"]["max_abs_rel_err"],
                     "cv": v["cross_validated"]["mean_abs_rel_err"], "cv_max": v["cross_validated"]["max_abs_rel_err"]})
    folds = [dict(shape=spec, **c) for spec, c in result["variants"]["all four"]["folds"].items()]
    return [f"## Error |pred - measured| / measured over the {result['points']} points", "",
            markdown_table(rows, [("model", "parameters fitted", "{}"), ("params", "values (all shapes)", "{}"),
                                  ("in", "mean in sample", "{:.1%}"), ("in_max", "max", "{:.1%}"),
                                  ("cv", "mean, shape left out", "{:.1%}"), ("cv_max", "max", "{:.1%}")]), "",
            "Parameters of each fold (all four, fitted without the shape):", "",
            markdown_table(folds, [("shape", "left out", "{}")] + [(k, k, "{:g}") for k in BOUNDS]), ""]


def _shape_tables(result: dict) -> List[str]:
    errors, picks, space = [], [], []
    for s in result["shapes"]:
        errors.append({"shape": s["shape"], "n": s["n"],
                       **{m: f"{s[m]['mean_abs_rel_err']:.1%} ({s[m]['max_abs_rel_err']:.1%})" for m in MODELS}})
        picks.append({"shape": s["shape"], "best": f"{s['best']} ({s['best_ms']:.3f})",
                      **{m: f"{s[m]['pick']} ({s[m]['best_over_pick']:.3f})" for m in MODELS}})
        space.append({"shape": s["shape"],
                      **{m: f"{s[m]['space_pick']} ({_ms(s[m]['space_pick_ms'])})" for m in MODELS}})
    lines = ["## Per shape", "", "Mean (max) error:", "",
             markdown_table(errors, [("shape", "shape", "{}"), ("n", "n", "{}")] + [
                 (m, MODEL_NAMES[m], "{}") for m in MODELS]),
             "", "Pick among the measured signal/nccl candidates (best/pick; >= 0.99 is within 1%). Equal predictions "
             "are broken as rank() breaks them (fewer groups first), so the original model's pick can differ from "
             "tune_validate.md's at the same predicted time:", "",
             markdown_table(picks, [("shape", "shape", "{}"), ("best", "best measured (ms)", "{}")] + [
                 (m, MODEL_NAMES[m], "{}") for m in MODELS]), ""]
    for m in MODELS:
        shapes = [s[m] for s in result["shapes"]]
        lines.append(f"- {MODEL_NAMES[m]}: within 1% of the best measured on {sum(p['within_1pct'] for p in shapes)}"
                     f"/{len(shapes)} shapes, within 5% on {sum(p['within_5pct'] for p in shapes)}/{len(shapes)}")
    lines += ["", "Pick over the whole signal/nccl space (its measured ms, '-' = not measured in the run, so not "
              "evaluable here):", "",
              markdown_table(space, [("shape", "shape", "{}")] + [(m, MODEL_NAMES[m], "{}") for m in MODELS]), ""]
    return lines


def markdown(result: dict) -> str:
    lines = ["# Tuner predictor: contention model refit", "", result["note"], "", f"Command: `{result['command']}`",
             "", MODEL_TEXT, ""]
    return "\n".join(lines + _error_tables(result) + _shape_tables(result))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m overlap_tp.tune.refit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("validate_json", help="a --validate run's tune_validate.json")
    p.add_argument("--out", required=True, help="folder for tune_refit.json and tune_refit.md")
    args = p.parse_args(argv)
    with open(args.validate_json) as f:
        run = json.load(f)
    points = points_of(run)
    diff = check_recomputation(points)
    env = run["environment"]
    result = {"command": " ".join(["python -m overlap_tp.tune.refit", args.validate_json, "--out", args.out]),
              "source": args.validate_json, "source_environment": env, "progress": PROGRESS,
              "points": len(points), "recomputation_max_diff_ms": diff, "bounds": BOUNDS}
    n_per_shape = len(points) / len({p.spec for p in points})
    result["note"] = NOTE.format(source=args.validate_json, date=env.get("date"), device=env.get("device"),
                                 t=points[0].shape.t, commit=env.get("git_commit"), diff=diff, n=round(n_per_shape))
    result.update(evaluate(points))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_refit.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = markdown(result)
    with open(os.path.join(args.out, "tune_refit.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
