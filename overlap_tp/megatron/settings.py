"""OverlapSettings: how overlap_tp's Megatron layers run, one frozen object carried by the layers.

    settings = OverlapSettings(gemm_rs=OverlapConfig(method="signal"), gather_in_place=True)
    spec = get_gpt_layer_overlap_spec(settings=settings)     # every overlap_tp module of the spec gets it

`megatron_patches.apply(args)` builds it from the flags (`settings_from_args`); a Python user builds it directly.
It reaches the layers through the layer spec (ModuleSpec params: the linears, OverlapTransformerLayer,
OverlapMoELayer each take `settings=`), so two models built with different settings in one process keep theirs;
nothing is read from process globals. The op configs it holds may leave fields unset: the ops' resolver
(overlap_tp/ops/resolve.py) fills them per shape when a plan is built.
"""
import dataclasses
from dataclasses import dataclass
from typing import Optional

from overlap_tp.ops.config import OverlapConfig

OP_KINDS = ("ag_gemm", "gemm_rs", "gemm_ar")   # the dense layers' op kinds
LAYER_SWITCHES = ("fused_norms", "gather_in_place", "defer_wgrad", "token_split", "fp8_wgrad")


@dataclass(frozen=True)
class OverlapSettings:
    """ag_gemm, gemm_rs, gemm_ar: the dense linears' OverlapConfig per op kind (a layer's own `overlap_config`
    attribute, where set, wins). moe: the MoE layers' expert ops' OverlapConfig (None: an MoE model keeps Megatron's
    MoE layer where apply builds the spec; an OverlapMoELayer built directly then runs the expert ops' defaults).
    fused_norms: OverlapTransformerLayer (bias-dropout-add and norm in one kernel) rather than Megatron's layer.
    gather_in_place: the norms write into linear_qkv's and linear_fc1's own gathered buffers (OverlapTransformerLayer).
    defer_wgrad: with gather_in_place, linear_fc1's wgrad runs inside linear_proj's backward (WgradHandoff).
    token_split: each micro-batch as two interleaved halves of its sequences (OverlapTransformerLayer).
    fp8_wgrad: under Megatron's FP8 flags, the linears' weight gradients in FP8 too (fp8_linear.py; Megatron's
    --no-fp8-wgrad keeps them bf16 whatever this says)."""

    ag_gemm: OverlapConfig = OverlapConfig()
    gemm_rs: OverlapConfig = OverlapConfig()
    gemm_ar: OverlapConfig = OverlapConfig()
    moe: Optional[OverlapConfig] = None
    fused_norms: bool = True
    gather_in_place: bool = False
    defer_wgrad: bool = False
    token_split: bool = False
    fp8_wgrad: bool = False

    def __post_init__(self):
        for op in OP_KINDS + ("moe",):
            value = getattr(self, op)
            if not (isinstance(value, OverlapConfig) or (op == "moe" and value is None)):
                raise TypeError(f"OverlapSettings.{op} must be an OverlapConfig, got {type(value).__name__}")
        for name in LAYER_SWITCHES:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"OverlapSettings.{name}={getattr(self, name)!r}: expected True or False")

    def config(self, op: str) -> OverlapConfig:
        """The OverlapConfig of dense op kind `op`."""
        if op not in OP_KINDS:
            raise ValueError(f"unknown op kind {op!r}; expected one of {OP_KINDS}")
        return getattr(self, op)

    def configs(self) -> dict:
        """{op kind: OverlapConfig} of the dense op kinds."""
        return {op: getattr(self, op) for op in OP_KINDS}

    def with_configs(self, config: Optional[OverlapConfig] = None, **per_op: OverlapConfig) -> "OverlapSettings":
        """These settings with `config` for every dense op kind, then the keywords (ag_gemm=, gemm_rs=, gemm_ar=)."""
        return dataclasses.replace(self, **({op: config for op in OP_KINDS} if config is not None else {}), **per_op)


DEFAULT_SETTINGS = OverlapSettings()
