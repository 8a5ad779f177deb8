"""The results tables, generated from benchmarks/results.jsonl.

    python benchmarks/tables.py           # rewrite the marked tables
    python benchmarks/tables.py --check   # exit 1 and name each file whose marked table differs

Writes between markers, nothing else:
  README.md              <!-- results:begin --> ... <!-- results:end -->   end-to-end speedups (on / off)
  docs/performance.md    <!-- tables:begin -->  ... <!-- tables:end -->    every row, one table per campaign
  benchmarks/<campaign>  <!-- rows:begin -->    ... <!-- rows:end -->      that campaign's rows
A file without its markers is an error that says where they go.
"""
import argparse
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results.jsonl")
FIELDS = ("date", "commit", "cards", "t", "what", "config", "metric", "value", "record", "logs")
CAMPAIGN = re.compile(r"benchmarks/[a-z0-9]+(?:-[a-z0-9]+)*_[a-z0-9]+(?:-[a-z0-9]+)*_\d{4}-\d{2}-\d{2}\.md")
E2E_METRIC = "speedup on/off"
# decimals per metric (the records' own); others print as given
DIGITS = {
    "speedup on/off": 3, "time ratio ours/megatron": 3, "time ratio ours/nocomm": 3, "time ratio ours/cuBLAS": 3,
    "speedup cuBLAS/ours (median)": 3, "speedup sequential/ours": 2, "speedup megatron/ours": 2,
    "speedup eager/fused": 2, "ms/iteration": 1, "ms": 3, "ms exposed communication per step": 3,
    "ms graph replay per step": 2, "% of same-size copy bandwidth": 1, "us": 2,
}
MARKERS = {"results": ("<!-- results:begin -->", "<!-- results:end -->"),
           "tables": ("<!-- tables:begin -->", "<!-- tables:end -->"),
           "rows": ("<!-- rows:begin -->", "<!-- rows:end -->")}


def load(path=RESULTS):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def problems(rows, root=ROOT):
    """What is wrong with the rows: missing fields, bad values, records or logs that do not exist."""
    out = []
    for i, row in enumerate(rows, 1):
        where = f"results.jsonl line {i}"
        if tuple(row) != FIELDS:
            out.append(f"{where}: fields {tuple(row)}, expected {FIELDS}")
            continue
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", row["date"]):
            out.append(f"{where}: date {row['date']!r}")
        if not re.fullmatch(r"[0-9a-f]{7}", row["commit"]):
            out.append(f"{where}: commit {row['commit']!r} (7 hex digits)")
        if not re.fullmatch(r"\d+x H(100|200)", row["cards"]):
            out.append(f"{where}: cards {row['cards']!r} (e.g. '2x H200')")
        if row["t"] not in (1, 2, 4, 8):
            out.append(f"{where}: t {row['t']!r}")
        if not isinstance(row["config"], dict) or not row["config"]:
            out.append(f"{where}: config must be a non-empty object")
        if not isinstance(row["value"], (int, float)) or isinstance(row["value"], bool):
            out.append(f"{where}: value {row['value']!r} is not a number")
        metric = row["metric"]
        ratio = "/" in metric.split(" (")[0] and not metric.startswith("ms/") or re.search(r"\bratio\b", metric)
        if ratio and not (metric.startswith("speedup ") or metric.startswith("time ratio ")):
            out.append(f"{where}: a ratio's metric says 'speedup a/b' (>1 good) or 'time ratio a/b' (<1 good), "
                       f"not {metric!r}")
        if metric == E2E_METRIC and not row["what"].startswith("e2e "):
            out.append(f"{where}: {E2E_METRIC!r} is the end-to-end metric")
        if not CAMPAIGN.fullmatch(row["record"]):
            out.append(f"{where}: record {row['record']!r} is not benchmarks/<theme>_<hardware>_<date>.md")
        elif not os.path.isfile(os.path.join(root, row["record"])):
            out.append(f"{where}: record {row['record']} does not exist")
        if row["logs"] and (len(row["logs"]) != 2 or metric != E2E_METRIC):
            out.append(f"{where}: logs are an end-to-end speedup's [off, on] train.log pair")
        for log in row["logs"]:
            if not os.path.isfile(os.path.join(root, log)):
                out.append(f"{where}: log {log} does not exist")
    return out


def number(value, metric):
    digits = DIGITS.get(metric)
    return f"{value:.{digits}f}" if digits is not None else f"{value:g}"


def config_text(config):
    parts = []
    for key, value in config.items():
        if key in ("method", "variant"):
            parts.append(str(value))
        elif value is True:
            parts.append(key)
        elif value is False:
            parts.append(f"not {key}")
        else:
            parts.append(f"{key} {value}")
    return ", ".join(parts)


def groups(rows, key):
    out = {}
    for row in rows:
        out.setdefault(key(row), []).append(row)
    return list(out.values())


def link(path, base):
    return f"[{os.path.basename(path)[:-3]}]({os.path.relpath(path, base) if base else path})"


def results_table(rows, base=""):
    """README's table: every end-to-end speedup, repeated pairs of one setup on one line."""
    lines = ["| setup | TP | cards | graphs | on / off (speedup) | date | record | logs (off, on) |",
             "|---|---|---|---|---|---|---|---|"]
    e2e = [r for r in rows if r["metric"] == E2E_METRIC]
    def same(row):   # the pairs of one setup (their rounds apart) on one line
        return {k: v for k, v in row["config"].items() if k != "round"}

    for group in groups(e2e, lambda r: (r["what"], r["t"], r["cards"], json.dumps(same(r)), r["record"])):
        first = group[0]
        config = {k: v for k, v in same(first).items() if k != "graphs"}
        setup = first["what"][len("e2e "):] + (f", {config_text(config)}" if config else "")
        values = " / ".join(number(r["value"], E2E_METRIC) for r in group)
        dates = ", ".join(sorted({r["date"] for r in group}))
        if all(r["logs"] for r in group):
            logs = "; ".join(" ".join(f"[{w}]({os.path.relpath(p, base) if base else p})"
                                      for w, p in zip(("off", "on"), r["logs"])) for r in group)
        else:
            logs = "not kept"
        lines.append(f"| {setup} | {first['t']} | {first['cards']} | {first['config'].get('graphs', '-')} | "
                     f"{values} | {dates} | {link(first['record'], base)} | {logs} |")
    return "\n".join(lines)


def rows_table(rows):
    """One line per measurement (what, cards, metric, commit): the shared config as its setup, the rest as labels."""
    lines = ["| what | TP | cards | setup | metric | values | date | commit |", "|---|---|---|---|---|---|---|---|"]
    for group in groups(rows, lambda r: (r["what"], r["t"], r["cards"], r["metric"], r["date"], r["commit"])):
        first = group[0]
        common = {k: v for k, v in first["config"].items() if all(r["config"].get(k, object()) == v for r in group)}
        values = []
        for r in group:
            label = config_text({k: v for k, v in r["config"].items() if k not in common})
            values.append(f"{label} {number(r['value'], r['metric'])}" if label else number(r["value"], r["metric"]))
        lines.append(f"| {first['what']} | {first['t']} | {first['cards']} | {config_text(common) or '-'} | "
                     f"{first['metric']} | {'; '.join(values)} | {first['date']} | {first['commit']} |")
    return "\n".join(lines)


def title(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.readline().lstrip("# ").strip()


def performance_tables(rows, root=ROOT):
    out = []
    for record in dict.fromkeys(r["record"] for r in rows):
        here = [r for r in rows if r["record"] == record]
        out.append(f"### {title(record) if os.path.isfile(os.path.join(root, record)) else record}\n\n"
                   f"Record: {link(record, 'docs')}\n\n{rows_table(here)}")
    return "\n\n".join(out)


def fill(text, name, body, path):
    begin, end = MARKERS[name]
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise SystemExit(f"{path}: needs one '{begin}' line and one '{end}' line after it, where the generated "
                         f"table goes (benchmarks/tables.py fills what lies between them)")
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def targets(rows, root=ROOT):
    """{path: (marker name, generated body)} for every file the tables go into."""
    out = {"README.md": ("results", results_table(rows)),
           os.path.join("docs", "performance.md"): ("tables", performance_tables(rows, root))}
    for record in dict.fromkeys(r["record"] for r in rows):
        out[record] = ("rows", rows_table([r for r in rows if r["record"] == record]))
    return out


def render(path, rows, root=ROOT):
    """The file at `path` (relative to root) with its marked table regenerated."""
    name, body = targets(rows, root)[path]
    with open(os.path.join(root, path)) as f:
        return fill(f.read(), name, body, path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 where a table differs")
    options = parser.parse_args(argv)
    rows = load()
    wrong = problems(rows)
    if wrong:
        print("\n".join(wrong), file=sys.stderr)
        return 1
    stale = []
    for path in targets(rows):
        new = render(path, rows)
        with open(os.path.join(ROOT, path)) as f:
            if f.read() == new:
                continue
        stale.append(path)
        if not options.check:
            with open(os.path.join(ROOT, path), "w") as f:
                f.write(new)
    if options.check and stale:
        print("out of date (run python benchmarks/tables.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    for path in stale:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
