"""Where the GPU waited for the host, from a torch.profiler chrome trace (bench moe_layer --profile's .json, or any):
the idle gaps between GPU activities (kernels, copies, memsets; every stream together), each with the GPU work
that ended it and the host op that launched that work (through the launch's correlation id), largest first.

    python3 docs/perf/scripts/trace_gaps.py TRACE.json [--min-us 50] [--top 15]
"""
import argparse
import gzip
import json
from collections import defaultdict


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--min-us", type=float, default=50.0)
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()
    events = [e for e in load(args.trace) if e.get("ph") == "X"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    launches = {e["args"].get("correlation"): e for e in events if e.get("cat") == "cuda_runtime"
                and "correlation" in e.get("args", {})}
    cpu_ops = sorted((e for e in events if e.get("cat") in ("cpu_op", "python_function", "user_annotation")),
                     key=lambda e: e["ts"])

    def enclosing(ts, tid):
        """The innermost host op on thread `tid` running at time ts."""
        best = None
        for e in cpu_ops:
            if e["ts"] > ts:
                break
            if e.get("tid") == tid and e["ts"] + e["dur"] >= ts and (best is None or e["dur"] <= best["dur"]):
                best = e
        return best["name"] if best else "?"

    gaps, end, busy = [], None, 0.0
    for e in gpu:
        if end is not None and e["ts"] - end >= args.min_us:
            launch = launches.get(e.get("args", {}).get("correlation"))
            who = enclosing(launch["ts"], launch.get("tid")) if launch else "?"
            gaps.append((e["ts"] - end, e["name"][:60], who[:60]))
        end = max(end or 0, e["ts"] + e["dur"])
        busy += e["dur"]
    span = (end - gpu[0]["ts"]) if gpu else 0
    total = sum(g[0] for g in gaps)
    print(f"GPU span {span / 1e3:.2f} ms, GPU work (summed) {busy / 1e3:.2f} ms, {len(gaps)} gaps >= {args.min_us:g} us "
          f"totalling {total / 1e3:.2f} ms")
    by_launcher = defaultdict(float)
    for gap, _, who in gaps:
        by_launcher[who] += gap
    print("gap time by the host op that ended it:")
    for who, t in sorted(by_launcher.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"  {t / 1e3:8.3f} ms  {who}")
    print("largest gaps:")
    for gap, kernel, who in sorted(gaps, reverse=True)[:args.top]:
        print(f"  {gap:9.0f} us  before {kernel}  (launched in {who})")


if __name__ == "__main__":
    main()
