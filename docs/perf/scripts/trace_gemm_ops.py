"""The layer GEMMs of a profiled Megatron training step, per op, overlap off against on (docs/perf/s22/README.md):
the off trace's cuBLAS GEMMs (nvjet kernels, wgrads and the output layer's left out) and the on trace's signaled GEMMs,
each in issue order, matched by position: per micro-batch the layers' forward qkv, proj, fc1, fc2, then their
backward dgrads (fc2, fc1, proj, qkv); the median kernel time of each op.

    python3 docs/perf/scripts/trace_gemm_ops.py OFF.json.gz ON.json.gz --layers 8 --micro-batches 4
"""
import argparse
import collections
import gzip
import json
import statistics

FORWARD = ("qkv AllGather+GEMM", "proj GEMM+ReduceScatter", "fc1 AllGather+GEMM", "fc2 GEMM+ReduceScatter")
BACKWARD = ("fc2 dgrad AllGather+GEMM", "fc1 dgrad GEMM+ReduceScatter", "proj dgrad AllGather+GEMM",
            "qkv dgrad GEMM+ReduceScatter")
OUTPUT_LAYER_US = 3000   # the output layer's GEMMs (vocabulary-wide) run for milliseconds; a layer GEMM for less


def kernels(path, keep):
    events = json.load(gzip.open(path))["traceEvents"]
    return sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel" and keep(e)),
                  key=lambda e: e["ts"])


def by_op(gemms, layers, micro_batches):
    per_mb = 8 * layers
    assert len(gemms) == per_mb * micro_batches, (len(gemms), per_mb * micro_batches)
    out = collections.defaultdict(list)
    for mb in range(micro_batches):
        step = gemms[mb * per_mb:(mb + 1) * per_mb]
        for i, e in enumerate(step):
            out[(FORWARD if i < per_mb // 2 else BACKWARD)[i % 4]].append(e["dur"])
    return out


p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("off")
p.add_argument("on")
p.add_argument("--layers", type=int, default=8)
p.add_argument("--micro-batches", type=int, default=4)
args = p.parse_args()
off = by_op(kernels(args.off, lambda e: "nvjet" in e["name"] and "NTN" not in e["name"]   # NTN: the wgrads
                    and e["dur"] < OUTPUT_LAYER_US), args.layers, args.micro_batches)
on = by_op(kernels(args.on, lambda e: "signaled_gemm" in e["name"]), args.layers, args.micro_batches)
print("| op | cuBLAS (off) us | signaled (on) us | + |\n|---|---|---|---|")
for op in FORWARD + BACKWARD:
    a, b = statistics.median(off[op]), statistics.median(on[op])
    print(f"| {op} | {a:.1f} | {b:.1f} | {100 * (b / a - 1):.0f}% |")
