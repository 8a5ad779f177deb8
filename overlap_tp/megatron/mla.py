"""Multi-latent attention (DeepSeek-V3 / Kimi-K2 style, Megatron's `--multi-latent-attention`) on overlap_tp's ops.

`mla_self_attention_spec(qk_layernorm)` is the `self_attention` slot of overlap_tp's layer spec for MLA: Megatron's
own MLASelfAttention (its RoPE / YaRN, the q / k / v split and concatenation, the latent and positional parts of the
keys) with these submodules, on the sequence-parallel input [s/t, b, h]:

    linear_q_down_proj, linear_kv_down_proj   Megatron's: TELinear (duplicated weights, a local GEMM on this rank's
                                              sequence shard, no communication) where Transformer Engine imports,
                                              else ColumnParallelLinear, as Megatron's local spec (its AllGather of
                                              the input, a GEMM, an AllGather of the output's columns and the scatter
                                              back to the sequence shard; megatron-core takes no other class there)
    q_layernorm, kv_layernorm                 the latent norms, on the sequence shard (qk_layernorm): OverlapQKRMSNorm
                                              (the kv latent is a strided view of the down projection's output); the
                                              weights carry `sequence_parallel`, so Megatron all-reduces their grads
    linear_q_up_proj, linear_kv_up_proj       OverlapColumnParallelLinear: AllGather+GEMM of the normalized latent
                                              (backward: GEMM+ReduceScatter of the dgrad)
    linear_q_proj (q_lora_rank None)          OverlapColumnParallelLinear: AllGather+GEMM of the layer's input
    core_attention                            TEDotProductAttention where TE imports, else SDPAttention (query-key
                                              and value heads of different sizes; packed sequences too)
    linear_proj                               OverlapRowParallelLinear: GEMM+ReduceScatter, whose output
                                              OverlapTransformerLayer adds into the residual and normalizes in one
                                              kernel (the fused add + RMSNorm), as for any attention

What stays Megatron's: the down projections (above), the positional key part's gather (k_pos_emb, qk_pos_emb_head_dim
columns per token, gathered by Megatron's gather_from_sequence_parallel_region where the down projection is
duplicated), RoPE / YaRN, and the inference paths (latent caching, absorption), which the training spec never takes.
With qk_layernorm the query needs q_lora_rank (a query latent to normalize), as in Megatron's local spec.
"""
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from overlap_tp.megatron.attention import core_attention_module
from overlap_tp.megatron.layers import OverlapColumnParallelLinear, OverlapRowParallelLinear

__all__ = ["mla_down_projection", "mla_self_attention_spec"]


def mla_down_projection() -> type:
    """The down projections' class: TELinear (duplicated) where Transformer Engine imports, else Megatron's
    ColumnParallelLinear (the classes megatron-core's MLASelfAttention accepts there)."""
    try:
        import transformer_engine  # noqa: F401  pylint: disable=unused-import
        from megatron.core.extensions.transformer_engine import TELinear
    except ImportError:
        return ColumnParallelLinear
    return TELinear


def mla_self_attention_spec(qk_layernorm: bool, latent_norm: type, column=OverlapColumnParallelLinear,
                            row=OverlapRowParallelLinear) -> ModuleSpec:
    """The self_attention ModuleSpec of an MLA layer (module docstring); `latent_norm` builds the q / kv latent
    norms where qk_layernorm is set; `column` / `row`: the spec entries of the column- and row-parallel linears
    (layer_spec passes them with the model's OverlapSettings as ModuleSpec params)."""
    down = mla_down_projection()
    norm = latent_norm if qk_layernorm else IdentityOp
    return ModuleSpec(
        module=MLASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=column,
            linear_q_down_proj=down,
            linear_q_up_proj=column,
            linear_kv_down_proj=down,
            linear_kv_up_proj=column,
            core_attention=core_attention_module(),
            linear_proj=row,
            q_layernorm=norm,
            kv_layernorm=norm,
        ),
    )
