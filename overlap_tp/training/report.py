"""`python -m overlap_tp.training.report LOG... --out DIR`: training runs side by side, from their stdout logs.

Reads Megatron's training log lines (`iteration N/M | ... elapsed time per iteration (ms): ... |
throughput per GPU (TFLOP/s/GPU): ... | lm loss: ... |`), the `[overlap_tp]` lines of
`overlap_tp.training.throughput` (tokens/s/GPU, MFU, exposed communication, communication hidden) and
Megatron's argument dump (seq_length, world_size, overlap_tp, ...). Writes DIR/report.png (matplotlib;
panels: throughput, tokens/s/GPU, MFU, step time, the overlap figures when present, loss) and DIR/report.html (the figure plus a table of
steady-state medians, each run against the first one, the baseline). Label runs with LOG=LABEL.
"""
import argparse
import base64
import html
import os
import re
import statistics
import sys

from overlap_tp.training.throughput import peak_tflops

_MEGATRON = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|")
_FIELDS = {
    "step_time_ms": re.compile(r"elapsed time per iteration \(ms\):\s*([0-9.eE+-]+)"),
    "tflops_per_gpu": re.compile(r"throughput per GPU \(TFLOP/s/GPU\):\s*([0-9.eE+-]+)"),
    "loss": re.compile(r"\blm loss:\s*([0-9.eE+-]+)"),
    "global_batch_size": re.compile(r"global batch size:\s*(\d+)"),
}
_OURS = re.compile(r"\[overlap_tp\] iteration\s+(\d+)")
_OUR_FIELDS = {
    "tokens_per_sec_per_gpu": re.compile(r"tokens/s/GPU:\s*([0-9.eE+-]+)"),
    "mfu": re.compile(r"MFU:\s*([0-9.eE+-]+)%"),
    # the figures of overlap_tp.training.throughput ("Overlap statistics"); a log's "overlap efficiency", a figure
    # of another definition, is not read
    "exposed_comm_ms": re.compile(r"exposed comm \(ms/step\):\s*([0-9.eE+-]+)"),
    "comm_hidden": re.compile(r"comm hidden:\s*([0-9.eE+-]+)"),
}
_ARG = re.compile(r"^\s*([a-z_][a-z0-9_]*) \.{3,} (.+?)\s*$")

PANELS = (  # key, title, unit
    ("tflops_per_gpu", "Throughput", "TFLOP/s/GPU"),
    ("tokens_per_sec_per_gpu", "Tokens", "tokens/s/GPU"),
    ("mfu", "MFU", "% of peak"),
    ("step_time_ms", "Step time", "ms"),
    ("exposed_comm_ms", "Exposed communication", "ms per step beyond the GEMMs (>= 0)"),
    ("comm_hidden", "Communication hidden", "share of comm-alone time, 0-1"),
    ("loss", "Loss", "lm loss"),
)


class Run:
    """One training log: label, Megatron arguments and per-iteration metrics."""

    def __init__(self, label, path=None):
        self.label = label
        self.path = path
        self.args = {}
        self.points = {}  # iteration -> {metric: value}

    def series(self, key):
        items = sorted((i, p[key]) for i, p in self.points.items() if p.get(key) is not None)
        return [i for i, _ in items], [v for _, v in items]

    def has(self, key):
        return any(p.get(key) is not None for p in self.points.values())

    def steady(self, key, skip=1):
        """Median over the logged intervals after the first `skip` (warm-up, compilation)."""
        _, values = self.series(key)
        values = values[skip:] if len(values) > skip else values
        return statistics.median(values) if values else None


def _number(text):
    try:
        return float(text)
    except ValueError:
        return None


def parse_log(lines, label="run", path=None, peak=None):
    """Parse one run's log lines (an iterable of str) into a Run; fills in what can be derived."""
    run = Run(label, path)
    for line in lines:
        m = _MEGATRON.search(line)
        if m and "[overlap_tp]" not in line:
            point = run.points.setdefault(int(m.group(1)), {})
            for key, pattern in _FIELDS.items():
                f = pattern.search(line)
                if f:
                    point[key] = _number(f.group(1))
            continue
        m = _OURS.search(line)
        if m:
            point = run.points.setdefault(int(m.group(1)), {})
            for key, pattern in _OUR_FIELDS.items():
                f = pattern.search(line)
                if f:
                    point[key] = _number(f.group(1))
            continue
        m = _ARG.match(line)
        if m and m.group(1) not in run.args:
            run.args[m.group(1)] = m.group(2)
    _derive(run, peak)
    return run


def _derive(run, peak):
    """MFU from TFLOP/s where the overlap_tp line is missing; tokens/s/GPU from the step time."""
    seq = _number(run.args.get("seq_length", "")) if run.args.get("seq_length") else None
    world = _number(run.args.get("world_size", "")) if run.args.get("world_size") else None
    peak = peak_tflops(peak)
    for point in run.points.values():
        if point.get("mfu") is None and point.get("tflops_per_gpu") is not None:
            point["mfu"] = 100.0 * point["tflops_per_gpu"] / peak
        if (point.get("tokens_per_sec_per_gpu") is None and seq and world and point.get("step_time_ms")
                and point.get("global_batch_size")):
            point["tokens_per_sec_per_gpu"] = point["global_batch_size"] * seq / (point["step_time_ms"] / 1e3 * world)


def load(spec, peak=None):
    """`path` or `path=label`; the default label is the run's folder (for train.log) or the file's stem."""
    path, _, label = spec.partition("=")
    with open(path, errors="replace") as f:
        run = parse_log(f, label or path, path, peak)
    if not label:  # runs/<name>/train.log (the recipes) -> <name>, else the file's stem
        stem = os.path.splitext(os.path.basename(path))[0]
        name = os.path.basename(os.path.dirname(os.path.abspath(path))) if stem == "train" else stem
        method = run.args.get("overlap_tp")
        run.label = f"{name} ({method})" if method and method not in name else name or path
    return run


def summary_rows(runs, skip=1):
    """[label, metric medians..., speedup of step time vs the first run]."""
    rows = []
    base = runs[0].steady("step_time_ms", skip) if runs else None
    for run in runs:
        step = run.steady("step_time_ms", skip)
        row = {"label": run.label, "iterations": len(run.points)}
        for key, _, _ in PANELS:
            row[key] = run.steady(key, skip)
        row["speedup"] = base / step if base and step else None
        rows.append(row)
    return rows


def render_png(runs, path, skip=1):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in PANELS if any(run.has(p[0]) for run in runs)]
    cols = 3
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False)
    for ax, (key, title, unit) in zip(axes.flat, panels):
        for index, run in enumerate(runs):  # one colour per run in every panel
            x, y = run.series(key)
            if x:
                median = run.steady(key, skip)
                ax.plot(x, y, marker="o", markersize=3, color=f"C{index % 10}",
                        label=f"{run.label}" + (f" ({median:.4g})" if median is not None else ""))
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle("overlap_tp training runs (legend: steady-state median)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render_html(runs, png_path, path, skip=1):
    with open(png_path, "rb") as f:
        image = base64.b64encode(f.read()).decode()
    rows = summary_rows(runs, skip)
    keys = [p for p in PANELS if any(r[p[0]] is not None for r in rows)]
    head = "".join(f"<th>{html.escape(t)}<br><small>{html.escape(u)}</small></th>" for _, t, u in keys)
    body = []
    for row in rows:
        cells = "".join(f"<td>{'' if row[k] is None else f'{row[k]:.4g}'}</td>" for k, _, _ in keys)
        speed = "" if row["speedup"] is None else f"{row['speedup']:.3f}x"
        body.append(f"<tr><td>{html.escape(row['label'])}</td><td>{row['iterations']}</td>{cells}<td>{speed}</td></tr>")
    sources = "".join(f"<li>{html.escape(r.label)}: <code>{html.escape(str(r.path))}</code></li>" for r in runs)
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>overlap_tp training report</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}td:first-child{{text-align:left}}</style></head>
<body><h1>overlap_tp training report</h1>
<p>Medians over the logged intervals after the first {skip} (warm-up). Speedup: the first run's step time
over each run's. MFU against a {peak_tflops():.0f} TFLOP/s/GPU peak unless the log says otherwise.</p>
<table><tr><th>run</th><th>intervals</th>{head}<th>speedup</th></tr>
{''.join(body)}</table>
<p><img alt="panels" src="data:image/png;base64,{image}"></p>
<h2>Logs</h2><ul>{sources}</ul></body></html>
"""
    with open(path, "w") as f:
        f.write(page)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m overlap_tp.training.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="+", metavar="LOG[=LABEL]", help="training stdout logs; the first is the baseline")
    parser.add_argument("--out", required=True, help="output folder (report.png, report.html)")
    parser.add_argument("--skip", type=int, default=1, help="logged intervals left out of the medians (warm-up)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="per-GPU peak for MFU (default 989)")
    options = parser.parse_args(argv)
    runs = [load(spec, options.peak_tflops) for spec in options.logs]
    empty = [run.label for run in runs if not run.points]
    if empty:
        print(f"no training log lines in: {', '.join(empty)}", file=sys.stderr)
        return 1
    os.makedirs(options.out, exist_ok=True)
    try:
        png = render_png(runs, os.path.join(options.out, "report.png"), options.skip)
    except ImportError:
        print("matplotlib is missing: pip install -e '.[report]' in the checkout", file=sys.stderr)
        return 1
    page = render_html(runs, png, os.path.join(options.out, "report.html"), options.skip)
    for row in summary_rows(runs, options.skip):
        values = ", ".join(f"{k}={row[k]:.4g}" for k, _, _ in PANELS if row[k] is not None)
        speed = f", speedup={row['speedup']:.3f}x" if row["speedup"] else ""
        print(f"{row['label']}: {values}{speed}")
    print(f"wrote {png} and {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
