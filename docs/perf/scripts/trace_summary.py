"""Summarise torch.profiler Chrome traces of layer steps (bench layer --profile): where the GPU's time goes.

    python docs/perf/scripts/trace_summary.py --steps 2 DIR/*_rank0.json.gz          # eager steps (--profile-steps 2)
    python docs/perf/scripts/trace_summary.py --steps 3 DIR/*_graph_rank0.json.gz    # one graph replay (--input-sets 3)

Per trace: the GPU span per step, and per step the time in which
  compute  a compute kernel runs (GEMMs, attention, norms, elementwise: every kernel but communication's),
  comm     communication runs (NCCL kernels, copy-engine copies) while no compute kernel runs (exposed),
  idle     nothing runs (launch gaps, waits on a peer, host-bound stretches);
then the kernels by total time (name shortened), so two configurations can be read side by side.
"""
import argparse
import collections
import gzip
import json
import os
import re

CLASSES = (   # kernel classes for the per-step totals, first match wins
    ("attention", re.compile(r"sdpa|flash|fmha|cudnn", re.I)),
    ("gemm", re.compile(r"nvjet|gemm|cutlass|sm90_xmma", re.I)),
    ("nccl", re.compile(r"nccl", re.I)),
    ("slot sum", re.compile(r"sum_slots|reduce_kernel", re.I)),
    ("norm", re.compile(r"_forward_kernel|_backward_kernel|_sum_partials|rms", re.I)),
)
COMM = re.compile(r"nccl|Memcpy PtoP|Memcpy DtoD \(Device -> Device\)|Memcpy Peer", re.I)
SPIN = re.compile(r"wait_and_reset|deadline_wait|_spin", re.I)   # a one-thread wait kernel: neither compute nor transfer


def union(intervals):
    total, end = 0.0, None
    for lo, hi in sorted(intervals):
        if end is None or lo > end:
            total += hi - lo
            end = hi
        elif hi > end:
            total += hi - end
            end = hi
    return total


def subtract(a, b):
    """Total length of the union of intervals `a` minus its overlap with the union of `b`."""
    events = sorted([(lo, 0, 1) for lo, _ in a] + [(hi, 0, -1) for _, hi in a]
                    + [(lo, 1, 1) for lo, _ in b] + [(hi, 1, -1) for _, hi in b])
    depth, total, last = [0, 0], 0.0, None
    for x, kind, delta in events:
        if last is not None and depth[0] > 0 and depth[1] == 0:
            total += x - last
        depth[kind] += delta
        last = x
    return total


def short(name):
    name = re.sub(r"<.*", "", name)
    name = re.sub(r"\(.*", "", name)
    return name[:70]


def summarise(path, steps, top):
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        trace = json.load(f)
    gpu = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"
           and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        return f"{os.path.basename(path)}: no GPU events\n"
    span = [(e["ts"], e["ts"] + e["dur"]) for e in gpu]
    lo, hi = min(s for s, _ in span), max(e for _, e in span)
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in gpu if COMM.search(e["name"])]
    compute = [(e["ts"], e["ts"] + e["dur"]) for e in gpu
               if not COMM.search(e["name"]) and not SPIN.search(e["name"]) and e.get("cat") == "kernel"]
    wall = (hi - lo) / steps
    busy = union(span) / steps
    comp = union(compute) / steps
    exposed = subtract(comm, compute) / steps
    by_class = collections.Counter()
    for e in gpu:
        kind = "copy" if e.get("cat") != "kernel" else next(
            (label for label, pattern in CLASSES if pattern.search(e["name"])), "other kernels")
        by_class[kind] += e["dur"] / steps
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for e in gpu:
        entry = by_name[short(e["name"])]
        entry[0] += e["dur"] / steps
        entry[1] += 1
    lines = [f"## {os.path.basename(path)}",
             f"per step: span {wall / 1e3:.3f} ms, compute {comp / 1e3:.3f}, exposed comm {exposed / 1e3:.3f}, "
             f"other (spin waits, memsets) {(busy - comp - exposed) / 1e3:.3f}, idle {(wall - busy) / 1e3:.3f}",
             "GPU time per step by class (ms, overlapping kernels both counted): "
             + ", ".join(f"{kind} {t / 1e3:.3f}" for kind, t in sorted(by_class.items())),
             "", "| kernel | ms/step | calls/step |", "|---|---|---|"]
    for name, (dur, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| {name} | {dur / 1e3:.3f} | {count / steps:g} |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+")
    p.add_argument("--steps", type=int, default=3,
                   help="steps in each trace (bench layer --profile-steps; with --graphs its --input-sets)")
    p.add_argument("--top", type=int, default=14)
    args = p.parse_args()
    for path in args.traces:
        print(summarise(path, args.steps, args.top))


if __name__ == "__main__":
    main()
