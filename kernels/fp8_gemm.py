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
  sw[k, cols][None, :], sw of a column being its 128x128 block's (or, for 1x128 w, its row's) scale; a tile no
  wider than 128 lies in one 128x128 block (tiles start at multiples of BLOCK_N), so its weight scale is one scalar
  per K step and the promotion one multiply-add per element: acc += dot(...) * (sa * sw)[:, None]. `a.ds` is
  stored [K/128, M], or for a gathered A [G, K/128, M/G]: every shard's scales as its rank quantized them, stacked
  (fp8_quant's layouts), so an AllGather moves them as they are. A row's scales are found from its shard,
  row // (M/G), once per tile; G = 1 is the plain layout.
Then bias (bf16, on source rows [bias_row_lo, bias_row_hi) only), the bf16 store, the signal.

Not served here: the row-tile tables of the grouped expert GEMMs (ROW_TILES) and the transposed-weight view (W_KN:
an FP8 operand is K-major, so a backward GEMM takes the transpose-quantized copy instead; fp8_quant.py).
"""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from overlap_tp.kernels.fp8_quant import BLOCK, ScaledFp8, dequantize_reference, shard_count
from overlap_tp.kernels.signaled_gemm import (INTERPRET, TILE_FIELDS, default_offsets, store_tile_then_signal,
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
    sa_ptr, rows_per_scale,         # tensorwise: sa[row // rows_per_scale]; blockwise: sa stored [G, K/128, M/G]
                                    # (G = M / rows_per_scale; G = 1: [K/128, M])
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
        # blockwise: a row's scales start in its shard's block, K step ks's are ks * M/G (w's: 1 or N) further on
        shard = rows // rows_per_scale
        sa_ptrs = sa_ptr + shard * (k_steps * rows_per_scale) + (rows - shard * rows_per_scale)
        sw_ptrs = sw_ptr + (cols // 128) * sw_ld if W_SCALING == 1 else sw_ptr + cols
        sw_block_ptr = sw_ptr + (col // 128) * sw_ld   # ONE_W_BLOCK: the tile's one weight block row of scales
        for ks in range(k_steps):
            a = a_desc.load([src_row, ks * BLOCK_K])
            w = w_desc.load([col, ks * BLOCK_K])
            if INTERPRETED:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            if A_BLOCKS:
                sa = tl.load(sa_ptrs, mask=rows < M, other=0.0)
                if W_SCALING == 1 and BLOCK_N <= 128:
                    # the tile lies in one 128x128 weight block: one weight scale per K step, so the promotion is
                    # one multiply-add per accumulator element
                    acc += tl.dot(a, w.T) * (sa * tl.load(sw_block_ptr + ks))[:, None]
                else:
                    sw = tl.load(sw_ptrs, mask=cols < N, other=0.0)
                    acc += tl.dot(a, w.T) * sa[:, None] * sw[None, :]
                    sw_ptrs += 1 if W_SCALING == 1 else N
                sa_ptrs += rows_per_scale
            else:
                acc = tl.dot(a, w.T, acc)
        if not A_BLOCKS:
            sa = tl.load(sa_ptr + shard, mask=rows < M, other=0.0)
            acc = acc * (sa * tl.load(sw_ptr))[:, None]

        col = tl.multiple_of(col, BLOCK_N)
        dst_col = tl.multiple_of(dst_col, BLOCK_N)
        store_tile_then_signal(acc, rows, cols, src_row_end, N, dst_base, ld_dst, dst_row, dst_col,
                               bias_ptr, bias_row_lo, bias_row_hi, counters_ptr, group,
                               HAS_BIAS, SIGNAL, INTERPRETED, BLOCK_M, BLOCK_N)


def check_scaled_operands(a: ScaledFp8, w: ScaledFp8, bias=None):
    """What C = (A * sa) @ (W * sw).T needs of its operands, whoever multiplies them (this kernel or torch's scaled_mm):
    ScaledFp8 a[M, K] and w[N, K], FP8, row-major with K contiguous, on one device, a scaling pair the kernel serves
    (SCALINGS) with the scales in its layouts (fp8_quant; a's may be a gathered operand's G shards'); a ValueError names
    the broken constraint."""
    if not isinstance(a, ScaledFp8) or not isinstance(w, ScaledFp8):
        raise ValueError(f"FP8 operands are ScaledFp8 (q, ds, scaling), both of them; got {type(a).__name__} and "
                         f"{type(w).__name__}")
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
    pair = (a.scaling, w.scaling)
    if pair not in SCALINGS:
        raise ValueError(f"unsupported scaling pair {pair}: expected one of {sorted(SCALINGS)}")
    if pair[0] == "tensorwise":
        groups = a.ds.numel()
        if w.ds.numel() != 1 or groups < 1 or m % groups:
            raise ValueError(f"tensorwise: w needs one scale and a one scale per M/G rows (M % G == 0); got "
                             f"{w.ds.numel()} and {groups} for M={m}")
    else:
        if k % BLOCK:
            raise ValueError(f"blockwise scaling promotes per {BLOCK} of K: needs K % {BLOCK} == 0; got K={k}")
        groups = shard_count(a)
        plain = (k // BLOCK, m) if a.ds.dim() == 2 else (groups, k // BLOCK, m // groups)
        if tuple(a.ds.shape) != plain or m % groups or not a.ds.is_contiguous():
            raise ValueError(f"a's 1x128 scales must be stored [K/128, M] = [{k // BLOCK}, {m}] (or a gathered a's "
                             f"[G, K/128, M/G], M % G == 0); got {tuple(a.ds.shape)} strides {a.ds.stride()}")
        want = (-(-n // BLOCK), -(-(k // BLOCK) // 4) * 4) if pair[1] == "128x128" else (k // BLOCK, n)
        if tuple(w.ds.shape) != want or not w.ds.is_contiguous():
            raise ValueError(f"w's {pair[1]} scales must be stored {list(want)}; got {tuple(w.ds.shape)}")
    for s in (a.ds, w.ds):
        if s.dtype != torch.float32 or s.device != qa.device:
            raise ValueError(f"scales must be fp32 on {qa.device}; got {s.dtype} on {s.device}")
    if bias is not None and (bias.shape != (n,) or bias.device != qa.device or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{n}] tensor on {qa.device}; got {tuple(bias.shape)}")


def check_fp8_operands(a: ScaledFp8, w: ScaledFp8, config, bias=None):
    """The kernel's input contract: check_scaled_operands, and what TMA and the K loop add (K % 16, 16-byte aligned
    operands, block_k = 128 for blockwise scaling); a ValueError names the broken constraint."""
    check_scaled_operands(a, w, bias)
    k = a.q.shape[1]
    if k % 16 or a.q.data_ptr() % 16 or w.q.data_ptr() % 16:
        raise ValueError(f"TMA needs K % 16 == 0 (16-byte FP8 rows) and 16-byte aligned operands; got K={k}")
    if a.scaling != "tensorwise" and config.block_k != BLOCK:
        raise ValueError(f"blockwise scaling promotes per {BLOCK} of K: needs block_k == {BLOCK}; got "
                         f"block_k={config.block_k}")


def _check_dst(dst):
    if dst.dtype not in (torch.bfloat16, torch.float16) or dst.stride(1) != 1:
        raise ValueError(f"dst must be a bf16 / fp16 matrix with unit column stride; got {dst.dtype}, "
                         f"strides {dst.stride()}")


def fp8_signaled_gemm(a: ScaledFp8, w: ScaledFp8, dst, tiles, counters, num_programs, config, bias=None,
                      bias_rows=(0, 0), dst_offsets=None, flags=None, wait_target=0):
    """Launch the kernel through Triton's JIT: the tiles of `tiles` (an expanded device int32 table) into `dst` (or,
    by DST_BUF b, into the buffer dst_offsets[b] elements away), raising `counters` (unless None); with `flags`, a
    tile whose WAIT field is f >= 0 first waits until flags[f] reaches wait_target. Returns the compiled kernel."""
    check_fp8_operands(a, w, config, bias)
    _check_dst(dst)
    assert tiles.dim() == 2 and tiles.shape[1] == TILE_FIELDS and tiles.dtype == torch.int32
    return _launch(a, w, dst, tiles, counters, num_programs, config, bias, bias_rows, dst_offsets, flags, wait_target)


def _launch(a, w, dst, tiles, counters, num_programs, config, bias, bias_rows, dst_offsets, flags, wait_target):
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
        a.ds, m // shard_count(a), w.ds, w.ds.shape[1] if w_scaling == 1 else 0,
        m, n, k,
        HAS_BIAS=bias is not None, SIGNAL=counters is not None, WAIT=flags is not None, INTERPRETED=INTERPRET,
        A_BLOCKS=a_blocks, W_SCALING=w_scaling, TILE_FIELDS=TILE_FIELDS,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NUM_PROGRAMS=grid,
        num_stages=config.num_stages, num_warps=config.num_warps)


class Fp8SignaledGemm:
    """The FP8 GEMM of one plan: what SignaledGemm is for the bf16 kernel (the same constructor and call), launched
    through Triton's JIT (tens of microseconds of host time per launch; captured CUDA graphs hide it).
    launch_checked(a, w, dst, bias): a call whose operands the plan has checked (OpPlan.check_call and the plan's
    build: shapes, formats, scale layouts, block_k) and whose dst the plan made, so only the launch remains."""

    def __init__(self, tiles, num_programs, config, *, counters=None, bias_rows=(0, 0), dst_offsets=None, flags=None,
                 wait_target=0):
        self.tiles, self.num_programs, self.config = tiles, num_programs, config
        self.counters, self.bias_rows, self.dst_offsets = counters, bias_rows, dst_offsets
        self.flags, self.wait_target = flags, wait_target

    def __call__(self, a: ScaledFp8, w: ScaledFp8, dst, bias=None):
        fp8_signaled_gemm(a, w, dst, self.tiles, self.counters, self.num_programs, self.config, bias, self.bias_rows,
                          self.dst_offsets, self.flags, self.wait_target)

    def launch_checked(self, a: ScaledFp8, w: ScaledFp8, dst, bias=None):
        _launch(a, w, dst, self.tiles, self.counters, self.num_programs, self.config, bias, self.bias_rows,
                self.dst_offsets, self.flags, self.wait_target)


def fp8_gemm_reference(a: ScaledFp8, w: ScaledFp8, bias=None) -> torch.Tensor:
    """float64 (A * sa) @ (W * sw).T (+ bias) of the dequantized operands: the reference every variant is checked
    against (a gathered a's G shards each with their own scales)."""
    out = dequantize_reference(a) @ dequantize_reference(w).t()
    return out + bias.double() if bias is not None else out
