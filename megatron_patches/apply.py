"""`apply(args)`: switch a Megatron training run to overlap_tp's layers, through Megatron's own hooks.

What it changes (only when `--overlap-tp` or `--overlap-moe` is not off, or `--overlap-tp-layers` is given):

- `args.spec` becomes `["overlap_tp.megatron_patches.spec", "flags"]` (SPEC). Megatron's GPT builders
  read `--spec`: megatron-core >= 0.19's `gpt_config_from_args` puts it into
  `GPTModelConfig.transformer_layer_spec` and `GPTModelBuilder` calls it with the model config and
  `vp_stage`; Megatron-LM's `gpt_builders.py` passes it to GPTModel as a block spec. `spec.flags` is
  both (megatron_patches/spec.py), so either way the model is built with `overlap_layer_spec`, which asks
  `overlap_tp.megatron.layer_spec.get_gpt_layer_overlap_spec` for the TransformerLayer spec. No Megatron
  function is patched.
- the layers' OverlapSettings (`overlap_tp.megatron.settings_from_args.settings_from_args`: the configs per op kind
  from `--overlap-tp` and `--overlap-tp-config`, the MoE layers' from `--overlap-moe`, the layer switches), readable
  as `get_settings()`: the spec built from `--spec` carries them to every overlap_tp module (ModuleSpec params).
  MoE models: with `--overlap-moe` on, every MoE layer's MLP (every layer, or those `--moe-layer-freq` makes MoE;
  the others get the dense MLP, on the same settings) is overlap_tp's OverlapMoELayer; with it off, the MLP slot
  of overlap_tp's layer spec holds the MoE module Megatron's own spec would build (its MoELayer, untouched). The
  layer is OverlapTransformerLayer, or Megatron's TransformerLayer with the file's layers.fused_norms false.
- `OVERLAP_TP_TUNE_CACHE` in the environment: `--overlap-tp-tune-cache`, else the variable as the user
  set it, else `overlap_tp_tune.json` in Megatron's `--save` folder
  (`overlap_tp.megatron.arguments.tune_cache_path`); with none of them it stays unset and the tuner
  writes nothing.
- the tuner's timing regime (`overlap_tp.tune.timing.set_regime`): under `--cuda-graph-impl local` or
  `full_iteration`, `method='auto'` times its candidates as CUDA graph replays, as the run executes them.

Applying twice changes nothing more (the second report lists no change). With `--overlap-tp off`,
`--overlap-moe off` and no `--overlap-tp-layers` nothing is touched. Run `validate_overlap_args(args)` first.
"""
import dataclasses
import inspect
import os

from overlap_tp.megatron.arguments import TUNE_CACHE_ENV, tune_cache_path
from overlap_tp.megatron.settings import LAYER_SWITCHES, OP_KINDS
from overlap_tp.megatron.settings_from_args import settings_from_args
from overlap_tp.tune import timing as tune_timing

# What apply() puts into --spec: overlap_tp.megatron_patches.spec's `flags`, a block spec that Megatron's
# builders take as a ModuleSpec (Megatron-LM's gpt_builders.py) or call with the model config and vp_stage
# (megatron-core >= 0.19's GPTModelBuilder); either way it builds overlap_layer_spec.
SPEC = ("overlap_tp.megatron_patches.spec", "flags")
SPEC_MODULE = SPEC[0]
SPEC_ATTRIBUTES = ("flags", "signal", "decompose", "auto", "off")   # megatron_patches.spec's block specs


def is_overlap_spec(spec):
    """Whether `--spec` names one of overlap_tp's specs (apply's, or one chosen directly), or the callable
    `overlap_layer_spec` of this module."""
    spec = list(spec or [])
    return spec == [__name__, "overlap_layer_spec"] or (
        len(spec) == 2 and spec[0] == SPEC_MODULE and spec[1] in SPEC_ATTRIBUTES)

# The settings the last apply() built, for the block spec Megatron's builders get by name from --spec
# (megatron_patches.spec): the one registry between the flags and the model build.
_APPLIED = {"settings": None}


@dataclasses.dataclass
class ApplyReport:
    """What `apply` did. `active`: overlap_tp's layers are in use; `settings`: the OverlapSettings the layers are
    built with; `changed`: what this call changed."""

    active: bool
    settings: object = None
    changed: list = dataclasses.field(default_factory=list)

    def __str__(self):
        if not self.active:
            return "[overlap_tp] --overlap-tp off: Megatron's own layers, nothing changed"
        head = f"[overlap_tp] layers on, {_describe(self.settings)}"
        if not self.changed:
            return head + "; already applied, nothing changed"
        return head + "".join(f"\n[overlap_tp]   {line}" for line in self.changed)


def _describe(settings):
    """gemm_rs's config, what the other op kinds set differently, the MoE config and the layer switches on."""
    base = settings.gemm_rs
    fields = [f.name for f in dataclasses.fields(base)]
    parts = [f"{base}"]
    for op in ("ag_gemm", "gemm_ar"):
        diff = {f: getattr(settings.config(op), f) for f in fields
                if getattr(settings.config(op), f) != getattr(base, f)}
        if diff:
            parts.append(f"{op}: " + ", ".join(f"{k}={v!r}" for k, v in diff.items()))
    if settings.moe is not None:
        parts.append(f"MoE layers on, {settings.moe}")
    switches = [name for name in LAYER_SWITCHES if getattr(settings, name) and name != "fused_norms"]
    if not settings.fused_norms:
        switches.append("Megatron's TransformerLayer (fused_norms false)")
    return "; ".join(parts + ([", ".join(switches)] if switches else []))


def get_settings():
    """The OverlapSettings `apply` built (None before, or when overlap_tp's layers are off)."""
    return _APPLIED["settings"]


def get_overlap_config(op: str = "gemm_rs"):
    """The OverlapConfig that `apply` set for op kind `op` (None before, or when overlap_tp's layers are off)."""
    settings = _APPLIED["settings"]
    return None if settings is None else settings.config(op)


def get_moe_overlap_config():
    """The MoE layers' OverlapConfig set by `apply` (None before, or when --overlap-moe is off)."""
    settings = _APPLIED["settings"]
    return None if settings is None else settings.moe


def reset():
    """Forget what apply() set (tests)."""
    _APPLIED["settings"] = None
    tune_timing.set_regime("eager")


def wanted(args):
    return (getattr(args, "overlap_tp", "off") != "off" or bool(getattr(args, "overlap_tp_layers", False))
            or getattr(args, "overlap_moe", "off") != "off")


def apply(args, *, log=None):
    """Make `args` build overlap_tp's layers; return an ApplyReport (also printed on rank 0)."""
    if log is None:
        log = _log_rank0
    if not wanted(args):
        report = ApplyReport(active=False)
        log(str(report))
        return report

    settings = settings_from_args(args)
    report = ApplyReport(active=True, settings=settings)
    previous = _APPLIED["settings"]
    if previous != settings:
        if previous is None:
            report.changed.append(f"the layers' settings: {_describe(settings)}")
        else:
            for name in OP_KINDS + ("moe",) + LAYER_SWITCHES:
                if getattr(previous, name) != getattr(settings, name):
                    report.changed.append(f"{name}: {getattr(previous, name)} -> {getattr(settings, name)}")
        _APPLIED["settings"] = settings

    spec = getattr(args, "spec", None)
    if not is_overlap_spec(spec):
        if spec:
            raise ValueError(f"--spec {' '.join(spec)} is set; overlap_tp would replace it (run "
                             "validate_overlap_args first: it explains the choice)")
        args.spec = list(SPEC)
        report.changed.append(f"--spec {' '.join(SPEC)} (was {spec})")

    # `auto` times its candidates as the run executes them: replays of CUDA graphs under --cuda-graph-impl
    timing = "eager" if str(getattr(args, "cuda_graph_impl", "none") or "none") == "none" else "graphs"
    if tune_timing.regime() != timing:
        tune_timing.set_regime(timing)
        how = "as CUDA graph replays" if timing == "graphs" else "eagerly"
        report.changed.append(f"the tuner times its candidates {how}")

    cache = tune_cache_path(args)
    if cache and os.environ.get(TUNE_CACHE_ENV) != cache:
        os.environ[TUNE_CACHE_ENV] = cache
        report.changed.append(f"{TUNE_CACHE_ENV}={cache}")

    log(str(report))
    return report


def overlap_layer_spec(config, vp_stage=None):
    """The decoder block spec with overlap_tp's layers, for a GPTModelConfig (0.19+) or a
    TransformerConfig: every layer is `get_gpt_layer_overlap_spec` with the TransformerConfig's values
    for the keywords it names (num_experts, moe_grouped_gemm, qk_layernorm, multi_latent_attention,
    qk_l2_norm, normalization, transformer_impl; config and vp_stage if it takes them), an MoE model's layers
    dense or MoE as moe_layer_freq says (overlap_tp.megatron.layer_pattern, Megatron's reading and pipeline
    slice of it), and the block's final
    norm is OverlapRMSNorm (TENorm with transformer_impl "transformer_engine" where TE imports). A block spec
    rather than a layer spec: given a layer spec, Megatron picks the final norm itself, and without TE or
    Apex that is WrappedTorchNorm, which refuses sequence parallel."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from overlap_tp.megatron.layer_pattern import moe_layer_pattern, stage_layer_ids
    from overlap_tp.megatron.layer_spec import te_norm_module
    from overlap_tp.megatron.norm import OverlapRMSNorm
    transformer = getattr(config, "transformer", config)
    # the final norm carries no TP communication: Transformer Engine's with --transformer-impl transformer_engine
    final_norm = te_norm_module(getattr(transformer, "transformer_impl", None)) or OverlapRMSNorm
    pattern = moe_layer_pattern(transformer)
    if pattern is not None and not all(pattern):   # --moe-layer-freq: dense layers between MoE layers
        from overlap_tp.megatron.transformer_layer import LayerChain
        chain = LayerChain()   # one block: a dense layer links to the MoE layer after it, and the other way round
        dense, moe = (overlap_transformer_layer_spec(config, vp_stage, dense=True, chain=chain),
                      overlap_transformer_layer_spec(config, vp_stage, chain=chain))
        return TransformerBlockSubmodules(
            layer_specs=[moe if pattern[i] else dense for i in stage_layer_ids(transformer, vp_stage)],
            layer_norm=final_norm)
    if "vp_stage" in inspect.signature(get_num_layers_to_build).parameters:
        layers = get_num_layers_to_build(transformer, vp_stage=vp_stage)
    else:
        layers = get_num_layers_to_build(transformer)
    return TransformerBlockSubmodules(layer_specs=[overlap_transformer_layer_spec(config, vp_stage)] * layers,
                                      layer_norm=final_norm)


def overlap_transformer_layer_spec(config, vp_stage=None, dense=False, chain=None):
    """One TransformerLayer ModuleSpec with overlap_tp's linears and norms (see overlap_layer_spec), built with the
    settings apply() built; for an MoE model its MLP is OverlapMoELayer with --overlap-moe on, else Megatron's own MoE
    module, and with `dense` (the dense layers of a --moe-layer-freq pattern) the dense MLP of ffn_hidden_size. The
    layer is OverlapTransformerLayer, or Megatron's TransformerLayer with layers.fused_norms false. chain: the block's
    LayerChain where several layer specs make one block (None: the spec's own)."""
    from overlap_tp.megatron.layer_spec import get_gpt_layer_overlap_spec

    transformer = getattr(config, "transformer", config)
    settings = _APPLIED["settings"]
    offered = {
        "num_experts": None if dense else getattr(transformer, "num_moe_experts", None),
        "moe_grouped_gemm": getattr(transformer, "moe_grouped_gemm", False),
        "qk_layernorm": getattr(transformer, "qk_layernorm", False),
        "multi_latent_attention": getattr(transformer, "multi_latent_attention", False),
        "qk_l2_norm": getattr(transformer, "qk_l2_norm", False),
        "normalization": getattr(transformer, "normalization", None),
        "transformer_impl": getattr(transformer, "transformer_impl", None),
        "config": transformer,
        "vp_stage": vp_stage,
        "settings": settings,
        "chain": chain,
    }
    parameters = inspect.signature(get_gpt_layer_overlap_spec).parameters
    kwargs = {name: value for name, value in offered.items() if name in parameters}
    spec = get_gpt_layer_overlap_spec(**kwargs)
    if offered["num_experts"] and (settings is None or settings.moe is None):   # --overlap-moe off: Megatron's
        spec.submodules.mlp = megatron_moe_spec(transformer)
    return spec


def megatron_moe_spec(transformer):
    """The MoE module Megatron's own layer spec builds for this TransformerConfig (TE's experts with
    --transformer-impl transformer_engine where TE imports, else the local ones)."""
    from megatron.core.extensions.transformer_engine import HAVE_TE
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    use_te = HAVE_TE and getattr(transformer, "transformer_impl", "local") == "transformer_engine"
    return get_moe_module_spec(use_te=use_te, num_experts=transformer.num_moe_experts,
                               moe_grouped_gemm=transformer.moe_grouped_gemm)


def _log_rank0(message):
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, flush=True)
