"""Steady-state step time and losses of Megatron training logs, side by side: python summarize_runs.py LOG...
(median 'elapsed time per iteration (ms)' over logged iterations after the first `--skip`, the range of those
logged values (each is Megatron's mean over one log interval), and lm loss)."""
import argparse
import re
import statistics

p = argparse.ArgumentParser()
p.add_argument("logs", nargs="+")
p.add_argument("--skip", type=int, default=10, help="iterations left out (warm-up, graph capture)")
args = p.parse_args()
LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*elapsed time per iteration \(ms\): ([\d.]+).*lm loss: ([\d.E+-]+)")
rows = []
for path in args.logs:
    its = [(int(m[1]), float(m[2]), m[3]) for m in map(LINE.search, open(path, errors="replace")) if m]
    steady = [ms for it, ms, _ in its if it > args.skip]
    spread = f"{min(steady):.1f}-{max(steady):.1f}" if steady else "-"
    rows.append((path, statistics.median(steady) if steady else float("nan"), spread, len(steady),
                 " ".join(f"{it}:{loss}" for it, _, loss in its)))
base = rows[0][1]
print(f"| log | ms/iter (median after it {args.skip}) | range | n | vs first | lm loss by iteration |")
print("|---|---|---|---|---|---|")
for path, ms, spread, n, losses in rows:
    print(f"| {path} | {ms:.1f} | {spread} | {n} | {base / ms:.3f}x | {losses} |")
