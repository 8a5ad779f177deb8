"""`apply(args)`: switch a Megatron training run to overlap_tp's layers, through Megatron's own hooks.

What it changes (only when `--overlap-tp` or `--overlap-moe` is not off, or `--overlap-tp-layers` is given):

- `args.spec` becomes `["overlap_tp.megatron_patches.spec", "flags"]` (SPEC). Megatron's GPT builders
  read `--spec`: megatron-core >= 0.19's `gpt_config_from_args` puts it into
  `GPTModelConfig.transformer_layer_spec` and `GPTModelBuilder` calls it with the model config and
  `vp_stage`; Megatron-LM's `gpt_builders.py` passes it to GPTModel as a block spec. `spec.flags` is
  both (megatron_patches/spec.py), so either way the model is built with `overlap_layer_spec`, which asks
  `overlap_tp.megatron.layer_spec.get_gpt_layer_overlap_spec` for the TransformerLayer spec. No Megatron
  function is patched.
- the process-wide OverlapConfig per op kind the layers use: `overlap_tp.megatron.layers.set_default_overlap_config`
  with `overlap_tp.megatron.arguments.layer_configs(args)` (gemm_ar keeps transport nccl, p2p being gemm_rs/ag_gemm
  only; `--overlap-tp-transport auto` puts ag_gemm and gemm_rs on p2p), also readable as `get_overlap_config(op)`.
- MoE models: with `--overlap-moe` on, every layer's MLP is overlap_tp's OverlapMoELayer and its
  OverlapConfig (`overlap_tp.megatron.moe_layer.set_default_moe_overlap_config`, `get_moe_overlap_config()`) comes
  from `--overlap-moe` and `--overlap-tp-comm-sms`; with it off, the MLP slot of overlap_tp's layer spec
  holds the MoE module Megatron's own spec would build (its MoELayer, untouched).
- the layer: OverlapTransformerLayer (bias-dropout-add and norm in one kernel, which also sums the p2p
  reduce-scatters and normalizes the next layer's input), or with `--no-overlap-tp-fused-norms` Megatron's own
  TransformerLayer around the same linears and norms; with `--overlap-tp-gather-in-place` its
  norms write into linear_qkv's and linear_fc1's own gathered buffers (`overlap_tp.megatron.layers.
  set_gather_in_place`), and with `--overlap-tp-defer-wgrad` too linear_fc1's wgrad runs inside linear_proj's
  backward (`set_defer_wgrad`); with `--overlap-tp-token-split` each micro-batch runs as two interleaved halves
  (`overlap_tp.megatron.transformer_layer.set_token_split`).
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

from overlap_tp.megatron.arguments import TUNE_CACHE_ENV, layer_configs, moe_overlap_config_kwargs, tune_cache_path
from overlap_tp.ops.config import OverlapConfig
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

_STATE = {"configs": None, "moe_config": None, "fused_norms": True, "gather_in_place": False, "defer_wgrad": False,
          "token_split": False}


@dataclasses.dataclass
class ApplyReport:
    """What `apply` did. `active`: overlap_tp's layers are in use; `changed`: what this call changed."""

    active: bool
    overlap_configs: object = None    # {op kind: OverlapConfig}
    moe_config: object = None
    changed: list = dataclasses.field(default_factory=list)

    def __str__(self):
        if not self.active:
            return "[overlap_tp] --overlap-tp off: Megatron's own layers, nothing changed"
        head = f"[overlap_tp] layers on, {_describe(self.overlap_configs)}"
        if self.moe_config is not None:
            head += f"; MoE layers on, {self.moe_config}"
        if not self.changed:
            return head + "; already applied, nothing changed"
        return head + "".join(f"\n[overlap_tp]   {line}" for line in self.changed)


def _describe(configs):
    """gemm_rs's config, then what the other op kinds run differently."""
    base = configs["gemm_rs"]
    fields = [f.name for f in dataclasses.fields(OverlapConfig)]
    extra = []
    for op in ("ag_gemm", "gemm_ar"):
        diff = {f: getattr(configs[op], f) for f in fields if getattr(configs[op], f) != getattr(base, f)}
        if diff:
            extra.append(f"{op}: " + ", ".join(f"{k}={v!r}" for k, v in diff.items()))
    return f"{base}" + "".join(f"; {e}" for e in extra)


def get_overlap_config(op: str = "gemm_rs"):
    """The OverlapConfig that `apply` set for op kind `op` (None before, or when overlap_tp's layers are off)."""
    configs = _STATE["configs"]
    return None if configs is None else configs[op]


def get_moe_overlap_config():
    """The MoE layers' OverlapConfig set by `apply` (None before, or when --overlap-moe is off)."""
    return _STATE["moe_config"]


def reset():
    """Forget the process-wide state (tests)."""
    _STATE["configs"] = _STATE["moe_config"] = None
    _STATE["fused_norms"] = True
    _STATE["gather_in_place"] = _STATE["defer_wgrad"] = _STATE["token_split"] = False
    _set_gather_in_place(False, False, False)
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

    configs = layer_configs(args)
    moe = getattr(args, "overlap_moe", "off")
    moe_config = OverlapConfig(**moe_overlap_config_kwargs(args)) if moe != "off" else None
    report = ApplyReport(active=True, overlap_configs=configs, moe_config=moe_config)

    for key, value, what in (("configs", configs, "the layers"), ("moe_config", moe_config, "the MoE layers")):
        if _STATE[key] != value:
            old = _describe(_STATE[key]) if key == "configs" and _STATE[key] else _STATE[key]
            new = _describe(value) if key == "configs" else value
            report.changed.append(f"OverlapConfig for {what}: {old} -> {new}")
            _STATE[key] = value
    _set_layer_defaults(configs, moe_config)
    fused_norms = bool(getattr(args, "overlap_tp_fused_norms", True))
    if _STATE["fused_norms"] != fused_norms:
        report.changed.append("the layer: " + ("overlap_tp's, fused bias-dropout-add + norm" if fused_norms else
                                               "Megatron's TransformerLayer (--no-overlap-tp-fused-norms)"))
        _STATE["fused_norms"] = fused_norms
    in_place = bool(getattr(args, "overlap_tp_gather_in_place", False))
    if _STATE["gather_in_place"] != in_place:
        report.changed.append("the norms before linear_qkv and linear_fc1 write into those layers' own gathered "
                              "buffers" if in_place else "the AllGathers stage their inputs (no gathering in place)")
        _STATE["gather_in_place"] = in_place
    defer = bool(getattr(args, "overlap_tp_defer_wgrad", False))
    if _STATE["defer_wgrad"] != defer:
        report.changed.append("linear_fc1's wgrad runs inside linear_proj's backward, beside its AllGather" if defer
                              else "every linear's wgrad runs in its own backward")
        _STATE["defer_wgrad"] = defer
    split = bool(getattr(args, "overlap_tp_token_split", False))
    if _STATE["token_split"] != split:
        report.changed.append("each micro-batch runs as two interleaved halves of its sequences (token split)" if split
                              else "each micro-batch runs whole (no token split)")
        _STATE["token_split"] = split
    _set_gather_in_place(in_place, defer, split)

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


def _set_layer_defaults(configs, moe_config):
    try:
        from overlap_tp.megatron import layers, moe_layer
    except ImportError:  # no megatron-core: nothing can be built anyway; the spec says why when asked
        return
    layers.set_default_overlap_config(**configs)
    if moe_config is not None:
        moe_layer.set_default_moe_overlap_config(moe_config)


def _set_gather_in_place(on, defer_wgrad, token_split):
    try:
        from overlap_tp.megatron import layers, transformer_layer
    except ImportError:  # no megatron-core: no layer to build
        return
    layers.set_gather_in_place(on)
    layers.set_defer_wgrad(defer_wgrad)
    transformer_layer.set_token_split(token_split)


def overlap_layer_spec(config, vp_stage=None):
    """The decoder block spec with overlap_tp's layers, for a GPTModelConfig (0.19+) or a
    TransformerConfig: every layer is `get_gpt_layer_overlap_spec` with the TransformerConfig's values
    for the keywords it names (num_experts, moe_grouped_gemm, qk_layernorm, multi_latent_attention,
    qk_l2_norm, normalization, transformer_impl; config and vp_stage if it takes them), and the block's final
    norm is OverlapRMSNorm (TENorm with transformer_impl "transformer_engine" where TE imports). A block spec
    rather than a layer spec: given a layer spec, Megatron picks the final norm itself, and without TE or
    Apex that is WrappedTorchNorm, which refuses sequence parallel."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from overlap_tp.megatron.layer_spec import te_norm_module
    from overlap_tp.megatron.norm import OverlapRMSNorm
    transformer = getattr(config, "transformer", config)
    if "vp_stage" in inspect.signature(get_num_layers_to_build).parameters:
        layers = get_num_layers_to_build(transformer, vp_stage=vp_stage)
    else:
        layers = get_num_layers_to_build(transformer)
    # the final norm carries no TP communication: Transformer Engine's with --transformer-impl transformer_engine
    final_norm = te_norm_module(getattr(transformer, "transformer_impl", None)) or OverlapRMSNorm
    return TransformerBlockSubmodules(layer_specs=[overlap_transformer_layer_spec(config, vp_stage)] * layers,
                                      layer_norm=final_norm)


def overlap_transformer_layer_spec(config, vp_stage=None):
    """One TransformerLayer ModuleSpec with overlap_tp's linears and norms (see overlap_layer_spec); for an
    MoE model its MLP is OverlapMoELayer with --overlap-moe on, else Megatron's own MoE module. The layer is
    OverlapTransformerLayer, or Megatron's TransformerLayer with --no-overlap-tp-fused-norms."""
    from overlap_tp.megatron.layer_spec import get_gpt_layer_overlap_spec

    transformer = getattr(config, "transformer", config)
    offered = {
        "num_experts": getattr(transformer, "num_moe_experts", None),
        "moe_grouped_gemm": getattr(transformer, "moe_grouped_gemm", False),
        "qk_layernorm": getattr(transformer, "qk_layernorm", False),
        "multi_latent_attention": getattr(transformer, "multi_latent_attention", False),
        "qk_l2_norm": getattr(transformer, "qk_l2_norm", False),
        "normalization": getattr(transformer, "normalization", None),
        "transformer_impl": getattr(transformer, "transformer_impl", None),
        "config": transformer,
        "vp_stage": vp_stage,
        "fused_norms": _STATE["fused_norms"],
    }
    parameters = inspect.signature(get_gpt_layer_overlap_spec).parameters
    kwargs = {name: value for name, value in offered.items() if name in parameters}
    spec = get_gpt_layer_overlap_spec(**kwargs)
    if offered["num_experts"] and _STATE["moe_config"] is None:   # --overlap-moe off: Megatron's MoE layer
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
