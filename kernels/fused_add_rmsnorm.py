"""Bias + dropout + residual add + RMSNorm after a row-parallel linear, reading the collective's output
in the standard layout or in the tile-exact layout of the GEMM+ReduceScatter schedule.

Megatron's sequence after linear_proj / linear_fc2 (one row = one token, N = hidden size):

    s = residual + dropout(x + bias)                  the new residual, stored (fp32 or x's dtype)
    rstd = 1 / sqrt(mean(s^2) + eps)                  one fp32 per row, kept for backward
    y = s * rstd * g,  g = weight (+ 1 with zero-centered gamma)   the next AG+GEMM's input

All arithmetic is fp32; `s` is rounded to the residual's dtype before it is normalized, so forward and
backward see exactly the stored residual (as Megatron's unfused bias-dropout-add then norm does).

Tile-exact layout (`TileOrder`): the collective's output is `T = (M/BM) * (N/BN)` row-major BM x BN
tiles; tile slot `slot_of[r // BM, c // BN]` holds the block of element (r, c), which therefore sits
at `slot * BM * BN + (r % BM) * BN + c % BN`. The kernels read `x` (forward) and `dy` (backward) by
that formula (backward writes dx in x's layout); every other tensor is in the standard [M, N] layout.
Each program sees its row as an [N_TILES, TILE_N] block with TILE_N dividing BN, so the slot is one
gather per run of TILE_N columns and the addresses stay contiguous, 16-byte-vectorizable runs.

Dropout keeps element (r, c) iff u >= p, u uniform from word c % 4 of Philox(seed; counter (r, c // 4)):
one Philox call per four elements, the mask a function of (seed, r, c) only (not of the layout or the
launch), regenerated in backward, never stored.
The seed is drawn from torch's generator of the tensor's device, on the device (no host sync), so runs
repeat under `torch.manual_seed`, activation recomputation and Megatron's RNG tracker.

FP8 output (`launch_forward(..., fp8=NormFp8Out)`, kernels/fp8_quant.py's rules): besides y, the kernel quantizes
the rounded y it stored, so the result is bit-equal to a quantizer applied to y afterwards:
    1x128     q [M, N] FP8 and one dequantizing scale per row per 128 columns (stored [N/128, M]), in this pass;
    amax      the amax of y, atomic-maxed into an fp32 word (one atomic per row) for per-tensor current scaling,
              whose quantizing pass (fp8_quant.quantize_tensorwise(y, amax=...)) then skips its own amax pass.

Backward (the row's upstream gradients: dy for y, d_res for s; x_hat = s * rstd):

    dw    = sum over rows of dy * x_hat                         (per-program partial rows, then summed)
    ds    = rstd * (dy*g - x_hat * mean(dy*g * x_hat)) + d_res  the residual's gradient
    dx    = ds * keep / (1 - p)                                 the collective output's gradient
    dbias = sum over rows of dx
"""
import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from overlap_tp.kernels.direct_launch import JitLauncher
from overlap_tp.kernels.fp8_quant import (BLOCK as FP8_BLOCK, FP8_MAX, abs_or_inf, cast_fp8, scales_from_amax,
                                          triton_dtype)
from overlap_tp.kernels.tile_order import TileOrder  # noqa: F401  (the layout contract; re-exported for callers)

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_STANDARD_TILE_N = 256  # columns per block row when the input is in the standard layout
_CPU_PROGRAMS = 4       # backward programs in the CPU interpreter (several, to exercise the partials)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def _offsets(order_ptr, row, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILE_N: tl.constexpr,
             N_TILES: tl.constexpr, ORDERED: tl.constexpr):
    """Element offsets of `row`'s [N_TILES, TILE_N] block: standard row-major, or tile-exact (BLOCK_M x
    BLOCK_N tiles; TILE_N divides BLOCK_N, so each run of TILE_N columns lies in one tile)."""
    tile = tl.arange(0, N_TILES)[:, None]
    lane = tl.arange(0, TILE_N)[None, :]
    if ORDERED:
        # (tile % RUNS) * TILE_N rather than col % BLOCK_N: the compiler then sees 16-byte alignment.
        RUNS: tl.constexpr = BLOCK_N // TILE_N  # runs of TILE_N columns per tile row
        slot = tl.load(order_ptr + (row // BLOCK_M) * (N // BLOCK_N) + tile // RUNS, mask=tile * TILE_N < N, other=0)
        return slot.to(tl.int64) * (BLOCK_M * BLOCK_N) + (row % BLOCK_M) * BLOCK_N + (tile % RUNS) * TILE_N + lane
    return row * N + tile * TILE_N + lane


@triton.jit
def _load_summed(ptr, offs, mask, slot_stride, SLOTS: tl.constexpr):
    """ptr[offs], or with SLOTS = t > 0 the sum of the t slots slot_stride elements apart (a p2p reduce-scatter's
    received partials), added in fp32 in slot order and rounded to the element type once: the bits
    kernels/sum_slots.py would have stored."""
    if SLOTS > 0:
        total = tl.zeros(offs.shape, dtype=tl.float32)
        for slot in tl.static_range(SLOTS):
            total += tl.load(ptr + slot * slot_stride + offs, mask=mask, other=0.0).to(tl.float32)
        return total.to(ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    return tl.load(ptr + offs, mask=mask, other=0.0)


@triton.jit
def _dropout_keep(seed, row, p, TILE_N: tl.constexpr, N_TILES: tl.constexpr):
    """Keep mask of `row`'s [N_TILES, TILE_N] block: Philox counter (row, c // 4), word c % 4."""
    quad = tl.arange(0, N_TILES)[:, None] * (TILE_N // 4) + tl.arange(0, TILE_N // 4)[None, :]
    r0, r1, r2, r3 = tl.randint4x(seed, (row << 32) + quad)
    bits = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), (N_TILES, TILE_N))
    return tl.uint_to_uniform_float(bits) >= p


@triton.jit
def _forward_kernel(x_ptr, x_order_ptr, bias_ptr, residual_ptr, weight_ptr, seed_ptr,
                    y_ptr, residual_out_ptr, rstd_ptr,
                    row_lo, N, eps, weight_offset, dropout_p, slot_stride,
                    X_BLOCK_M: tl.constexpr, X_BLOCK_N: tl.constexpr, X_ORDERED: tl.constexpr,
                    X_SLOTS: tl.constexpr, TILE_N: tl.constexpr, N_TILES: tl.constexpr,
                    HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                    q_ptr=None, q_scale_ptr=None, q_scale_stride=0, amax_ptr=None,
                    FP8: tl.constexpr = 0, FP8_MAX: tl.constexpr = 448.0, FP8_TYPE: tl.constexpr = None):
    """One program per row: s = residual + dropout(x + bias) (stored), y = s * rstd * g. With X_SLOTS = t > 0,
    x is the sum of t slots slot_stride elements apart (a p2p reduce-scatter's received partials), added in
    fp32 in slot order and rounded to x's dtype once: the bits kernels/sum_slots.py would have stored.
    FP8 = 1: also q (FP8_TYPE) of the stored y in 1x128 blocks, their dequantizing scales at q_scale_ptr + block *
    q_scale_stride + row; FP8 = 2: also the amax of the stored y, atomic-maxed into amax_ptr[0]."""
    row = (row_lo + tl.program_id(0)).to(tl.int64)
    cols = tl.arange(0, N_TILES)[:, None] * TILE_N + tl.arange(0, TILE_N)[None, :]
    mask = cols < N
    offs = row * N + cols

    # The residual's loads go out first: a warp issues in order, so loads placed after x's, whose addresses
    # wait for the tile-order lookup, would wait too.
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + offs, mask=mask, other=0.0)
    x_offs = _offsets(x_order_ptr, row, N, X_BLOCK_M, X_BLOCK_N, TILE_N, N_TILES, X_ORDERED)
    s = _load_summed(x_ptr, x_offs, mask, slot_stride, X_SLOTS).to(tl.float32)
    if HAS_BIAS:
        s += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        keep = _dropout_keep(tl.load(seed_ptr), row, dropout_p, TILE_N, N_TILES)
        s = tl.where(keep, s * (1.0 / (1.0 - dropout_p)), 0.0)
    if HAS_RESIDUAL:
        s += residual.to(tl.float32)
        s = s.to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + offs, s, mask=mask)
        s = s.to(tl.float32)

    rstd = tl.rsqrt(tl.sum(s * s) / N + eps)
    g = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32) + weight_offset
    y = (s * rstd * g).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs, y, mask=mask)
    tl.store(rstd_ptr + row, rstd)
    if FP8 == 1:   # the row's [N_TILES, TILE_N] block seen as runs of 128 columns (column order is kept)
        BLOCKS: tl.constexpr = N_TILES * TILE_N // 128
        y_blocks = tl.reshape(y.to(tl.float32), (BLOCKS, 128))
        block_cols = tl.reshape(cols, (BLOCKS, 128))
        qs, ds = scales_from_amax(tl.max(abs_or_inf(y_blocks), 1), FP8_MAX)
        tl.store(q_ptr + row * N + block_cols, cast_fp8(y_blocks, qs[:, None], FP8_MAX, FP8_TYPE),
                 mask=block_cols < N)
        blocks = tl.arange(0, BLOCKS)
        tl.store(q_scale_ptr + blocks * q_scale_stride + row, ds, mask=blocks * 128 < N)
    if FP8 == 2:
        tl.atomic_max(amax_ptr, tl.max(tl.max(tl.where(mask, abs_or_inf(y), 0.0), 1), 0))


@triton.jit
def _backward_kernel(dy_ptr, dy_order_ptr, d_residual_out_ptr, s_ptr, rstd_ptr, weight_ptr, seed_ptr,
                     ds_ptr, dx_ptr, dx_order_ptr, partials_ptr,
                     M, N, rows_per_program, weight_offset, dropout_p, dy_slot_stride,
                     DY_BLOCK_M: tl.constexpr, DY_BLOCK_N: tl.constexpr, DY_ORDERED: tl.constexpr, DY_SLOTS: tl.constexpr,
                     DX_BLOCK_M: tl.constexpr, DX_BLOCK_N: tl.constexpr, DX_ORDERED: tl.constexpr,
                     TILE_N: tl.constexpr, N_TILES: tl.constexpr,
                     HAS_D_RESIDUAL_OUT: tl.constexpr, HAS_DROPOUT: tl.constexpr, STORE_DX: tl.constexpr,
                     HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    """A contiguous run of rows per program, in one pass: ds (and dx) per row; dw (and dbias) as one fp32
    partial row per program: partials[0, pid] (and partials[1, pid]). With DY_SLOTS = t > 0, dy is the sum of t
    slots dy_slot_stride elements apart (the next column-parallel layer's p2p dgrad reduce-scatter, left unsummed to
    this kernel). At t = 2 both slots are prefetched and summed at the row's use, so their loads stay in flight as
    dy's would (summed at the prefetch they waited out their latency there: no gain over a separate sum). For t > 2
    they are summed at the prefetch: prefetched as t separate loads they measured slower than a separate sum, summed
    at the prefetch faster (docs/performance.md).

    The loads of row i + 1 are issued before row i's reduction and stores (software pipelining by
    hand): without it each program has one row's reads in flight and waits out the full memory latency
    once per row, since the row's sum must complete before its stores and the next row's loads."""
    pid = tl.program_id(0)
    if PDL:   # the partial sum, launched behind us with PDL, may take its SM slots now; it waits for our end
        gdc_launch_dependents()
    cols = tl.arange(0, N_TILES)[:, None] * TILE_N + tl.arange(0, TILE_N)[None, :]
    mask = cols < N
    g = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32) + weight_offset
    dweight = tl.zeros((N_TILES, TILE_N), dtype=tl.float32)
    dbias = tl.zeros((N_TILES, TILE_N), dtype=tl.float32)
    if HAS_DROPOUT:
        seed = tl.load(seed_ptr)

    first_row = pid.to(tl.int64) * rows_per_program
    num_rows = tl.minimum(rows_per_program, M - first_row)
    # Row first_row's inputs (a program always has at least one row). Here and in the prefetch below dy comes
    # last: its addresses may wait for a tile-order lookup, and a warp issues in order.
    next_s = tl.load(s_ptr + first_row * N + cols, mask=mask, other=0.0)
    next_rstd = tl.load(rstd_ptr + first_row)
    if HAS_D_RESIDUAL_OUT:
        next_d_res = tl.load(d_residual_out_ptr + first_row * N + cols, mask=mask, other=0.0)
    dy_offs = _offsets(dy_order_ptr, first_row, N, DY_BLOCK_M, DY_BLOCK_N, TILE_N, N_TILES, DY_ORDERED)
    if DY_SLOTS == 2:   # slot 0 in next_dy, slot 1 in next_dy1, summed at use
        next_dy = tl.load(dy_ptr + dy_offs, mask=mask, other=0.0)
        next_dy1 = tl.load(dy_ptr + dy_slot_stride + dy_offs, mask=mask, other=0.0)
    else:
        next_dy = _load_summed(dy_ptr, dy_offs, mask, dy_slot_stride, DY_SLOTS)
    for i in range(0, num_rows):
        row = first_row + i
        offs = row * N + cols
        if DY_SLOTS == 2:   # the fp32 sum in slot order, rounded once (_load_summed's bits)
            dy = (next_dy.to(tl.float32) + next_dy1.to(tl.float32)).to(
                dy_ptr.dtype.element_ty, fp_downcast_rounding="rtne").to(tl.float32)
        else:
            dy = next_dy.to(tl.float32)
        x_hat = next_s.to(tl.float32) * next_rstd
        rstd = next_rstd
        if HAS_D_RESIDUAL_OUT:
            d_res = next_d_res.to(tl.float32)

        # Prefetch the next row: past the program's last row the loads are masked off (no traffic) and
        # the row index is clamped so that even the tile-order lookup stays in bounds. The mask is a column
        # bound (N, or 0 past the last row) rather than `mask & (i + 1 < num_rows)`: Triton 3.9's interpreter
        # (the CPU tests; 3.6 does not) turns that & of a tensor and a scalar int1 into int32, which tl.load refuses.
        next_mask = cols < tl.where(i + 1 < num_rows, N, 0)
        next_row = tl.minimum(row + 1, M - 1)
        next_s = tl.load(s_ptr + next_row * N + cols, mask=next_mask, other=0.0)
        next_rstd = tl.load(rstd_ptr + next_row)
        if HAS_D_RESIDUAL_OUT:
            next_d_res = tl.load(d_residual_out_ptr + next_row * N + cols, mask=next_mask, other=0.0)
        dy_offs = _offsets(dy_order_ptr, next_row, N, DY_BLOCK_M, DY_BLOCK_N, TILE_N, N_TILES, DY_ORDERED)
        if DY_SLOTS == 2:
            next_dy = tl.load(dy_ptr + dy_offs, mask=next_mask, other=0.0)
            next_dy1 = tl.load(dy_ptr + dy_slot_stride + dy_offs, mask=next_mask, other=0.0)
        else:
            next_dy = _load_summed(dy_ptr, dy_offs, next_mask, dy_slot_stride, DY_SLOTS)

        dx_hat = dy * g
        ds = rstd * (dx_hat - x_hat * (tl.sum(dx_hat * x_hat) / N))
        if HAS_D_RESIDUAL_OUT:
            ds += d_res
        tl.store(ds_ptr + offs, ds.to(ds_ptr.dtype.element_ty), mask=mask)
        dweight += dy * x_hat

        dx = ds
        if HAS_DROPOUT:
            keep = _dropout_keep(seed, row, dropout_p, TILE_N, N_TILES)
            dx = tl.where(keep, ds * (1.0 / (1.0 - dropout_p)), 0.0)
        if STORE_DX:
            dx_offs = _offsets(dx_order_ptr, row, N, DX_BLOCK_M, DX_BLOCK_N, TILE_N, N_TILES, DX_ORDERED)
            tl.store(dx_ptr + dx_offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            dbias += dx

    tl.store(partials_ptr + pid * N + cols, dweight, mask=mask)
    if HAS_BIAS:
        tl.store(partials_ptr + (tl.num_programs(0) + pid) * N + cols, dbias, mask=mask)


@triton.jit
def _sum_partials_kernel(partials_ptr, out_ptr, programs, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                         PDL: tl.constexpr):
    """out[k, c] = sum over p of partials[k, p, c] ([K, programs, N] fp32), the rows added in a fixed order:
    the same bits every run. With PDL this kernel was launched while the backward kernel still ran: wait
    until that has completed and its stores are visible."""
    if PDL:
        gdc_wait()
    k = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for p0 in range(0, programs, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        acc += tl.load(partials_ptr + (k * programs + p[:, None]).to(tl.int64) * N + cols[None, :],
                       mask=(p < programs)[:, None] & (cols < N)[None, :], other=0.0)
    tl.store(out_ptr + k * N + cols, tl.sum(acc, 0), mask=cols < N)


@triton.jit
def _dropout_mask_kernel(seed_ptr, keep_ptr, N, p, TILE_N: tl.constexpr, N_TILES: tl.constexpr):
    """The keep mask the forward and backward kernels apply, one row per program (for references)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, N_TILES)[:, None] * TILE_N + tl.arange(0, TILE_N)[None, :]
    keep = _dropout_keep(tl.load(seed_ptr), row, p, TILE_N, N_TILES)
    tl.store(keep_ptr + row * N + cols, keep.to(tl.int8), mask=cols < N)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------

def _block(n, *orders):
    """(TILE_N, N_TILES, the forward's num_warps) for rows of n elements read or written in these orders."""
    tile_n = min([_STANDARD_TILE_N, max(4, triton.next_power_of_2(n))] + [o.block_n for o in orders if o is not None])
    n_tiles = triton.next_power_of_2(triton.cdiv(n, tile_n))
    block = tile_n * n_tiles
    num_warps = 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4
    return tile_n, n_tiles, num_warps


def _order_args(order):
    """(slot_of, block_m, block_n, ordered) kernel arguments for an order or None (standard)."""
    return (order.slot_of, order.block_m, order.block_n, True) if order is not None else (None, 1, 1, False)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _has_pdl(device_index):
    """Programmatic dependent launch (griddepcontrol): Hopper and later."""
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


# Launched through their compiled kernels (kernels/direct_launch.py): Triton's JIT launch costs tens of microseconds of
# host time per call, and an eager layer runs several of these per step.
_forward = JitLauncher(_forward_kernel)
_backward = JitLauncher(_backward_kernel)
_sum_partials = JitLauncher(_sum_partials_kernel)
_dropout_mask = JitLauncher(_dropout_mask_kernel)


def dropout_seed(device):
    """A Philox seed (int64 tensor [1] on `device`) drawn from torch's default generator there."""
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)


def dropout_keep_mask(seed, num_rows, hidden, p):
    """The bool [num_rows, hidden] keep mask the kernels derive from `seed` for dropout probability p."""
    keep = torch.empty(num_rows, hidden, dtype=torch.int8, device=seed.device)
    tile_n, n_tiles, num_warps = _block(hidden)
    if num_rows:
        _dropout_mask[(num_rows,)](seed, keep, hidden, p, TILE_N=tile_n, N_TILES=n_tiles,
                                          num_warps=num_warps)
    return keep.bool()


class ForwardOutputs(NamedTuple):
    y: torch.Tensor             # normalized output, x's dtype, residual's shape
    residual_out: torch.Tensor  # residual + dropout(x + bias), standard layout (None without a residual)
    rstd: torch.Tensor          # fp32 [M]


def empty_forward_outputs(x, residual, residual_dtype, y=None):
    """Uninitialized outputs for `launch_forward` (shapes follow `residual`, or `x` without one). y: where the
    normalized output goes instead of a new tensor (the next column-parallel layer's gathered buffer: check_y_out)."""
    like = residual if residual is not None else x
    rows = like.numel() // like.shape[-1]
    residual_out = None if residual is None else torch.empty(like.shape, dtype=residual_dtype, device=like.device)
    if y is None:
        y = torch.empty(like.shape, dtype=x.dtype, device=x.device)
    return ForwardOutputs(y, residual_out, torch.empty(rows, dtype=torch.float32, device=x.device))


def check_y_out(y_out, x, residual):
    """Raise ValueError unless y_out can take the normalized output: x's dtype and device, the output's shape
    (residual's, or x's without one), contiguous."""
    like = residual if residual is not None else x
    if (not isinstance(y_out, torch.Tensor) or y_out.shape != like.shape or y_out.dtype != x.dtype
            or y_out.device != x.device or not y_out.is_contiguous()):
        raise ValueError(f"y_out must be a contiguous {tuple(like.shape)} {x.dtype} tensor on {x.device}, got "
                         f"{_describe(y_out) if isinstance(y_out, torch.Tensor) else type(y_out).__name__}")


class NormFp8Out(NamedTuple):
    """Where launch_forward writes its FP8 output (kernels/fp8_quant.py's rules): scaling "1x128": q [M, N] (fp8)
    and scales [N/128, M] fp32, in the forward's pass; scaling "amax": amax, an fp32 [1] word the rows' amax is
    atomic-maxed into (zero it first), for per-tensor current scaling (q and scales unused)."""
    scaling: str
    q: torch.Tensor = None
    scales: torch.Tensor = None
    amax: torch.Tensor = None


def launch_forward(x, residual, weight, bias, out, *, eps, zero_centered_gamma=False, dropout_p=0.0, seed=None,
                   x_order=None, x_slots=None, row_lo=0, row_hi=None, num_warps=None, fp8=None):
    """Write rows [row_lo, row_hi) of `out` (a ForwardOutputs). No checks: call `check_forward` once.

    residual None = plain RMSNorm of x (no bias, dropout or order). dropout_p > 0 needs `seed`.
    x_slots: a contiguous [t, ...] tensor, t stacked tensors of x's elements in x's order whose sum is x (x itself
    is then not read; the standard layout only).
    Per-group use: launch on the stream where a group's rows became complete, with that group's rows.
    num_warps: per program (one row); None = `_block`'s rule (the benchmark sweeps it).
    fp8: a NormFp8Out (checked by check_fp8_out), or None.
    """
    n = weight.shape[0]
    row_hi = out.rstd.shape[0] if row_hi is None else row_hi
    if row_hi <= row_lo:
        return
    tile_n, n_tiles, default_warps = _block(n, x_order)
    num_warps = num_warps or default_warps
    x_slot_of, x_block_m, x_block_n, x_ordered = _order_args(x_order)
    slots = 0 if x_slots is None else x_slots.shape[0]
    _forward[(row_hi - row_lo,)](
        x if x_slots is None else x_slots, x_slot_of, bias, residual, weight, seed if dropout_p > 0 else None,
        out.y, out.residual_out, out.rstd,
        row_lo, n, eps, 1.0 if zero_centered_gamma else 0.0, dropout_p, x.numel(),
        X_BLOCK_M=x_block_m, X_BLOCK_N=x_block_n, X_ORDERED=x_ordered, X_SLOTS=slots, TILE_N=tile_n, N_TILES=n_tiles,
        HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, HAS_DROPOUT=dropout_p > 0,
        num_warps=num_warps, **({} if fp8 is None else _fp8_args(fp8, out.rstd.shape[0])))


def _fp8_args(fp8, rows):
    """The forward kernel's FP8 arguments of a NormFp8Out."""
    if fp8.scaling == "amax":
        return dict(amax_ptr=fp8.amax, FP8=2)
    return dict(q_ptr=fp8.q, q_scale_ptr=fp8.scales, q_scale_stride=rows, FP8=1, FP8_MAX=FP8_MAX[fp8.q.dtype],
                FP8_TYPE=triton_dtype(fp8.q.dtype))


def check_fp8_out(fp8, y):
    """Raise ValueError unless `fp8` (a NormFp8Out) fits the normalized output y [.., N]."""
    rows, n = y.numel() // y.shape[-1], y.shape[-1]
    if fp8.scaling == "amax":
        if fp8.amax is None or fp8.amax.shape != (1,) or fp8.amax.dtype != torch.float32 or fp8.amax.device != y.device:
            raise ValueError(f"amax must be an fp32 [1] tensor on {y.device}; got {_describe(fp8.amax)}")
        return
    if fp8.scaling != "1x128":
        raise ValueError(f"NormFp8Out.scaling must be '1x128' or 'amax'; got {fp8.scaling!r}")
    if n % FP8_BLOCK:
        raise ValueError(f"1x128 FP8 output needs the hidden size to be a multiple of {FP8_BLOCK}; got {n}")
    q, scales = fp8.q, fp8.scales
    if (not isinstance(q, torch.Tensor) or q.dtype not in FP8_MAX or q.shape != (rows, n) or not q.is_contiguous()
            or q.device != y.device):
        raise ValueError(f"q must be a contiguous ({rows}, {n}) float8 tensor on {y.device}; got {_describe(q)}")
    if (not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or scales.shape != (n // FP8_BLOCK, rows)
            or not scales.is_contiguous() or scales.device != y.device):
        raise ValueError(f"scales must be a contiguous ({n // FP8_BLOCK}, {rows}) fp32 tensor on {y.device}; "
                         f"got {_describe(scales)}")


def backward_grid(m, n, device, programs_per_sm=None, num_warps=None, orders=()):
    """(programs, rows_per_program, TILE_N, N_TILES, num_warps) of the backward launch for m rows of n.

    Defaults, from the launch grid sweep (`python -m overlap_tp.bench norm --sweep`; docs/performance.md): 32 fp32
    elements per thread per row (num_warps = row block / 1024) and about 256 threads per SM (2 programs
    per SM at 4096 columns, 1 at 8192). More warps per row or more programs per SM measured slower:
    each program already keeps two rows of loads in flight, and more programs add partial rows to write
    and sum. Fewer warps spill registers (4 warps at 8192 columns: many times slower)."""
    tile_n, n_tiles, _ = _block(n, *orders)
    block = tile_n * n_tiles
    num_warps = num_warps or min(32, max(4, block // 1024))
    if device.type == "cuda":
        programs = (programs_per_sm or max(1, 8192 // block)) * _num_sms(device.index or 0)
    else:
        programs = _CPU_PROGRAMS
    rows_per_program = triton.cdiv(m, max(1, min(m, programs)))
    programs = triton.cdiv(m, rows_per_program) if m else 0
    return programs, rows_per_program, tile_n, n_tiles, num_warps


def launch_backward(dy, d_residual_out, s, rstd, weight, ds, dx, *, zero_centered_gamma=False, dropout_p=0.0,
                    seed=None, dy_order=None, dx_order=None, bias_grad=False, programs_per_sm=None, num_warps=None,
                    pdl=None, dy_slots=None):
    """One pass over the rows; returns the fp32 column sums (dweight, dbias or None). No checks.

    Reads dy (in dy_order), d_residual_out (or None: zero), the saved s and rstd. Writes ds (the grad of
    s: the residual's, or x's for the plain norm, standard layout) and dx (x's grad, in dx_order) unless
    `dx` is None, which means dx is ds (no dropout, standard layout, same dtype). Each program writes one
    partial row (programs x N fp32) that a second kernel sums (`_sum_partials_kernel`, faster than torch's `sum(0)`
    there, and deterministic: docs/performance.md). pdl: launch that kernel with
    programmatic dependent launch, so it is resident and waiting when the backward ends (None: where the
    GPU has it, Hopper on). programs_per_sm, num_warps: the benchmark sweeps them; it also times pdl=False.
    dy_slots: a contiguous [t, ...] tensor, t stacked tensors of dy's elements whose sum is dy (dy itself is then not
    read; the standard layout only)."""
    m, n = rstd.shape[0], weight.shape[0]
    if m == 0:   # the kernel loads each program's first row before its loop: launch none
        zeros = torch.zeros(n, dtype=torch.float32, device=s.device)
        return zeros, zeros.clone() if bias_grad else None
    programs, rows_per_program, tile_n, n_tiles, num_warps = backward_grid(
        m, n, s.device, programs_per_sm, num_warps, (dy_order, dx_order))
    partials = torch.empty(2 if bias_grad else 1, programs, n, dtype=torch.float32, device=s.device)
    if pdl is None:
        pdl = s.is_cuda and _has_pdl(s.device.index)
    dy_slot_of, dy_block_m, dy_block_n, dy_ordered = _order_args(dy_order)
    dx_slot_of, dx_block_m, dx_block_n, dx_ordered = _order_args(dx_order)
    _backward[(programs,)](
        dy if dy_slots is None else dy_slots, dy_slot_of, d_residual_out, s, rstd, weight,
        seed if dropout_p > 0 else None, ds, dx, dx_slot_of, partials,
        m, n, rows_per_program, 1.0 if zero_centered_gamma else 0.0, dropout_p, dy.numel(),
        DY_BLOCK_M=dy_block_m, DY_BLOCK_N=dy_block_n, DY_ORDERED=dy_ordered,
        DY_SLOTS=0 if dy_slots is None else dy_slots.shape[0],
        DX_BLOCK_M=dx_block_m, DX_BLOCK_N=dx_block_n, DX_ORDERED=dx_ordered, TILE_N=tile_n, N_TILES=n_tiles,
        HAS_D_RESIDUAL_OUT=d_residual_out is not None, HAS_DROPOUT=dropout_p > 0, STORE_DX=dx is not None,
        HAS_BIAS=bias_grad, PDL=pdl, num_warps=num_warps)
    sums = torch.empty(partials.shape[0], n, dtype=torch.float32, device=s.device)
    block_n = 32   # N / 32 programs, each summing a [programs, 32] column strip in one pass where programs <= 256
    _sum_partials[(triton.cdiv(n, block_n), partials.shape[0])](
        partials, sums, programs, n, BLOCK_P=min(256, triton.next_power_of_2(programs)), BLOCK_N=block_n, PDL=pdl,
        num_warps=4, **(dict(launch_pdl=True) if pdl else {}))
    return sums[0], sums[1] if bias_grad else None


# ----------------------------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------------------------

def _describe(t):
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)} on {t.device}{'' if t.is_contiguous() else ' (non-contiguous)'}"


def _check_tensor(name, t, device, dtypes=FLOAT_DTYPES):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like the other inputs")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}, expected one of {dtypes}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got {_describe(t)}")


def _check_order(name, order, rows, n, device):
    if order is None:
        return
    if not isinstance(order, TileOrder):
        raise ValueError(f"{name} must be a TileOrder or None, got {type(order).__name__}")
    if order.shape != (rows, n):
        raise ValueError(f"{name} describes a {order.shape[0]} x {order.shape[1]} matrix (slot_of "
                         f"{tuple(order.slot_of.shape)} of {order.block_m} x {order.block_n} tiles), "
                         f"but the rows are {rows} x {n}")
    if order.slot_of.device != device:
        raise ValueError(f"{name}.slot_of is on {order.slot_of.device}, expected {device}")


def check_forward(x, residual, weight, bias=None, *, eps=1e-5, dropout_p=0.0, residual_dtype=None, x_order=None):
    """Raise ValueError unless the inputs fit `launch_forward`; return (M, N)."""
    _check_tensor("weight", weight, weight.device if isinstance(weight, torch.Tensor) else None)
    device = weight.device
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"tensors on {device} need a CUDA device, or TRITON_INTERPRET=1 set before import")
    if weight.dim() != 1 or weight.shape[0] == 0:
        raise ValueError(f"weight must be 1-D [hidden], got {_describe(weight)}")
    n = weight.shape[0]
    _check_tensor("x", x, device)
    if residual is None:
        if bias is not None or dropout_p or x_order is not None:
            raise ValueError("bias, dropout and x_order need a residual (plain RMSNorm takes none)")
        like = x
    else:
        _check_tensor("residual", residual, device)
        if residual_dtype not in (x.dtype, torch.float32):
            raise ValueError(f"residual_dtype must be x's dtype ({x.dtype}) or torch.float32, got {residual_dtype}")
        if x.numel() != residual.numel() or (x_order is None and x.shape != residual.shape):
            raise ValueError(f"x {_describe(x)} does not match residual {_describe(residual)}"
                             + ("" if x_order is None else " in element count"))
        like = residual
    if like.dim() < 1 or like.shape[-1] != n:
        raise ValueError(f"the last dimension must be the hidden size {n}: {_describe(like)}")
    if bias is not None:
        _check_tensor("bias", bias, device)
        if bias.shape != weight.shape:
            raise ValueError(f"bias must be [hidden] like weight {tuple(weight.shape)}, got {_describe(bias)}")
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")
    if not (isinstance(dropout_p, (int, float)) and 0.0 <= dropout_p <= 1.0):
        raise ValueError(f"dropout probability must be in [0, 1], got {dropout_p!r}")
    rows = like.numel() // n
    _check_order("x_order", x_order, rows, n, device)
    return rows, n


# ----------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------

def _check_slots(slots, x):
    """slots: [t, ...] holding t copies of x's elements in x's order (any shape with x's element count)."""
    if (slots.dim() < 2 or slots[0].numel() != x.numel() or slots.shape[-1] != x.shape[-1] or slots.dtype != x.dtype
            or not slots.is_contiguous()):
        raise ValueError(f"x_sum's slots {_describe(slots)} are not a contiguous stack of t tensors of x's elements "
                         f"and dtype (x: {_describe(x)})")
    return slots


class DeferredGrad:
    """The link between a norm's output y and the one layer that consumes it (the next column-parallel linear, whose
    dgrad reduce-scatter on the p2p transport may leave its sum to the norm's backward kernel: the backward mirror of
    x_sum). Made in the consumer's forward (accept_deferred_grad). In its backward the consumer either returns dy
    summed, as always, or calls `defer(placeholder, deferred_sum)`: `placeholder` (unwritten, y's element count)
    then stands for dy in autograd, and the norm's backward sums the slots in its kernel. The norm checks that the
    gradient it receives is that placeholder (or a view of it): a gradient combined with another one on the way
    (a second consumer of y) is a RuntimeError, never a read of the unwritten placeholder."""

    __slots__ = ("deferred", "placeholder", "shared")

    def __init__(self):
        self.deferred, self.placeholder, self.shared = None, None, False

    def defer(self, placeholder: torch.Tensor, deferred_sum):
        # Holding the placeholder also keeps autograd from adding another gradient into it in place (it does so only
        # into a tensor whose storage nothing else uses): a sum with it is a new tensor, which take() refuses.
        self.deferred, self.placeholder = deferred_sum, placeholder

    def take(self, dy: torch.Tensor):
        """The deferred sum dy stands for (None: dy is the gradient itself)."""
        deferred, placeholder, self.deferred, self.placeholder = self.deferred, self.placeholder, None, None
        if deferred is None:
            return None
        if dy.data_ptr() != placeholder.data_ptr() or dy.numel() != placeholder.numel():
            raise RuntimeError("overlap_tp RMSNorm backward: the output's gradient was left unsummed by the next "
                               "column-parallel layer, but what arrived is another tensor (the output has a second "
                               "consumer whose gradient was added to it); only a norm whose output feeds that layer "
                               "alone may take it unsummed")
        return deferred


def accept_deferred_grad(y: torch.Tensor):
    """For the consumer of a norm's output y (a column-parallel linear's forward): a DeferredGrad linking its backward
    to the norm's, or None where y is not a norm output of this module or already has a consumer that asked (then
    neither defers)."""
    ctx = y.grad_fn
    if not isinstance(ctx, (FusedAddRMSNormFunction._backward_cls, RMSNormFunction._backward_cls)):
        return None
    link = getattr(ctx, "deferred_grad", None)
    if link is not None:   # a second consumer: the gradients will be added, so nobody may defer
        link.shared = True
        return None
    link = ctx.deferred_grad = DeferredGrad()
    return link


def _backward_summing(ctx, dy, launch, dy_order=None):
    """launch(dy_slots) with dy's deferred slots where the consumer left them (DeferredGrad), else launch(None)."""
    link = getattr(ctx, "deferred_grad", None)
    deferred = None if link is None else link.take(dy)
    if deferred is None:
        return launch(None)
    if dy_order is not None:
        raise ValueError("a deferred output gradient is read in the standard layout; the norm expected grad_order")
    result = []
    deferred.consume(lambda slots: result.append(launch(_check_slots(slots, dy))))
    return result[0]


class FusedAddRMSNormFunction(torch.autograd.Function):
    """(y, residual_out) = RMSNorm(residual + dropout(x + bias)), see the module docstring.

    x_order: layout of x (and so of its gradient); grad_order: layout in which y's gradient will
    arrive (the next layer's dgrad ReduceScatter); None = standard.
    x_sum: x is not computed yet but is the sum of t slots (a peer-to-peer reduce-scatter's partials, not yet
    summed: overlap_tp/ops/p2p_reduction.py, DeferredSum); x_sum.consume(fn) calls fn(slots [t, ...]) where the slots
    are readable, and the kernel sums them itself: one pass over the activation less. x then only stands for
    the input in autograd (its gradient is the reduce-scatter output's, as without x_sum).
    fp8: a NormFp8Out the same pass writes y's FP8 copy (or its amax) into (launch_forward); not part of autograd."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, zero_centered_gamma, dropout_p, residual_dtype,
                x_order, grad_order, x_sum=None, y_out=None, fp8=None):
        rows, n = check_forward(x, residual, weight, bias, eps=eps, dropout_p=dropout_p,
                                residual_dtype=residual_dtype, x_order=x_order)
        _check_order("grad_order", grad_order, rows, n, weight.device)
        if y_out is not None:
            check_y_out(y_out, x, residual)
        seed = dropout_seed(x.device) if dropout_p > 0 else None
        out = empty_forward_outputs(x, residual, residual_dtype, y_out)
        if fp8 is not None:
            check_fp8_out(fp8, out.y)

        def launch(x_slots=None):
            launch_forward(x, residual, weight, bias, out, eps=eps, zero_centered_gamma=zero_centered_gamma,
                           dropout_p=dropout_p, seed=seed, x_order=x_order, x_slots=x_slots, fp8=fp8)
        if x_sum is None:
            launch()
        else:   # x is not written yet: the kernel sums its slots where x_sum makes them readable
            if x_order is not None:
                raise ValueError("x_sum reads x in the standard layout; it takes no x_order")
            x_sum.consume(lambda slots: launch(_check_slots(slots, x)))
        ctx.save_for_backward(out.residual_out, out.rstd, weight, seed)
        ctx.options = (zero_centered_gamma, dropout_p, x_order, grad_order)
        ctx.input_meta = (x.shape, x.dtype, residual.dtype, None if bias is None else bias.dtype)
        ctx.set_materialize_grads(False)
        return out.y, out.residual_out

    @staticmethod
    def backward(ctx, dy, d_residual_out):
        residual_out, rstd, weight, seed = ctx.saved_tensors
        zero_centered_gamma, dropout_p, x_order, grad_order = ctx.options
        x_shape, x_dtype, residual_dtype, bias_dtype = ctx.input_meta
        if dy is None:
            dy, grad_order = torch.zeros_like(residual_out, dtype=x_dtype), None
        d_residual = torch.empty_like(residual_out, dtype=residual_dtype)
        dx_is_d_residual = dropout_p == 0 and x_order is None and x_dtype == residual_dtype
        dx = None if dx_is_d_residual else torch.empty(x_shape, dtype=x_dtype, device=d_residual.device)
        d_residual_out = None if d_residual_out is None else d_residual_out.contiguous()
        d_weight, d_bias = _backward_summing(ctx, dy, lambda dy_slots: launch_backward(
            dy.contiguous(), d_residual_out, residual_out, rstd, weight, d_residual, dx,
            zero_centered_gamma=zero_centered_gamma, dropout_p=dropout_p, seed=seed, dy_order=grad_order,
            dx_order=x_order, bias_grad=bias_dtype is not None and ctx.needs_input_grad[3], dy_slots=dy_slots),
            grad_order)
        return (d_residual if dx_is_d_residual else dx, d_residual, d_weight.to(weight.dtype),
                None if d_bias is None else d_bias.to(bias_dtype), None, None, None, None, None, None, None, None,
                None)


class RMSNormFunction(torch.autograd.Function):
    """y = x * rstd * g (plain RMSNorm, standard layout), what input_layernorm computes. fp8: as
    FusedAddRMSNormFunction's."""

    @staticmethod
    def forward(ctx, x, weight, eps, zero_centered_gamma, y_out=None, fp8=None):
        check_forward(x, None, weight, eps=eps)
        if y_out is not None:
            check_y_out(y_out, x, None)
        out = empty_forward_outputs(x, None, None, y_out)
        if fp8 is not None:
            check_fp8_out(fp8, out.y)
        launch_forward(x, None, weight, None, out, eps=eps, zero_centered_gamma=zero_centered_gamma, fp8=fp8)
        ctx.save_for_backward(x, out.rstd, weight)
        ctx.zero_centered_gamma = zero_centered_gamma
        return out.y

    @staticmethod
    def backward(ctx, dy):
        x, rstd, weight = ctx.saved_tensors
        dx = torch.empty_like(x)
        d_weight, _ = _backward_summing(ctx, dy, lambda dy_slots: launch_backward(
            dy.contiguous(), None, x, rstd, weight, dx, None, zero_centered_gamma=ctx.zero_centered_gamma,
            dy_slots=dy_slots))
        return dx, d_weight.to(weight.dtype), None, None, None, None


# ----------------------------------------------------------------------------------------------
# Float64 reference
# ----------------------------------------------------------------------------------------------

def reference_add_rmsnorm(x, residual, weight, bias=None, *, eps=1e-5, zero_centered_gamma=False, keep=None,
                          dropout_p=0.0, x_order=None):
    """Pure-torch float64 (y, residual_out) of the same math; differentiable. residual None = plain
    RMSNorm of x (then residual_out is x). `keep`: the bool [M, N] dropout mask (dropout_keep_mask)."""
    n = weight.shape[0]
    g = weight.double() + (1.0 if zero_centered_gamma else 0.0)
    if residual is None:
        s = x.double().reshape(-1, n)
    else:
        h = x_order.undo(x.double()) if x_order is not None else x.double().reshape(-1, n)
        if bias is not None:
            h = h + bias.double()
        if keep is not None:
            h = h * keep / (1.0 - dropout_p)
        s = residual.double().reshape(-1, n) + h
    y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * g
    shape = (residual if residual is not None else x).shape
    return y.reshape(shape), s.reshape(shape)
