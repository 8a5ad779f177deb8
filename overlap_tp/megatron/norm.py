"""RMSNorm for Megatron layers, on the Triton kernels of `overlap_tp.kernels.fused_add_rmsnorm`.

- `rmsnorm(x, weight)`: what `input_layernorm` / `pre_mlp_layernorm` / `final_layernorm` compute.
- `fused_add_rmsnorm(x, residual, weight, bias)`: a row-parallel linear's output (standard layout or
  the tile-exact GEMM+ReduceScatter layout) through Megatron's bias-dropout-add into the residual, then
  the next norm, in one kernel; returns what the next sublayer needs: (its input, the residual it adds to).
- `OverlapRMSNorm(config, hidden_size, eps)`: the module for Megatron's layer specs (sequence-parallel
  capable: the norm is per token, and the weight carries Megatron's `sequence_parallel` attribute so
  `finalize_model_grads` all-reduces its gradient across the TP group, as for TE's norms).
- FP8 output (`fp8=Fp8Output(format, scaling)` on both functions; `OverlapRMSNorm.fp8_output`): the same kernel pass
  that stores the normalized rows also quantizes them for the FP8 linear that reads them (1x128: q and scales in
  that pass; tensorwise: the rows' amax in that pass, then one quantizing pass that reads y once). The copy travels
  on the output tensor itself and `fp8_rows(y, format, scaling)` hands it to the consumer, bit-equal to quantizing
  y afterwards (kernels/fp8_norm.py's rule), so the consumer's own quantizing pass is skipped.

Megatron is not imported: any object with the config attributes below works.
"""
from typing import NamedTuple, Optional

import torch

from overlap_tp.kernels.fp8_quant import BLOCK, ScaledFp8, fp8_dtype, quantize_tensorwise
from overlap_tp.kernels.fused_add_rmsnorm import FusedAddRMSNormFunction, NormFp8Out, RMSNormFunction, TileOrder

__all__ = ["Fp8Output", "OverlapRMSNorm", "TileOrder", "fp8_rows", "fused_add_rmsnorm", "rmsnorm"]

FP8_ROWS = "overlap_tp_fp8_rows"   # the attribute of a norm's output that holds (its version, Fp8Output, FP8 copy)

# TransformerConfig's defaults for the options read here (megatron-core 0.16).
_CONFIG_DEFAULTS = {
    "normalization": "LayerNorm",
    "layernorm_zero_centered_gamma": False,
    "sequence_parallel": False,
    "hidden_dropout": 0.1,
    "fp32_residual_connection": False,
    "apply_residual_connection_post_layernorm": False,
    "params_dtype": torch.float32,
}


class Fp8Output(NamedTuple):
    """The FP8 copy a norm writes beside its output, for the FP8 linear that reads it: format ("e4m3" | "e5m2") and
    scaling ("1x128" | "tensorwise"), the linear's (fp8_linear.Fp8Recipe's forward_format and row_scaling)."""
    format: str
    scaling: str


def _fp8_target(fp8: Optional[Fp8Output], like: torch.Tensor) -> Optional[NormFp8Out]:
    """Where the kernel writes the FP8 copy of an output shaped like `like` [.., N] (as [rows, N])."""
    if fp8 is None:
        return None
    rows, n = like.numel() // like.shape[-1], like.shape[-1]
    if fp8.scaling == "1x128":
        return NormFp8Out("1x128", q=torch.empty(rows, n, dtype=fp8_dtype(fp8.format), device=like.device),
                          scales=torch.empty(n // BLOCK, rows, dtype=torch.float32, device=like.device))
    if fp8.scaling == "tensorwise":
        return NormFp8Out("amax", amax=torch.zeros(1, dtype=torch.float32, device=like.device))
    raise ValueError(f"Fp8Output.scaling must be '1x128' or 'tensorwise'; got {fp8.scaling!r}")


def _keep_fp8(y: torch.Tensor, fp8: Optional[Fp8Output], target: Optional[NormFp8Out]) -> torch.Tensor:
    """Attach y's FP8 copy to y (tensorwise: its quantizing pass, with the amax the kernel gathered)."""
    if fp8 is not None:
        if target.scaling == "1x128":
            rows8 = ScaledFp8(target.q, target.scales, "1x128")
        else:
            rows8 = quantize_tensorwise(y.detach().reshape(-1, y.shape[-1]), fp8.format, amax=target.amax)
        setattr(y, FP8_ROWS, (y._version, fp8, rows8))
    return y


def fp8_rows(x: torch.Tensor, fmt: str, scaling: str) -> Optional[ScaledFp8]:
    """Take the FP8 copy of x [.., N], as [rows, N] rows in `fmt` with `scaling`, that the norm producing x wrote
    beside it (fp8=...), or None: x carries none, or one of another format or scaling, or x was written since. Taken
    once: x no longer holds it (x may live on to the backward, the copy need not)."""
    kept = getattr(x, FP8_ROWS, None)
    if kept is None:
        return None
    delattr(x, FP8_ROWS)
    version, fp8, rows8 = kept
    if version != x._version or fp8 != (fmt, scaling):
        return None
    return rows8


def rmsnorm(x, weight, *, eps=1e-5, zero_centered_gamma=False, y_out=None, fp8=None):
    """x * rstd(x) * (weight (+ 1)), over the last dimension; x contiguous, any leading shape. y_out: where the
    output goes (x's shape and dtype, contiguous) instead of a new tensor. fp8: an Fp8Output, the output's FP8 copy
    written in the same pass (fp8_rows)."""
    target = _fp8_target(fp8, x)
    return _keep_fp8(RMSNormFunction.apply(x, weight, eps, zero_centered_gamma, y_out, target), fp8, target)


def fused_add_rmsnorm(x, residual, weight, bias=None, *, eps=1e-5, zero_centered_gamma=False, dropout_p=0.0,
                      training=True, fp32_residual=False, residual_post_norm=False, x_order=None, grad_order=None,
                      x_sum=None, y_out=None, fp8=None):
    """Megatron's bias-dropout-add followed by the next RMSNorm:

        residual_out = residual + dropout(x + bias)        (dropout only when training)
        normalized   = RMSNorm(residual_out) * (weight (+ 1 with zero_centered_gamma))

    Returns (normalized, carried residual): the carried residual is `residual_out` (fp32 with
    fp32_residual, else x's dtype), or `normalized` itself with residual_post_norm (Megatron's
    `apply_residual_connection_post_layernorm`, the original BERT ordering).

    x: the collective's output, [..., hidden] like `residual` or, with `x_order` (a TileOrder), the
    tile-exact buffer of the same element count. grad_order: the TileOrder in which the gradient of
    `normalized` will arrive (the next column-parallel layer's dgrad ReduceScatter), None = standard.
    Every output is in the standard layout; x's gradient is in x's layout.
    x_sum: x is the not yet summed output of a peer-to-peer reduce-scatter (ops/p2p_reduction.py, DeferredSum):
    the kernel reads its slots and sums them itself (FusedAddRMSNormFunction says more).
    y_out: where `normalized` goes instead of a new tensor (residual's shape, x's dtype, contiguous): the next
    column-parallel layer's own gathered buffer (OverlapRMSNorm.output_for).
    fp8: an Fp8Output, `normalized`'s FP8 copy written in the same pass (fp8_rows).
    """
    residual_dtype = torch.float32 if fp32_residual else x.dtype
    target = _fp8_target(fp8, residual)
    normalized, residual_out = FusedAddRMSNormFunction.apply(
        x, residual, weight, bias, eps, zero_centered_gamma, dropout_p if training else 0.0, residual_dtype,
        x_order, grad_order, x_sum, y_out, target)
    _keep_fp8(normalized, fp8, target)
    return normalized, normalized if residual_post_norm else residual_out


def _option(config, name):
    return getattr(config, name, _CONFIG_DEFAULTS[name])


class OverlapRMSNorm(torch.nn.Module):
    """Megatron norm module: `OverlapRMSNorm(config, hidden_size, eps)`, built by `build_module` in the
    `input_layernorm`, `pre_mlp_layernorm` or `final_layernorm` slot of a layer spec.

    Reads config.normalization (must be "RMSNorm"), layernorm_zero_centered_gamma, sequence_parallel,
    params_dtype and, on the fused residual path, hidden_dropout, fp32_residual_connection and
    apply_residual_connection_post_layernorm. memory_efficient_layer_norm and persist_layer_norm have no
    meaning here and are ignored.

    output_for: set by the layer whose column-parallel linear is this norm's only consumer and gathers its input in
    place (OverlapColumnParallelLinear.input_buffer): output_for(shape, dtype, device) is where the normalized rows
    go (that linear's region of its own gathered buffer), or None (a new tensor). Every producer of this norm's
    output asks it: this forward, and a fused bias-dropout-add that hands its rows over (output_buffer).

    fp8_output: set, likewise, by the layer whose FP8 column-parallel linear is this norm's only consumer (an
    Fp8Output, the linear's format and scaling): every producer then writes the output's FP8 copy in its pass, and
    the linear takes it (fp8_rows) instead of quantizing the rows again.
    """

    def __init__(self, config, hidden_size, eps=1e-5):
        super().__init__()
        if _option(config, "normalization") != "RMSNorm":
            raise ValueError(f"OverlapRMSNorm implements RMSNorm only, config.normalization is "
                             f"{_option(config, 'normalization')!r}")
        self.config = config
        self.eps = eps
        self.zero_centered_gamma = _option(config, "layernorm_zero_centered_gamma")
        self.sequence_parallel = _option(config, "sequence_parallel")
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, dtype=_option(config, "params_dtype")))
        setattr(self.weight, "sequence_parallel", self.sequence_parallel)
        self._handovers = []    # [(x, this norm of x)] computed ahead by fused bias-dropout-adds (hand_over)
        self.output_for = None  # where the normalized rows go (the consumer linear's gathered buffer), see above
        self.fp8_output = None  # the FP8 copy its consumer reads (an Fp8Output), see above
        self.reset_parameters()

    def reset_parameters(self):
        """Unit gain: weight 1, or 0 when the gain is stored zero-centered (weight + 1)."""
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)

    def forward(self, x):
        """Plain RMSNorm of x [s, b, h] (or any [..., h]), what input_layernorm does; or, when x is the tensor
        a fused bias-dropout-add handed over with its norm already computed (hand_over), that norm."""
        handovers, self._handovers = self._handovers, []
        for i, (handed, normalized) in enumerate(handovers):
            if handed is x:
                self._handovers = handovers[:i] + handovers[i + 1:]
                return normalized
        return rmsnorm(x, self.weight, eps=self.eps, zero_centered_gamma=self.zero_centered_gamma,
                       y_out=self.output_buffer(x.shape, x.dtype, x.device), fp8=self.fp8_output)

    def output_buffer(self, shape, dtype, device):
        """Where this norm's output goes: the consumer's buffer (output_for), or None (a new tensor)."""
        return None if self.output_for is None else self.output_for(shape, dtype, device)

    def hand_over(self, x, normalized):
        """The next forward of this norm on x itself returns `normalized` (computed with this norm's weight, in
        autograd, by the kernel that produced x: OverlapTransformerLayer's fused attention or MLP bda). Keyed by
        identity, and used at most once: any other input runs the norm and drops what was handed over. Two may wait
        at once (the token split's halves, each taken by its own x), never more: the older goes."""
        self._handovers = self._handovers[-1:] + [(x, normalized)]

    def add_and_norm(self, x, residual, bias=None, *, x_order=None, grad_order=None):
        """Bias-dropout-add of a row-parallel linear's output `x` (+ `bias`) into `residual`, then this
        norm: returns (normalized, carried residual), see `fused_add_rmsnorm`."""
        return fused_add_rmsnorm(
            x, residual, self.weight, bias, eps=self.eps, zero_centered_gamma=self.zero_centered_gamma,
            dropout_p=_option(self.config, "hidden_dropout"), training=self.training,
            fp32_residual=_option(self.config, "fp32_residual_connection"),
            residual_post_norm=_option(self.config, "apply_residual_connection_post_layernorm"),
            x_order=x_order, grad_order=grad_order)

    def extra_repr(self):
        return (f"{self.weight.shape[0]}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}, "
                f"sequence_parallel={self.sequence_parallel}")
