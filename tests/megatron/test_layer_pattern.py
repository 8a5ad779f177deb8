"""--moe-layer-freq: overlap_tp's decoder block spec puts an MoE layer exactly where Megatron's own block spec
(get_gpt_decoder_layer_specs / get_gpt_decoder_block_spec) puts one, and a dense layer everywhere else, for integer
and list patterns and for every pipeline stage's slice of them."""
import warnings

import pytest

pytest.importorskip("megatron.core", reason="the layer spec needs megatron-core")

import torch  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: E402
    get_gpt_decoder_block_spec,
    get_gpt_decoder_layer_specs,
)
from megatron.core.transformer.mlp import MLP  # noqa: E402
from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from overlap_tp import OverlapConfig  # noqa: E402
from overlap_tp.megatron.validation import validate_overlap_args  # noqa: E402
from overlap_tp.megatron.layer_pattern import moe_layer_pattern  # noqa: E402
from overlap_tp.megatron.moe_layer import OverlapMoELayer  # noqa: E402
from overlap_tp.megatron.settings import OverlapSettings  # noqa: E402
from overlap_tp.megatron.transformer_layer import OverlapTransformerLayer  # noqa: E402
from overlap_tp.megatron_patches import apply as patches  # noqa: E402


def _config(num_layers, freq, pp=1, **extra):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=4, num_moe_experts=4,
                                 moe_ffn_hidden_size=32, ffn_hidden_size=128, moe_layer_freq=freq,
                                 normalization="RMSNorm", use_cpu_initialization=True, bf16=True,
                                 params_dtype=torch.bfloat16, pipeline_model_parallel_size=pp,
                                 pipeline_dtype=torch.bfloat16 if pp > 1 else None, **extra)


def _module(spec):
    """The class a spec entry builds (a ModuleSpec, a functools.partial as megatron-core 0.19 writes them, or a
    class)."""
    return getattr(spec, "module", None) or getattr(spec, "func", None) or spec


def _is_moe(layer_spec):
    module = _module(layer_spec.submodules.mlp)
    if isinstance(module, type) and issubclass(module, MoELayer):
        return True
    assert isinstance(module, type) and issubclass(module, MLP) or callable(module), module
    return False


PATTERNS = [
    (4, 1),
    (6, 2),
    (6, 3),
    (5, [0, 1, 1, 1, 1]),             # DeepSeek-V3's first dense layer
    (6, [0, 0, 1, 1, 1, 1]),          # first-k dense, k = 2
    (6, [1, 0, 1, 0, 1, 0]),          # interleaved (Llama-4 style)
    (6, [1, 1, 1, 0, 1, 1]),
]


@pytest.fixture
def moe_on():
    """apply's state as --overlap-moe signal leaves it (OverlapMoELayer in the MoE slots); yields its settings."""
    patches.reset()
    settings = OverlapSettings(moe=OverlapConfig(method="signal"))
    patches._APPLIED["settings"] = settings
    yield settings
    patches.reset()


@pytest.mark.parametrize("num_layers, freq", PATTERNS)
def test_pattern_is_megatrons(num_layers, freq):
    config = _config(num_layers, freq)
    megatron = [_is_moe(spec) for spec in get_gpt_decoder_layer_specs(config, use_transformer_engine=False,
                                                                      normalization="RMSNorm")]
    assert moe_layer_pattern(config) == megatron


@pytest.mark.parametrize("num_layers, freq", PATTERNS)
def test_block_spec_puts_our_moe_and_dense_layers_where_megatron_puts_its(num_layers, freq, moe_on, monkeypatch):
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: 0)
    config = _config(num_layers, freq)
    megatron = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm", pp_rank=0)
    ours = patches.overlap_layer_spec(config)
    assert len(ours.layer_specs) == len(megatron.layer_specs) == num_layers
    chain = ours.layer_specs[0].params["chain"]   # one block: dense and MoE layers link through one LayerChain
    for layer, (our, their) in enumerate(zip(ours.layer_specs, megatron.layer_specs)):
        assert our.module is OverlapTransformerLayer and our.params["chain"] is chain
        if _is_moe(their):
            assert _module(our.submodules.mlp) is OverlapMoELayer, layer
            assert "pre_mlp_layernorm." not in our.submodules.sharded_state_dict_keys_map
        else:
            assert _module(our.submodules.mlp) is MLP, layer
            fc1 = our.submodules.mlp.submodules.linear_fc1
            assert _module(fc1).__module__ == "overlap_tp.megatron.layers"
            assert fc1.params["settings"] is moe_on   # the dense layers are built with apply's settings too
            # a dense layer keeps the dense spec's checkpoint key map (interchangeable with Megatron's)
            assert our.submodules.sharded_state_dict_keys_map["pre_mlp_layernorm."] == "mlp.linear_fc1.layer_norm_"


@pytest.mark.parametrize("freq, layout", [([0, 1, 1, 0, 1, 1, 1, 0], None),
                                          (2, None),
                                          ([0, 1, 1, 0, 1, 1, 1, 0], [["embedding", "decoder"],
                                                                      ["decoder"] * 4,
                                                                      ["decoder"] * 3 + ["loss"]])])
@pytest.mark.parametrize("pp_rank", [0, 1, 2])
def test_each_pipeline_stage_builds_megatrons_slice(freq, layout, pp_rank, moe_on, monkeypatch):
    """Three stages: each builds the layers Megatron's block spec gives that stage, dense or MoE as Megatron's."""
    extra = {}
    if layout is not None:
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
        extra["pipeline_model_parallel_layout"] = PipelineParallelLayerLayout(layout, pipeline_model_parallel_size=3)
    else:
        extra.update(num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=2)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: pp_rank)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: 3)
    config = _config(8, freq, pp=3, **extra)
    megatron = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                          pp_rank=pp_rank)
    ours = patches.overlap_layer_spec(config)
    assert [_is_moe(s) for s in ours.layer_specs] == [_is_moe(s) for s in megatron.layer_specs]
    assert len(ours.layer_specs) == len(megatron.layer_specs) > 0


def test_megatrons_moe_layer_with_overlap_moe_off(monkeypatch):
    """--overlap-tp on, --overlap-moe off: the MoE layers of the pattern are Megatron's MoELayer, the dense ones our
    dense MLP."""
    patches.reset()
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: 0)
    specs = patches.overlap_layer_spec(_config(4, [0, 1, 0, 1])).layer_specs
    modules = [_module(s.submodules.mlp) for s in specs]
    assert modules[0] is MLP and modules[2] is MLP
    assert modules[1] is MoELayer and modules[3] is MoELayer


@pytest.mark.parametrize("freq", [0, -1, [0, 1, 2, 1], [0, 1, 1], "2", True])
def test_bad_patterns_say_what_is_wrong(freq):
    from types import SimpleNamespace
    with pytest.raises(ValueError, match="moe_layer_freq"):
        moe_layer_pattern(SimpleNamespace(num_moe_experts=4, num_layers=4, moe_layer_freq=freq))


def test_dense_model_has_no_pattern():
    from types import SimpleNamespace
    assert moe_layer_pattern(SimpleNamespace(num_moe_experts=None, num_layers=4, moe_layer_freq=2)) is None


@pytest.mark.parametrize("freq", [2, [0, 1, 1, 1]])
def test_moe_layer_freq_is_accepted(freq):
    from types import SimpleNamespace
    args = SimpleNamespace(overlap_tp="signal", overlap_moe="signal", tensor_model_parallel_size=2,
                           sequence_parallel=True, num_experts=4, moe_layer_freq=freq,
                           moe_token_dispatcher_type="alltoall", expert_tensor_parallel_size=1,
                           add_bias_linear=False, normalization="RMSNorm", transformer_impl="local")
    validate_overlap_args(args, warn=None)
