"""Megatron layer specs whose dense linear layers are overlap_tp's (docs/layers.md).

    get_gpt_layer_overlap_spec(...)   a ModuleSpec for OverlapTransformerLayer (Megatron's TransformerLayer
                                      with self_attn_bda + pre_mlp_layernorm fused into one kernel), like
                                      get_gpt_layer_local_spec, with
        linear_qkv, linear_fc1                 -> OverlapColumnParallelLinear
        linear_proj, linear_fc2                -> OverlapRowParallelLinear
        input_layernorm, pre_mlp_layernorm     -> OverlapRMSNorm (separate norm slots, SP-capable)
        q/k layernorm                          -> TENorm with transformer_impl="transformer_engine" where
                                                  Transformer Engine imports, else OverlapQKRMSNorm
        core_attention                         -> TEDotProductAttention if Transformer Engine is
                                                  importable, else overlap_tp.megatron.attention.SDPAttention
        mlp with num_experts                   -> OverlapMoELayer (get_moe_overlap_module_spec)
        self_attention with multi_latent_attention -> Megatron's MLASelfAttention, its up-projections and
                                                  linear_proj ours (overlap_tp.megatron.mla)
    OverlapSpecProvider                         the BackendSpecProvider behind it

Use it where Megatron takes a layer spec, e.g. `GPTModel(config, transformer_layer_spec=
get_gpt_layer_overlap_spec(qk_layernorm=True), ...)`, with config.normalization = "RMSNorm" and
bf16/fp16 params. How the overlap runs comes from the `settings` given (an OverlapSettings, carried to every
overlap_tp module through ModuleSpec params) or later `overlap_tp.megatron.layers.set_overlap_config(model, ...)`.
"""
from typing import Optional

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import BackendSpecProvider
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import L2Norm
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from overlap_tp.megatron.attention import core_attention_module
from overlap_tp.megatron.layers import OverlapColumnParallelLinear, OverlapRowParallelLinear
from overlap_tp.megatron.mla import mla_self_attention_spec
from overlap_tp.megatron.moe_layer import OverlapGroupedMLP, OverlapMoELayer
from overlap_tp.megatron.norm import OverlapRMSNorm
from overlap_tp.megatron.settings import DEFAULT_SETTINGS, OverlapSettings
from overlap_tp.megatron.transformer_layer import LayerChain, OverlapTransformerLayer

__all__ = ["OverlapQKRMSNorm", "OverlapSpecProvider", "get_gpt_layer_overlap_spec", "get_moe_overlap_module_spec"]

NO_EXPERTS_FOR_MEGATRON_MOE = (
    "OverlapSpecProvider has no experts module for Megatron's MoELayer: overlap_tp's experts (OverlapGroupedMLP) "
    "run inside OverlapMoELayer, whose dispatch and combine are fused with the expert GEMMs. Build MoE layers "
    "with get_gpt_layer_overlap_spec(num_experts=...) or get_moe_overlap_module_spec()")


class OverlapQKRMSNorm(OverlapRMSNorm):
    """OverlapRMSNorm for the q/k layernorm slots: its input is a strided view of the fused QKV output (or, in MLA's
    q / kv latent norm slots, of the down projection's output). Megatron all-reduces these weights' grads over TP
    (by name, q_layernorm / k_layernorm, or by the `sequence_parallel` attribute)."""

    def forward(self, x):
        return super().forward(x.contiguous())


class OverlapSpecProvider(BackendSpecProvider):
    """Megatron's BackendSpecProvider for overlap_tp: our linears, our RMSNorm, TE or SDPA attention."""

    def column_parallel_linear(self) -> type:
        return OverlapColumnParallelLinear

    def row_parallel_linear(self) -> type:
        return OverlapRowParallelLinear

    def fuse_layernorm_and_linear(self) -> bool:
        """The norm stays a separate module (its own input_layernorm / pre_mlp_layernorm slot)."""
        return False

    def column_parallel_layer_norm_linear(self) -> Optional[type]:
        return None

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        if not rms_norm:
            raise NotImplementedError("OverlapSpecProvider provides RMSNorm only (OverlapRMSNorm); set "
                                      "config.normalization='RMSNorm' / --normalization RMSNorm")
        return OverlapQKRMSNorm if for_qk else OverlapRMSNorm

    def core_attention(self) -> type:
        return core_attention_module()

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool = False):
        """(megatron-core <= 0.18 passes both flags, >= 0.19 only the first.)"""
        raise NotImplementedError(NO_EXPERTS_FOR_MEGATRON_MOE)

    def activation_func(self) -> type:
        return None


def _with_settings(module: type, settings: Optional[OverlapSettings]):
    """`module` as a spec entry that builds it with `settings` (ModuleSpec params), or the class itself where there
    are none to pass."""
    return module if settings is None else ModuleSpec(module=module, params={"settings": settings})


def get_moe_overlap_module_spec(settings: Optional[OverlapSettings] = None) -> ModuleSpec:
    """The MoE `mlp` slot: OverlapMoELayer with OverlapGroupedMLP experts (always one grouped GEMM per op,
    so moe_grouped_gemm changes nothing) and Megatron's SharedExpertMLP on overlap_tp's linears; settings (an
    OverlapSettings) reach the experts and the shared experts' linears."""
    backend = OverlapSpecProvider()
    shared = MLPSubmodules(linear_fc1=_with_settings(backend.column_parallel_linear(), settings),
                           linear_fc2=_with_settings(backend.row_parallel_linear(), settings))
    return ModuleSpec(module=OverlapMoELayer,
                      submodules=MoESubmodules(experts=_with_settings(OverlapGroupedMLP, settings),
                                               shared_experts=ModuleSpec(module=SharedExpertMLP, submodules=shared)))


def te_norm_module(transformer_impl: Optional[str]) -> Optional[type]:
    """Transformer Engine's norm (TENorm) for the norms that carry no TP communication (q/k layernorm, the
    block's final norm) when `transformer_impl` is "transformer_engine" and TE imports; else None."""
    if transformer_impl != "transformer_engine":
        return None
    try:
        import transformer_engine  # noqa: F401  pylint: disable=unused-import
        from megatron.core.extensions.transformer_engine import TENorm
    except ImportError:
        return None
    return TENorm


def get_gpt_layer_overlap_spec(num_experts: Optional[int] = None, moe_grouped_gemm: Optional[bool] = False,
                               qk_layernorm: Optional[bool] = False, multi_latent_attention: Optional[bool] = False,
                               fp8: Optional[str] = None, moe_use_legacy_grouped_gemm: Optional[bool] = False,
                               normalization: Optional[str] = None, qk_l2_norm: Optional[bool] = False,
                               transformer_impl: Optional[str] = None, fused_norms: Optional[bool] = None,
                               settings: Optional[OverlapSettings] = None, chain: Optional[LayerChain] = None,
                               **unused_kwargs) -> ModuleSpec:
    """A TransformerLayer spec (the arguments of get_gpt_layer_local_spec) on overlap_tp's layers; with
    num_experts the MLP is OverlapMoELayer (moe_grouped_gemm and moe_use_legacy_grouped_gemm change nothing).

    transformer_impl="transformer_engine" with Transformer Engine importable: the q/k layernorms are TENorm.
    The input and pre-MLP norms stay OverlapRMSNorm whatever the impl: they are fused with the residual add
    (OverlapTransformerLayer), and TE's LayerNorm+Linear fusion would take the norm into qkv / fc1, whose
    AllGather+GEMM is overlap_tp's. Core attention: TEDotProductAttention where TE imports, else SDPA.

    settings: the OverlapSettings every overlap_tp module of the spec is built with (ModuleSpec params): the linears'
    configs per op kind, the MoE experts' config, the layer's switches. None: the defaults (OverlapSettings()).
    chain: the LayerChain the layers built from this spec link through (the MLP boundary); None: a new one, so that
    the layers one spec builds in a block link; a block spec of several layer specs (dense and MoE) passes one.
    fused_norms (default: settings.fused_norms) False: the layer is Megatron's TransformerLayer, which runs the
    bias-dropout-adds and the norms as separate kernels (same submodules, same checkpoint keys)."""
    if fused_norms is None:
        fused_norms = (settings or DEFAULT_SETTINGS).fused_norms
    if multi_latent_attention and qk_l2_norm:
        raise NotImplementedError("overlap_tp: qk_l2_norm with multi-latent attention (Megatron does not support it "
                                  "either)")
    if fp8 is not None and num_experts is not None:
        raise NotImplementedError("overlap_tp: FP8 with MoE layers: the expert ops are bf16 (docs/fp8.md); the dense "
                                  "linears run FP8 from the model config (config.fp8, config.fp8_recipe)")
    if normalization not in (None, "RMSNorm"):
        raise NotImplementedError(f"overlap_tp: normalization={normalization!r}: the overlap spec provides RMSNorm "
                                  f"only (OverlapRMSNorm)")
    backend = OverlapSpecProvider()
    layer_norm = backend.layer_norm(rms_norm=True, for_qk=False)
    qk_norm = L2Norm if qk_l2_norm else (
        (te_norm_module(transformer_impl) or backend.layer_norm(rms_norm=True, for_qk=True)) if qk_layernorm
        else IdentityOp)
    column, row = (_with_settings(backend.column_parallel_linear(), settings),
                   _with_settings(backend.row_parallel_linear(), settings))
    if multi_latent_attention:   # overlap_tp.megatron.mla: the up-projections and linear_proj on our ops
        self_attention = mla_self_attention_spec(qk_layernorm, backend.layer_norm(rms_norm=True, for_qk=True),
                                                 column=column, row=row)
    else:
        self_attention = ModuleSpec(
            module=SelfAttention,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(
                linear_qkv=column,
                core_attention=backend.core_attention(),
                linear_proj=row,
                q_layernorm=qk_norm,
                k_layernorm=qk_norm,
            ),
        )
    return ModuleSpec(
        module=OverlapTransformerLayer if fused_norms else TransformerLayer,
        params=({"chain": chain if chain is not None else LayerChain(),
                 **({"settings": settings} if settings is not None else {})} if fused_norms else {}),
        submodules=TransformerLayerSubmodules(
            input_layernorm=layer_norm,
            self_attention=self_attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=layer_norm,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row),
            ) if num_experts is None else get_moe_overlap_module_spec(settings),
            mlp_bda=get_bias_dropout_add,
            # checkpoints interchange with Megatron's local and TE specs (same key map as the local spec; an
            # MoE layer keeps its pre_mlp_layernorm keys, as Megatron's TE MoE spec, where no fc1 fuses it)
            # (MLA: Megatron's MLA specs keep input_layernorm under its own key)
            sharded_state_dict_keys_map={
                **({} if multi_latent_attention else {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}),
                **({"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"} if num_experts is None else {}),
            },
        ),
    )
