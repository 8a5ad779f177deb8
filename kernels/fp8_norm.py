"""The fused residual add + RMSNorm with FP8 output, for the AllGather+GEMM that follows it: one call that runs
kernels/fused_add_rmsnorm.py's forward with its FP8 output and returns the FP8 rows with their scales.

- "1x128": one pass. The kernel normalizes a row, stores y (x's dtype), and quantizes the stored y in blocks of
  128 columns: q and one scale per row per block, no global amax needed.
- "tensorwise" (per-tensor current scaling): the amax of y is known only after every row is normalized, so the
  forward pass atomic-maxes each row's amax into one fp32 word as it goes, and a second pass quantizes y with it
  (fp8_quant.quantize_tensorwise(y, amax=...), which then reads y once and writes q: no separate amax pass). In an
  AllGather+GEMM each rank quantizes its own shard with its own amax, and the gathered A carries one scale per
  source rank (fp8_gemm.py: a tensorwise `a.ds` of t scales), so no collective is needed for the amax.

Either way the FP8 output is bit-equal to fp8_quant's quantizer applied to the y the norm stored.
"""
import torch

from overlap_tp.kernels.fp8_quant import BLOCK, ScaledFp8, fp8_dtype, quantize_tensorwise
from overlap_tp.kernels.fused_add_rmsnorm import (NormFp8Out, check_forward, check_fp8_out, empty_forward_outputs,
                                                  launch_forward)

SCALINGS = ("1x128", "tensorwise")


def add_rmsnorm_fp8(x, residual, weight, bias=None, *, eps=1e-5, scaling="1x128", fmt="e4m3", residual_dtype=None,
                    zero_centered_gamma=False, dropout_p=0.0, seed=None, x_order=None, q_out=None):
    """(ForwardOutputs, ScaledFp8 of y as a [M, N] matrix). q_out: where the FP8 rows go (the AllGather's buffer:
    a contiguous [M, N] fp8 tensor), else a new tensor. The remaining arguments are launch_forward's."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}; got {scaling!r}")
    residual_dtype = residual_dtype or (x.dtype if residual is not None else None)
    m, n = check_forward(x, residual, weight, bias, eps=eps, dropout_p=dropout_p, residual_dtype=residual_dtype,
                         x_order=x_order)
    out = empty_forward_outputs(x, residual, residual_dtype)
    dtype = fp8_dtype(fmt)
    if scaling == "1x128":
        q = q_out if q_out is not None else torch.empty(m, n, dtype=dtype, device=x.device)
        fp8 = NormFp8Out("1x128", q=q, scales=torch.empty(n // BLOCK, m, dtype=torch.float32, device=x.device))
    else:
        fp8 = NormFp8Out("amax", amax=torch.zeros(1, dtype=torch.float32, device=x.device))
    check_fp8_out(fp8, out.y)
    launch_forward(x, residual, weight, bias, out, eps=eps, zero_centered_gamma=zero_centered_gamma,
                   dropout_p=dropout_p, seed=seed, x_order=x_order, fp8=fp8)
    if scaling == "1x128":
        return out, ScaledFp8(fp8.q, fp8.scales, "1x128")
    return out, quantize_tensorwise(out.y.reshape(m, n), fmt, amax=fp8.amax, q_out=q_out)
