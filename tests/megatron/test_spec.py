"""--spec overlap_tp.megatron_patches.spec ATTRIBUTE: what Megatron-LM's builders get from import_module is a
block spec they can use as it is (gpt_builders.py) or call (megatron-core >= 0.19's GPTModelBuilder), and
resolving it checks the arguments and sets the layers' OverlapConfig for the method it names."""
from types import SimpleNamespace

import pytest

pytest.importorskip("megatron.core", reason="the layer spec needs megatron-core")
pytest.importorskip("megatron.training", reason="the spec reads Megatron's args through megatron.training")

from megatron.core.transformer import transformer_block  # noqa: E402
from megatron.core.transformer.spec_utils import import_module  # noqa: E402

from overlap_tp import OverlapConfig  # noqa: E402
from overlap_tp.ops.resolve import fill_defaults  # noqa: E402
from overlap_tp.megatron.arguments import OverlapArgumentError  # noqa: E402
from overlap_tp.megatron.norm import OverlapRMSNorm  # noqa: E402
from overlap_tp.megatron.transformer_layer import OverlapTransformerLayer  # noqa: E402
from overlap_tp.megatron_patches import apply as patches  # noqa: E402
from overlap_tp.megatron_patches import spec as spec_module  # noqa: E402


def megatron_args(**overrides):
    values = dict(tensor_model_parallel_size=2, sequence_parallel=True, spec=None, num_layers=3,
                  normalization="RMSNorm", transformer_impl="local", virtual_pipeline_model_parallel_size=None)
    values.update(overrides)
    return SimpleNamespace(**values)


@pytest.fixture
def megatron(monkeypatch):
    """Megatron's global args and config as the builders see them at model-build time (3 layers, one stage)."""
    import megatron.training
    from megatron.training import arguments

    state = {"args": megatron_args()}
    monkeypatch.setattr(megatron.training, "get_args", lambda: state["args"])
    monkeypatch.setattr(arguments, "core_transformer_config_from_args",
                        lambda args: SimpleNamespace(num_layers=args.num_layers, normalization="RMSNorm",
                                                     num_moe_experts=None))
    monkeypatch.setattr(transformer_block, "get_num_layers_to_build", lambda config, vp_stage=None: config.num_layers)
    patches.reset()
    spec_module._APPLIED.update(args=None, method=None)
    yield state
    patches.reset()


def test_import_module_gives_a_block_spec_megatron_can_use_directly(megatron):
    block = import_module(["overlap_tp.megatron_patches.spec", "signal"])
    assert isinstance(block, transformer_block.TransformerBlockSubmodules)
    # what TransformerBlock does with a TransformerBlockSubmodules: takes it as is, reads both fields
    submodules = transformer_block._get_block_submodules(SimpleNamespace(num_layers=3), block)
    assert len(submodules.layer_specs) == 3 and submodules.layer_norm is OverlapRMSNorm
    assert all(s.module is OverlapTransformerLayer for s in submodules.layer_specs)
    # the layers are built with the settings apply() made (carried by the spec, not by a process global)
    assert all(s.params["settings"] is patches.get_settings() for s in submodules.layer_specs)
    assert patches.get_overlap_config("gemm_rs").method == "signal"
    # the transport and SMs are the resolver's: on CUDA the AllGather pulls over p2p with its GEMM on every SM
    ag = fill_defaults(patches.get_overlap_config("ag_gemm"), "ag_gemm", "cuda", 2)
    assert (ag.method, ag.transport, ag.comm_sms) == ("signal", "p2p", 0)


def test_callable_form_for_builders_that_pass_vp_stage(megatron):
    block = spec_module.decompose(SimpleNamespace(num_layers=2, normalization="RMSNorm"), vp_stage=0)
    assert len(block.layer_specs) == 2 and block.layer_norm is OverlapRMSNorm
    assert patches.get_overlap_config("gemm_rs").method == "decompose"


def test_off_builds_our_layers_with_the_overlap_off(megatron):
    assert len(spec_module.off.layer_specs) == 3
    assert patches.get_overlap_config("gemm_rs").method == "off"


def test_the_arguments_are_checked(megatron):
    megatron["args"] = megatron_args(sequence_parallel=False)
    with pytest.raises(OverlapArgumentError, match="needs --sequence-parallel"):
        spec_module.signal.layer_specs


def test_tp1_is_refused(megatron):
    megatron["args"] = megatron_args(tensor_model_parallel_size=1, sequence_parallel=False)
    with pytest.raises(ValueError, match="tensor-model-parallel-size 1"):
        spec_module.signal.layer_specs


def test_virtual_pipeline_needs_the_callable_form(megatron):
    megatron["args"] = megatron_args(virtual_pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match="virtual pipeline"):
        spec_module.signal.layer_specs


def test_flags_needs_apply_first(megatron):
    with pytest.raises(ValueError, match="were not applied"):
        spec_module.flags.layer_specs
    args = megatron_args(overlap_tp="signal", overlap_tp_config={"gemm_rs": {"transport": "nccl", "comm_sms": 8}},
                         overlap_tp_layers=False, overlap_tp_tune_cache=None)
    megatron["args"] = args
    patches.apply(args, log=lambda message: None)
    assert args.spec == list(patches.SPEC)
    assert import_module(args.spec) is spec_module.flags
    assert len(spec_module.flags.layer_specs) == 3
    assert patches.get_overlap_config("gemm_rs") == OverlapConfig(method="signal", transport="nccl", comm_sms=8)


def test_megatron_args_are_not_changed(megatron):
    before = dict(vars(megatron["args"]))
    spec_module.signal.layer_specs
    assert vars(megatron["args"]) == before
