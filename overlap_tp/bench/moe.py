"""MoE expert-parallel benchmark: a2a_gemm (dispatch + fc1) and gemm_a2a (fc2 + combine) against the
sequential path, BENCHMARKS.md's MoE shapes (Mixtral-8x7B-like: hidden 4096, ffn 14336, fc1 N = 2 * ffn,
8 experts, top-2, EP = the number of processes; 8192 and 16384 tokens per rank; uniform and Zipf(1.2)
routing over the experts).

    torchrun --nproc-per-node 2 -m overlap_tp.bench moe --out OUT_DIR

One process per GPU; every variant runs in the same process on the same inputs and routing:
  seq        method='off': NCCL all_to_all_single then one cuBLAS matmul per (source rank, expert) segment
             (a2a_gemm), or the matmuls then the all-to-all (gemm_a2a): Megatron's alltoall path
  gemm       the per-segment cuBLAS matmuls alone; sgemm: the grouped signaled Triton GEMM alone (all
             SMs, no communication, no waits)
  comm       the all_to_all_single alone
  decomp     method='decompose' (cuBLAS per part, the parts' exchanges on the comm stream), best of
             groups in {2, 4, 8}
  ours       method='signal' with the default config; `--sweep` also times groups x comm_sms variants
Times are medians of --reps calls (CUDA events, inputs rotated over 3 sets), the slowest rank's: with
skewed routing the rank that receives most rows sets the pace. `rows max` / `imbalance` = the most rows
a rank receives (the GEMM's M) and its ratio to the mean over ranks. Every variant's output is checked
against `seq` before it is timed. Plans are rebuilt on every call (as in training, where the counts
change every step), so their host cost is inside the times.
"""
import argparse
import os

import torch
import torch.distributed as dist

from overlap_tp import OverlapConfig, a2a_gemm, gemm_a2a
from overlap_tp.tune import report
from overlap_tp.bench import ops
from overlap_tp.tune.timing import timed
from overlap_tp.ops.resolve import resolve
from overlap_tp.ops.expert import all_to_all_rows, expert_mm
from overlap_tp.kernels.signaled_gemm import signaled_gemm
from overlap_tp.ops.moe_tile_plan import dispatch_plan, layout
from overlap_tp.ops.plan_base import gemm_programs

INPUT_SETS = 3
ZIPF_S = 1.2


def routing_counts(tokens, experts, ep, routing, top_k=2, seed=0):
    """counts [ep, E], the same on every rank without communication: each rank's tokens pick top_k
    distinct experts uniformly ("uniform"), by Zipf(1.2) over the experts ("zipf"), or among rank 0's
    experts only ("rank0_only": every other rank receives nothing)."""
    ranks = torch.arange(1, experts + 1, dtype=torch.float64)
    probs = {"uniform": torch.ones(experts, dtype=torch.float64), "zipf": ranks ** -ZIPF_S,
             "rank0_only": (ranks <= experts // ep).double()}[routing]
    counts = torch.zeros(ep, experts, dtype=torch.int64)
    for s in range(ep):
        g = torch.Generator().manual_seed(seed + s)
        picks = torch.multinomial(probs.expand(tokens, experts), top_k, replacement=False, generator=g)
        counts[s] = torch.bincount(picks.flatten(), minlength=experts)
    return counts


def agree(got, ref, what):
    """ops.agree, where a rank that receives nothing has nothing to compare."""
    if got.shape != ref.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)}, the sequential baseline's is {tuple(ref.shape)}")
    if ref.numel():
        ops.agree(got, ref, what)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m overlap_tp.bench moe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="a2a_gemm,gemm_a2a", help="comma list of a2a_gemm, gemm_a2a")
    p.add_argument("--tokens", default="8192,16384", help="tokens per rank (before top-k)")
    p.add_argument("--routing", default="uniform,zipf", help="comma list of uniform, zipf, rank0_only")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336, help="fc2's K; fc1's N is 2 * ffn (gated linear unit)")
    p.add_argument("--experts", type=int, default=8, help="global experts E (EP = the number of processes)")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--sweep", action="store_true", help="also time groups x comm_sms variants of signal")
    p.add_argument("--out", default="runs/bench", help="folder for the JSON + Markdown report (rank 0)")
    p.add_argument("--name", default="moe", help="report file name (without extension)")
    return p.parse_args(argv)


def ours_variants(sweep):
    variants = {"ours": resolve(OverlapConfig(method="signal"), "a2a_gemm", device="cuda")}   # the ops' defaults
    if sweep:
        for groups in (2, 4, 8):
            for comm_sms in (2, 4, 8, 16):
                variants[f"g{groups}/sm{comm_sms}"] = OverlapConfig(method="signal", groups=groups, comm_sms=comm_sms)
    return variants


def bench_shape(op, tokens, routing, args, group):
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    counts = routing_counts(tokens, args.experts, ep, routing, args.top_k)
    lay = layout(counts, rank)
    experts, hidden, ffn = lay.experts, args.hidden, args.ffn
    if op == "a2a_gemm":   # x [T, H], w1 [L, 2F, H]: fc1 over the received rows
        run, rows, k, n = a2a_gemm, lay.tokens, hidden, 2 * ffn
    else:                  # h [R, F], w2 [L, H, F]: fc2, then the rows go back
        run, rows, k, n = gemm_a2a, lay.rows, ffn, hidden
    sets = [(torch.randn(rows, k, device="cuda", dtype=torch.bfloat16),
             torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5) for _ in range(INPUT_SETS)]
    received = [int(counts[:, r * experts:(r + 1) * experts].sum()) for r in range(ep)]
    row = {"op": op, "shape": f"{routing}.t{tokens}", "tokens": tokens, "routing": routing, "H": hidden, "F": ffn,
           "E": args.experts, "ep": ep, "rows_max": max(received), "imbalance": max(received) * ep / max(1, sum(received))}

    def call(config):
        return lambda a, w: run(a, counts, w, group, config=config)

    off = OverlapConfig(method="off")
    seq_out = call(off)(*sets[0])
    row["seq"] = timed(call(off), sets, args.reps, group)

    # the GEMM alone over the received rows (cuBLAS per segment, and the signaled kernel), the all-to-all alone
    gemm_in = torch.randn(lay.rows, k, device="cuda", dtype=torch.bfloat16)
    gemm_out = torch.empty(lay.rows, n, device="cuda", dtype=torch.bfloat16)
    row["gemm"] = timed(lambda a, w: expert_mm(gemm_in, w, lay.segments, (gemm_out,)), sets, args.reps, group)
    full_grid = OverlapConfig(method="signal", groups="auto", comm_sms=0)
    plan = dispatch_plan(layout(counts, rank), n, full_grid.block_m, full_grid.block_n, 1)
    tiles, programs = plan.tiles.to(torch.Tensor.cuda), gemm_programs(gemm_in.device, full_grid)

    def signaled_alone(a, w):
        if plan.num_tiles:   # a rank that receives nothing has no tile
            signaled_gemm(gemm_in, w, gemm_out, tiles, None, programs, full_grid)

    row["sgemm"] = timed(signaled_alone, sets, args.reps, group)
    row["sgemm_vs_cublas"] = row["gemm"] / row["sgemm"]
    if op == "a2a_gemm":
        comm_in, comm_rows, out_splits, in_splits = sets[0][0], lay.rows, lay.xr_splits, lay.x_splits
    else:
        comm_in, comm_rows, out_splits, in_splits = gemm_out, lay.tokens, lay.x_splits, lay.xr_splits
    row["comm"] = timed(lambda: all_to_all_rows(comm_in, comm_rows, out_splits, in_splits, group), [()], args.reps,
                        group)
    row["S_ideal"] = row["seq"] / max(row["gemm"], row["comm"])

    decomp = {}
    for groups in (2, 4, 8):
        config = OverlapConfig(method="decompose", comm_sms=16, groups=groups)
        agree(call(config)(*sets[0]), seq_out, f"{op} decompose groups={groups}")
        decomp[groups] = timed(call(config), sets, args.reps, group)
    row["decomp_g"], row["decomp"] = min(decomp.items(), key=lambda kv: kv[1])

    variants = {}
    for label, config in ours_variants(args.sweep).items():
        agree(call(config)(*sets[0]), seq_out, f"{op} {label}")
        variants[label] = timed(call(config), sets, args.reps, group)
    row["ours"] = variants.pop("ours")
    row["S"] = row["seq"] / row["ours"]
    hideable = row["seq"] - max(row["gemm"], row["comm"])
    row["pct_ideal"] = 100 * (row["seq"] - row["ours"]) / hideable if hideable > 0.001 else None
    if variants:
        row["best_variant"], row["best"] = min(variants.items(), key=lambda kv: kv[1])
        row["S_best"] = row["seq"] / row["best"]
    row["comm_share"] = row["comm"] / row["gemm"]
    return row


COLUMNS = [
    ("op", "op", "{}"), ("shape", "routing.tokens", "{}"), ("rows_max", "rows max", "{}"),
    ("imbalance", "imbalance", "{:.2f}"), ("seq", "seq", "{:.3f}"), ("gemm", "gemm", "{:.3f}"),
    ("comm", "comm", "{:.3f}"), ("S_ideal", "S_ideal", "{:.2f}"), ("decomp", "decomp (best g)", "{:.3f}"),
    ("decomp_g", "g", "{}"), ("ours", "ours", "{:.3f}"), ("S", "S", "{:.2f}"), ("pct_ideal", "%ideal", "{:.0f}"),
    ("best", "best variant", "{:.3f}"), ("best_variant", "which", "{}"), ("S_best", "S best", "{:.2f}"),
    ("sgemm_vs_cublas", "sgemm/cuBLAS", "{:.3f}"),
]


def main(argv):
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("run under torchrun: torchrun --nproc-per-node 2 -m overlap_tp.bench moe ...")
        return 2
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    if args.experts % dist.get_world_size():
        raise SystemExit(f"--experts {args.experts} is not a multiple of EP = {dist.get_world_size()}")
    torch.manual_seed(1234 + dist.get_rank())
    rows = []
    for op in args.ops.split(","):
        for tokens in map(int, args.tokens.split(",")):
            for routing in args.routing.split(","):
                row = bench_shape(op, tokens, routing, args, group)
                rows.append(row)
                if dist.get_rank() == 0:
                    print(" ".join(f"{key}={row[key]:.3f}" if isinstance(row[key], float) else f"{key}={row[key]}"
                                   for key in row), flush=True)
    if dist.get_rank() == 0:
        notes = ("Times in ms (median of calls, slowest rank). S = seq / ours; S_ideal = seq / max(gemm, comm); "
                 "%ideal = (seq - ours) / (seq - max(gemm, comm)). rows max / imbalance: the most rows one rank "
                 "receives and its ratio to the mean (the slowest rank's GEMM). gemm = per-segment cuBLAS over "
                 "the received rows; sgemm/cuBLAS: the grouped signaled GEMM alone against it.")
        command = f"torchrun --nproc-per-node {dist.get_world_size()} -m overlap_tp.bench moe " + " ".join(argv)
        report.write(args.out, args.name, f"MoE a2a_gemm / gemm_a2a, EP = {dist.get_world_size()}", rows, COLUMNS,
                     notes, command=command)
        print(report.markdown_table(rows, COLUMNS))
        print(notes)
    dist.destroy_process_group()
    return 0
