"""The FP8 signaled GEMM alone against cuBLAS FP8 and the bf16 GEMM, one GPU, every GEMM of a Llama layer.

On the device (one H100 or H200, under 4 minutes with the defaults):

    source benchmarks/device/setup.sh && python3 $REPO/benchmarks/device/fp8_gemm.py --out $OUT

Per public layer shape (overlap_tp/tune/shapes.py: l8b, l70b) at TP = 2 and 4 (--tp), s 8192 (--seq), the GEMMs a
layer runs: fwd and dgrad as overlap_tp/bench/gemm.py lists them, and wgrad (dW = dY.T @ X, contracting over the
tokens). Every GEMM is C[M, N] = A[M, K] @ B[N, K].T with both FP8 operands K-major, quantized before the timing
(the dgrad's weight and both wgrad operands by the transpose-quantize kernels, as the backward would hand them over):
  bf16 cuBLAS             torch.matmul on the bf16 operands
  cublas tensorwise       torch._scaled_mm, e4m3 x e4m3, per-tensor scales, use_fast_accum False and True
  cublas blockwise        torch.nn.functional.scaled_mm, BlockWise1x128 x BlockWise128x128 (wgrad: 1x128 x 1x128)
  FP8 wgrad (wgrad only)  the FP8 layers' whole weight gradient from the bf16 dY and X (fp8_linear.fp8_weight_grad:
                          both transposed quantizers, then cuBLAS), tensorwise and blockwise: whether it beats bf16;
                          and, tensorwise, with dY's transposed copy written by the dgrad's quantizer
                          (fp8_linear.quantize_grad) beside that quantizer alone: what the FP8 wgrad adds in a layer
  ours tensorwise / blockwise, per tile config, sync on and off: "on" runs the op's synchronisation (gemm_rs plan:
                          the signal atomics; ag_gemm plan: every tile waits on its raised ready flag), "off" neither
  gluon blockwise (--gluon) the Gluon candidates of fp8_blockwise_gluon.py on the same plans and synchronisation,
                          on the blockwise configs they take (add 128x256x128/4/4 for the warp-specialised one)
Each variant's output is checked first against the float64 product of the dequantized operands on 256 sampled rows
(relative Frobenius error, recorded; a variant above 2**-6 is recorded as failed and not timed). Times: CUDA graph
replays in interleaved rounds (overlap_tp/bench/gemm.py's `interleaved`), the median over rounds.
Writes $OUT/fp8_gemm.jsonl (rows with benchmarks/results.jsonl's fields; `record` names the campaign file the
coordinator writes from them) and $OUT/fp8_gemm.md (the table and the medians of the ratios).
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton

from overlap_tp import OverlapConfig
from overlap_tp.bench.gemm import interleaved, layer_gemms
from overlap_tp.kernels import fp8_quant as Q
from overlap_tp.kernels.fp8_gemm import fp8_signaled_gemm
from overlap_tp.megatron.fp8_linear import Fp8Recipe, fp8_weight_grad, quantize_grad
from overlap_tp.ops.plan_base import gemm_programs
from overlap_tp.ops.tile_plan import ag_plan, make_plan

TENSORWISE_CONFIGS = "128x256x128/3/8,128x128x128/4/8,128x256x64/4/8"
BLOCKWISE_CONFIGS = "64x128x128/3/4,128x128x128/3/8,128x256x128/3/8"
CHECK_ROWS = 256
MAX_REL_ERR = 2 ** -6
WGRAD = "FP8 wgrad, quantizers + cuBLAS"
WGRAD_FUSED = "FP8 wgrad with the dgrad's dY quantizer"
DGRAD_QUANTIZER = "dgrad's dY quantizer alone"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", default="2,4")
    p.add_argument("--seq", default="8192")
    p.add_argument("--layers", default="l8b,l70b")
    p.add_argument("--passes", default="fwd,dgrad,wgrad")
    p.add_argument("--tensorwise-configs", default=TENSORWISE_CONFIGS, help="BMxBNxBK/stages/warps, comma list")
    p.add_argument("--blockwise-configs", default=BLOCKWISE_CONFIGS, help="block_k must be 128")
    p.add_argument("--gluon", action="store_true",
                   help="also the Gluon candidates of fp8_blockwise_gluon.py on the blockwise configs they take "
                        "(gluon: BN <= 128, two programs per SM where the tile is 64x128; gluon-ws: 128x256x128/S/4), "
                        "sync on and off as ours")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--input-sets", type=int, default=2)
    p.add_argument("--deadline-s", type=float, default=220, help="no new GEMM starts after this many seconds")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    return p.parse_args(argv)


def parse_config(text):
    tile, stages, warps = text.split("/")
    bm, bn, bk = (int(v) for v in tile.split("x"))
    return OverlapConfig(method="signal", block_m=bm, block_n=bn, block_k=bk, num_stages=int(stages),
                         num_warps=int(warps), tile_by_shape=False, comm_sms=0)


def label(c):
    return f"{c.block_m}x{c.block_n}x{c.block_k}/{c.num_stages}/{c.num_warps}"


def gemms(layer, m, tp, passes):
    """(name, plan op, M, N, K) of the layer's GEMMs as C[M, N] = A[M, K] @ B[N, K].T."""
    out = []
    for name, op, k, n, _ in layer_gemms(layer, m, tp):
        gemm_pass = name.split()[-1]
        if gemm_pass in passes:
            out.append((name, op, m, n, k))
        if gemm_pass == "fwd" and "wgrad" in passes:   # dW[N, K] = dY.T[N, M] @ X[M, K]: contracts over the tokens
            out.append((name.replace("fwd", "wgrad"), "plain", n, k, m))
    return out


def operands(m, n, k, wgrad, gen):
    """bf16 A [M, K] and B [N, K] and their FP8 forms: tensorwise pair, blockwise pair (1x128 A; B 128x128, or 1x128
    for wgrad). A wgrad's operands are quantized by the transpose-quantize kernel from their [K, M] / [K, N] forms."""
    a = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    b = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).bfloat16()
    tensorwise = (Q.quantize_tensorwise(a), Q.quantize_tensorwise(b))
    if wgrad:
        blockwise = (Q.quantize_1x128_transposed(a.t().contiguous()), Q.quantize_1x128_transposed(b.t().contiguous()))
    else:
        blockwise = (Q.quantize_1x128(a), Q.quantize_128x128(b))
    return a, b, tensorwise, blockwise


def dequantized_rows(x, rows):
    """float64 dequantized rows of a ScaledFp8 (all rows for a 128x128 weight: its blocks span rows)."""
    if x.scaling == "tensorwise":
        return x.q[rows].double() * x.ds.double()
    if x.scaling == "1x128":
        q = x.q[rows].double()
        return (q.view(len(rows), -1, Q.BLOCK) * x.ds[:, rows].t().double()[:, :, None]).view(len(rows), -1)
    return Q.dequantize_reference(x)[rows]


def reference_rows(a, b, rows):
    return dequantized_rows(a, rows) @ Q.dequantize_reference(b).t() if b.scaling == "128x128" else \
        dequantized_rows(a, rows) @ dequantized_rows(b, torch.arange(b.q.shape[0], device=b.q.device)).t()


def plan_for(op, m, n, k, tp, config):
    """(tiles on the GPU, output shape, row map: output row of each C row, counters or None, flags or None)."""
    if op == "rs":
        plan = make_plan("row_slice", m, n, tp, config.block_m, config.block_n)
        counters = torch.zeros(plan.num_groups, dtype=torch.int32, device="cuda")
        # staging row of each C row: group g's staging rows hold rows [lo, hi) of every region, region after region
        row_of = torch.empty(m, dtype=torch.long)
        m_local = m // tp
        for c in plan.collectives:
            rows = c.dst_hi - c.dst_lo
            for k in range(tp):
                row_of[k * m_local + c.dst_lo:k * m_local + c.dst_hi] = torch.arange(c.src_lo + k * rows,
                                                                                     c.src_lo + (k + 1) * rows)
        return plan.tiles.cuda(), plan.staging_shape, row_of.cuda(), counters, None
    world = tp if op == "ag" else 1
    plan = ag_plan(m, n, k, world, 0, config.block_m, config.block_n, elem_bytes=1)
    flags = torch.ones(max(1, plan.num_groups), dtype=torch.int32, device="cuda") if op == "ag" else None
    return plan.tiles.cuda(), (m, n), torch.arange(m, device="cuda"), None, flags


def rel_err(got, ref):
    return float((got.double() - ref).norm() / ref.norm())


def bench_one(name, op, m, n, k, tp, args, configs, gen):
    wgrad = op == "plain"
    a, b, tensorwise, blockwise = operands(m, n, k, wgrad, gen)
    rows = torch.randperm(m, device="cuda", generator=gen)[:CHECK_ROWS].sort().values
    refs = {"tensorwise": reference_rows(*tensorwise, rows), "blockwise": reference_rows(*blockwise, rows)}
    sets = [()] * args.input_sets    # the operands are bound in each call; sets only set the calls per replay
    variants = []   # (variant name, scaling, config label, call, rel error or failure)

    def add(variant, scaling, config, call, out_rows):
        try:
            call()
            torch.cuda.synchronize()
        except (RuntimeError, triton.runtime.errors.OutOfResources, ValueError) as error:
            variants.append((variant, scaling, config, None, f"unavailable: {str(error).splitlines()[0][:160]}"))
            return
        err = rel_err(out_rows(), refs[scaling]) if scaling in refs else None
        ok = err is None or err <= MAX_REL_ERR
        variants.append((variant, scaling, config, call if ok else None, err if ok else f"failed: rel err {err:.3g}"))

    out_bf16 = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    add("bf16 cuBLAS", "bf16", "", lambda: torch.matmul(a, b.t(), out=out_bf16), None)
    ta, tb = tensorwise
    for fast in (False, True):
        out = {}

        def cublas_tensorwise(fast=fast, out=out):
            out["c"] = torch._scaled_mm(ta.q, tb.q.t(), scale_a=ta.ds.reshape(()), scale_b=tb.ds.reshape(()),
                                        out_dtype=torch.bfloat16, use_fast_accum=fast)
        add(f"cuBLAS tensorwise{' fast-accum' if fast else ''}", "tensorwise", "", cublas_tensorwise,
            lambda out=out: out["c"][rows])
    ba, bb = blockwise
    recipe_b = F.ScalingType.BlockWise1x128 if wgrad else F.ScalingType.BlockWise128x128
    scale_b = Q.scale_view_1x128(bb.ds) if wgrad else Q.scale_view_128x128(bb.ds)
    out = {}

    def cublas_blockwise(out=out):
        out["c"] = F.scaled_mm(ba.q, bb.q.t(), Q.scale_view_1x128(ba.ds), F.ScalingType.BlockWise1x128, scale_b,
                               recipe_b, output_dtype=torch.bfloat16)
    add("cuBLAS blockwise", "blockwise", "", cublas_blockwise, lambda: out["c"][rows])
    if wgrad:   # the FP8 layers' whole weight gradient from bf16 dY [tokens, N] and X [tokens, K]: both transposed
        dy, x = a.t().contiguous(), b.t().contiguous()   # quantizers, then the scaled GEMM (fp8_weight_grad)
        for scaling in ("tensorwise", "blockwise"):
            recipe, out = Fp8Recipe("e4m3", scaling), {}

            def whole_wgrad(recipe=recipe, out=out):
                out["c"] = fp8_weight_grad(dy, x, recipe)
            add(f"{WGRAD} {scaling}", scaling, "", whole_wgrad, lambda out=out: out["c"][rows])
        # what the FP8 wgrad adds to a tensorwise layer's backward, whose dgrad quantizes dY anyway: dY's quantizer
        # writing the transposed copy too (fp8_linear.quantize_grad), X.T's quantizer, the GEMM; minus dY's quantizer
        recipe, out = Fp8Recipe("e4m3", "tensorwise", True), {}

        def with_dgrad_quantizer(recipe=recipe, out=out):
            _, dy_t8 = quantize_grad(dy, recipe)
            out["c"] = fp8_weight_grad(dy, x, recipe, dy_t8)
        add(f"{WGRAD_FUSED} tensorwise", "tensorwise", "", with_dgrad_quantizer, lambda out=out: out["c"][rows])
        add(DGRAD_QUANTIZER, "none", "", lambda: Q.quantize_tensorwise(dy, "e4m3"), None)

    for scaling, (qa, qb) in (("tensorwise", tensorwise), ("blockwise", blockwise)):
        for config in configs[scaling]:
            for sync in (True, False):
                tiles, shape, row_of, counters, flags = plan_for(op, m, n, k, tp, config)
                if op == "plain" and not sync:
                    continue   # wgrad has no synchronisation: one variant
                dst = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
                programs = gemm_programs(dst.device, config)

                def ours(qa=qa, qb=qb, dst=dst, tiles=tiles, counters=counters if sync else None,
                         flags=flags if sync else None, programs=programs, config=config):
                    fp8_signaled_gemm(qa, qb, dst, tiles, counters, programs, config, flags=flags, wait_target=1)
                add(f"ours {scaling} sync {'on' if sync and op != 'plain' else 'off'}", scaling, label(config), ours,
                    lambda dst=dst, row_of=row_of: dst[row_of[rows]])
                if args.gluon and scaling == "blockwise" and not wgrad:
                    add_gluon(add, qa, qb, dst, tiles, counters if sync else None, flags if sync else None, programs,
                              config, "on" if sync else "off", scaling,
                              lambda dst=dst, row_of=row_of: dst[row_of[rows]])

    timed = [v for v in variants if v[3] is not None]
    per_round = interleaved([lambda call=v[3]: call() for v in timed], sets, args.rounds, args.reps)
    times = {(v[0], v[2]): statistics.median(t) for v, t in zip(timed, per_round)}
    results = []
    for variant, scaling, config, call, err in variants:
        ms = times.get((variant, config))
        results.append(dict(gemm=name, op=op, M=m, N=n, K=k, t=tp, variant=variant, config=config, ms=ms,
                            tflops=2 * m * n * k / ms / 1e9 if ms else None,
                            rel_err=err if isinstance(err, float) else None,
                            note=err if isinstance(err, str) else ""))
    return results


def add_gluon(add, qa, qb, dst, tiles, counters, flags, programs, config, sync, scaling, out_rows):
    """The Gluon candidate (benchmarks/device/fp8_blockwise_gluon.py) that takes `config`'s tile, on the library's
    plan and synchronisation: blockwise_gluon_kernel where BN divides 128 (two programs per SM at 64x128, where two
    CTAs fit), blockwise_ws_kernel at 128x256x128/S/4; a tile neither takes is recorded as unavailable."""
    import fp8_blockwise_gluon as G   # beside this script, on sys.path as the script's directory
    tile = (config.block_m, config.block_n, config.block_k, config.num_stages, config.num_warps)
    name, launch = ("gluon-ws", G.launch_ws) if config.block_n > 128 else ("gluon", G.launch)
    per_sm = 2 if (config.block_m, config.block_n) == (64, 128) else 1

    def call():   # the launcher's checks raise ValueError for a tile it does not take: add() records it
        launch(qa, qb, dst, tile, programs * per_sm, tiles, counters=counters, flags=flags, wait_target=1)()
    add(f"{name} {scaling} sync {sync}", scaling, label(config) + (f" x{per_sm}" if per_sm > 1 else ""), call,
        out_rows)


def best(results, prefix):
    rows = [r for r in results if r["variant"].startswith(prefix) and r["ms"]]
    return min(rows, key=lambda r: r["ms"]) if rows else None


def main(argv):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8_gemm: needs a CUDA GPU", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    configs = {"tensorwise": [parse_config(c) for c in args.tensorwise_configs.split(",") if c],
               "blockwise": [parse_config(c) for c in args.blockwise_configs.split(",") if c]}
    card = torch.cuda.get_device_name()
    commit = os.environ.get("OVERLAP_TP_GIT_COMMIT", "unknown")[:7]
    date = datetime.date.today().isoformat()
    record = f"benchmarks/fp8_gemm_{card.split()[1] if len(card.split()) > 1 else card}x1_{date}.md"
    gen = torch.Generator(device="cuda").manual_seed(0)
    start, results, skipped = time.time(), [], []
    jsonl = open(os.path.join(args.out, "fp8_gemm.jsonl"), "w")
    for tp in (int(v) for v in args.tp.split(",")):
        for m in (int(v) for v in args.seq.split(",")):
            for layer in args.layers.split(","):
                for name, op, gm, gn, gk in gemms(layer, m, tp, args.passes.split(",")):
                    full = f"{name} s{m}"
                    if time.time() - start > args.deadline_s:
                        skipped.append(f"{full} t{tp}")
                        continue
                    rows = bench_one(full, op, gm, gn, gk, tp, args, configs, gen)
                    results += rows
                    for r in rows:
                        print(f"t{tp} {full:24s} {r['variant']:34s} {r['config']:18s} "
                              f"{'' if r['ms'] is None else '%.3f ms' % r['ms']:>10s} "
                              f"err {r['rel_err'] if r['rel_err'] is not None else '-'} {r['note']}", flush=True)
                        if r["ms"] is not None:
                            jsonl.write(json.dumps(dict(
                                date=date, commit=commit, cards=f"1x {card}", t=tp, what=f"kernel gemm {full}",
                                config=dict(variant=r["variant"], tile=r["config"], M=r["M"], N=r["N"], K=r["K"],
                                            rel_err=r["rel_err"]),
                                metric="ms", value=round(r["ms"], 4), record=record, logs=[])) + "\n")
                    for scaling, cublas in (("tensorwise", "cuBLAS tensorwise"), ("blockwise", "cuBLAS blockwise")):
                        ours = best(rows, f"ours {scaling} sync on") or best(rows, f"ours {scaling} sync off")
                        theirs = best(rows, cublas)
                        if ours and theirs:
                            jsonl.write(json.dumps(dict(
                                date=date, commit=commit, cards=f"1x {card}", t=tp, what=f"kernel gemm {full}",
                                config=dict(variant=f"ours {scaling} (best tile, sync on) vs {theirs['variant']}",
                                            tile=ours["config"]),
                                metric=f"speedup {theirs['variant']}/ours", value=round(theirs["ms"] / ours["ms"], 3),
                                record=record, logs=[])) + "\n")
                    jsonl.flush()
    jsonl.close()
    lines = [f"# FP8 signaled GEMM vs cuBLAS, {card}, commit {commit}, {date}", "",
             f"command: python3 benchmarks/device/fp8_gemm.py {' '.join(argv)}",
             f"torch {torch.__version__}, CUDA {torch.version.cuda}, triton {triton.__version__}", ""]
    lines += ["| t | GEMM | M | N | K | variant | tile | ms | TFLOP/s | rel err | note |", "|---" * 11 + "|"]
    for r in results:
        lines.append(f"| {r['t']} | {r['gemm']} | {r['M']} | {r['N']} | {r['K']} | {r['variant']} | {r['config']} | "
                     f"{'' if r['ms'] is None else format(r['ms'], '.3f')} | "
                     f"{'' if r['tflops'] is None else format(r['tflops'], '.0f')} | "
                     f"{'' if r['rel_err'] is None else format(r['rel_err'], '.2e')} | {r['note']} |")
    lines += ["", "Medians over the GEMMs of cuBLAS time / ours (best tile; above 1: ours faster):"]
    for tp in sorted({r["t"] for r in results}):
        for scaling, cublas in (("tensorwise", "cuBLAS tensorwise"), ("tensorwise", "cuBLAS tensorwise fast-accum"),
                                ("blockwise", "cuBLAS blockwise"), ("tensorwise", "bf16 cuBLAS")):
            for sync in ("on", "off"):
                ratios = []
                for g in sorted({r["gemm"] for r in results if r["t"] == tp}):
                    rows = [r for r in results if r["t"] == tp and r["gemm"] == g]
                    ours = best(rows, f"ours {scaling} sync {sync}") or (best(rows, f"ours {scaling} sync off")
                                                                        if rows[0]["op"] == "plain" else None)
                    theirs = [r for r in rows if r["variant"] == cublas and r["ms"]]
                    if ours and theirs:
                        ratios.append(theirs[0]["ms"] / ours["ms"])
                if ratios:
                    lines.append(f"- t {tp}: {cublas} / ours {scaling} sync {sync}: median {statistics.median(ratios):.3f} "
                                 f"(min {min(ratios):.3f}, max {max(ratios):.3f}, {len(ratios)} GEMMs)")
    lines += ["", "The weight gradient in FP8 as the layers run it (both transposed quantizers from bf16, then cuBLAS) "
              "against the bf16 GEMM, medians over the wgrad GEMMs of bf16 time / FP8 time (above 1: FP8 faster):"]
    for tp in sorted({r["t"] for r in results}):
        for scaling in ("tensorwise", "blockwise"):
            ratios = []
            for g in sorted({r["gemm"] for r in results if r["t"] == tp and r["op"] == "plain"}):
                rows = [r for r in results if r["t"] == tp and r["gemm"] == g and r["ms"]]
                fp8 = [r for r in rows if r["variant"] == f"{WGRAD} {scaling}"]
                bf16 = [r for r in rows if r["variant"] == "bf16 cuBLAS"]
                if fp8 and bf16:
                    ratios.append(bf16[0]["ms"] / fp8[0]["ms"])
            if ratios:
                lines.append(f"- t {tp}: bf16 cuBLAS / {WGRAD} {scaling}: median {statistics.median(ratios):.3f} "
                             f"(min {min(ratios):.3f}, max {max(ratios):.3f}, {len(ratios)} GEMMs)")
        ratios = []   # in the layer: bf16 wgrad against what the FP8 wgrad adds to the dgrad's quantizer
        for g in sorted({r["gemm"] for r in results if r["t"] == tp and r["op"] == "plain"}):
            ms = {r["variant"]: r["ms"] for r in results if r["t"] == tp and r["gemm"] == g and r["ms"]}
            if {"bf16 cuBLAS", f"{WGRAD_FUSED} tensorwise", DGRAD_QUANTIZER} <= set(ms):
                ratios.append(ms["bf16 cuBLAS"] / (ms[f"{WGRAD_FUSED} tensorwise"] - ms[DGRAD_QUANTIZER]))
        if ratios:
            lines.append(f"- t {tp}: bf16 cuBLAS / (({WGRAD_FUSED}) - ({DGRAD_QUANTIZER})) tensorwise, what the FP8 "
                         f"wgrad adds in the layer: median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, "
                         f"max {max(ratios):.3f}, {len(ratios)} GEMMs)")
    if skipped:
        lines += ["", f"Not measured (past --deadline-s): {', '.join(skipped)}"]
    with open(os.path.join(args.out, "fp8_gemm.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[-12:]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
