"""Transformer Engine baselines of the layer benchmark: Megatron's own TE layer, as Megatron-LM trains it by default
(`--transformer-impl transformer_engine`), with and without TE's userbuffers overlap (`--tp-comm-overlap`).

    te      get_gpt_layer_with_transformer_engine_spec(): Megatron's TransformerLayer on TE's modules:
            TELayerNormColumnParallelLinear for linear_qkv and linear_fc1 (the RMSNorm fused into the linear),
            TERowParallelLinear for linear_proj and linear_fc2, TEDotProductAttention; the sequence-parallel
            AllGather / ReduceScatter are TE's own NCCL collectives, not overlapped with the GEMMs
    te-ub   the same layer with config.tp_comm_overlap=True (`--tp-comm-overlap`), after userbuffers are
            initialised as megatron.training.initialize._initialize_tp_communicators does it with no
            --tp-comm-overlap-cfg: transformer_engine.pytorch.module.base.initialize_ub(shape=[s * b, h],
            tp_size=t, quantization_modes=[NONE] (bf16 buffers), ub_cfgs={} (TE's default per-GEMM methods),
            bootstrap_backend="nccl"), with UB_SKIPMC=1 (CUDA IPC in place of NVLink multicast) unless the
            environment sets it

TE's linears overlap only where sequence parallelism is on (t >= 2): at t = 1 the te-ub layer is built and run
with userbuffers initialised, but none of its linears takes a userbuffers path (`active_userbuffers` counts the
linears that do; the layer benchmark reports it).

Parameter names: TE's layer keeps the input and pre-MLP norm weights inside the fused linears
(`self_attention.linear_qkv.layer_norm_weight`, `mlp.linear_fc1.layer_norm_weight`); `reference_name` maps them to
the separate norm slots of Megatron's local spec and of overlap_tp's (`input_layernorm.weight`,
`pre_mlp_layernorm.weight`); every other name, and every shard, is the same at the same t.
"""
import copy
import importlib
import importlib.util
import os

__all__ = ["TE_SPECS", "UB_LINEAR_FLAGS", "active_userbuffers", "build_te_layer", "initialize_userbuffers",
           "reference_name", "release_userbuffers", "te_problem", "te_version"]

TE_SPECS = ("te", "te-ub")   # the layer benchmark's spec kinds (and configuration names) of TE's layer
TE_TO_REFERENCE = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
                   "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}
# a TE linear's attributes that say it runs a GEMM through userbuffers (transformer_engine.pytorch.module.linear /
# layernorm_linear: set where sequence parallelism is on and the ub_* arguments asked for it)
UB_LINEAR_FLAGS = ("ub_overlap_ag_fprop", "ub_overlap_rs_fprop", "ub_overlap_ag_dgrad", "ub_overlap_rs_dgrad",
                   "ub_bulk_wgrad", "ub_bulk_dgrad")


def te_problem():
    """Why Transformer Engine's PyTorch modules cannot be used here (one line), or None."""
    try:
        importlib.import_module("transformer_engine.pytorch")
        importlib.import_module("megatron.core.extensions.transformer_engine")
    except Exception as error:   # ImportError, or TE's own load errors (a missing library, no CUDA)
        return f"Transformer Engine does not import here ({type(error).__name__}: {str(error)[:200]})"
    return None


def te_version():
    """transformer_engine's version string where it is installed, else None (without importing it)."""
    from importlib.metadata import PackageNotFoundError, version
    for name in ("transformer_engine", "transformer-engine"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    spec = importlib.util.find_spec("transformer_engine")
    return "unknown version" if spec is not None else None


def reference_name(name: str) -> str:
    """The name a TE layer's parameter has in Megatron's local spec and in overlap_tp's."""
    return TE_TO_REFERENCE.get(name, name)


def initialize_userbuffers(tokens: int, hidden: int, tp: int):
    """Userbuffers for a layer of [tokens, hidden] activations at TP `tp`, as Megatron's
    _initialize_tp_communicators sets them up (module docstring); any earlier ones are destroyed first (one set per
    shape). Collective: every rank of the world calls it."""
    os.environ.setdefault("UB_SKIPMC", "1")
    from transformer_engine.pytorch.module import base
    base.destroy_ub()
    base.initialize_ub(shape=[tokens, hidden], tp_size=tp, quantization_modes=[base.UserBufferQuantizationMode.NONE],
                       ub_cfgs={}, bootstrap_backend="nccl")


def release_userbuffers():
    """Destroy the userbuffers communicators, where TE is loaded and has any."""
    import sys
    if "transformer_engine.pytorch" in sys.modules:
        from transformer_engine.pytorch.module import base
        base.destroy_ub()


def build_te_layer(kind: str, config, layer_number: int = 1):
    """Megatron's TE TransformerLayer ('te'), or the same with config.tp_comm_overlap ('te-ub'; userbuffers must be
    initialised first: initialize_userbuffers), on the current CUDA device."""
    if kind not in TE_SPECS:
        raise ValueError(f"unknown TE layer kind {kind!r}: expected one of {TE_SPECS}")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.spec_utils import build_module
    config = copy.copy(config)
    config.tp_comm_overlap = kind == "te-ub"
    return build_module(get_gpt_layer_with_transformer_engine_spec(), config=config, layer_number=layer_number)


def active_userbuffers(layer) -> int:
    """How many modules of `layer` run a GEMM through userbuffers (any of UB_LINEAR_FLAGS set)."""
    return sum(any(getattr(module, flag, False) for flag in UB_LINEAR_FLAGS) for module in layer.modules())
