"""Where the GPU waited for the host, from a torch.profiler chrome trace (bench moe_layer --profile's .json, or any):
the idle gaps between GPU activities (kernels, copies, memsets; every stream together), each with the GPU work
that ended it and the host op that launched that work (through the launch's correlation id), largest first.

    python3 docs/perf/scripts/trace_gaps.py TRACE.json [--min-us 50] [--top 15] [--host 3]

--host K: for the K largest gaps, what the launching thread did during the gap (host ops and, in a trace taken
with with_stack=True, Python functions), nested, each clipped to the gap, those over 5% of it.
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
    p.add_argument("--host", type=int, default=0, metavar="K")
    args = p.parse_args()
    events = [e for e in load(args.trace) if e.get("ph") == "X"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    # runtime calls (torch's launches) and driver calls (Triton's C launcher calls cuLaunchKernelEx itself)
    launches = {e["args"].get("correlation"): e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
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
            gaps.append((e["ts"] - end, e["name"][:60], who[:60], end, launch))
        end = max(end or 0, e["ts"] + e["dur"])
        busy += e["dur"]
    span = (end - gpu[0]["ts"]) if gpu else 0
    total = sum(g[0] for g in gaps)
    print(f"GPU span {span / 1e3:.2f} ms, GPU work (summed) {busy / 1e3:.2f} ms, {len(gaps)} gaps >= {args.min_us:g} us "
          f"totalling {total / 1e3:.2f} ms")
    by_launcher = defaultdict(float)
    for gap, _, who, _, _ in gaps:
        by_launcher[who] += gap
    print("gap time by the host op that ended it:")
    for who, t in sorted(by_launcher.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"  {t / 1e3:8.3f} ms  {who}")
    print("largest gaps:")
    largest = sorted(gaps, key=lambda g: -g[0])
    for gap, kernel, who, _, _ in largest[:args.top]:
        print(f"  {gap:9.0f} us  before {kernel}  (launched in {who})")
    for gap, kernel, _, start, launch in largest[:args.host]:
        if launch is None:
            continue
        lo, hi = start, launch["ts"]
        print(f"host during the {gap:.0f} us gap before {kernel} (launch {hi - lo:.0f} us after the GPU went idle):")
        inside = [(max(e["ts"], lo), min(e["ts"] + e["dur"], hi), e) for e in cpu_ops
                  if e.get("tid") == launch.get("tid") and e["ts"] < hi and e["ts"] + e["dur"] > lo]
        inside = [(a, b, e) for a, b, e in inside if b - a >= 0.05 * (hi - lo)]
        inside.sort(key=lambda t: (t[0], -(t[1] - t[0])))
        for a, b, e in inside[:30]:
            depth = sum(1 for a2, b2, e2 in inside if e2 is not e and a2 <= a and b <= b2 and e2["dur"] > e["dur"])
            print(f"  {'  ' * depth}{b - a:7.0f} us  {e['name'][:90]}")


if __name__ == "__main__":
    main()
