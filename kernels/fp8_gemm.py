"""The signaled persistent GEMM with FP8 operands: C = (A * sa) @ (W * sw).T in bf16, A [M, K] and W [N, K] FP8, both
K-major (row-major with K contiguous: what Hopper's FP8 wgmma reads).

It walks the same tile tables as the bf16 kernel (kernels/signaled_gemm.py: the fields SRC_ROW .. EXPERT of an
expanded table, one row per tile in execution order, built by overlap_tp/ops/tile_plan.py), stores each tile the same
way (into the staging matrix or, by DST_BUF, into a peer's buffer at its offset), and synchronises the same way: the
producer signal (the CTA's stores, bar.sync, one gpu-scope release atomic on the tile's group counter) and the
consumer's in-kernel wait (acquire spin on the tile's ready flag, then fence.proxy.async before the TMA loads), the
very jit functions of the bf16 kernel, so the ordering arguments written there hold here word for word. Only the
main loop and the first step of the epilogue differ:

- tensorwise (a and w scaled "tensorwise", kernels/fp8_quant.py): the K loop accumulates fp8 x fp8 products in fp32
  (acc = dot(a, w.T, acc)); the epilogue multiplies by sa[row] * sw. `a.ds` holds one scale or G scales, one per
  M/G consecutive rows: the gathered A of an AllGather+GEMM whose shards were each quantized on their own rank with
  their own amax (no collective for a global amax).
- blockwise (a "1x128"; w "128x128" or "1x128"): BLOCK_K = 128, and each K step's product is promoted into the fp32
  accumulator with its scales (FP32 promotion per 128 of K): acc += dot(a_blk, w_blk.T) * sa[rows, k][:, None] *
  sw[k, cols][None, :], sw of a column being its 128x128 block's (or, for 1x128 w, its row's) scale.
Then bias (bf16, on source rows [bias_row_lo, bias_row_hi) only), the bf16 store, the signal.

Not served here: the row-tile tables of the grouped expert GEMMs (ROW_TILES) and the transposed-weight view (W_KN:
an FP8 operand is K-major, so a backward GEMM takes the transpose-quantized copy instead; fp8_quant.py).
"""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from overlap_tp.kernels.fp8_quant import BLOCK, ScaledFp8, dequantize_reference
from overlap_tp.kernels.signaled_gemm import (INTERPRET, TILE_FIELDS, cta_barrier_then, default_offsets,
                                              wait_flag_then)

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# the scaled operands this kernel multiplies: (a's scaling, w's scaling) -> (A_BLOCKS, W_SCALING)
SCALINGS = {("tensorwise", "tensorwise"): (False, 0), ("1x128", "128x128"): (True, 1), ("1x128", "1x128"): (True, 2)}


@triton.jit(do_not_specialize=("bias_row_lo", "bias_row_hi", "num_tiles", "wait_target"))
def fp8_signaled_gemm_kernel(
    a_desc, w_desc,                 # TMA descriptors: A [M, K] in [BLOCK_M, BLOCK_K] boxes, W [N, K] in [BLOCK_N, BLOCK_K]
    dst_ptr, ld_dst, dst_offsets_ptr,
    bias_ptr, bias_row_lo, bias_row_hi,
    tiles_ptr, num_tiles,           # an expanded plan table (signaled_gemm.py's fields) and its tiles
    counters_ptr, flags_ptr, wait_target,
    sa_ptr, rows_per_scale,         # tensorwise: sa[row // rows_per_scale]; blockwise: sa stored [K/128, M]
    sw_ptr, sw_ld,                  # tensorwise: sw[0]; 128x128: stored [ceil(N/128), sw_ld]; 1x128: [K/128, N]
    M, N, K,
    HAS_BIAS: tl.constexpr, SIGNAL: tl.constexpr, WAIT: tl.constexpr, INTERPRETED: tl.constexpr,
    A_BLOCKS: tl.constexpr,         # a scaled 1x128 (else tensorwise)
    W_SCALING: tl.constexpr,        # 0 tensorwise, 1 128x128, 2 1x128
    TILE_FIELDS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
):
    k_steps = tl.cdiv(K, BLOCK_K)
    for e in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=True):
        entry = tiles_ptr + e * TILE_FIELDS
        src_row = tl.load(entry + 0)
        src_row_end = tl.load(entry + 1)
        col = tl.load(entry + 2)
        dst_row = tl.load(entry + 3)
        dst_col = tl.load(entry + 4)
        group = tl.load(entry + 5)
        dst_base = dst_ptr + tl.multiple_of(tl.load(dst_offsets_ptr + tl.load(entry + 6)), 16)

        if WAIT:
            flag = tl.load(entry + 7)
            if flag >= 0:
                src_row = wait_flag_then(flags_ptr, flag, wait_target, src_row, INTERPRETED)

        rows = src_row + tl.arange(0, BLOCK_M)
        cols = col + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        sa_ptrs = sa_ptr + rows                    # blockwise: K step ks's scales are ks * M (or N) further on
        sw_ptrs = sw_ptr + (cols // 128) * sw_ld if W_SCALING == 1 else sw_ptr + cols
        for ks in range(k_steps):
            a = a_desc.load([src_row, ks * BLOCK_K])
            w = w_desc.load([col, ks * BLOCK_K])
            if INTERPRETED:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            if A_BLOCKS:
                sa = tl.load(sa_ptrs, mask=rows < M, other=0.0)
                sw = tl.load(sw_ptrs, mask=cols < N, other=0.0)
                acc += tl.dot(a, w.T) * sa[:, None] * sw[None, :]
                sa_ptrs += M
                sw_ptrs += 1 if W_SCALING == 1 else N
            else:
                acc = tl.dot(a, w.T, acc)
        if not A_BLOCKS:
            sa = tl.load(sa_ptr + rows // rows_per_scale, mask=rows < M, other=0.0)
            acc = acc * (sa * tl.load(sw_ptr))[:, None]

        col = tl.multiple_of(col, BLOCK_N)
        dst_col = tl.multiple_of(dst_col, BLOCK_N)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
            owns = (rows >= bias_row_lo) & (rows < bias_row_hi)
            acc += tl.where(owns[:, None], bias[None, :], 0.0)
        mask = (rows < src_row_end)[:, None] & (cols < N)[None, :]
        out_rows = (dst_row + tl.arange(0, BLOCK_M)).to(tl.int64)
        out_cols = dst_col + tl.arange(0, BLOCK_N)
        tl.store(dst_base + out_rows[:, None] * ld_dst + out_cols[None, :],
                 acc.to(dst_ptr.dtype.element_ty), mask=mask)
        if SIGNAL:
            if INTERPRETED:
                tl.debug_barrier()
            else:
                group = cta_barrier_then(group)
            tl.atomic_add(counters_ptr + group, 1, sem="release", scope="gpu")


def check_fp8_operands(a: ScaledFp8, w: ScaledFp8, config, bias=None):
    """The kernel's input contract; a ValueError names the broken constraint."""
    qa, qw = a.q, w.q
    if qa.dim() != 2 or qw.dim() != 2:
        raise ValueError(f"expected a[M, K] and w[N, K]; got a{tuple(qa.shape)} and w{tuple(qw.shape)}")
    m, k = qa.shape
    n = qw.shape[0]
    if qw.shape[1] != k:
        raise ValueError(f"inner dimensions differ: a{tuple(qa.shape)} @ w{tuple(qw.shape)}.T")
    if qa.dtype not in FP8_DTYPES or qw.dtype not in FP8_DTYPES:
        raise ValueError(f"a and w must be float8_e4m3fn or float8_e5m2; got {qa.dtype} and {qw.dtype}")
    if not qa.is_contiguous() or not qw.is_contiguous():
        raise ValueError("FP8 a and w must both be row-major with K contiguous (K-major, as FP8 wgmma reads them); "
                         "quantize a transposed copy (fp8_quant.quantize_1x128_transposed / transposed=True)")
    if qa.device != qw.device:
        raise ValueError(f"a is on {qa.device} but w is on {qw.device}")
    if k % 16 or qa.data_ptr() % 16 or qw.data_ptr() % 16:
        raise ValueError(f"TMA needs K % 16 == 0 (16-byte FP8 rows) and 16-byte aligned operands; got K={k}")
    pair = (a.scaling, w.scaling)
    if pair not in SCALINGS:
        raise ValueError(f"unsupported scaling pair {pair}: expected one of {sorted(SCALINGS)}")
    if pair[0] == "tensorwise":
        groups = a.ds.numel()
        if w.ds.numel() != 1 or groups < 1 or m % groups:
            raise ValueError(f"tensorwise: w needs one scale and a one scale per M/G rows (M % G == 0); got "
                             f"{w.ds.numel()} and {groups} for M={m}")
    else:
        if k % BLOCK or config.block_k != BLOCK:
            raise ValueError(f"blockwise scaling promotes per {BLOCK} of K: needs K % {BLOCK} == 0 and "
                             f"block_k == {BLOCK}; got K={k}, block_k={config.block_k}")
        if tuple(a.ds.shape) != (k // BLOCK, m) or not a.ds.is_contiguous():
            raise ValueError(f"a's 1x128 scales must be stored [K/128, M] = [{k // BLOCK}, {m}]; got "
                             f"{tuple(a.ds.shape)} strides {a.ds.stride()}")
        want = (-(-n // BLOCK), -(-(k // BLOCK) // 4) * 4) if pair[1] == "128x128" else (k // BLOCK, n)
        if tuple(w.ds.shape) != want or not w.ds.is_contiguous():
            raise ValueError(f"w's {pair[1]} scales must be stored {list(want)}; got {tuple(w.ds.shape)}")
    for s in (a.ds, w.ds):
        if s.dtype != torch.float32 or s.device != qa.device:
            raise ValueError(f"scales must be fp32 on {qa.device}; got {s.dtype} on {s.device}")
    if bias is not None and (bias.shape != (n,) or bias.device != qa.device or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{n}] tensor on {qa.device}; got {tuple(bias.shape)}")


def fp8_signaled_gemm(a: ScaledFp8, w: ScaledFp8, dst, tiles, counters, num_programs, config, bias=None,
                      bias_rows=(0, 0), dst_offsets=None, flags=None, wait_target=0):
    """Launch the kernel through Triton's JIT: the tiles of `tiles` (an expanded device int32 table) into `dst` (or,
    by DST_BUF b, into the buffer dst_offsets[b] elements away), raising `counters` (unless None); with `flags`, a
    tile whose WAIT field is f >= 0 first waits until flags[f] reaches wait_target. Returns the compiled kernel."""
    check_fp8_operands(a, w, config, bias)
    if dst.dtype not in (torch.bfloat16, torch.float16) or dst.stride(1) != 1:
        raise ValueError(f"dst must be a bf16 / fp16 matrix with unit column stride; got {dst.dtype}, "
                         f"strides {dst.stride()}")
    assert tiles.dim() == 2 and tiles.shape[1] == TILE_FIELDS and tiles.dtype == torch.int32
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    (m, k), n = a.q.shape, w.q.shape[0]
    a_blocks, w_scaling = SCALINGS[(a.scaling, w.scaling)]
    num_tiles = tiles.shape[0]
    grid = max(1, min(num_programs, num_tiles))
    return fp8_signaled_gemm_kernel[(grid,)](
        TensorDescriptor.from_tensor(a.q, [bm, bk]), TensorDescriptor.from_tensor(w.q, [bn, bk]),
        dst, dst.stride(0), dst_offsets if dst_offsets is not None else default_offsets(dst.device),
        bias if bias is not None else dst, bias_rows[0], bias_rows[1],
        tiles, num_tiles, counters if counters is not None else tiles, flags if flags is not None else tiles,
        wait_target,
        a.ds, m // a.ds.numel() if not a_blocks else 1, w.ds, w.ds.shape[1] if w_scaling == 1 else 0,
        m, n, k,
        HAS_BIAS=bias is not None, SIGNAL=counters is not None, WAIT=flags is not None, INTERPRETED=INTERPRET,
        A_BLOCKS=a_blocks, W_SCALING=w_scaling, TILE_FIELDS=TILE_FIELDS,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NUM_PROGRAMS=grid,
        num_stages=config.num_stages, num_warps=config.num_warps)


def fp8_gemm_reference(a: ScaledFp8, w: ScaledFp8, bias=None) -> torch.Tensor:
    """float64 (A * sa) @ (W * sw).T (+ bias) of the dequantized operands: the reference every variant is checked
    against (a's tensorwise G scales apply to M/G rows each)."""
    if a.scaling == "tensorwise" and a.ds.numel() > 1:
        g = a.ds.numel()
        qa = a.q.double().reshape(g, -1, a.q.shape[1]) * a.ds.double().reshape(g, 1, 1)
        da = qa.reshape(a.q.shape)
    else:
        da = dequantize_reference(a)
    out = da @ dequantize_reference(w).t()
    return out + bias.double() if bias is not None else out
