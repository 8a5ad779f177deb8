"""The FP8 GEMM anchor, one GPU: Transformer Engine's FP8 forward (te.Linear under TE's autocast) beside
torch._scaled_mm and bf16 cuBLAS, on the forward GEMMs of the public layer shapes.

    python -m overlap_tp.bench te_gemm --out OUT_DIR [--jsonl OUT_DIR/te_gemm.jsonl]

GEMMs (overlap_tp/tune/shapes.py at TP = --tp, M = --seq tokens, bench gemm's `fwd` rows): qkv and fc1
[M, K] @ W[N_local, K].T (the gathered rows), proj and fc2 [M, K_local] @ W[N, K_local].T. Variants, each on the
same bf16 activations and weights:
  bf16                        torch.matmul (cuBLAS, bf16)
  scaled_mm tensorwise        torch._scaled_mm on E4M3 operands quantized beforehand with one scale per tensor
                              (amax / 448): the GEMM alone
  scaled_mm blockwise         the same with 1x128 activation blocks and 128x128 weight blocks (fp32 scales; the
                              scale layouts tried in turn, the first that runs and passes the check is kept)
  te <recipe> W in call       te.Linear(K, N, bias=False) forward under TE's autocast with the recipe: the
                              activation and the weight quantized in the call, then TE's FP8 GEMM (what a
                              training step's first micro-batch runs)
  te <recipe> W cached        the same with is_first_microbatch=False after a first call: the FP8 weight kept
                              (TE's weight cache), the activation quantized in the call
with recipe Float8CurrentScaling (tensorwise) and Float8BlockScaling (1x128 / 128x128 blocks), where this TE and
GPU run them (a recipe that does not is named with its error). te.Linear runs as in training: its weight needs a
gradient, so TE also makes what the backward will read.

Checks before timing: the scaled_mm outputs against the float64 product of their dequantized operands (relative
error <= 1e-2: the bf16 output's rounding); TE's against the float64 product of the unquantized bf16 operands
(<= --fp8-tol: the FP8 rounding of the inputs). Times: every variant captured in one CUDA graph of 4 x
--input-sets calls (inputs rotated over the sets, no L2 flush) and timed by replay with CUDA events, the variants
in --rounds interleaved rounds of --reps calls (bench gemm's method); a variant whose capture fails is timed
eagerly, back to back, and says so. ms: the median over all rounds.

Output: OUT_DIR/NAME.json + .md (the table, environment), and with --jsonl one JSON line per variant and GEMM
in benchmarks/results.jsonl's fields (date, commit from $OVERLAP_TP_GIT_COMMIT, cards, t, what, config, metric,
value, record, logs).
"""
import argparse
import datetime
import functools
import json
import os
import statistics
import sys
import zlib

import torch

from overlap_tp.bench.gemm import GRAPH_CALLS_PER_SET, layer_gemms
from overlap_tp.tune import report
from overlap_tp.tune.timing import CapturedCalls, event_times

E4M3_MAX = 448.0
BLOCK = 128
SCALED_MM_TOL = 1e-2
TE_RECIPES = ("Float8CurrentScaling", "Float8BlockScaling")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m overlap_tp.bench te_gemm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2, help="the TP size whose shards are multiplied")
    p.add_argument("--seq", type=int, default=8192, help="tokens M")
    p.add_argument("--layers", default="l8b,l70b", help="comma list of l8b, l70b, smoke")
    p.add_argument("--recipes", default=",".join(TE_RECIPES), help=f"comma list of {', '.join(TE_RECIPES)}")
    p.add_argument("--input-sets", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=20, help="calls per variant and round")
    p.add_argument("--fp8-tol", type=float, default=0.1,
                   help="max relative error of TE's output against the unquantized float64 product")
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--name", default="te_gemm")
    p.add_argument("--jsonl", default=None, help="also write one results.jsonl-style line per variant and GEMM here")
    args = p.parse_args(argv)
    unknown = set(args.recipes.split(",")) - set(TE_RECIPES)
    if unknown:
        p.error(f"unknown recipes {sorted(unknown)}: expected some of {', '.join(TE_RECIPES)}")
    unknown = set(args.layers.split(",")) - {"l8b", "l70b", "smoke"}
    if unknown:
        p.error(f"unknown layers {sorted(unknown)}")
    if args.rounds < 1 or args.reps < 1:
        p.error("--rounds and --reps must be >= 1")
    return args


# ---------------------------------------------------------------------------------------------------
# Quantization (the torch side) and the references
# ---------------------------------------------------------------------------------------------------

def quantize_tensorwise(t):
    """(E4M3 tensor, fp32 decode scale: t ~ q * scale), one scale for the whole tensor."""
    amax = t.abs().amax().float().clamp(min=1e-12)
    scale = amax / E4M3_MAX
    return (t.float() / scale).to(torch.float8_e4m3fn), scale.reshape(())


def quantize_blocks(t, rows):
    """(E4M3 tensor, fp32 decode scales [R / rows, C / 128]) for blocks of `rows` x 128 of a 2-D tensor t [R, C]
    (rows 1: the activations' 1x128 blocks; rows 128: the weights' 128x128 blocks)."""
    r, c = t.shape
    if c % BLOCK or r % rows:
        raise ValueError(f"blockwise quantization of [{r}, {c}] needs {rows} | rows and {BLOCK} | columns")
    blocks = t.float().reshape(r // rows, rows, c // BLOCK, BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-12) / E4M3_MAX)
    q = (blocks / scale).to(torch.float8_e4m3fn).reshape(r, c)
    return q, scale.reshape(r // rows, c // BLOCK)


def dequantize_blocks(q, scale, rows):
    r, c = q.shape
    return (q.double().reshape(r // rows, rows, c // BLOCK, BLOCK)
            * scale.double().reshape(r // rows, 1, c // BLOCK, 1)).reshape(r, c)


def rel_error(got, want):
    return float((got.double() - want).norm() / want.norm().clamp(min=1e-30))


# ---------------------------------------------------------------------------------------------------
# The variants: (name, fn(x) -> out, reference check) per GEMM
# ---------------------------------------------------------------------------------------------------

def scaled_mm_tensorwise(x, w):
    """The call and its dequantized float64 reference."""
    xq, xs = quantize_tensorwise(x)
    wq, ws = quantize_tensorwise(w)
    want = (xq.double() * xs.double()) @ (wq.double() * ws.double()).t()

    def call(_x):
        return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)
    return call, want


def blockwise_scale_layouts(xs, ws):
    """The layouts of the 1x128 activation scales [M, K/128] and the 128x128 weight scales (for the column-major
    second operand W.T: [K/128, N/128]) that torch._scaled_mm may ask for: outer-dimension-major first (cuBLAS's
    blockwise scaling reads the scales that way), then row-major."""
    ws_t = ws.t()   # [K/128, N/128]
    return [("outer-major", xs.t().contiguous().t(), ws_t.t().contiguous().t()),
            ("row-major", xs.contiguous(), ws_t.contiguous())]


def scaled_mm_blockwise(x, w):
    """The call (its scale layout the first that runs and passes the check), its reference, and the layout's
    name; raises with every layout's error where none does."""
    xq, xs = quantize_blocks(x, 1)
    wq, ws = quantize_blocks(w, BLOCK)
    want = dequantize_blocks(xq, xs, 1) @ dequantize_blocks(wq, ws, BLOCK).t()
    errors = []
    for layout, a_scale, b_scale in blockwise_scale_layouts(xs, ws):
        def call(_x, a_scale=a_scale, b_scale=b_scale):
            return torch._scaled_mm(xq, wq.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=torch.bfloat16)
        try:
            err = rel_error(call(x), want)
        except RuntimeError as error:
            errors.append(f"{layout}: {type(error).__name__}: {str(error)[:160]}")
            continue
        if err <= SCALED_MM_TOL:
            return call, want, layout
        errors.append(f"{layout}: relative error {err:.2e} > {SCALED_MM_TOL}")
    raise RuntimeError("torch._scaled_mm blockwise: " + "; ".join(errors))


def te_recipe(name):
    from transformer_engine.common import recipe
    return getattr(recipe, name)()


def te_autocast(recipe):
    import transformer_engine.pytorch as te
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)


def te_linear(w, recipe_name):
    """call(x, first=None): te.Linear with weight w [N, K] under the recipe; `first` is TE's is_first_microbatch
    (None: the weight quantized in every call; True: quantized and kept; False: the kept FP8 weight used)."""
    import transformer_engine.pytorch as te
    n, k = w.shape
    layer = te.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        layer.weight.copy_(w)
    recipe = te_recipe(recipe_name)

    def call(x, first=None):
        with te_autocast(recipe):
            return layer(x, is_first_microbatch=first)
    return call


# ---------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------

def timer(fn, sets, reps):
    """(fn's per-call timer, 'graph' or why it is eager): captured in a CUDA graph where it can be."""
    try:
        captured = CapturedCalls(fn, sets * GRAPH_CALLS_PER_SET)
        return functools.partial(captured.samples, reps, None), "graph"
    except Exception as error:   # a capture this library refuses: timed eagerly, and the row says so
        torch.cuda.synchronize()
        return functools.partial(event_times, fn, sets, reps), f"eager (capture: {type(error).__name__})"


def bench_gemm(name, m, k, n, args):
    """Rows (one per variant) for one GEMM."""
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{name} {m}".encode()))
    sets = [(torch.randn(m, k, device="cuda", generator=gen).bfloat16(),) for _ in range(args.input_sets)]
    w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).bfloat16()
    x0 = sets[0][0]
    exact = x0.double() @ w.double().t()
    variants, rows = [], []

    def add(variant, build, fp8=True):
        row = dict(gemm=f"{name}.s{m}", M=m, K=k, N=n, variant=variant)
        try:
            fn, err, note = build()
            row["check_err"] = err
            variants.append((row, fn))
            if note:
                row["note"] = note
        except Exception as error:   # a variant this TE / torch / GPU does not run: named, the others go on
            row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        row["fp8"] = fp8
        rows.append(row)

    add("bf16", lambda: (lambda x: torch.matmul(x, w.t()), rel_error(torch.matmul(x0, w.t()), exact), None),
        fp8=False)

    def tensorwise():
        call, want = scaled_mm_tensorwise(x0, w)
        err = rel_error(call(x0), want)
        if err > SCALED_MM_TOL:
            raise RuntimeError(f"check failed: relative error {err:.2e} > {SCALED_MM_TOL}")
        return call, err, None
    add("scaled_mm tensorwise", tensorwise)

    def blockwise():
        call, want, layout = scaled_mm_blockwise(x0, w)
        return call, rel_error(call(x0), want), f"scales {layout}"
    add("scaled_mm blockwise", blockwise)

    for recipe_name in args.recipes.split(","):
        for cached in (False, True):
            def te(recipe_name=recipe_name, cached=cached):
                call = te_linear(w, recipe_name)
                if cached:
                    call(x0, first=True)   # quantizes the weight and keeps it
                    call = functools.partial(call, first=False)
                out = call(x0)
                err = rel_error(out.detach(), exact)
                if err > args.fp8_tol:
                    raise RuntimeError(f"check failed: relative error {err:.2e} > {args.fp8_tol}")
                return call, err, None
            add(f"te {recipe_name} W {'cached' if cached else 'in call'}", te)

    timers = []
    for row, fn in variants:
        time_fn, how = timer(fn, sets, args.reps)
        row["timing"] = how
        timers.append((row, time_fn, []))
    for _ in range(args.rounds):
        for row, time_fn, medians in timers:
            medians.append(statistics.median(time_fn()))
    bf16_ms = None
    for row, _, medians in timers:
        row["ms"] = statistics.median(medians)
        row["round_ms"] = medians
        row["tflops"] = 2 * m * n * k / row["ms"] / 1e9
        if row["variant"] == "bf16":
            bf16_ms = row["ms"]
    for row, _, _ in timers:
        if bf16_ms:
            row["vs_bf16"] = row["ms"] / bf16_ms
    return rows


COLUMNS = [
    ("gemm", "GEMM", "{}"), ("M", "M", "{}"), ("K", "K", "{}"), ("N", "N", "{}"), ("variant", "variant", "{}"),
    ("ms", "ms", "{:.3f}"), ("vs_bf16", "t/bf16", "{:.3f}"), ("tflops", "TFLOP/s", "{:.0f}"),
    ("check_err", "check err", "{:.1e}"), ("timing", "timing", "{}"), ("note", "note", "{}"), ("error", "error", "{}"),
]


def jsonl_records(rows, args, cards, te_version):
    """results.jsonl-style records: ms and TFLOP/s of every timed variant."""
    date = datetime.date.today().isoformat()
    commit = os.environ.get("OVERLAP_TP_GIT_COMMIT", "unknown")
    records = []
    for row in rows:
        if "ms" not in row:
            continue
        config = {"variant": row["variant"], "M": row["M"], "K": row["K"], "N": row["N"], "timing": row["timing"],
                  "transformer_engine": te_version if row["variant"].startswith("te ") else None}
        for metric, value in (("ms", row["ms"]), ("TFLOP/s", row["tflops"])):
            records.append({"date": date, "commit": commit, "cards": cards, "t": args.tp,
                            "what": f"FP8 GEMM anchor {row['gemm']} fwd", "config": config, "metric": metric,
                            "value": round(value, 4), "record": None, "logs": []})
    return records


def main(argv):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("te_gemm benchmark: needs a CUDA GPU", file=sys.stderr)
        return 2
    from overlap_tp.bench.te_baselines import te_problem, te_version
    problem = te_problem()
    if problem:
        print(f"te_gemm benchmark: {problem}", file=sys.stderr)
        return 2
    rows = []
    for layer in args.layers.split(","):
        for name, op, k, n, _ in layer_gemms(layer, args.seq, args.tp):
            if not name.endswith(" fwd"):
                continue
            for row in bench_gemm(name.removesuffix(" fwd"), args.seq, k, n, args):
                rows.append(row)
                print(" | ".join(fmt.format(row[key]) if key in row else "" for key, _, fmt in COLUMNS), flush=True)
    cards = f"1x {torch.cuda.get_device_name()}"
    version = te_version()
    notes = f"Transformer Engine {version}, torch {torch.__version__}, {cards}.\n\n" + __doc__.split("\n\n", 1)[1]
    report.write(args.out, args.name, f"FP8 GEMM anchor: TE's FP8 forward, torch._scaled_mm and bf16 cuBLAS "
                 f"(one GPU, TP {args.tp} shards, s {args.seq})", rows, COLUMNS, notes)
    if args.jsonl:
        os.makedirs(os.path.dirname(os.path.abspath(args.jsonl)), exist_ok=True)
        with open(args.jsonl, "a") as f:
            for record in jsonl_records(rows, args, cards, version):
                f.write(json.dumps(record) + "\n")
    return 0
