"""Megatron's TransformerLayer with the attention output, bias-dropout-add and pre-MLP RMSNorm fused.

Megatron's layer runs, after self-attention (x = linear_proj's output, already reduce-scattered back to
the sequence shards under SP):

    hidden = residual + dropout(x + bias)        self_attn_bda      reads x, residual; writes hidden
    normed = RMSNorm(hidden)                     pre_mlp_layernorm  reads hidden; writes normed

`OverlapTransformerLayer` computes both in one kernel (overlap_tp.megatron.norm.fused_add_rmsnorm): one read of
x and residual, one write of each output, and in backward one kernel instead of two. Everything else is
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
            # Megatron's TransformerLayer ignores apply_residual_connection_post_layernorm: so do we.
            normed, hidden = fused_add_rmsnorm(
                x, residual, norm.weight, bias, eps=norm.eps, zero_centered_gamma=norm.zero_centered_gamma,
                dropout_p=prob, training=training, fp32_residual=self.config.fp32_residual_connection)
            self._fused_handover = (hidden, normed)
            return hidden

        return bias_dropout_add_norm

    def _forward_pre_mlp_layernorm(self, hidden_states):
        handover, self._fused_handover = self._fused_handover, None
        if handover is not None and handover[0] is hidden_states:
            return handover[1]
        return super()._forward_pre_mlp_layernorm(hidden_states)
