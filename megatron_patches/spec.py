"""`--spec overlap_tp.megatron_patches.spec signal`: overlap_tp's layers through Megatron's `--spec` alone.

Megatron-LM hands `--spec MODULE ATTRIBUTE` to its model builders as `import_module([MODULE, ATTRIBUTE])`.
Some builders take the result as a ModuleSpec (Megatron-LM's `gpt_builders.py`), others also call it
when it is callable (megatron-core >= 0.19's GPTModelBuilder, with the model config and `vp_stage`).
The attributes of this module work with both: each is an `OverlapBlockSpec`, a
`TransformerBlockSubmodules` (what a decoder block takes) whose layer list is built when the model is
built, and which is also callable like `apply.overlap_layer_spec`.

    signal | decompose | auto   overlap_tp's layers with that --overlap-tp mode (the rest decided as the
                                 flags decide it)
    off                          overlap_tp's layers with the overlap off (--overlap-tp-layers)
    flags                        the method of --overlap-tp & co. (what `megatron_patches.apply` sets when
                                 overlap_tp's flags are in the parser, e.g. under overlap-tp-run)

With `--spec` alone the arguments are checked when the model is built (`validate_overlap_args` on a copy
of Megatron's args with that method), and there is no `[overlap_tp]` throughput line (that needs
`overlap-tp-run` or the launcher's training-log hook). Virtual pipeline stages need the callable form.
"""
import copy

from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from overlap_tp.megatron_patches import apply as patches

MODULE = __name__
METHOD_ATTRIBUTES = ("signal", "decompose", "auto", "off")


class OverlapBlockSpec(TransformerBlockSubmodules):
    """A decoder block spec with overlap_tp's layers, resolved from Megatron's arguments when used.

    `method`: an --overlap-tp method ("off": overlap_tp's layers, overlap off), or None to take the method
    from the arguments' own overlap_tp flags (`apply` must have run on them).
    """

    def __init__(self, method=None):   # no dataclass __init__: layer_specs and layer_norm are computed
        self.method = method
        self.attribute = method or "flags"

    def __repr__(self):
        return f"OverlapBlockSpec({MODULE} {self.attribute})"

    def __call__(self, config, vp_stage=None):
        """The concrete block spec for a model config (GPTModelConfig or TransformerConfig)."""
        self.activate()
        return patches.overlap_layer_spec(config, vp_stage=vp_stage)

    @property
    def layer_specs(self):
        from megatron.training import get_args
        from megatron.training.arguments import core_transformer_config_from_args
        args = self.activate()
        if getattr(args, "virtual_pipeline_model_parallel_size", None):
            raise ValueError(
                f"--spec {MODULE} {self.attribute} with virtual pipeline stages: this builder takes the spec "
                "as a ModuleSpec and does not say which stage it builds. Use a builder that calls the spec "
                "with vp_stage (megatron-core >= 0.19's GPTModelBuilder, Megatron-LM's pretrain_gpt.py), or "
                "overlap-tp-run.")
        return patches.overlap_layer_spec(core_transformer_config_from_args(get_args() if args is None else args)
                                          ).layer_specs

    @property
    def layer_norm(self):
        from overlap_tp.megatron.norm import OverlapRMSNorm
        return OverlapRMSNorm

    def activate(self):
        """Check the arguments and set the layers' OverlapConfig (once per arguments object); returns them."""
        from megatron.training import get_args
        args = get_args()
        if self.method is None:
            if patches.get_settings() is None:
                raise ValueError(
                    f"--spec {MODULE} flags: overlap_tp's flags were not applied (megatron_patches.apply did not "
                    f"run). Name the method instead (--spec {MODULE} signal), or run the script through "
                    "overlap-tp-run.")
            return args
        if _APPLIED["args"] is args and _APPLIED["method"] == self.method:
            return args
        chosen = copy.copy(args)   # Megatron's args keep their values; the copy carries the method
        chosen.overlap_tp = "off" if self.method == "off" else self.method
        chosen.overlap_tp_layers = self.method == "off"
        chosen.spec = list(spec_of(self.method))
        from overlap_tp.megatron.validation import validate_overlap_args
        validate_overlap_args(chosen)
        if not patches.wanted(chosen):   # validation turned it off: TP 1
            raise ValueError(f"--spec {MODULE} {self.attribute} with --tensor-model-parallel-size 1: there is no "
                             "TP communication for overlap_tp's layers to carry. Drop --spec.")
        patches.apply(chosen)
        _APPLIED.update(args=args, method=self.method)
        return args


_APPLIED = {"args": None, "method": None}   # the Megatron args object the layers' configs were set from


def spec_of(attribute):
    """The two strings of `--spec` for an attribute of this module."""
    return (MODULE, attribute)


signal = OverlapBlockSpec("signal")
decompose = OverlapBlockSpec("decompose")
auto = OverlapBlockSpec("auto")
off = OverlapBlockSpec("off")
flags = OverlapBlockSpec(None)
