"""Which decoder layers of an MoE model are MoE layers, and which of them this pipeline stage builds.

Megatron's `--moe-layer-freq` (TransformerConfig.moe_layer_freq) sets the pattern, read as Megatron's
`get_gpt_decoder_layer_specs` reads it:

    an integer N        layer i (0-based) is an MoE layer where i % N == 0 (1: every layer)
    a list of 0 / 1     one entry per layer of the model, 1 = MoE (e.g. DeepSeek-V3's first dense layers:
                        [0] * 3 + [1] * 58, as --moe-layer-freq "([0]*3+[1]*58)")

and the layers this stage builds are Megatron's slice of that list (`get_gpt_decoder_block_spec`): the
layer ids of --pipeline-model-parallel-layout where one is given, else `get_num_layers_to_build` layers
from `get_transformer_layer_offset`.
"""
import inspect
from typing import List, Optional

__all__ = ["moe_layer_pattern", "stage_layer_ids"]


def moe_layer_pattern(config) -> Optional[List[bool]]:
    """One flag per decoder layer of the model (True = MoE layer), or None for a dense model."""
    if not getattr(config, "num_moe_experts", None):
        return None
    freq = getattr(config, "moe_layer_freq", 1)
    num_layers = config.num_layers
    if isinstance(freq, bool):
        raise ValueError(f"moe_layer_freq={freq!r}: expected an integer or a list of 0 / 1 per layer")
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"moe_layer_freq={freq}: expected an integer >= 1 (one MoE layer every N layers)")
        return [i % freq == 0 for i in range(num_layers)]
    if isinstance(freq, (list, tuple)):
        if len(freq) != num_layers:
            raise ValueError(f"moe_layer_freq has {len(freq)} entries for {num_layers} layers (--num-layers): "
                             f"give one 0 (dense) or 1 (MoE) per layer")
        if any(entry not in (0, 1) or isinstance(entry, float) for entry in freq):
            raise ValueError(f"moe_layer_freq={list(freq)}: every entry must be 0 (dense) or 1 (MoE)")
        return [entry == 1 for entry in freq]
    raise ValueError(f"moe_layer_freq={freq!r}: expected an integer or a list of 0 / 1 per layer")


def stage_layer_ids(config, vp_stage=None) -> List[int]:
    """The 0-based ids of the decoder layers this pipeline stage (and virtual stage) builds, in order."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if layout is not None:
        return list(layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage))
    count = _call_with_vp_stage(get_num_layers_to_build, config, vp_stage)
    offset = _call_with_vp_stage(get_transformer_layer_offset, config, vp_stage)
    return list(range(offset, offset + count))


def _call_with_vp_stage(function, config, vp_stage):
    if "vp_stage" in inspect.signature(function).parameters:
        return function(config, vp_stage=vp_stage)
    return function(config)
