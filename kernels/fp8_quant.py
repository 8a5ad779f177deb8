"""FP8 quantizers: per-tensor current scaling, blockwise 1x128 and 128x128, their pure-torch references, and the
Triton kernels (including the transpose-quantize that produces a K-major operand for dgrad / wgrad).

Formats. "e4m3" is torch.float8_e4m3fn (largest finite 448), the format of every forward operand; "e5m2" is
torch.float8_e5m2 (largest finite 57344), the gradients' format under the `hybrid` recipe.

Scales. Every quantized block has one amax (the largest |x| of the block) and two fp32 scales:

    qs = fp8_max / amax   (correctly rounded fp32 division; at most FLT_MAX)   the quantizing scale
    ds = 1 / qs           (correctly rounded fp32 division)                    the dequantizing scale
    q  = fp8(clamp(fp32(x * qs), -fp8_max, fp8_max))                           round to nearest even

so x ~= q * ds. Only ds is stored: it is the scale torch's `_scaled_mm` / `scaled_mm` and the FP8 GEMM
(fp8_gemm.py) multiply by. Edge cases, stated:
- amax == 0 (an all-zero block): qs = ds = 1, q = 0.
- a tiny amax (fp8_max / amax above FLT_MAX): qs = FLT_MAX; the block then dequantizes with ds = 1 / FLT_MAX.
- inf or NaN anywhere in the block (amax is then taken as inf): qs = ds = NaN and every q of the block is NaN, so the
  GEMM's outputs that read the block are NaN, as a bf16 GEMM's would turn inf / NaN: nothing is silently clipped.

Layouts (those of torch.nn.functional.scaled_mm's ScalingType.TensorWise / BlockWise1x128 / BlockWise128x128 for
C = A @ B with A [M, K] row-major and B = W.t(), W [N, K] row-major; torch's meta checks `_check_scaled_mm_sizes_v2`):
- tensorwise: ds is a one-element fp32 tensor.
- 1x128 of x [R, C] (one scale per row per 128 of C; C % 128 == 0): ds is the [R, C/128] view with strides (1, R),
  i.e. stored as [C/128, R] row-major ("outer-dim major"); `ds[r, j]` scales x[r, 128j:128j+128].
- 128x128 of w [R, C] (one scale per 128 x 128 block; C % 128 == 0, R any): stored as [ceil(R/128), L4] row-major,
  L4 = ceil(C/128) rounded up to a multiple of 4 (padding columns 1.0), and handed to torch as the [L4, ceil(R/128)]
  view with strides (1, L4); `storage[i, j]` scales w[128i:128i+128, 128j:128j+128].
`ScaledFp8` carries q with its ds in these layouts.
- a gathered operand (the AllGather of G row shards [R/G, C], each quantized on its own rank with its own scales):
  the shards' scales stacked in shard order, each in its own layout: tensorwise ds [G] (one scale per R/G rows),
  1x128 ds [G, C/128, R/G]. `shards(x)` splits it back into G operands of the layouts above; torch's scaled_mm
  takes each shard on its own.

K-major operands. Hopper's FP8 wgmma reads both operands K-major, so a backward GEMM contracting over the rows of
x (wgrad: dW = dY.T @ X, over the tokens) needs x transposed before it is quantized: `quantize_1x128_transposed(x)`
writes q of x.T [C, R] with 1x128 blocks along R (bit-equal to `quantize_1x128(x.t().contiguous())`), and
`quantize_128x128(w, transposed=True)` also writes w.T's q and scales (128x128 blocks are the same blocks
transposed, so the values are the same bits). `quantize_tensorwise(x, transposed=True)` likewise, and
`quantize_tensorwise_transposed(x)` writes x.T's q alone.

References (`*_reference`) compute in float64 where a value is exact there and round exactly where the kernels round
in fp32 (the product x * qs is exact in float64 and is then rounded to fp32, the fp32 divisions likewise), so a
kernel's q and ds are bit-equal to its reference (on the GPU through the GPU's conversion, in the CPU interpreter
through `_interpreted_cast`).
"""
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from overlap_tp.kernels.signaled_gemm import INTERPRET

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# the smallest normal magnitude of each format (below it the format is subnormal)
FP8_MIN_NORMAL = {torch.float8_e4m3fn: 2.0 ** -6, torch.float8_e5m2: 2.0 ** -14}
FLT_MAX = torch.finfo(torch.float32).max
BLOCK = 128   # the blockwise recipe's block edge (1x128 and 128x128)
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INTERPRETED = tl.constexpr(INTERPRET)


class ScaledFp8(NamedTuple):
    """An FP8 tensor and its dequantizing scales: x ~= q * ds, ds in the layout of `scaling` (module docstring)."""
    q: torch.Tensor
    ds: torch.Tensor
    scaling: str   # "tensorwise" | "1x128" | "128x128"


def fp8_dtype(fmt) -> torch.dtype:
    """torch's dtype of a format name ("e4m3", "e5m2") or of an fp8 dtype; a ValueError for anything else."""
    if fmt in FP8_MAX:
        return fmt
    if fmt not in FORMATS:
        raise ValueError(f"unknown FP8 format {fmt!r}: expected one of {sorted(FORMATS)}")
    return FORMATS[fmt]


def padded_k_blocks(cols: int) -> int:
    """L4: the 128x128 scale storage's row length, ceil(cols / 128) rounded up to a multiple of 4."""
    return -(-(-(-cols // BLOCK)) // 4) * 4


def scale_view_1x128(storage: torch.Tensor) -> torch.Tensor:
    """The [R, C/128] view (strides (1, R)) of 1x128 scales stored as [C/128, R]: what scaled_mm takes."""
    return storage.t()


def scale_view_128x128(storage: torch.Tensor) -> torch.Tensor:
    """The [L4, ceil(R/128)] view (strides (1, L4)) of 128x128 scales stored as [ceil(R/128), L4]: what scaled_mm
    takes."""
    return storage.t()


# ----------------------------------------------------------------------------------------------
# pure-torch references
# ----------------------------------------------------------------------------------------------

def scales_from_amax_reference(amax: torch.Tensor, dtype: torch.dtype):
    """(qs, ds) fp32 of each amax (any shape), by the module's rules."""
    fmax = FP8_MAX[dtype]
    amax = amax.double()
    finite = torch.isfinite(amax)
    # fp8_max / amax rounded to fp32 once (float64 division of two fp32 values, then one rounding, is the correctly
    # rounded fp32 quotient: 53 >= 2 * 24 + 2 bits)
    qs = (fmax / torch.where(amax > 0, amax, 1.0)).float()
    qs = torch.where(qs > FLT_MAX, torch.tensor(FLT_MAX), qs)   # an inf quotient (overflow) is clamped too
    qs = torch.where(amax == 0, torch.tensor(1.0), qs)
    qs = torch.where(finite, qs, torch.tensor(float("nan")))
    ds = (1.0 / qs.double()).float()
    return qs, ds


def _amax_reference(x: torch.Tensor, dim=None):
    """max |x| (inf where a NaN or inf is present), over `dim` or the whole tensor."""
    ax = x.double().abs()
    ax = torch.where(torch.isnan(ax), torch.tensor(float("inf"), dtype=torch.float64), ax)
    return ax.amax() if dim is None else ax.amax(dim=dim)


def _cast_reference(x: torch.Tensor, qs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8(clamp(fp32(x * qs))) with qs broadcast against x; NaN stays NaN."""
    fmax = FP8_MAX[dtype]
    y = (x.double() * qs.double()).float()   # exact in float64, rounded to fp32 as the kernels' multiply
    y = torch.where(torch.isnan(y), y, y.clamp(-fmax, fmax))
    return y.to(dtype)


def quantize_tensorwise_reference(x: torch.Tensor, fmt="e4m3") -> ScaledFp8:
    """One scale for all of x (per-tensor current scaling)."""
    dtype = fp8_dtype(fmt)
    qs, ds = scales_from_amax_reference(_amax_reference(x), dtype)
    return ScaledFp8(_cast_reference(x, qs, dtype), ds.reshape(1), "tensorwise")


def quantize_1x128_reference(x: torch.Tensor, fmt="e4m3") -> ScaledFp8:
    """One scale per row per 128 columns of x [R, C]; ds stored [C/128, R] (module docstring)."""
    dtype = fp8_dtype(fmt)
    check_blockwise(x, "1x128")
    r, c = x.shape
    blocks = x.reshape(r, c // BLOCK, BLOCK)
    qs, ds = scales_from_amax_reference(_amax_reference(blocks, dim=2), dtype)   # [R, C/128]
    q = _cast_reference(blocks, qs[:, :, None], dtype).reshape(r, c)
    return ScaledFp8(q, ds.t().contiguous(), "1x128")


def quantize_128x128_reference(w: torch.Tensor, fmt="e4m3") -> ScaledFp8:
    """One scale per 128 x 128 block of w [R, C]; ds stored [ceil(R/128), L4], padding 1.0 (module docstring)."""
    dtype = fp8_dtype(fmt)
    check_blockwise(w, "128x128")
    r, c = w.shape
    rb, cb = -(-r // BLOCK), c // BLOCK
    padded = torch.zeros(rb * BLOCK, c, dtype=w.dtype, device=w.device)
    padded[:r] = w
    blocks = padded.reshape(rb, BLOCK, cb, BLOCK)
    qs, ds = scales_from_amax_reference(_amax_reference(blocks, dim=(1, 3)), dtype)   # [rb, cb]
    q = _cast_reference(blocks, qs[:, None, :, None], dtype).reshape(rb * BLOCK, c)[:r]
    storage = torch.ones(rb, padded_k_blocks(c), dtype=torch.float32, device=w.device)
    storage[:, :cb] = ds
    return ScaledFp8(q, storage, "128x128")


def shard_count(x: ScaledFp8) -> int:
    """G: how many row shards' scales x carries (1 unless it is a gathered operand: module docstring)."""
    if x.scaling == "tensorwise":
        return x.ds.numel()
    return x.ds.shape[0] if x.scaling == "1x128" and x.ds.dim() == 3 else 1


def is_gathered(x: ScaledFp8) -> bool:
    """Whether x's scales are in the gathered layout (tensorwise [G], G > 1; 1x128 [G, C/128, R/G], G >= 1)."""
    return x.ds.dim() == 3 if x.scaling == "1x128" else x.scaling == "tensorwise" and x.ds.numel() > 1


def shards(x: ScaledFp8) -> list:
    """The G row shards of x, each a ScaledFp8 with its own scales in the plain layout (views, no copy); [x] itself
    where it holds plain scales. A ValueError where the rows do not split into G shards."""
    if not is_gathered(x):
        return [x]
    g, rows = shard_count(x), x.q.shape[0]
    if rows % g:
        raise ValueError(f"{rows} rows do not split into the {g} shards whose scales ds {tuple(x.ds.shape)} holds")
    ds = x.ds.reshape(g, 1) if x.scaling == "tensorwise" else x.ds
    size = rows // g
    return [ScaledFp8(x.q[p * size:(p + 1) * size], ds[p], x.scaling) for p in range(g)]


def dequantize_reference(x: ScaledFp8) -> torch.Tensor:
    """q * ds in float64 (exact): the operand a float64 reference GEMM multiplies (a gathered operand shard by
    shard, each with its own scales)."""
    if is_gathered(x):
        return torch.cat([dequantize_reference(s) for s in shards(x)])
    q = x.q.double()
    r, c = q.shape
    if x.scaling == "tensorwise":
        return q * x.ds.double().reshape(())
    if x.scaling == "1x128":
        return (q.reshape(r, c // BLOCK, BLOCK) * x.ds.double().t()[:, :, None]).reshape(r, c)
    if x.scaling == "128x128":
        ds = x.ds.double()[:, :c // BLOCK].repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        return q * ds[:r]
    raise ValueError(f"unknown scaling {x.scaling!r}")


def check_blockwise(x: torch.Tensor, scaling: str):
    """A blockwise quantizer's input contract; a ValueError names the broken constraint."""
    if x.dim() != 2:
        raise ValueError(f"{scaling} quantization takes a 2-D tensor; got shape {tuple(x.shape)}")
    if x.shape[1] % BLOCK:
        raise ValueError(f"{scaling} quantization needs the columns (the GEMM's K) to be a multiple of {BLOCK}; "
                         f"got {x.shape[1]}")


def _check_input(x: torch.Tensor):
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"expected a contiguous 2-D tensor; got shape {tuple(x.shape)}, strides {x.stride()}")
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"expected one of {INPUT_DTYPES}; got {x.dtype}")


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def abs_or_inf(x):
    """|x| in fp32, NaN turned into inf (so a block's amax is inf where it holds a NaN)."""
    x = x.to(tl.float32)
    return tl.where(x != x, float("inf"), tl.abs(x))


@triton.jit
def scales_from_amax(amax, FP8_MAX: tl.constexpr):
    """(qs, ds) of an amax (scalar or tensor), by the module's rules."""
    qs = tl.math.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), tl.where(amax > 0, amax, 1.0))
    qs = tl.minimum(qs, 3.4028234663852886e38)
    qs = tl.where(amax == 0, 1.0, qs)
    qs = tl.where(amax == float("inf"), float("nan"), qs)
    ds = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), qs)
    return qs, ds


@triton.jit
def cast_fp8(x, qs, FP8_MAX: tl.constexpr, OUT: tl.constexpr):
    """fp8(clamp(fp32(x * qs))), NaN kept: the explicit clamp is the saturation (the GPU's cvt.rn.satfinite would
    saturate too; the CPU interpreter would not)."""
    y = x.to(tl.float32) * qs
    y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX))
    if _INTERPRETED:
        q = _interpreted_cast(y, OUT)
    else:
        q = y.to(OUT)
    return q


@triton.jit
def _interpreted_cast(y, OUT: tl.constexpr):
    """The CPU interpreter's fp32 -> fp8 conversion mis-rounds (a carry into the exponent is lost, subnormals are
    flushed, NaN becomes a number), but converts values already on the fp8 grid exactly: so round to the grid first,
    in exact fp32 arithmetic (y / ulp is exact, the magic-number add rounds to nearest even), then convert, and
    write NaN's bits (0x7f in both formats) explicitly. The compiled kernels convert with the GPU's own cvt."""
    if OUT == tl.float8e4nv:
        mant: tl.constexpr = 3
        emin: tl.constexpr = -6
    else:
        mant: tl.constexpr = 2
        emin: tl.constexpr = -14
    e = tl.maximum(((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, emin)
    ulp = ((e - mant + 127) << 23).to(tl.float32, bitcast=True)
    on_grid = ((y / ulp + 12582912.0) - 12582912.0) * ulp
    on_grid = tl.where(on_grid == 0, y * 0.0, on_grid)   # a negative value rounded to zero is -0, as the GPU's
    bits = tl.where(y != y, 0x7F, on_grid.to(OUT).to(tl.uint8, bitcast=True))
    return bits.to(OUT, bitcast=True)


@triton.jit
def _amax_kernel(x_ptr, R, C, amax_ptr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], mask=mask, other=0.0)
    tl.atomic_max(amax_ptr, tl.max(tl.max(abs_or_inf(x), 1), 0))


@triton.jit
def _tensorwise_kernel(x_ptr, R, C, amax_ptr, q_ptr, qt_ptr, ds_ptr, FP8_MAX: tl.constexpr, OUT: tl.constexpr,
                       WRITE_Q: tl.constexpr, WRITE_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], mask=mask, other=0.0)
    qs, ds = scales_from_amax(tl.load(amax_ptr), FP8_MAX)
    q = cast_fp8(x, qs, FP8_MAX, OUT)
    if WRITE_Q:
        tl.store(q_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], q, mask=mask)
    if WRITE_T:
        tl.store(qt_ptr + cols.to(tl.int64)[None, :] * R + rows[:, None], q, mask=mask)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(ds_ptr, ds)


@triton.jit
def _blocks_1x128_kernel(x_ptr, R, C, q_ptr, ds_ptr, FP8_MAX: tl.constexpr, OUT: tl.constexpr,
                         BLOCK_R: tl.constexpr):
    """x [R, C] -> q [R, C], ds stored [C/128, R]: program (i, j) quantizes rows [i*BLOCK_R, ...) x block j."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    j = tl.program_id(1)
    cols = j * 128 + tl.arange(0, 128)
    mask = (rows < R)[:, None]
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    qs, ds = scales_from_amax(tl.max(abs_or_inf(x), 1), FP8_MAX)
    tl.store(q_ptr + offs, cast_fp8(x, qs[:, None], FP8_MAX, OUT), mask=mask)
    tl.store(ds_ptr + j.to(tl.int64) * R + rows, ds, mask=rows < R)


@triton.jit
def _blocks_1x128_transposed_kernel(x_ptr, R, C, qt_ptr, ds_ptr, FP8_MAX: tl.constexpr, OUT: tl.constexpr,
                                    BLOCK_C: tl.constexpr):
    """x [R, C] -> q of x.T [C, R] with 1x128 blocks along R, ds stored [R/128, C]: program (i, j) quantizes the
    128 rows [128i, 128i+128) of x, columns [j*BLOCK_C, ...) (one block of x.T per column)."""
    i = tl.program_id(0)
    rows = i * 128 + tl.arange(0, 128)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (cols < C)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], mask=mask, other=0.0)
    qs, ds = scales_from_amax(tl.max(abs_or_inf(x), 0), FP8_MAX)
    q = cast_fp8(x, qs[None, :], FP8_MAX, OUT)
    tl.store(qt_ptr + cols.to(tl.int64)[None, :] * R + rows[:, None], q, mask=mask)
    tl.store(ds_ptr + i.to(tl.int64) * C + cols, ds, mask=cols < C)


@triton.jit
def _blocks_128x128_kernel(w_ptr, R, C, q_ptr, ds_ptr, L4, qt_ptr, dst_ptr, L4_T,
                           FP8_MAX: tl.constexpr, OUT: tl.constexpr, WRITE_T: tl.constexpr):
    """w [R, C] -> q [R, C], ds stored [ceil(R/128), L4]; with WRITE_T also q of w.T [C, R] and its scales stored
    [C/128, L4_T]: program (i, j) quantizes block (i, j)."""
    i = tl.program_id(0)
    j = tl.program_id(1)
    rows = i * 128 + tl.arange(0, 128)
    cols = j * 128 + tl.arange(0, 128)
    mask = (rows < R)[:, None]
    x = tl.load(w_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], mask=mask, other=0.0)
    qs, ds = scales_from_amax(tl.max(tl.max(abs_or_inf(x), 1), 0), FP8_MAX)
    q = cast_fp8(x, qs, FP8_MAX, OUT)
    tl.store(q_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], q, mask=mask)
    tl.store(ds_ptr + i * L4 + j, ds)
    if WRITE_T:
        tl.store(qt_ptr + cols.to(tl.int64)[None, :] * R + rows[:, None], q, mask=mask)
        tl.store(dst_ptr + j * L4_T + i, ds)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------

_TILE = 64   # rows (or columns) per program of the tensorwise and 1x128 kernels


def quantize_tensorwise(x: torch.Tensor, fmt="e4m3", *, transposed=False, amax: Optional[torch.Tensor] = None,
                        q_out: Optional[torch.Tensor] = None):
    """Per-tensor current scaling of x [R, C]: a pass for the amax (skipped where `amax`, a one-element fp32 tensor
    on x's device, is given: a known or earlier amax), then one quantizing pass. Returns ScaledFp8 of x, or with
    `transposed` a pair (x's, x.T's), both with the same ds. q_out: where x's q goes (a contiguous [R, C] fp8
    tensor of the format), else a new tensor."""
    return _tensorwise(x, fmt, True, transposed, amax, q_out)


def quantize_tensorwise_transposed(x: torch.Tensor, fmt="e4m3") -> ScaledFp8:
    """Per-tensor current scaling of x.T [C, R], read from x [R, C] (an amax pass, then one pass writing x.T's q
    only): the K-major operand of a GEMM contracting over x's rows; equal to quantize_tensorwise(x.t().contiguous())."""
    return _tensorwise(x, fmt, False, True, None, None)[1]


def _tensorwise(x, fmt, rowwise, transposed, amax, q_out):
    _check_input(x)
    dtype = fp8_dtype(fmt)
    r, c = x.shape
    grid = (triton.cdiv(r, _TILE), triton.cdiv(c, _TILE))
    if amax is None:
        amax = torch.zeros(1, dtype=torch.float32, device=x.device)
        _amax_kernel[grid](x, r, c, amax, _TILE, _TILE)
    if q_out is not None and (q_out.shape != (r, c) or q_out.dtype != dtype or not q_out.is_contiguous()
                              or q_out.device != x.device):
        raise ValueError(f"q_out must be a contiguous ({r}, {c}) {dtype} tensor on {x.device}; got {q_out.dtype} "
                         f"{tuple(q_out.shape)} on {q_out.device}")
    q = q_out if q_out is not None else torch.empty(r if rowwise else 0, c, dtype=dtype, device=x.device)
    qt = torch.empty(c, r, dtype=dtype, device=x.device) if transposed else q
    ds = torch.empty(1, dtype=torch.float32, device=x.device)
    _tensorwise_kernel[grid](x, r, c, amax, q, qt, ds, FP8_MAX[dtype], triton_dtype(dtype), rowwise, transposed,
                             _TILE, _TILE)
    out = ScaledFp8(q, ds, "tensorwise")
    return (out, ScaledFp8(qt, ds, "tensorwise")) if transposed else out


def quantize_1x128(x: torch.Tensor, fmt="e4m3") -> ScaledFp8:
    """1x128 blocks of x [R, C] (C % 128 == 0), one pass; ds stored [C/128, R]."""
    _check_input(x)
    check_blockwise(x, "1x128")
    dtype = fp8_dtype(fmt)
    r, c = x.shape
    q = torch.empty(r, c, dtype=dtype, device=x.device)
    ds = torch.empty(c // BLOCK, r, dtype=torch.float32, device=x.device)
    _blocks_1x128_kernel[(triton.cdiv(r, _TILE), c // BLOCK)](x, r, c, q, ds, FP8_MAX[dtype], triton_dtype(dtype),
                                                              _TILE)
    return ScaledFp8(q, ds, "1x128")


def quantize_1x128_transposed(x: torch.Tensor, fmt="e4m3") -> ScaledFp8:
    """1x128 blocks of x.T [C, R] (R % 128 == 0) read from x [R, C] in one pass: the K-major operand of a GEMM
    contracting over x's rows; equal to quantize_1x128(x.t().contiguous())."""
    _check_input(x)
    check_blockwise(x.t(), "1x128")
    dtype = fp8_dtype(fmt)
    r, c = x.shape
    qt = torch.empty(c, r, dtype=dtype, device=x.device)
    ds = torch.empty(r // BLOCK, c, dtype=torch.float32, device=x.device)
    _blocks_1x128_transposed_kernel[(r // BLOCK, triton.cdiv(c, _TILE))](x, r, c, qt, ds, FP8_MAX[dtype],
                                                                        triton_dtype(dtype), _TILE)
    return ScaledFp8(qt, ds, "1x128")


def quantize_128x128(w: torch.Tensor, fmt="e4m3", *, transposed=False):
    """128x128 blocks of w [R, C] (C % 128 == 0), one pass; ds stored [ceil(R/128), L4] with padding 1.0. With
    `transposed` (R % 128 == 0 too) returns the pair (w's, w.T's): w.T's q and scales are the same blocks
    transposed (the dgrad's K-major weight)."""
    _check_input(w)
    check_blockwise(w, "128x128")
    if transposed:
        check_blockwise(w.t(), "128x128 (transposed)")
    dtype = fp8_dtype(fmt)
    r, c = w.shape
    rb, cb = triton.cdiv(r, BLOCK), c // BLOCK
    q = torch.empty(r, c, dtype=dtype, device=w.device)
    ds = torch.ones(rb, padded_k_blocks(c), dtype=torch.float32, device=w.device)
    qt = torch.empty(c, r, dtype=dtype, device=w.device) if transposed else q
    dst = torch.ones(cb, padded_k_blocks(r), dtype=torch.float32, device=w.device) if transposed else ds
    _blocks_128x128_kernel[(rb, cb)](w, r, c, q, ds, ds.shape[1], qt, dst, dst.shape[1], FP8_MAX[dtype],
                                     triton_dtype(dtype), transposed)
    out = ScaledFp8(q, ds, "128x128")
    return (out, ScaledFp8(qt, dst, "128x128")) if transposed else out


def triton_dtype(dtype: torch.dtype):
    """Triton's type of an FP8 torch dtype."""
    return {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}[dtype]
