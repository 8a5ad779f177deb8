"""RMSNorm for Megatron layers, on the Triton kernels of `overlap_tp.kernels.fused_add_rmsnorm`.

- `rmsnorm(x, weight)`: what `input_layernorm` / `pre_mlp_layernorm` / `final_layernorm` compute.
- `fused_add_rmsnorm(x, residual, weight, bias)`: a row-parallel linear's output (standard layout or
  the tile-exact GEMM+ReduceScatter layout) through Megatron's bias-dropout-add into the residual, then
  the next norm, in one kernel; returns what the next sublayer needs: (its input, the residual it adds to).
- `OverlapRMSNorm(config, hidden_size, eps)`: the module for Megatron's layer specs (sequence-parallel
  capable: the norm is per token, and the weight carries Megatron's `sequence_parallel` attribute so
  `finalize_model_grads` all-reduces its gradient across the TP group, as for TE's norms).

Megatron is not imported: any object with the config attributes below works.
"""
import torch

from overlap_tp.kernels.fused_add_rmsnorm import FusedAddRMSNormFunction, RMSNormFunction, TileOrder

__all__ = ["OverlapRMSNorm", "TileOrder", "fused_add_rmsnorm", "rmsnorm"]

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


def rmsnorm(x, weight, *, eps=1e-5, zero_centered_gamma=False, y_out=None):
    """x * rstd(x) * (weight (+ 1)), over the last dimension; x contiguous, any leading shape. y_out: where the
    output goes (x's shape and dtype, contiguous) instead of a new tensor."""
    return RMSNormFunction.apply(x, weight, eps, zero_centered_gamma, y_out)


def fused_add_rmsnorm(x, residual, weight, bias=None, *, eps=1e-5, zero_centered_gamma=False, dropout_p=0.0,
                      training=True, fp32_residual=False, residual_post_norm=False, x_order=None, grad_order=None,
                      x_sum=None, y_out=None):
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
    """
    residual_dtype = torch.float32 if fp32_residual else x.dtype
    normalized, residual_out = FusedAddRMSNormFunction.apply(
        x, residual, weight, bias, eps, zero_centered_gamma, dropout_p if training else 0.0, residual_dtype,
        x_order, grad_order, x_sum, y_out)
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
                       y_out=self.output_buffer(x.shape, x.dtype, x.device))

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
