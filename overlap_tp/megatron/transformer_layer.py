"""Megatron's TransformerLayer with the attention output, bias-dropout-add and pre-MLP RMSNorm fused.

Megatron's layer runs, after self-attention (x = linear_proj's output, already reduce-scattered back to
the sequence shards under SP):

    hidden = residual + dropout(x + bias)        self_attn_bda      reads x, residual; writes hidden
    normed = RMSNorm(hidden)                     pre_mlp_layernorm  reads hidden; writes normed

`OverlapTransformerLayer` computes both in one kernel (overlap_tp.megatron.norm.fused_add_rmsnorm): one read of
x and residual, one write of each output, and in backward one kernel instead of two. When linear_proj's
reduce-scatter runs on the p2p transport (overlap_tp/ops/p2p.py), x itself is never written: the kernel reads the
t received partials and sums them (one pass over the activation and one launch less): the layer asks linear_proj
to defer its sum (OverlapRowParallelLinear.defer_sum_next) for the span of its attention block, and the fused bda
runs the deferred sum it finds on x. Everything else is
Megatron's own code: the subclass only swaps `self_attn_bda` for a function that runs the fused kernel
and hands its normalized output to `_forward_pre_mlp_layernorm`, which returns it instead of running the
norm again. The handover is keyed on the tensor's identity, so a layer whose forward did not come through
the fused bda (or a recompute that re-runs it) never sees a stale result.

The fused path needs what it replaces to be plain: an OverlapRMSNorm as pre_mlp_layernorm, no
cross-attention, no recompute or CPU offload of the pre-MLP norm. Otherwise the layer is Megatron's
TransformerLayer unchanged, and says so once (a warning naming the reason).
"""
import warnings
from typing import Optional

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_layer import TransformerLayer

from overlap_tp.megatron.layers import OverlapRowParallelLinear
from overlap_tp.megatron.norm import OverlapRMSNorm, fused_add_rmsnorm

__all__ = ["OverlapTransformerLayer"]

_warned = set()


class OverlapTransformerLayer(TransformerLayer):
    """TransformerLayer whose self-attention bias-dropout-add and pre-MLP RMSNorm run as one kernel."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._fused_handover = None   # (hidden, normed) from the fused bda, consumed by the pre-MLP norm
        reason = self._unfusable_reason()
        self.fused_attn_norm = reason is None
        proj = getattr(self.self_attention, "linear_proj", None)
        # linear_proj's p2p sum summed by the fused kernel (offloading would copy its unwritten output)
        self.fused_proj_sum = (self.fused_attn_norm and isinstance(proj, OverlapRowParallelLinear)
                               and proj.sequence_parallel and not getattr(self.self_attention, "offload_attn_proj",
                                                                          False))
        if self.fused_attn_norm:
            self.self_attn_bda = self._fused_attn_bda
        elif reason not in _warned:
            _warned.add(reason)
            warnings.warn(f"OverlapTransformerLayer: running Megatron's separate bias-dropout-add and pre-MLP "
                          f"norm because {reason}")

    def _unfusable_reason(self) -> Optional[str]:
        if type(self.pre_mlp_layernorm) is not OverlapRMSNorm:
            return f"pre_mlp_layernorm is {type(self.pre_mlp_layernorm).__name__}, not OverlapRMSNorm"
        if not isinstance(self.cross_attention, IdentityOp) or not isinstance(self.pre_cross_attn_layernorm,
                                                                              IdentityOp):
            return "the layer has cross-attention (the bda's output is not the pre-MLP norm's input)"
        if getattr(self, "recompute_pre_mlp_layernorm", False):
            return "the pre-MLP norm is recomputed (recompute_modules includes 'layernorm')"
        if getattr(self, "offload_mlp_norm", False) or getattr(self, "offload_attn_norm", False):
            return "norm activations are offloaded to the CPU"
        if getattr(self.config, "inference_fuse_tp_communication", False):
            return "config.inference_fuse_tp_communication fuses the residual into linear_proj instead"
        return None

    def _fused_attn_bda(self, training: bool, fused: bool):
        """Stands in for `get_bias_dropout_add(training, fused)`: returns Megatron's bda signature."""
        norm = self.pre_mlp_layernorm

        def bias_dropout_add_norm(x_with_bias, residual, prob):
            x, bias = x_with_bias
            x_sum = getattr(x, "overlap_tp_deferred_sum", None)   # linear_proj left its p2p sum to this kernel
            if x_sum is not None:
                del x.overlap_tp_deferred_sum
            # Megatron's TransformerLayer ignores apply_residual_connection_post_layernorm: so do we.
            normed, hidden = fused_add_rmsnorm(
                x, residual, norm.weight, bias, eps=norm.eps, zero_centered_gamma=norm.zero_centered_gamma,
                dropout_p=prob, training=training, fp32_residual=self.config.fp32_residual_connection, x_sum=x_sum)
            self._fused_handover = (hidden, normed)
            return hidden

        return bias_dropout_add_norm

    def _forward_attention(self, *args, **kwargs):
        """Megatron's attention block (self-attention, then the bda), with linear_proj's p2p sum deferred to the
        fused bda's kernel when the layer fuses them; an output left unsummed is an error, never a silent read."""
        if not self.fused_proj_sum:
            return super()._forward_attention(*args, **kwargs)
        proj = self.self_attention.linear_proj
        proj.defer_sum_next = True
        try:
            out = super()._forward_attention(*args, **kwargs)
        finally:
            proj.defer_sum_next = False
        deferred, proj.deferred_sum = proj.deferred_sum, None
        if deferred is not None and not deferred.done:
            raise RuntimeError("OverlapTransformerLayer: linear_proj's output reached something other than the fused "
                               "bias-dropout-add + norm while its p2p sum was left to that kernel")
        return out

    def _forward_pre_mlp_layernorm(self, hidden_states):
        handover, self._fused_handover = self._fused_handover, None
        if handover is not None and handover[0] is hidden_states:
            return handover[1]
        return super()._forward_pre_mlp_layernorm(hidden_states)
