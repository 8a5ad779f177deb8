"""Main-loop variants of the blockwise FP8 GEMM (1x128 activations x 128x128 weights, FP32 promotion per 128 of K), as
stand-alone Triton kernels, against cuBLAS's blockwise GEMM and the library's kernel (kernels/fp8_gemm.py): which
change to the library's main loop closes its gap to cuBLAS. Not part of the library: the winner moves into
kernels/fp8_gemm.py behind the same plan interface.

On the device (one H100 or H200; a few minutes for every layer GEMM, most of it compiling):

    source benchmarks/device/setup.sh && python3 $REPO/benchmarks/device/fp8_blockwise_variants.py --out $OUT

Every variant is a persistent kernel over the output tiles (grouped by GROUP_M rows of tiles), TMA loads, and one K
loop per tile that promotes each 128-wide K step's product into the fp32 accumulator:
  outer       acc += dot(a, w.T) * sa[:, None] * sw[None, :]: the library's loop (sw loaded per column)
  rowscale    acc += dot(a, w.T) * (sa * sw)[:, None]: a tile no wider than a weight block (BLOCK_N <= 128) has one
              weight scale per K step, a scalar, so the promotion is one multiply-add per element instead of three
  unroll2     rowscale over two K steps per iteration, both products issued before either is promoted, so the
              tensor cores have the second while the first is promoted
  gluon       fp8_blockwise_gluon.py: two K steps' MMAs issued asynchronously, the first promoted while the
              second runs (Gluon's explicit wgmma waits; GPU only, not in the interpreter); the library's
              candidate, so it walks the library's plan table and has its epilogue (signal, wait, bias)
  gluon-ws    fp8_blockwise_gluon.py's 128x256 tile on two warpgroups, each its own warp-specialised partition,
              one promoting while the other's MMAs run (tile 128x256x128/STAGES/4 only), with the same epilogue
  ws          rowscale in a warp-specialised loop (tl.range(warp_specialize=True): a producer warp for the loads,
              the math warps consuming), where this Triton supports it on this GPU (Triton 3.6 for sm_90 keeps the
              loop whole: the attribute stays on the loop and no partitions are made, so ws runs as rowscale)
In every variant Triton (3.6) waits for each K step's MMAs to finish before promoting them (wgmma.wait_group 0 in
the loop: an MMA result read by anything but the next MMA's accumulator cannot stay in flight), so within one CTA
the tensor cores idle while the promotion runs. --programs-per-sm 2 launches two persistent programs per SM: where
registers and shared memory let two CTAs share the SM (64x128x128/3/4: about 74 KB and 193 registers a thread),
one's MMAs run while the other promotes, the overlap a warp-specialised ping-pong kernel builds by hand.
Each is checked against the float64 product of the dequantized operands (relative error <= 2**-6, else reported and
not timed), then timed with CUDA-graph replays in interleaved rounds (overlap_tp/bench/gemm.py's `interleaved`) beside
cuBLAS (torch.nn.functional.scaled_mm, BlockWise1x128 x BlockWise128x128) and the library kernel, on the forward and
dgrad GEMMs of the chosen layers (fp8_gemm.py's list). Writes $OUT/fp8_blockwise_variants.jsonl (one row per GEMM
and variant: results.jsonl's fields with the card's full name, plus vs_cublas and operand_tb_s; a campaign file's
summary rows are what go into results.jsonl), appended, each GEMM's rows as soon as it is timed, so a time limit
keeps what ran; and prints a table with each variant's time over cuBLAS's and the rate at which it loads its
operands (`operand_bytes`: a 64x128 tile loads 1.5 times the bytes of a 128x128 tile and twice those of a 128x256
tile for the same product, so a small tile can be bound by L2's bandwidth before its promotion matters).

--cpu: the check alone, in Triton's CPU interpreter, on small shapes (the script's own test).
"""
import argparse
import datetime
import json
import os
import statistics
import sys

import torch

CPU = "--cpu" in sys.argv
if CPU:   # before triton is imported: the interpreter
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from overlap_tp.kernels import fp8_quant as Q  # noqa: E402

VARIANTS = {"outer": 0, "rowscale": 1, "unroll2": 2, "ws": 3, "gluon": None, "gluon-ws": None}   # gluon*: Gluon
MAX_REL_ERR = 2 ** -6


@triton.jit
def _load_step(a_desc, w_desc, row0, col0, ks, INTERPRETED: tl.constexpr, BLOCK_K: tl.constexpr):
    """K step ks's tiles of a and w (fp32 in the interpreter, whose dot takes no fp8)."""
    a = a_desc.load([row0, ks * BLOCK_K])
    w = w_desc.load([col0, ks * BLOCK_K])
    if INTERPRETED:
        a = a.to(tl.float32)
        w = w.to(tl.float32)
    return a, w


@triton.jit
def _promote_step(a_desc, w_desc, acc, row0, col0, ks, sa_ptrs, M, sw_row_ptr,
                  INTERPRETED: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + dot(a_ks, w_ks.T) * (sa * sw)[:, None]: one K step, the weight's scale one scalar (rowscale)."""
    a, w = _load_step(a_desc, w_desc, row0, col0, ks, INTERPRETED, BLOCK_K)
    sa = tl.load(sa_ptrs + ks * M)
    sw = tl.load(sw_row_ptr + ks)
    return acc + tl.dot(a, w.T) * (sa * sw)[:, None]


@triton.jit
def blockwise_variant_kernel(a_desc, w_desc, c_ptr, sa_ptr, sw_ptr, sw_ld, M, N, K,
                             VARIANT: tl.constexpr, INTERPRETED: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                             GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr):
    """C [M, N] bf16 = (A * sa) @ (W * sw).T; A [M, K] e4m3 with sa stored [K/128, M] (M a multiple of BLOCK_M), W
    [N, K] e4m3 with sw stored [ceil(N/128), sw_ld]; K a multiple of 128 (of 256 for unroll2)."""
    k_steps = K // BLOCK_K
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS):
        group = tile // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (tile % (GROUP_M * tiles_n)) % rows_in_group
        pid_n = (tile % (GROUP_M * tiles_n)) // rows_in_group
        row0 = pid_m * BLOCK_M
        col0 = pid_n * BLOCK_N
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = col0 + tl.arange(0, BLOCK_N)
        sa_ptrs = sa_ptr + rows
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if VARIANT == 0:
            sw_ptrs = sw_ptr + (cols // 128) * sw_ld
            for ks in range(k_steps):
                a, w = _load_step(a_desc, w_desc, row0, col0, ks, INTERPRETED, BLOCK_K)
                sa = tl.load(sa_ptrs + ks * M)
                sw = tl.load(sw_ptrs + ks, mask=cols < N, other=0.0)
                acc += tl.dot(a, w.T) * sa[:, None] * sw[None, :]
        else:
            sw_row_ptr = sw_ptr + (col0 // 128) * sw_ld
            if VARIANT == 1:
                for ks in range(k_steps):
                    acc = _promote_step(a_desc, w_desc, acc, row0, col0, ks, sa_ptrs, M, sw_row_ptr,
                                        INTERPRETED, BLOCK_K)
            elif VARIANT == 2:
                for ks in range(0, k_steps, 2):
                    a0, w0 = _load_step(a_desc, w_desc, row0, col0, ks, INTERPRETED, BLOCK_K)
                    a1, w1 = _load_step(a_desc, w_desc, row0, col0, ks + 1, INTERPRETED, BLOCK_K)
                    p0 = tl.dot(a0, w0.T)
                    p1 = tl.dot(a1, w1.T)
                    s0 = tl.load(sa_ptrs + ks * M) * tl.load(sw_row_ptr + ks)
                    s1 = tl.load(sa_ptrs + (ks + 1) * M) * tl.load(sw_row_ptr + ks + 1)
                    acc += p0 * s0[:, None] + p1 * s1[:, None]
            else:
                for ks in tl.range(k_steps, warp_specialize=True):
                    acc = _promote_step(a_desc, w_desc, acc, row0, col0, ks, sa_ptrs, M, sw_row_ptr,
                                        INTERPRETED, BLOCK_K)
        tl.store(c_ptr + rows[:, None] * N + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))


def parse_tile(text):
    tile, stages, warps = text.split("/")
    bm, bn, bk = (int(v) for v in tile.split("x"))
    return bm, bn, bk, int(stages), int(warps)


def variant_call(variant, a, w, out, tile, num_programs, plan_tiles=None):
    """A callable that runs `variant` of the kernel on ScaledFp8 a (1x128) and w (128x128) into out (gluon: over
    the library's plan table `plan_tiles`, as kernels/fp8_gemm.py runs it)."""
    if variant.startswith("gluon"):
        if CPU:
            raise ValueError(f"{variant} does not run in Triton's interpreter")
        from fp8_blockwise_gluon import launch, launch_ws   # beside this script, on sys.path from gpu_bench
        return (launch_ws if variant == "gluon-ws" else launch)(a, w, out, tile, num_programs, plan_tiles)
    bm, bn, bk, stages, warps = tile
    m, k = a.q.shape
    n = w.q.shape[0]
    if bk != Q.BLOCK or (variant != "outer" and bn > Q.BLOCK) or m % bm or (variant == "unroll2" and k % (2 * bk)):
        raise ValueError(f"{variant} does not take tile {bm}x{bn}x{bk} at M={m}, K={k}")
    a_desc = TensorDescriptor.from_tensor(a.q, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(w.q, [bn, bk])
    tiles = -(-m // bm) * -(-n // bn)
    grid = (max(1, min(num_programs, tiles)),)

    def call():
        blockwise_variant_kernel[grid](a_desc, w_desc, out, a.ds, w.ds, w.ds.shape[1], m, n, k,
                                       VARIANT=VARIANTS[variant], INTERPRETED=CPU, NUM_PROGRAMS=grid[0], GROUP_M=8,
                                       BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_stages=stages, num_warps=warps)
    return call


def operands(m, n, k, device, gen):
    """a [m, k] 1x128 and w [n, k] 128x128, each block's magnitude its own power of two in [2**-3, 2**3], so a
    scale applied to the wrong block is an error far above MAX_REL_ERR."""
    def blocks(rows, cols, block_rows):
        exponents = torch.randint(-3, 4, (-(-rows // block_rows), cols // Q.BLOCK), device=device, generator=gen)
        return (2.0 ** exponents).repeat_interleave(block_rows, 0)[:rows].repeat_interleave(Q.BLOCK, 1)
    a = (torch.randn(m, k, device=device, generator=gen) * blocks(m, k, 1)).bfloat16()
    w = (torch.randn(n, k, device=device, generator=gen) / k ** 0.5 * blocks(n, k, Q.BLOCK)).bfloat16()
    return Q.quantize_1x128(a), Q.quantize_128x128(w)


def rel_err(got, ref):
    return float((got.double() - ref).norm() / ref.norm())


def check(variant, a, w, tile, num_programs, plan_tiles=None):
    """Run `variant` once: (its relative error against the float64 reference, the call) or (an error text, None)."""
    out = torch.empty(a.q.shape[0], w.q.shape[0], device=a.q.device, dtype=torch.bfloat16)
    try:
        call = variant_call(variant, a, w, out, tile, num_programs, plan_tiles)
        call()
        if out.is_cuda:
            torch.cuda.synchronize()
    except Exception as error:   # a variant this Triton or GPU cannot build is reported, not fatal
        return f"unavailable: {type(error).__name__}: {str(error).splitlines()[0][:160]}", None
    err = rel_err(out, Q.dequantize_reference(a) @ Q.dequantize_reference(w).t())
    return (err, call) if err <= MAX_REL_ERR else (f"failed: rel err {err:.3g}", None)


def cpu_check(args):
    """The variants in Triton's interpreter on small shapes: every one within MAX_REL_ERR of the reference."""
    gen = torch.Generator().manual_seed(0)
    failures = []
    for m, n, k in ((64, 128, 256), (128, 256, 512), (64, 192, 256)):
        a, w = operands(m, n, k, "cpu", gen)
        for variant in args.variants.split(","):
            if variant.startswith("gluon"):   # not in the interpreter: tests/bench/test_fp8_blockwise_gluon.py
                continue                         # compiles them
            for tile in ((64, 128, 128, 1, 4), (64, 64, 128, 1, 4)):
                err, call = check(variant, a, w, tile, num_programs=3)
                print(f"{m}x{n}x{k} {variant} {tile[:2]}: {err}")
                if call is None:
                    failures.append((m, n, k, variant, err))
    if failures:
        raise SystemExit(f"variants failed their check: {failures}")


def gpu_bench(args):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch.nn.functional as F
    from fp8_gemm import gemms, plan_for
    from overlap_tp import OverlapConfig
    from overlap_tp.bench.gemm import interleaved
    from overlap_tp.kernels.fp8_gemm import fp8_signaled_gemm
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    tiles = [parse_tile(t) for t in args.tiles.split(",")]
    programs_per_sm = [int(p) for p in args.programs_per_sm.split(",")]
    commit = os.environ.get("OVERLAP_TP_GIT_COMMIT", "unknown")
    card = torch.cuda.get_device_name(0)
    date = datetime.date.today().isoformat()
    record = f"benchmarks/fp8-gemm_{card.split()[1].lower() if len(card.split()) > 1 else card}x1_{date}.md"
    rows, lines = [], []
    os.makedirs(args.out, exist_ok=True)
    # a GEMM's rows once it is timed, appended (several runs, e.g. one per variant, fill one file)
    jsonl = open(os.path.join(args.out, "fp8_blockwise_variants.jsonl"), "a")
    for layer in args.layers.split(","):
        for tp in (int(t) for t in args.tp.split(",")):
            m = int(args.seq)
            for name, _, gm, gn, gk in gemms(layer, m, tp, ("fwd", "dgrad")):
                a, w = operands(gm, gn, gk, "cuda", gen)
                out = torch.empty(gm, gn, device="cuda", dtype=torch.bfloat16)
                cublas = lambda a=a, w=w, out=out: out.copy_(F.scaled_mm(   # noqa: E731
                    a.q, w.q.t(), Q.scale_view_1x128(a.ds), F.ScalingType.BlockWise1x128, Q.scale_view_128x128(w.ds),
                    F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16))
                calls, labels = [cublas], ["cuBLAS blockwise"]
                for tile, per_sm in ((tile, per_sm) for tile in tiles for per_sm in programs_per_sm):
                    bm, bn, bk, stages, warps = tile
                    if per_sm > 1 and bm * bn > 64 * 128:   # two CTAs of a larger tile: over the 64K registers
                        continue
                    config = OverlapConfig(method="signal", block_m=bm, block_n=bn, block_k=bk, num_stages=stages,
                                           num_warps=warps, tile_by_shape=False, comm_sms=0)
                    plan_tiles = plan_for("plain", gm, gn, gk, 1, config)[0]
                    label = f"{args_label(tile)} x{per_sm}"

                    def library(a=a, w=w, out=out, plan_tiles=plan_tiles, config=config, programs=sms * per_sm):
                        fp8_signaled_gemm(a, w, out, plan_tiles, None, programs, config)
                    if bn <= 128:   # the library's blockwise tiles (wider ones hold two accumulators of 128 x 256)
                        calls.append(library)
                        labels.append(f"library {label}")
                    for variant in args.variants.split(","):
                        err, call = check(variant, a, w, tile, sms * per_sm, plan_tiles)
                        if call is None:
                            lines.append(f"{layer} t{tp} {name} {variant} {label}: {err}")
                            print(lines[-1], flush=True)
                            continue
                        calls.append(call)
                        labels.append(f"{variant} {label}")
                times = [statistics.median(r) for r in interleaved(calls, [()], args.rounds, args.reps)]
                base = times[0]
                for label, ms in zip(labels, times):
                    tile = parse_tile(label.split()[-2]) if label != "cuBLAS blockwise" else None
                    rate = operand_bytes(gm, gn, gk, tile) / ms / 1e9 if tile else None
                    lines.append(f"{layer} t{tp} {name} [{gm}x{gn}x{gk}] {label}: {ms:.3f} ms, "
                                 f"{base / ms:.3f} of cuBLAS" + (f", operands {rate:.1f} TB/s" if rate else ""))
                    rows.append(dict(date=date, commit=commit, cards=f"1x {card}", t=tp,
                                     what=f"kernel fp8 blockwise {layer} {name} s{m}", config={"variant": label},
                                     metric="ms", value=round(ms, 4), vs_cublas=round(base / ms, 4),
                                     operand_tb_s=round(rate, 2) if rate else None, record=record, logs=[]))
                    jsonl.write(json.dumps(rows[-1]) + "\n")
                jsonl.flush()
                print("\n".join(lines[-len(labels):]), flush=True)   # the failed checks printed as they ran
    jsonl.close()
    by_label = {}
    for row in rows:
        by_label.setdefault(row["config"]["variant"], []).append(row["vs_cublas"])
    print("median of cuBLAS blockwise's time over each variant's:")
    for label, ratios in by_label.items():
        print(f"  {label}: {statistics.median(ratios):.3f} over {len(ratios)} GEMMs")


def operand_bytes(m, n, k, tile):
    """The FP8 operand bytes a kernel with output tile BM x BN loads (every tile reads its BM rows of A and BN rows
    of W over the whole K, one byte each; scales left out): the traffic from L2 into shared memory, which bounds a
    tile's speed by L2's bandwidth whatever its main loop does (2 BM BN / (BM + BN) flops per byte)."""
    bm, bn = tile[0], tile[1]
    return -(-m // bm) * -(-n // bn) * (bm + bn) * k


def args_label(tile):
    bm, bn, bk, stages, warps = tile
    return f"{bm}x{bn}x{bk}/{stages}/{warps}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="rowscale,gluon,gluon-ws")
    p.add_argument("--tiles", default="64x128x128/3/4,64x128x128/4/4,128x128x128/4/8,128x128x128/6/8,"
                                      "128x256x128/4/4", help="BMxBNxBK/stages/warps, comma list")
    p.add_argument("--programs-per-sm", default="1,2",
                   help="persistent programs per SM, comma list: 2 lets two CTAs share an SM where registers and "
                        "shared memory allow, so one's promotion runs while the other's MMAs do (tiles up to 64x128: "
                        "two CTAs of a larger tile need more than the SM's 64K registers)")
    p.add_argument("--layers", default="l8b")
    p.add_argument("--tp", default="2")
    p.add_argument("--seq", default="8192")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    p.add_argument("--cpu", action="store_true", help="the check alone, in Triton's CPU interpreter, small shapes")
    args = p.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {sorted(VARIANTS)}")
    cpu_check(args) if args.cpu else gpu_bench(args)


if __name__ == "__main__":
    main()
