"""GPU work of a torch.profiler chrome trace grouped by the host call that launched it (through the correlation id):
under full-iteration CUDA graphs, how long the replayed forward + backward ran on the GPU (the cudaGraphLaunch row)
against the eager rest of the step (kernel launches, copies), each with its busy time and its window.

    python3 docs/perf/scripts/trace_launches.py TRACE.json.gz [TRACE2.json.gz ...]
"""
import collections
import gzip
import json
import sys


def main():
    for path in sys.argv[1:]:
        events = json.load((gzip.open if path.endswith(".gz") else open)(path, "rt"))["traceEvents"]
        runtime = {e["args"]["correlation"]: e["name"] for e in events
                   if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
        gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        start = min(e["ts"] for e in gpu)
        print(f"{path}: GPU span {(max(e['ts'] + e['dur'] for e in gpu) - start) / 1e3:.2f} ms")
        by_launch = collections.defaultdict(list)
        for e in gpu:
            by_launch[runtime.get(e["args"].get("correlation"), "(no runtime call)")].append(e)
        for name, work in sorted(by_launch.items(), key=lambda kv: -sum(e["dur"] for e in kv[1])):
            t0, t1 = min(e["ts"] for e in work), max(e["ts"] + e["dur"] for e in work)
            print(f"  {name[:40]:40s} {len(work):5d} ops, busy {sum(e['dur'] for e in work) / 1e3:7.2f} ms, "
                  f"window {(t1 - t0) / 1e3:7.2f} ms [{(t0 - start) / 1e3:.2f}, {(t1 - start) / 1e3:.2f}]")


if __name__ == "__main__":
    main()
