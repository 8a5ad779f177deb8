"""Where a profiled training step's GPU sits idle: inside the replayed CUDA graph or in the eager rest of the step.

    python docs/perf/scripts/trace_gaps.py TRACE.json.gz [TRACE.json.gz ...]

Per trace (a torch.profiler Chrome trace of one step, rank 0): the replay window, from the first to the last of our
ops' kernels (signaled GEMMs, wait kernels) or NCCL ReduceScatters, which the graph runs back to back; the idle time
(no kernel, copy or memset on any stream) inside it and outside it (the optimizer, data and logging run eagerly and
host-bound); the ten largest idle stretches inside the window (> 5 us), summed by the pair of kernels around them.
Session 34 (docs/perf/s34/smoke_step.md): the smoke's replay 28.26 ms off against 26.80 auto, while the eager rest
took 10.8 against 16.5 ms in that one step.
"""
import collections
import gzip
import json
import sys

MARK = ("signaled", "ReduceScatter", "deadline")   # kernels that only the graph's layers run


def gaps(path):
    events = [e for e in json.load(gzip.open(path))["traceEvents"]
              if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    events.sort(key=lambda e: e["ts"])
    marks = [e for e in events if any(m in e["name"] for m in MARK)]
    window = (marks[0]["ts"], marks[-1]["ts"] + marks[-1]["dur"])
    idle, end, last = [], events[0]["ts"] + events[0]["dur"], events[0]
    for e in events[1:]:
        if e["ts"] > end:   # nothing ran between the latest end so far and this start
            idle.append((e["ts"] - end, end, last["name"][:40], e["name"][:40]))
        if e["ts"] + e["dur"] > end:
            end, last = e["ts"] + e["dur"], e
    return events[0]["ts"], window, idle


def main():
    for path in sys.argv[1:]:
        t0, (lo, hi), idle = gaps(path)
        inside = [g for g in idle if lo <= g[1] <= hi]
        outside = sum(g[0] for g in idle) - sum(g[0] for g in inside)
        print(f"{path} replay window {(lo - t0) / 1e3:.2f}-{(hi - t0) / 1e3:.2f} ms ({(hi - lo) / 1e3:.2f} ms): "
              f"idle inside {sum(g[0] for g in inside) / 1e3:.3f} ms, outside {outside / 1e3:.3f}")
        around = collections.Counter()
        for us, _, before, after in inside:
            if us > 5:
                around[(before, after)] += us
        for (before, after), us in around.most_common(10):
            print(f"   {us / 1e3:6.3f} ms  after {before:40s} before {after}")


if __name__ == "__main__":
    main()
