"""The signaled GEMM alone against cuBLAS, one GPU: every GEMM a Llama layer issues through overlap_tp.

    python -m overlap_tp.bench gemm --out OUT_DIR

Per public layer shape (overlap_tp/tune/shapes.py; TP = --tp shards, --seq tokens), bf16, the GEMM of each overlapped call the layers make:
  fwd   qkv / fc1: ag_gemm's  [M, K] @ W[N_local, K].T     (W row-major: the kernel's "nk" layout)
        proj / fc2: gemm_rs's [M, K_local] @ W[N, K_local].T
  dgrad qkv / fc1: gemm_rs's  dY[M, N_local] @ W[N_local, K]   (the weight read transposed in place: "kn")
        proj / fc2: ag_gemm's dZ[M, N] @ W[N, K_local]
each with the tile plan of its op (ag_gemm: local rows first; gemm_rs: row-slice schedule, t regions), on
the grid the op gives it (--comm-sms: the SMs the collective keeps; 0 = every SM, as the p2p transports run),
no communication and no waits. cuBLAS: torch.matmul on the same operands (it transposes for free).
`ratio` = cuBLAS time / ours (above 1: ours is faster); `rule's tile` marks the tile that OverlapConfig's
tile_by_shape rule (ops/tile_rule.py tile_for_shape) gives the plan of that GEMM with the default config. --configs adds tile configurations
(BMxBNxBK/stages/warps; one that does not fit the GPU's resources is named and left out). Every configuration's output is checked against cuBLAS before it is timed.
Times: cuBLAS and every variant of a GEMM are timed in --rounds interleaved rounds of --reps calls each, replayed
from one CUDA graph per variant (CUDA events per replay of 4 x --input-sets calls; inputs rotated over the sets,
no L2 flush, as in a layer; --eager: back-to-back eager calls, which at the smoke recipe's shapes measure the
host's launch rate, not the GPU), so the clock drift of a run falls on all of them alike; `ms` is the median over all rounds, `ratio range` the lowest and highest of the
per-round ratios. (Timed one after the other, a clock drift between the two would move the ratios.)
"""
import argparse
import functools
import statistics
import sys

import torch
import triton

from overlap_tp import OverlapConfig
from overlap_tp.tune import report
from overlap_tp.tune.shapes import AG_SHAPES, SHAPES, SMOKE_AG_SHAPES, SMOKE_SHAPES, at_tp
from overlap_tp.tune.timing import CapturedCalls, event_times
from overlap_tp.kernels.signaled_gemm import signaled_gemm
from overlap_tp.ops.plan_base import gemm_programs
from overlap_tp.ops.tile_rule import DEFAULT_TILE, tile_for_shape
from overlap_tp.ops.collective_reduction import device_plan
from overlap_tp.ops.tile_plan import ag_plan

# every config runs the tile as given
DEFAULT = OverlapConfig(method="signal", transport="nccl", tile_by_shape=False, **DEFAULT_TILE)
BY_SHAPE = OverlapConfig(method="signal", transport="nccl", **DEFAULT_TILE)   # what the ops' plans start from


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m overlap_tp.bench gemm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2, help="the TP size whose shards are multiplied")
    p.add_argument("--seq", default="8192", help="comma list of tokens M")
    p.add_argument("--layers", default="l8b,l70b", help="comma list of BENCHMARKS.md models (l8b, l70b) or smoke")
    p.add_argument("--comm-sms", default=f"0,{DEFAULT.comm_sms}", help="comma list of SMs left to the collective")
    p.add_argument("--configs", default="", help="comma list of BMxBNxBK/stages/warps beside the default "
                   f"{DEFAULT.block_m}x{DEFAULT.block_n}x{DEFAULT.block_k}/{DEFAULT.num_stages}/{DEFAULT.num_warps}")
    p.add_argument("--input-sets", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=20, help="calls per variant and round")
    p.add_argument("--eager", action="store_true", help="time back-to-back eager calls instead of graph replays "
                   "(host-bound where a GEMM takes less GPU time than its launch)")
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--name", default="signaled_gemm")
    return p.parse_args(argv)


def parse_config(text):
    """'128x256x64/3/8' -> OverlapConfig with that tile and pipelining."""
    tile, stages, warps = text.split("/")
    bm, bn, bk = (int(v) for v in tile.split("x"))
    return OverlapConfig(method="signal", transport="nccl", block_m=bm, block_n=bn, block_k=bk,
                         num_stages=int(stages), num_warps=int(warps), tile_by_shape=False)


def label(config):
    return f"{config.block_m}x{config.block_n}x{config.block_k}/{config.num_stages}/{config.num_warps}"


def layer_gemms(layer, m, tp):
    """(name, op, K (inner), N (output columns), weight layout) of the layer's overlapped GEMMs."""
    gemms = []
    for name, (k, n) in {**AG_SHAPES, **SMOKE_AG_SHAPES}.items():        # column-parallel: qkv, fc1
        if name.startswith(layer + "."):
            k, n = at_tp("ag", k, n, tp)
            gemms += [(f"{name} fwd", "ag", k, n, "nk"), (f"{name} dgrad", "rs", n, k, "kn")]
    for name, (k, n) in {**SHAPES, **SMOKE_SHAPES}.items():           # row-parallel: proj, fc2
        if name.startswith(layer + "."):
            k, n = at_tp("rs", k, n, tp)
            gemms += [(f"{name} fwd", "rs", k, n, "nk"), (f"{name} dgrad", "ag", n, k, "kn")]
    return gemms


GRAPH_CALLS_PER_SET = 4   # calls per replay: sets x this, so a replay's launch gap falls on several calls


def interleaved(calls, sets, rounds, reps, graphs=True):
    """Per call, its per-round medians (ms): every round times each call `reps` times, in turn. graphs: the
    calls captured in one CUDA graph per call (len(sets) x GRAPH_CALLS_PER_SET calls) and timed by replay, so
    the GPU's time is measured and not the host's launch rate (a small GEMM runs in less time than its
    launch takes); else back to back eagerly."""
    for call in calls:
        for s in sets:
            call(*s)
    if graphs:
        captured = [CapturedCalls(call, sets * GRAPH_CALLS_PER_SET) for call in calls]
        timers = [functools.partial(c.samples, reps, None) for c in captured]
    else:
        timers = [functools.partial(event_times, call, sets, reps) for call in calls]
    per_round = [[] for _ in calls]
    for _ in range(rounds):
        for times, timer in zip(per_round, timers):
            times.append(statistics.median(timer()))
    return per_round


def bench_gemm(name, op, m, k, n, layout, args, configs, comm_sms_list):
    """Rows for one GEMM: cuBLAS, then ours per (config, comm_sms)."""
    device = torch.device("cuda")
    sets = []
    for _ in range(args.input_sets):
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        w_rows = torch.randn(*((k, n) if layout == "kn" else (n, k)), device=device, dtype=torch.bfloat16) / k ** 0.5
        sets.append((a, w_rows.t() if layout == "kn" else w_rows))   # w as the ops pass it: [N, K], maybe a view
    want = torch.matmul(sets[0][0], sets[0][1].t()).float()
    variants, calls = [], [lambda a, w: torch.matmul(a, w.t())]
    for config in configs:
        for comm_sms in comm_sms_list:
            grid_config = OverlapConfig(**{**config.__dict__, "comm_sms": comm_sms})
            programs = gemm_programs(device, grid_config)
            if op == "ag":
                tiles = ag_plan(m, n, k, args.tp, 0, config.block_m, config.block_n).tiles.to(device)
                out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
                expected = want
            else:
                state = device_plan("row_slice", m, n, args.tp, grid_config, 2, device)
                tiles, out = state.tiles, torch.empty(state.plan.staging_shape, device=device, dtype=torch.bfloat16)
                # group g's staging rows hold rows [lo, hi) of every rank region, region after region
                regions = want.view(args.tp, m // args.tp, n)
                expected = torch.cat([regions[:, c.dst_lo:c.dst_hi].reshape(-1, n) for c in state.plan.collectives])

            def ours(a, w, out=out, tiles=tiles, programs=programs, grid_config=grid_config):
                signaled_gemm(a, w, out, tiles, None, programs, grid_config)

            out.fill_(float("nan"))
            try:
                ours(*sets[0])
            except triton.runtime.errors.OutOfResources as error:   # e.g. shared memory: a sweep goes on
                print(f"{name} {label(config)}: left out, it does not fit: {error}", file=sys.stderr, flush=True)
                continue
            torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2 * want.abs().mean().item(),
                                       msg=lambda msg: f"{name} {label(config)} comm_sms={comm_sms}: {msg}")
            variants.append((config, comm_sms, programs))
            calls.append(ours)
    cublas, *ours_rounds = interleaved(calls, sets, args.rounds, args.reps, graphs=not args.eager)
    rows = []
    for (config, comm_sms, programs), times in zip(variants, ours_rounds):
        ratios = [c / o for c, o in zip(cublas, times)]
        ms = statistics.median(times)
        rows.append(dict(gemm=f"{name}.s{m}", op=op, M=m, K=k, N=n, layout=layout, config=label(config),
                         comm_sms=comm_sms, programs=programs,
                         rule="x" if label(tile_for_shape(BY_SHAPE, m, n, programs)) == label(config) else "",
                         cublas_ms=statistics.median(cublas), ours_ms=ms,
                         ratio=statistics.median(ratios), ratio_range=f"{min(ratios):.3f}-{max(ratios):.3f}",
                         tflops=2 * m * n * k / ms / 1e9, round_ratios=ratios))
    return rows


COLUMNS = [
    ("gemm", "GEMM", "{}"), ("op", "op plan", "{}"), ("M", "M", "{}"), ("K", "K", "{}"), ("N", "N", "{}"),
    ("layout", "W", "{}"), ("config", "config", "{}"), ("comm_sms", "comm SMs", "{}"), ("programs", "grid", "{}"),
    ("rule", "rule's tile", "{}"),
    ("cublas_ms", "cuBLAS ms", "{:.3f}"), ("ours_ms", "ours ms", "{:.3f}"), ("ratio", "cuBLAS/ours", "{:.3f}"),
    ("ratio_range", "ratio range", "{}"), ("tflops", "ours TFLOP/s", "{:.0f}"),
]


def main(argv):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gemm benchmark: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    configs = [DEFAULT] + [parse_config(c) for c in args.configs.split(",") if c]
    comm_sms_list = [int(v) for v in args.comm_sms.split(",")]
    rows = []
    for m in (int(v) for v in args.seq.split(",")):
        for layer in args.layers.split(","):
            for name, op, k, n, layout in layer_gemms(layer, m, args.tp):
                for row in bench_gemm(name, op, m, k, n, layout, args, configs, comm_sms_list):
                    rows.append(row)
                    print(" | ".join(fmt.format(row[key]) for key, _, fmt in COLUMNS), flush=True)
    summary = []
    for config in configs:
        for comm_sms in comm_sms_list:
            for layout in ("nk", "kn"):
                sel = [r["ratio"] for r in rows if r["config"] == label(config) and r["comm_sms"] == comm_sms
                       and r["layout"] == layout]
                if sel:
                    summary.append(f"- {label(config)}, comm SMs {comm_sms}, W {layout}: cuBLAS/ours median "
                                   f"{statistics.median(sel):.3f} (min {min(sel):.3f}, max {max(sel):.3f}, {len(sel)} GEMMs)")
    notes = "\n".join(summary) + "\n\n" + __doc__.split("\n\n", 1)[1]
    print("\n".join(summary))
    report.write(args.out, args.name, f"Signaled GEMM alone vs cuBLAS (one GPU, TP {args.tp} shards, bf16, "
                 f"{'eager' if args.eager else 'graph replays'})", rows,
                 COLUMNS, notes)
    return 0
