"""Core attention for the overlap layer spec where Transformer Engine is absent.

`SDPAttention` has the constructor and forward signature of Megatron's `DotProductAttention`
(the `core_attention` slot of `SelfAttentionSubmodules`) and runs
`torch.nn.functional.scaled_dot_product_attention`: flash / memory-efficient kernels on the GPU (the math
kernel under Megatron's --deterministic-mode: the others' backward is not bit-exact run to run), the
math kernel on the CPU, so a layer built from our spec also runs in CPU tests (Megatron's own
DotProductAttention allocates its score buffer on CUDA).

Input/output layout is Megatron's: query [sq, b, np, hn], key/value [sk, b, ng, hn] (GQA: ng divides
np) -> context [sq, b, np * hn]. Masks follow Megatron's convention (True = masked out); with
attn_mask_type causal and no mask given, the causal mask is implied (is_causal).

Packed sequences (`packed_seq_params` with qkv_format 'thd': query [t, np, hn], key/value [t, ng, hn] ->
[t, np * hn]): each sequence attends to itself only, through torch's varlen_attn where it can run the call, else
SDPA with a document mask (overlap_tp.megatron.packed_attention).
"""
import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

from overlap_tp.megatron import packed_attention

__all__ = ["SDPAttention", "core_attention_module"]


class SDPAttention(MegatronModule):
    """Megatron's DotProductAttention contract on torch's scaled_dot_product_attention."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 k_channels: Optional[int] = None, v_channels: Optional[int] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, **unused_kwargs):
        super().__init__(config=config)
        name = type(self).__name__
        if getattr(config, "context_parallel_size", 1) != 1:
            raise NotImplementedError(f"{name}: context_parallel_size={config.context_parallel_size} needs "
                                      f"Transformer Engine's TEDotProductAttention (install transformer-engine)")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise NotImplementedError(f"{name}: softmax_type={config.softmax_type!r} is not supported")
        if getattr(config, "window_size", None) is not None:
            raise NotImplementedError(f"{name}: sliding-window attention (window_size) is not supported")
        if pg_collection is not None and hasattr(pg_collection, "tp"):
            tp_size = pg_collection.tp.size()
        else:
            from megatron.core import parallel_state
            tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        # k_channels / v_channels: the query-key and value head sizes where they differ from kv_channels (MLA)
        self.hidden_size_per_attention_head = k_channels if k_channels is not None else config.kv_channels
        value_head = v_channels if v_channels is not None else config.kv_channels
        self.hidden_size_per_partition = divide(value_head * config.num_attention_heads, tp_size)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)
        # apply_query_key_layer_scaling divides the scale by the layer number and multiplies the fp32
        # scores back: the same softmax, so it needs no handling here.
        self.softmax_scale = (1.0 / math.sqrt(self.hidden_size_per_attention_head)
                              if softmax_scale is None else softmax_scale)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **unused_kwargs):
        name = type(self).__name__
        if attention_bias is not None:
            raise NotImplementedError(f"{name}: attention_bias is not supported")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if packed_seq_params is not None:
            return self._forward_packed(query, key, value, attention_mask, mask_type, packed_seq_params)
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))   # [b, np, s, hn]
        mask, is_causal = None, False
        if attention_mask is not None:
            mask = ~attention_mask if attention_mask.dtype == torch.bool else attention_mask
        elif mask_type == AttnMaskType.causal and q.shape[2] > 1:
            is_causal = True
        elif mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask, AttnMaskType.padding):
            raise NotImplementedError(f"{name}: attn_mask_type={mask_type} needs an explicit attention_mask")
        dropout_p = self.dropout_p if self.training else 0.0
        context = self._attend(q, k, v, mask, is_causal, dropout_p)
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return context.permute(2, 0, 1, 3).reshape(context.shape[2], context.shape[0], self.hidden_size_per_partition)

    def _forward_packed(self, query, key, value, attention_mask, mask_type, packed):
        """THD: query [t, np, hn], key / value [t, ng, hn] / [t, ng, hv] (Megatron squeezes the batch of 1) ->
        [t, np * hv], each sequence of the pack attending to itself only (overlap_tp.megatron.packed_attention)."""
        name = type(self).__name__
        if packed.qkv_format != "thd":
            raise NotImplementedError(f"{name}: packed_seq_params with qkv_format={packed.qkv_format!r}: packed "
                                      f"sequences run in the 'thd' format (or use TEDotProductAttention)")
        if attention_mask is not None:
            raise NotImplementedError(f"{name}: packed sequences with an attention_mask: the sequences' bounds "
                                      f"(cu_seqlens) are the mask; pass attention_mask=None")
        if mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask, AttnMaskType.padding,
                             AttnMaskType.padding_causal):
            raise NotImplementedError(f"{name}: packed sequences with attn_mask_type={mask_type}")
        if query.dim() != 3:
            raise ValueError(f"{name}: packed sequences expect query [t, np, hn], got {tuple(query.shape)}")
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        dropout_p = self.dropout_p if self.training else 0.0
        deterministic = getattr(self.config, "deterministic_mode", False)
        if packed_attention.uses_varlen(query, packed, causal=causal, dropout_p=dropout_p,
                                        deterministic=deterministic, value_head_dim=value.shape[-1]):
            context = packed_attention.varlen_attention(query, key, value, packed, causal=causal,
                                                        scale=self.softmax_scale)
            return context.reshape(context.shape[0], -1)
        mask = packed_attention.document_mask(packed, query.shape[0], key.shape[0], causal, query.device)
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)
        q, k, v = (t.permute(1, 0, 2).unsqueeze(0) for t in (query, key, value))   # [1, np, t, hn]
        context = self._attend(q, k, v, mask, False, dropout_p)
        # [1, np, t, hv] -> [t, np * hv] (hv: the value heads' size as given; MLA pads them to the query's in THD)
        return context[0].permute(1, 0, 2).reshape(context.shape[2], -1)

    def _attend(self, q, k, v, mask, is_causal, dropout_p):
        # --deterministic-mode: the flash and cuDNN kernels' backward accumulate dQ with atomics (two identical
        # steps differ; so does the memory-efficient one's), so the math kernel runs: bit-exact run to
        # run, at the memory and time cost of materialised scores (as Megatron's own local attention).
        deterministic = getattr(self.config, "deterministic_mode", False) and q.is_cuda
        # Megatron draws attention dropout from the model-parallel RNG stream (different per TP rank)
        tp_rng = dropout_p > 0.0 and q.is_cuda and not self.config.sequence_parallel
        if tp_rng:
            from megatron.core.tensor_parallel import get_cuda_rng_tracker
        with (sdpa_kernel([SDPBackend.MATH]) if deterministic else contextlib.nullcontext()), \
                (get_cuda_rng_tracker().fork() if tp_rng else contextlib.nullcontext()):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                                  scale=self.softmax_scale)

def core_attention_module():
    """TEDotProductAttention when Transformer Engine is importable, else SDPAttention."""
    try:
        import transformer_engine  # noqa: F401  pylint: disable=unused-import
        from megatron.core.extensions.transformer_engine import TEDotProductAttention
        return TEDotProductAttention
    except ImportError:
        return SDPAttention
