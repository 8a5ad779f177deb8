"""Operator benchmark: GEMM+ReduceScatter, GEMM+AllReduce and AllGather+GEMM against the baselines of
BENCHMARKS.md.

    torchrun --nproc-per-node 2 -m overlap_tp.bench ops --out OUT_DIR

One process per GPU; every baseline runs in the same process on the same inputs:
  seq        cuBLAS then the NCCL collective on one stream (method='off'; AG: the all-gather first)
  gemm/comm  the GEMM alone, the collective alone
  decomp     M split into c in {2, 4, 8} cuBLAS calls, chunk collectives on the comm stream (best c)
  async-TP   torch.distributed._symmetric_memory._fused_matmul_reduce_scatter / _fused_all_gather_matmul
  ours       gemm_rs / gemm_ar / ag_gemm with the default config; `--sweep` also times other configs
Times are medians of --reps calls (CUDA events, inputs rotated over 3 sets), the slowest rank's.
Every configuration's output is checked against `seq` before it is timed.
"""
import argparse
import os
import statistics

import torch
import torch.distributed as dist

from overlap_tp import OverlapConfig, ag_gemm, gemm_ar, gemm_rs
from overlap_tp.tune import report
from overlap_tp.tune.shapes import AG_SHAPES, SHAPES, SMOKE_AG_SHAPES, SMOKE_SHAPES, at_tp
from overlap_tp.ops.ag_gemm import AgGemm
from overlap_tp.ops.gemm_ar import GemmAR
from overlap_tp.ops.gemm_rs import GemmRS
from overlap_tp.tune.timing import enqueue_us, graph_timed, queued_ms
from overlap_tp.tune.timing import timed as eager_timed
from overlap_tp.kernels.signaled_gemm import signaled_gemm
from overlap_tp.ops.plan_base import gemm_programs
from overlap_tp.ops.collective_reduction import device_plan
from overlap_tp.ops.tile_plan import ag_plan

INPUT_SETS = 3


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m overlap_tp.bench ops", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="rs,ar,ag", help="comma list of rs, ar, ag")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma list of " + ",".join({**SHAPES, **SMOKE_SHAPES}))
    p.add_argument("--ag-shapes", default=",".join(AG_SHAPES),
                   help="comma list of " + ",".join({**AG_SHAPES, **SMOKE_AG_SHAPES}))
    p.add_argument("--ag-seq", default="4096,8192,16384", help="tokens M for ag_gemm")
    p.add_argument("--seq", default="4096,8192,16384", help="tokens M per rank group (GEMM rows)")
    p.add_argument("--ar-seq", default="8192", help="tokens for gemm_ar (its collective moves 2x the bytes)")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--sweep", action="store_true", help="also time schedule x groups x comm_sms variants")
    p.add_argument("--auto", action="store_true",
                   help="also time method='auto' (the tuner's pick; tunes each shape once, cache: "
                        "$OVERLAP_TP_TUNE_CACHE if set, else none) and report it against seq")
    p.add_argument("--graphs", action="store_true",
                   help="time every configuration (ours and each baseline) as replays of a captured CUDA graph")
    p.add_argument("--host", action="store_true",
                   help="also measure ours' host time per call (GPU held busy): through a prebuilt plan and the "
                        "functional API, in a run of calls (tune.timing.enqueue_us), and one call alone")
    p.add_argument("--host-config", choices=("ours", "p2p"), default="ours",
                   help="the config --host times: ours (what the Megatron layers run: gemm_ar on NCCL) or p2p (the "
                        "signaled GEMM on the p2p transports for all three ops, gemm_ar's too)")
    p.add_argument("--out", default="runs/bench", help="folder for the JSON + Markdown report (rank 0)")
    p.add_argument("--name", default="gemm_rs_ar", help="report file name (without extension)")
    return p.parse_args(argv)


def agree(got, ref, what):
    error = float((got.float() - ref.float()).norm() / ref.float().norm())
    if not error < 1e-2:
        raise AssertionError(f"{what}: relative error {error:.3g} against the sequential baseline")


def ours_variants(op, sweep):
    """`ours` is what the Megatron layers run by default (`--overlap-tp signal`, transport auto): GEMM+RS and
    AllGather+GEMM on the p2p transports with their GEMMs on every SM, GEMM+AllReduce on NCCL per-group
    collectives. `nccl` (GEMM+RS: the signaled GEMM + per-group NCCL reduce-scatters, 16 SMs to NCCL) and
    `cublas-p2p` (method decompose over the same p2p transports: cuBLAS GEMMs, no Triton GEMM) are always timed
    next to it, and for AllGather+GEMM its pulls on 16 and 32 SMs (comm_sms > 0), both pulling one peer's rows per
    chunk (`/by-peer`: chunk_by 'peer', what `ours` runs where t > 2) and ours with row chunks (`p2p/by-rows`), and
    for GEMM+RS its two p2p transfers (`p2p/epilogue`, `p2p/copy`: OverlapConfig.rs_transfer) and cuBLAS's regions
    pushed by the copy engines (`cublas-p2p/copy`); for GEMM+AllReduce its p2p transport (`p2p`, `cublas-p2p`: the
    p2p ReduceScatter, then the copy engines' pulls of the summed regions);
    --sweep adds the schedule x groups x comm_sms corners that have measured best (docs/performance.md) and, for
    AllGather+GEMM, chunk counts of the pulls and in-place NCCL broadcasts."""
    p2p = OverlapConfig(method="signal", transport="p2p", comm_sms=0)
    cublas_p2p = OverlapConfig(method="decompose", transport="p2p", comm_sms=0)   # 4 chunks, as the flags give
    if op == "ag":
        variants = {"ours": p2p, "cublas-p2p": cublas_p2p,
                    # one peer's rows per chunk, one copy each, as async-TP pulls (chunk_by 'peer'; `ours` where
                    # t > 2), and the same rows of every peer per chunk (chunk_by 'rows'; `ours` at t = 2)
                    "p2p/by-peer": OverlapConfig(method="signal", transport="p2p", comm_sms=0, chunk_by="peer"),
                    "p2p/by-rows": OverlapConfig(method="signal", transport="p2p", comm_sms=0, chunk_by="rows"),
                    "cublas-p2p/by-peer": OverlapConfig(method="decompose", transport="p2p", comm_sms=0, chunks=1,
                                                        chunk_by="peer")}
        for sms in (16, 32):   # the pulls by a kernel on the SMs the GEMM leaves (comm_sms), not the copy engines
            variants[f"p2p/sm{sms}"] = OverlapConfig(method="signal", transport="p2p", comm_sms=sms)
        if sweep:
            for groups in (2, 4, 8):
                variants[f"p2p/g{groups}"] = OverlapConfig(method="signal", transport="p2p", comm_sms=0, groups=groups)
            for groups, comm_sms in ((2, 16), (4, 16), (4, 8)):
                variants[f"nccl/g{groups}/sm{comm_sms}"] = OverlapConfig(method="signal", transport="nccl",
                                                                         groups=groups,
                                                                         comm_sms=comm_sms)
        return variants
    variants = {"ours": p2p, "nccl": OverlapConfig(method="signal", transport="nccl"), "cublas-p2p": cublas_p2p,
                # the peers' partials stored by the GEMM's epilogue over NVLink (`ours` at t = 2) and stored locally,
                # then pushed by the copy engines region by region (`ours` where t > 2: rs_transfer 'auto')
                "p2p/epilogue": OverlapConfig(method="signal", transport="p2p", comm_sms=0, rs_transfer="epilogue"),
                "p2p/copy": OverlapConfig(method="signal", transport="p2p", comm_sms=0, rs_transfer="copy"),
                # cuBLAS per region into the staging matrix, each pushed by the copy engines after its GEMM
                "cublas-p2p/copy": OverlapConfig(method="decompose", transport="p2p", comm_sms=0,
                                                 rs_transfer="copy")} \
        if op == "rs" else {"ours": OverlapConfig(method="signal", transport="nccl"), "p2p": p2p,
                            "cublas-p2p": cublas_p2p}
    if sweep:
        for schedule, groups, comm_sms in (("row_slice", 2, 0), ("row_slice", 4, 0), ("row_slice", 2, 16),
                                           ("tile_exact", 8, 0)):
            variants[f"{schedule}/g{groups}/sm{comm_sms}"] = OverlapConfig(
                method="signal", transport="nccl", schedule=schedule, groups=groups, comm_sms=comm_sms)
    return variants


def bench_shape(op, name, m, k, n, args, group):
    timed = graph_timed if args.graphs else eager_timed
    t = dist.get_world_size(group)
    a_rows = m // t if op == "ag" else m      # ag_gemm's input is this rank's shard of the rows
    sets = [(torch.randn(a_rows, k, device="cuda", dtype=torch.bfloat16),
             torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5) for _ in range(INPUT_SETS)]
    run = {"rs": gemm_rs, "ar": gemm_ar, "ag": ag_gemm}[op]
    off = OverlapConfig(method="off")
    seq_out = run(*sets[0], group, config=off)
    row = {"op": op, "shape": f"{name}.s{m}", "M": m, "K": k, "N": n}
    row["seq"] = timed(lambda a, w: run(a, w, group, config=off), sets, args.reps, group)
    gathered = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    if op == "ag":
        row["gemm"] = timed(lambda a, w: gathered @ w.t(), sets, args.reps, group)
        row["comm"] = timed(lambda a, w: dist.all_gather_into_tensor(gathered, a, group=group), sets, args.reps, group)
    else:
        row["gemm"] = timed(lambda a, w: a @ w.t(), sets, args.reps, group)
        partial = sets[0][0] @ sets[0][1].t()
        out_rows = m // t if op == "rs" else m
        comm_out = torch.empty(out_rows, n, device="cuda", dtype=torch.bfloat16)
        if op == "rs":
            row["comm"] = timed(lambda: dist.reduce_scatter_tensor(comm_out, partial, group=group), [()], args.reps,
                                group)
        else:
            row["comm"] = timed(lambda: dist.all_reduce(partial, group=group), [()], args.reps, group)
    row["S_ideal"] = row["seq"] / max(row["gemm"], row["comm"])

    # the signaled GEMM alone (full grid, no communication, no waits) against cuBLAS
    full_grid = OverlapConfig(method="signal", transport="nccl", comm_sms=0)
    programs = gemm_programs(sets[0][0].device, full_grid)
    if op == "ag":
        tiles = ag_plan(m, n, k, t, dist.get_rank(group), full_grid.block_m, full_grid.block_n).tiles.cuda()
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        row["sgemm"] = timed(lambda a, w: signaled_gemm(gathered, w, out, tiles, None, programs, full_grid),
                             sets, args.reps, group)
    else:
        state = device_plan(full_grid.schedule, m, n, t if op == "rs" else 1, full_grid, 2, sets[0][0].device)
        staging = torch.empty(state.plan.staging_shape, device="cuda", dtype=torch.bfloat16)
        counters = torch.zeros_like(state.counters)
        row["sgemm"] = timed(lambda a, w: signaled_gemm(a, w, staging, state.tiles, counters, programs, full_grid),
                             sets, args.reps, group)
    row["sgemm_vs_cublas"] = row["gemm"] / row["sgemm"]

    decomp = {}
    for chunks in (2, 4, 8):
        config = OverlapConfig(method="decompose", transport="nccl", chunks=chunks)
        agree(run(*sets[0], group, config=config), seq_out, f"{op} decompose c={chunks}")
        decomp[chunks] = timed(lambda a, w: run(a, w, group, config=config), sets, args.reps, group)
    row["decomp_c"], row["decomp"] = min(decomp.items(), key=lambda kv: kv[1])

    if op in ("rs", "ag"):
        from torch.distributed import _symmetric_memory as symm

        def async_tp(a, w):
            if op == "rs":
                return symm._fused_matmul_reduce_scatter(a, w.t(), "sum", 0, group.group_name)
            return symm._fused_all_gather_matmul(a, [w.t()], 0, group.group_name)[1][0]

        agree(async_tp(*sets[0]), seq_out, "async-TP")
        try:
            row["async_tp"] = timed(async_tp, sets, args.reps, group)
        except RuntimeError as error:   # PyTorch's fused ops may refuse capture: say so, keep the others
            row["async_tp_error"] = str(error).splitlines()[0][:120]
            if dist.get_rank(group) == 0:
                print(f"async-TP not timed ({op} {name}.s{m}): {row['async_tp_error']}", flush=True)

    variants = {}
    for label, config in ours_variants(op, args.sweep).items():
        if op != "ag" and config.schedule == "tile_exact" and (out_rows % config.block_m or n % config.block_n):
            continue
        agree(run(*sets[0], group, config=config), seq_out, f"{op} {label}")
        variants[label] = timed(lambda a, w: run(a, w, group, config=config), sets, args.reps, group)
    row["ours"] = variants.pop("ours")
    row["S"] = row["seq"] / row["ours"]
    if args.host:
        hosted = ours_variants(op, False)["ours"] if args.host_config == "ours" else \
            OverlapConfig(method="signal", transport="p2p", comm_sms=0)
        plan = {"rs": GemmRS, "ar": GemmAR, "ag": AgGemm}[op](group, a_rows, n, k, torch.bfloat16, sets[0][0].device,
                                                               hosted)
        row["host_plan_us"] = enqueue_us(lambda a, w: plan(a, w), sets, group)
        row["host_api_us"] = enqueue_us(lambda a, w: run(a, w, group, config=hosted), sets, group)
        row["host_seq_us"] = enqueue_us(lambda a, w: run(a, w, group, config=off), sets, group)
        row["host_first_us"] = 1e3 * queued_ms(lambda a, w: plan(a, w), sets, group, rounds=20)[0]
    row["pct_ideal"] = 100 * (row["S"] - 1) / (row["S_ideal"] - 1) if row["S_ideal"] > 1.001 else None
    if variants:
        row["variants"] = dict(variants)   # every variant's time in the JSON
        row["best_variant"], row["best"] = min(variants.items(), key=lambda kv: kv[1])
        row["S_best"] = row["seq"] / row["best"]
        for name in ("nccl", "cublas-p2p"):
            if name in variants:
                key = name.replace("-", "_")
                row[key] = variants[name]
                row[f"S_{key}"] = row["seq"] / row[key]

    if args.auto:
        from overlap_tp.tune import choose, label, set_regime
        set_regime("graphs" if args.graphs else "eager")   # the tuner times candidates as this run times ours
        auto = OverlapConfig(method="auto")
        agree(run(*sets[0], group, config=auto), seq_out, f"{op} auto")   # the first call tunes the shape
        row["auto_pick"] = label(choose(op, *sets[0], group, base=auto))
        row["auto"] = timed(lambda a, w: run(a, w, group, config=auto), sets, args.reps, group)
        row["auto_vs_seq"] = row["seq"] / row["auto"]

    row["comm_share"] = row["comm"] / row["gemm"]
    if op == "ag":
        return row
    # FlashOverlap's bound: the GEMM plus the last group's collective when the GEMM dominates, else the
    # first wave of the GEMM plus the whole collective.
    default = OverlapConfig(method="signal", transport="nccl")
    plan = device_plan(default.schedule, m, n, t if op == "rs" else 1, default, 2, sets[0][0].device).plan
    last = plan.collectives[-1]
    if row["gemm"] >= row["comm"]:
        src = partial[:last.src_hi - last.src_lo]
        dst = comm_out[:last.dst_hi - last.dst_lo]
        if op == "rs":
            last_comm = timed(lambda: dist.reduce_scatter_tensor(dst, src, group=group), [()], args.reps, group)
        else:
            last_comm = timed(lambda: dist.all_reduce(src, group=group), [()], args.reps, group)
        row["fo_bound"] = row["gemm"] + last_comm
    else:
        first_wave = min(1.0, gemm_programs(sets[0][0].device, default) / plan.num_tiles)
        row["fo_bound"] = row["gemm"] * first_wave + row["comm"]
    return row


COLUMNS = [
    ("op", "op", "{}"), ("shape", "shape", "{}"), ("seq", "seq", "{:.3f}"), ("gemm", "gemm", "{:.3f}"),
    ("comm", "comm", "{:.3f}"), ("S_ideal", "S_ideal", "{:.2f}"), ("decomp", "decomp (best c)", "{:.3f}"),
    ("async_tp", "async-TP", "{:.3f}"), ("ours", "ours", "{:.3f}"), ("S", "S", "{:.2f}"),
    ("pct_ideal", "%ideal", "{:.0f}"), ("fo_bound", "FO bound", "{:.3f}"), ("best", "best variant", "{:.3f}"),
    ("best_variant", "which", "{}"), ("nccl", "nccl", "{:.3f}"), ("S_nccl", "S nccl", "{:.2f}"),
    ("cublas_p2p", "cuBLAS p2p", "{:.3f}"), ("S_cublas_p2p", "S cuBLAS p2p", "{:.2f}"),
    ("sgemm_vs_cublas", "sgemm/cuBLAS", "{:.3f}"), ("auto", "auto", "{:.3f}"), ("auto_vs_seq", "seq/auto", "{:.2f}"),
    ("auto_pick", "auto pick", "{}"), ("host_plan_us", "host us (plan)", "{:.0f}"),
    ("host_api_us", "host us (gemm_rs/...)", "{:.0f}"), ("host_seq_us", "host us (seq)", "{:.0f}"),
    ("host_first_us", "host us (plan, first call)", "{:.0f}"),
]


def main(argv):
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("run under torchrun: torchrun --nproc-per-node 2 -m overlap_tp.bench ops ...")
        return 2
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    from torch.distributed import _symmetric_memory as symm
    symm.enable_symm_mem_for_group(group.group_name)
    torch.manual_seed(1234 + dist.get_rank())
    rows = []
    for op in args.ops.split(","):
        seqs = {"rs": args.seq, "ar": args.ar_seq, "ag": args.ag_seq}[op]
        table, names = (({**AG_SHAPES, **SMOKE_AG_SHAPES}, args.ag_shapes) if op == "ag"
                        else ({**SHAPES, **SMOKE_SHAPES}, args.shapes))
        for m in map(int, seqs.split(",")):
            for name in names.split(","):
                k, n = at_tp(op, *table[name], dist.get_world_size(group))
                row = bench_shape(op, name, m, k, n, args, group)
                rows.append(row)
                if dist.get_rank() == 0:
                    print(" ".join(f"{key}={row[key]:.3f}" if isinstance(row[key], float) else f"{key}={row[key]}"
                                   for key in row), flush=True)
    if dist.get_rank() == 0:
        sgemm = statistics.median(r["sgemm_vs_cublas"] for r in rows)
        mode = ("every configuration captured in a CUDA graph and timed by replay" if args.graphs
                else "eager, back-to-back calls")
        notes = (f"Signaled GEMM without communication vs cuBLAS, median over rows: {sgemm:.3f}.\n"
                 f"Times in ms (median of calls, slowest rank; {mode}). S = seq / ours; %ideal = (S-1)/(S_ideal-1); "
                 "FO bound = FlashOverlap's theoretical bound. host us: the host's time per call in a run of calls "
                 "with the GPU held busy (enqueue_us: 24 calls timed after 8), "
                 + ("ours' default config" if args.host_config == "ours" else "the signaled p2p transport") +
                 " through a prebuilt plan, through the functional API (a cached plan), and seq (method 'off'); first call: "
                 "one call alone after a synchronize (queued_ms).")
        command = f"torchrun --nproc-per-node {dist.get_world_size()} -m overlap_tp.bench ops " + " ".join(argv)
        report.write(args.out, args.name, "GEMM+ReduceScatter / GEMM+AllReduce / AllGather+GEMM, t = %d"
                     % dist.get_world_size(),
                     rows, COLUMNS, notes, command=command)
        print(report.markdown_table(rows, COLUMNS))
        print(notes)
    dist.destroy_process_group()
    return 0
