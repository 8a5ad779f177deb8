"""The whole GPU suite as one gate: every file tests/gpu/test_*.py, on whatever machine this is, in chunks that each
end well inside one device command, and one summary per machine size.

    python tests/gpu/gpu_suite.py plan                          # the chunks for this machine's GPU count
    python tests/gpu/gpu_suite.py run --commit SHA --out DIR    # every chunk, then the summary, into DIR
    python tests/gpu/gpu_suite.py run --chunk K --commit SHA --out DIR   # chunk K alone (one 10-minute command)
    python tests/gpu/gpu_suite.py run --jobs 2 --commit SHA --out DIR    # every chunk, two at a time
    (--logs DIR2: the chunks' pytest output and raw records there instead of beside the results)
    python tests/gpu/gpu_suite.py summary DIR/chunk-*.json      # the chunks' results -> tests/gpu/results/

Run it from the clone's root (the checkout imports as the installed package does). One GPU runs the files whose
tests need one (two ranks on one GPU over CUDA IPC included) and skips the rest for want of GPUs; two or more
GPUs run those too. Each chunk is one pytest process under a time limit; its results are written test by test as
they come (a plugin), so a chunk cut by its limit still says what passed and what never ran. Chunks are planned
from the times of the machine size's latest summary: per file, and per test function for a file longer than a
chunk (a file without a time is a chunk of its own).

The summary (tests/gpu/results/<N>gpu.json and .md) names the commit, the cards, the versions and a hash of the
sources the gate covers (GATED), and per file: passed, failed, errors, skipped (with reasons), not run, seconds.
The rule it records: a change to kernels/, overlap_tp/ops/, overlap_tp/megatron/ or overlap_tp/tune/ lands only
after the whole suite passed on the device at that commit, for the machine sizes lent; the latest summary per
machine size is kept (it replaces the older one). tests/test_gpu_gate.py checks, on the CPU, that the one-GPU
summary passed and was taken of the sources as they are.
"""
import argparse
import concurrent.futures
import glob
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "tests", "gpu", "results")
GATED = ("kernels", "overlap_tp/ops", "overlap_tp/megatron", "overlap_tp/tune", "tests/gpu")
CHUNK_BUDGET_S = 300     # planned seconds of tests per chunk (their seconds as the latest summary measured them)
UNTIMED_FILE_S = 120     # where a file the summary has not timed yet goes in the order chunks start
CHUNK_LIMIT_S = 540      # a chunk's pytest is stopped here (stacks dumped first): inside a 10-minute command
META = ("commit", "source_hash", "machine", "date", "command")   # what a chunk's record carries beside its tests
RULE = ("A change to kernels/, overlap_tp/ops/, overlap_tp/megatron/ or overlap_tp/tune/ lands only after the whole "
        "GPU suite passed on the device at that commit, for the machine sizes lent (one GPU at least); the latest "
        "summary per machine size is kept.")
# the device machines: NVLink multicast stays off (it can take a shared host's GPUs out of service)
DEVICE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
              "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
NEEDS_GPUS = re.compile(r"needs (\d+) GPUs")
# an optional dependency the device images lack; benchmarks/device/te_build.sh installs it, and the summary lists
# every such skip with its reason
WITHOUT_TE = re.compile(r"Transformer Engine")


def test_files():
    """Every GPU test file, relative to the root, sorted."""
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "tests", "gpu", "test_*.py")))


def source_hash(root: str = ROOT) -> str:
    """sha256 over the gated folders' files (relative path and bytes, sorted; caches, hidden files and the results
    folder left out): the same on the device's copy of a commit as on a clone of it."""
    digest = hashlib.sha256()
    paths = []
    for folder in GATED:
        for dirpath, dirnames, files in os.walk(os.path.join(root, folder)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__" and not d.startswith(".")
                           and os.path.join(dirpath, d) != os.path.join(root, "tests", "gpu", "results")]
            paths += [os.path.join(dirpath, f) for f in files if not f.startswith(".") and not f.endswith(".pyc")]
    for path in sorted(paths, key=lambda p: os.path.relpath(p, root)):
        digest.update(os.path.relpath(path, root).replace(os.sep, "/").encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(f.read() + b"\0")
    return digest.hexdigest()


def summary_path(gpus: int, ext: str) -> str:
    return os.path.join(RESULTS, f"{gpus}gpu.{ext}")


def _pack(items, budget):
    """items (name, seconds) -> groups of names, each at most `budget` seconds where one item allows (first fit,
    longest first), with their planned seconds."""
    groups = []
    for name, cost in sorted(items, key=lambda item: -item[1]):
        for group in groups:
            if group[1] + cost <= budget:
                group[0].append(name)
                group[1] += cost
                break
        else:
            groups.append([[name], cost])
    return [(names, cost) for names, cost in groups]


def plan(gpus: int, files=None):
    """Chunks of pytest selectors, each planned at most CHUNK_BUDGET_S from the latest summary's seconds. A file
    longer than the budget is split into its test functions (`file::test_name`, with their recorded seconds), packed
    into chunks of their own; a file the summary has not timed yet (its time unknown) is a chunk of its own; the
    other files are packed together. Chunks come longest first (an untimed file counts UNTIMED_FILE_S), so that
    `run --jobs N` starts the long ones first; within a chunk, selectors keep name order."""
    files = test_files() if files is None else files
    rows = {}
    if os.path.exists(summary_path(gpus, "json")):
        with open(summary_path(gpus, "json")) as f:
            rows = json.load(f)["files"]
    chunks, whole_files = [], []
    for name in files:
        if name not in rows:
            chunks.append(([name], float(UNTIMED_FILE_S)))
        elif rows[name]["seconds"] + 5 > CHUNK_BUDGET_S and rows[name].get("functions"):
            functions = [(f"{name}::{function}", seconds + 5)   # + its processes' start
                         for function, seconds in rows[name]["functions"].items()]
            chunks += _pack(functions, CHUNK_BUDGET_S)
        else:
            whole_files.append((name, rows[name]["seconds"] + 5))   # + its import and collection
    chunks += _pack(whole_files, CHUNK_BUDGET_S)
    return [sorted(names) for names, _ in sorted(chunks, key=lambda chunk: -chunk[1])]


# ---------------------------------------------------------------------------------------------------
# One chunk: a pytest process whose results are written as they come
# ---------------------------------------------------------------------------------------------------

class Recorder:
    """The pytest plugin of a chunk's process: one JSON line per collected test list, test phase and collection
    error, flushed at once."""

    def __init__(self, path: str):
        self.out = open(path, "a")

    def _write(self, record):
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()

    def pytest_collection_finish(self, session):
        self._write({"collected": [item.nodeid for item in session.items]})

    def pytest_collectreport(self, report):
        if report.failed:
            self._write({"collection_error": report.nodeid, "text": str(report.longrepr)[-2000:]})

    def pytest_runtest_logreport(self, report):
        record = {"test": report.nodeid, "when": report.when, "outcome": report.outcome,
                  "seconds": round(report.duration, 3)}
        if report.skipped:
            record["reason"] = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        elif report.failed:
            record["text"] = str(report.longrepr)[-2000:]
        self._write(record)


def _pytest_child(records: str, files):
    """In the chunk's process: pytest over `files` with the Recorder, the root first on sys.path (as `python -m
    pytest` from the root puts it)."""
    sys.path.insert(0, ROOT)
    import pytest
    sys.exit(pytest.main(["-q", "-rfEs", "-p", "no:cacheprovider", *files], plugins=[Recorder(records)]))


def machine():
    """The cards, driver and versions of this machine."""
    import importlib.metadata
    import platform
    import torch
    import triton
    info = {"gpus": torch.cuda.device_count(), "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton.__version__}
    info["cards"] = [torch.cuda.get_device_name(i) for i in range(info["gpus"])]
    try:
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as error:   # noqa: BLE001  (a build without NCCL: say so in the record)
        info["nccl"] = f"unavailable ({error})"
    try:
        info["megatron-core"] = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        info["megatron-core"] = "not installed"
    try:
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=30).stdout.split("\n")[0].strip()
    except (OSError, subprocess.SubprocessError):
        info["driver"] = "unknown"
    return info


def run_chunk(index: int, files, logs: str, limit_s: float) -> str:
    """Chunk `index` (files) as one pytest process, stopped at limit_s (SIGABRT first: stacks in its log). Returns
    the path of its records (JSON lines, in `logs`); its output goes to chunk-<index>.log beside them."""
    records = os.path.join(logs, f"chunk-{index}.jsonl")
    log = os.path.join(logs, f"chunk-{index}.log")
    for path in (records, log):
        if os.path.exists(path):
            os.remove(path)
    env = dict(os.environ, **{k: os.environ.get(k, v) for k, v in DEVICE_ENV.items()})
    start = time.time()
    with open(log, "w") as log_file:
        child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "_pytest", records, *files], cwd=ROOT,
                                 env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = child.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGABRT)   # every process of the chunk prints its stacks
            time.sleep(5)
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            code = f"stopped at its {limit_s:.0f} s limit"
    with open(records, "a") as f:
        f.write(json.dumps({"chunk": index, "files": files, "exit": code, "seconds": round(time.time() - start, 1)})
                + "\n")
    return records


# ---------------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------------

def file_of(nodeid: str) -> str:
    return nodeid.split("::")[0]


def function_of(nodeid: str) -> str:
    """The test function a node id runs (its parameters left out)."""
    return nodeid.split("::")[1].split("[")[0]


def _new_row():
    return {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "not_run": 0, "seconds": 0.0, "functions": {},
            "skips": {}, "failures": [], "ran": False}


def merge(chunks_records, meta):
    """The chunks' records (one list of JSON records per chunk) -> the summary: meta (commit, machine, hash) and per
    file its counts."""
    files = {name: _new_row() for name in test_files()}
    chunks = []
    for records in chunks_records:
        tests, collected = {}, []
        for rec in records:
            if "chunk" in rec:
                chunks.append({k: rec[k] for k in ("chunk", "files", "exit", "seconds")})
                for selector in rec["files"]:
                    files.setdefault(file_of(selector), _new_row())["ran"] = True
            elif "collected" in rec:
                collected = rec["collected"]
            elif "collection_error" in rec:
                row = files.setdefault(file_of(rec["collection_error"]), _new_row())
                row["errors"] += 1
                row["failures"].append({"test": rec["collection_error"], "text": rec["text"]})
            elif "test" in rec:
                tests.setdefault(rec["test"], []).append(rec)
        for nodeid in collected:
            row = files.setdefault(file_of(nodeid), _new_row())
            phases = tests.get(nodeid, [])
            seconds = sum(p["seconds"] for p in phases)
            row["seconds"] += seconds
            row["functions"][function_of(nodeid)] = row["functions"].get(function_of(nodeid), 0.0) + seconds
            failed = [p for p in phases if p["outcome"] == "failed"]
            skipped = [p for p in phases if p["outcome"] == "skipped"]
            if failed:
                kind = "failed" if failed[0]["when"] == "call" else "errors"
                row[kind] += 1
                row["failures"].append({"test": nodeid, "text": failed[0].get("text", "")})
            elif skipped:
                row["skipped"] += 1
                reason = skipped[0].get("reason", "")
                row["skips"][reason] = row["skips"].get(reason, 0) + 1
            elif any(p["when"] == "call" and p["outcome"] == "passed" for p in phases):
                row["passed"] += 1
            else:
                row["not_run"] += 1
    for row in files.values():
        row["seconds"] = round(row["seconds"], 1)
        row["functions"] = {name: round(seconds, 1) for name, seconds in row["functions"].items()}
    return dict(meta, rule=RULE, chunks=sorted(chunks, key=lambda c: c["chunk"]), files=files)


def read_records(path: str) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def problems(summary) -> list:
    """What keeps a summary from being a pass of the whole suite: a file not run, a test failed, errored or not
    reached, or skipped for another reason than a machine with fewer GPUs than it needs or without Transformer
    Engine installed."""
    found = []
    gpus = summary["machine"]["gpus"]
    for name, row in summary["files"].items():
        if not row.get("ran"):
            found.append(f"{name}: not run")
        for kind in ("failed", "errors", "not_run"):
            if row.get(kind):
                found.append(f"{name}: {row[kind]} {kind.replace('_', ' ')}")
        for reason, count in row.get("skips", {}).items():
            needed = NEEDS_GPUS.search(reason)
            if WITHOUT_TE.search(reason):
                continue
            if needed is None or int(needed.group(1)) <= gpus:
                found.append(f"{name}: {count} skipped ({reason})")
    return found


def render(summary) -> str:
    """The summary as Markdown (what tests/gpu/results/<N>gpu.md holds)."""
    m = summary["machine"]
    bad = problems(summary)
    total = {k: sum(row.get(k, 0) for row in summary["files"].values())
             for k in ("passed", "failed", "errors", "skipped", "not_run")}
    cards = ", ".join(f"{m['cards'].count(c)} x {c}" for c in dict.fromkeys(m["cards"])) or "none"
    lines = [f"# GPU suite, {m['gpus']} GPU{'s' if m['gpus'] != 1 else ''}: "
             + ("PASSED" if not bad else "NOT PASSED"), "",
             f"- commit: `{summary['commit']}`; sources (tests/gpu/gpu_suite.py GATED): sha256 `{summary['source_hash']}`",
             f"- date: {summary['date']}; cards: {cards}; driver {m['driver']}",
             f"- versions: Python {m['python']}, torch {m['torch']} (CUDA {m['cuda']}), triton {m['triton']}, "
             f"NCCL {m['nccl']}, megatron-core {m['megatron-core']}",
             f"- command: `{summary['command']}`",
             f"- rule: {summary['rule']}", "",
             f"{total['passed']} passed, {total['failed']} failed, {total['errors']} errors, {total['skipped']} skipped, "
             f"{total['not_run']} not run.", "",
             "| file | passed | failed | errors | skipped | not run | seconds | skipped because |",
             "|---|---|---|---|---|---|---|---|"]
    for name, row in sorted(summary["files"].items()):
        skips = "; ".join(f"{reason} ({count})" for reason, count in row.get("skips", {}).items())
        lines.append(f"| {os.path.basename(name)} | {row.get('passed', 0)} | {row.get('failed', 0)} | "
                     f"{row.get('errors', 0)} | {row.get('skipped', 0)} | "
                     f"{row.get('not_run', 0) if row.get('ran') else 'file not run'} | {row.get('seconds', 0)} | "
                     f"{skips} |")
    lines += ["", "| chunk | files | exit | seconds |", "|---|---|---|---|"]
    for c in summary["chunks"]:
        lines.append(f"| {c['chunk']} | {len(c['files'])} | {c['exit']} | {c['seconds']} |")
    if bad:
        lines += ["", "## Not passed", ""] + [f"- {p}" for p in bad]
        for name, row in sorted(summary["files"].items()):
            for failure in row.get("failures", []):
                lines += ["", f"### {failure['test']}", "", "```", failure["text"].strip()[-1500:], "```"]
    return "\n".join(lines) + "\n"


def write_summary(summary, folder: str):
    os.makedirs(folder, exist_ok=True)
    gpus = summary["machine"]["gpus"]
    with open(os.path.join(folder, f"{gpus}gpu.json"), "w") as f:
        json.dump(summary, f, indent=1, sort_keys=True)
        f.write("\n")
    with open(os.path.join(folder, f"{gpus}gpu.md"), "w") as f:
        f.write(render(summary))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python tests/gpu/gpu_suite.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print the chunks for this machine's GPUs (or --gpus)")
    p.add_argument("--gpus", type=int, default=None)
    r = sub.add_parser("run", help="run every chunk (then write the summary) or one (--chunk)")
    r.add_argument("--chunk", type=int, default=None, help="run chunk K of `plan` alone (from 1)")
    r.add_argument("--commit", required=True, help="the commit the tree is (the device's copy has no reliable git)")
    r.add_argument("--out", required=True, help="folder for the chunks' records and logs (and the summary)")
    r.add_argument("--logs", default=None, help="folder for the chunks' pytest output and raw records (--out)")
    r.add_argument("--limit", type=float, default=CHUNK_LIMIT_S, help="seconds a chunk may run")
    r.add_argument("--jobs", type=int, default=1, help="chunks run at once (one GPU is shared: their tests "
                   "time-slice it; the results are the same, the wall time shorter where the tests leave it idle)")
    s = sub.add_parser("summary", help="merge chunk records into tests/gpu/results/<N>gpu.{json,md}")
    s.add_argument("records", nargs="+", help="the chunks' chunk-K.json files (run's --out)")
    s.add_argument("--into", default=RESULTS)
    p2 = sub.add_parser("_pytest")   # internal: a chunk's process
    p2.add_argument("records")
    p2.add_argument("files", nargs="+")
    args = parser.parse_args(argv)
    if args.command == "_pytest":
        return _pytest_child(args.records, args.files)
    if args.command == "plan":
        import torch
        gpus = torch.cuda.device_count() if args.gpus is None else args.gpus
        for k, files in enumerate(plan(gpus), 1):
            print(f"chunk {k}: {' '.join(os.path.basename(f) for f in files)}")
        return 0
    if args.command == "summary":
        parts = []
        for path in args.records:
            with open(path) as f:
                parts.append(json.load(f))
        heads = {(p["commit"], p["source_hash"], p["machine"]["gpus"]) for p in parts}
        if len(heads) != 1:
            sys.exit(f"gpu_suite summary: the chunks come from different commits, sources or machine sizes: {heads}")
        summary = merge([p["records"] for p in parts], {k: parts[0][k] for k in META})
        write_summary(summary, args.into)
        bad = problems(summary)
        print(render(summary).split("\n")[0] + ("" if not bad else ": " + "; ".join(bad)))
        return 0 if not bad else 1
    logs = args.logs or args.out
    for folder in (args.out, logs):
        os.makedirs(folder, exist_ok=True)
    info = machine()
    chunks = plan(info["gpus"])
    picked = range(1, len(chunks) + 1) if args.chunk is None else [args.chunk]
    if args.chunk is not None and not 1 <= args.chunk <= len(chunks):
        sys.exit(f"gpu_suite run: --chunk {args.chunk}: this machine's plan has chunks 1 to {len(chunks)}")
    meta = {"commit": args.commit, "source_hash": source_hash(), "machine": info,
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "command": "python tests/gpu/gpu_suite.py run" + ("" if args.chunk is None else " --chunk K")
            + ("" if args.jobs == 1 else f" --jobs {args.jobs}")}
    def run(k):
        print(f"chunk {k}/{len(chunks)}: {' '.join(os.path.basename(f) for f in chunks[k - 1])}", flush=True)
        records = read_records(run_chunk(k, chunks[k - 1], logs, args.limit))
        with open(os.path.join(args.out, f"chunk-{k}.json"), "w") as f:   # what `summary` merges
            json.dump(dict(meta, records=records), f)
        ran = [row for row in merge([records], meta)["files"].values() if row["ran"]]
        print(f"chunk {k}: " + ", ".join(f"{sum(r[c] for r in ran)} {c.replace('_', ' ')}"
                                         for c in ("passed", "failed", "errors", "skipped", "not_run")), flush=True)
        return records

    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        done = list(pool.map(run, picked))
    if args.chunk is None:
        summary = merge(done, meta)
        write_summary(summary, args.out)
        bad = problems(summary)
        print(render(summary).split("\n")[0] + ("" if not bad else ": " + "; ".join(bad)))
        return 0 if not bad else 1
    return 0

if __name__ == "__main__":
    sys.exit(main())
