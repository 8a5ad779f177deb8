"""megatron_patches.apply: off leaves Megatron's args untouched; on switches the spec and the layers'
OverlapSettings (carried by the spec); applying twice changes nothing more."""
import copy
from types import SimpleNamespace

import pytest

from overlap_tp import OverlapConfig
from overlap_tp.megatron.arguments import TUNE_CACHE_ENV
from overlap_tp.megatron_patches import apply as patch


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    # setenv first so that monkeypatch restores the variable's absence after apply() exported it
    monkeypatch.setenv(TUNE_CACHE_ENV, "")
    monkeypatch.delenv(TUNE_CACHE_ENV)
    patch.reset()
    yield
    patch.reset()


# every op kind on NCCL with 8 SMs (the expert config file, read as a mapping)
NCCL8 = {op: {"transport": "nccl", "comm_sms": 8} for op in ("ag_gemm", "gemm_rs", "gemm_ar", "expert")}


def fake_args(**overrides):
    values = dict(overlap_tp="signal", overlap_tp_config=NCCL8,
                  overlap_tp_tune_cache=None, overlap_tp_layers=False, spec=None,
                  tensor_model_parallel_size=2, sequence_parallel=True, num_layers=2)
    values.update(overrides)
    return SimpleNamespace(**values)


def quiet(message):
    pass


def test_off_leaves_megatron_untouched():
    args = fake_args(overlap_tp="off")
    before = copy.deepcopy(vars(args))
    report = patch.apply(args, log=quiet)
    assert not report.active and report.changed == []
    assert vars(args) == before
    assert patch.get_overlap_config() is None
    assert "nothing changed" in str(report)


def test_on_sets_spec_and_config():
    args = fake_args()
    report = patch.apply(args, log=quiet)
    assert report.active
    assert args.spec == list(patch.SPEC)
    assert patch.get_overlap_config() == OverlapConfig(method="signal", transport="nccl", comm_sms=8)
    assert len(report.changed) == 2  # the settings and --spec


def test_apply_twice_changes_nothing_more():
    args = fake_args(overlap_tp_tune_cache="/tmp/overlap_tp_tune.json")
    first = patch.apply(args, log=quiet)
    state = copy.deepcopy(vars(args))
    config = patch.get_overlap_config()
    second = patch.apply(args, log=quiet)
    assert len(first.changed) == 3 and second.changed == []
    assert vars(args) == state and patch.get_overlap_config() is config
    assert "already applied" in str(second)


def test_tune_cache_is_exported(monkeypatch):
    patch.apply(fake_args(overlap_tp="auto", overlap_tp_tune_cache="/tmp/cache.json"), log=quiet)
    import os
    assert os.environ[TUNE_CACHE_ENV] == "/tmp/cache.json"


def test_tune_cache_goes_where_the_user_says_else_under_save(monkeypatch):
    import os
    patch.apply(fake_args(overlap_tp="auto"), log=quiet)
    assert TUNE_CACHE_ENV not in os.environ                      # no flag, variable or --save: no file
    report = patch.apply(fake_args(overlap_tp="auto", save="/runs/a/ckpt"), log=quiet)
    assert os.environ[TUNE_CACHE_ENV] == "/runs/a/ckpt/overlap_tp_tune.json"
    assert f"{TUNE_CACHE_ENV}=/runs/a/ckpt/overlap_tp_tune.json" in report.changed
    monkeypatch.setenv(TUNE_CACHE_ENV, "/mine/tune.json")        # the user's variable beats --save
    patch.apply(fake_args(overlap_tp="auto", save="/runs/a/ckpt"), log=quiet)
    assert os.environ[TUNE_CACHE_ENV] == "/mine/tune.json"
    patch.apply(fake_args(overlap_tp="auto", save="/runs/a/ckpt", overlap_tp_tune_cache="/flag.json"), log=quiet)
    assert os.environ[TUNE_CACHE_ENV] == "/flag.json"             # and the flag beats both


def test_a_foreign_spec_is_never_overwritten():
    args = fake_args(spec=["my.module", "my_spec"])
    with pytest.raises(ValueError, match="--spec"):
        patch.apply(args, log=quiet)
    assert args.spec == ["my.module", "my_spec"]


def test_overlap_tp_layers_with_off_uses_our_spec_with_method_off():
    args = fake_args(overlap_tp="off", overlap_tp_layers=True)
    patch.apply(args, log=quiet)
    assert args.spec == list(patch.SPEC) and patch.get_overlap_config().method == "off"


def test_the_report_is_logged():
    lines = []
    patch.apply(fake_args(), log=lines.append)
    assert len(lines) == 1 and "--spec overlap_tp.megatron_patches.spec flags" in lines[0]


def test_layers_receive_the_settings(monkeypatch):
    """The settings apply() builds reach every overlap_tp module of the spec it sets (ModuleSpec params): the file's
    per-op fields, and where the file says nothing the mode alone (the rest left to the ops' resolver, which on CUDA
    puts the AllGather and the ReduceScatter on p2p with every SM, gemm_ar on NCCL with 16)."""
    pytest.importorskip("megatron.core", reason="the layer spec needs megatron-core")
    from megatron.core.transformer import transformer_block
    from overlap_tp.ops.resolve import fill_defaults
    monkeypatch.setattr(transformer_block, "get_num_layers_to_build", lambda config, vp_stage=None: config.num_layers)
    patch.apply(fake_args(overlap_tp_config={"ag_gemm": {"transport": "p2p", "comm_sms": 8}}), log=quiet)
    settings = patch.get_settings()
    assert settings.ag_gemm == OverlapConfig(method="signal", transport="p2p", comm_sms=8)
    assert settings.gemm_rs == settings.gemm_ar == OverlapConfig(method="signal")
    transformer = SimpleNamespace(num_moe_experts=None, moe_grouped_gemm=False, qk_layernorm=False,
                                  multi_latent_attention=False, qk_l2_norm=False, normalization="RMSNorm",
                                  num_layers=1)
    spec = patch.overlap_layer_spec(transformer).layer_specs[0]
    attention = spec.submodules.self_attention.submodules
    assert spec.params["settings"] is settings
    assert attention.linear_qkv.params["settings"] is settings and attention.linear_proj.params["settings"] is settings
    patch.apply(fake_args(overlap_tp_config=None), log=quiet)
    resolved = {op: fill_defaults(patch.get_overlap_config(op), op, "cuda", 2) for op in ("ag_gemm", "gemm_rs", "gemm_ar")}
    assert [(c.transport, c.comm_sms) for c in resolved.values()] == [("p2p", 0), ("p2p", 0), ("nccl", 16)]


def test_spec_callable_builds_our_block_spec(monkeypatch):
    """--spec resolves to a decoder block spec: our layer in every slot and OverlapRMSNorm as the final
    norm (given a layer spec, Megatron would pick WrappedTorchNorm, which refuses SP, without TE/Apex)."""
    pytest.importorskip("megatron.core", reason="the layer spec needs megatron-core")
    from overlap_tp.megatron import layer_spec
    from megatron.core.transformer import transformer_block
    from overlap_tp.megatron.transformer_layer import OverlapTransformerLayer

    from overlap_tp.megatron.norm import OverlapRMSNorm
    # the pipeline split is Megatron's business (it needs initialized parallel state): 3 layers here
    monkeypatch.setattr(transformer_block, "get_num_layers_to_build", lambda config, vp_stage=None: config.num_layers)
    transformer = SimpleNamespace(num_moe_experts=None, moe_grouped_gemm=False, qk_layernorm=False,
                                  multi_latent_attention=False, qk_l2_norm=False, normalization="RMSNorm",
                                  num_layers=3)
    model_config = SimpleNamespace(transformer=transformer)  # megatron-core 0.19's GPTModelConfig shape
    for config in (model_config, transformer):
        block = patch.overlap_layer_spec(config, vp_stage=None)
        assert isinstance(block, transformer_block.TransformerBlockSubmodules)
        assert len(block.layer_specs) == 3 and block.layer_norm is OverlapRMSNorm
        spec = block.layer_specs[0]
        assert spec.module is OverlapTransformerLayer
        qkv = spec.submodules.self_attention.submodules.linear_qkv
        assert qkv.__module__ == "overlap_tp.megatron.layers"
    # Megatron's import_module(--spec) resolves to a block spec that is also callable (tests/megatron/test_spec.py)
    module = __import__(patch.SPEC[0], fromlist=[patch.SPEC[1]])
    assert isinstance(getattr(module, patch.SPEC[1]), transformer_block.TransformerBlockSubmodules)
    assert layer_spec.get_gpt_layer_overlap_spec is not None


def test_no_fused_norms_builds_megatrons_transformer_layer(monkeypatch):
    """layers.fused_norms false (the config file): every layer of the block spec is Megatron's TransformerLayer
    around our linears and norms (the A/B of the fused bias-dropout-add + norm kernels); the report says so, and
    applying the default again brings OverlapTransformerLayer back."""
    pytest.importorskip("megatron.core", reason="the layer spec needs megatron-core")
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from overlap_tp.megatron.norm import OverlapRMSNorm
    from overlap_tp.megatron.transformer_layer import OverlapTransformerLayer
    monkeypatch.setattr(transformer_block, "get_num_layers_to_build", lambda config, vp_stage=None: config.num_layers)
    transformer = SimpleNamespace(num_moe_experts=None, moe_grouped_gemm=False, qk_layernorm=False,
                                  multi_latent_attention=False, qk_l2_norm=False, normalization="RMSNorm",
                                  num_layers=2)
    report = patch.apply(fake_args(overlap_tp_config={"layers": {"fused_norms": False}}), log=quiet)
    assert "Megatron's TransformerLayer" in str(report)
    spec = patch.overlap_layer_spec(transformer).layer_specs[0]
    assert spec.module is TransformerLayer
    assert spec.submodules.input_layernorm is OverlapRMSNorm
    assert spec.submodules.self_attention.submodules.linear_proj.module.__module__ == "overlap_tp.megatron.layers"
    report = patch.apply(fake_args(), log=quiet)
    assert "fused_norms: False -> True" in report.changed
    assert patch.overlap_layer_spec(transformer).layer_specs[0].module is OverlapTransformerLayer


def test_layer_switches_come_from_the_file_else_from_the_run():
    """gather_in_place: on where the layers overlap on the p2p AllGather (not with an nccl ag_gemm, nor recomputation
    or pipeline parallelism); defer_wgrad: with it, at TP >= 4 under CUDA graphs; token_split: off. The file's
    'layers' section sets any of them; a change is reported, applying the same again reports none."""
    report = patch.apply(fake_args(), log=quiet)   # ag_gemm on nccl (NCCL8): nothing gathers in place
    assert not patch.get_settings().gather_in_place
    report = patch.apply(fake_args(overlap_tp_config=None), log=quiet)
    settings = patch.get_settings()
    assert settings.gather_in_place and not settings.defer_wgrad and not settings.token_split
    assert "gather_in_place: False -> True" in report.changed
    again = patch.apply(fake_args(overlap_tp_config=None), log=quiet).changed   # fresh args: only --spec is new
    assert [line for line in again if not line.startswith("--spec")] == []
    patch.apply(fake_args(overlap_tp_config=None, tensor_model_parallel_size=4, cuda_graph_impl="local"), log=quiet)
    assert patch.get_settings().defer_wgrad
    patch.apply(fake_args(overlap_tp_config=None, tensor_model_parallel_size=4), log=quiet)   # eager: not deferred
    assert patch.get_settings().gather_in_place and not patch.get_settings().defer_wgrad
    patch.apply(fake_args(overlap_tp_config=None, recompute_granularity="full"), log=quiet)
    assert not patch.get_settings().gather_in_place
    report = patch.apply(fake_args(overlap_tp_config={"layers": {"token_split": True, "gather_in_place": False}}),
                         log=quiet)
    assert patch.get_settings().token_split and not patch.get_settings().gather_in_place
    assert "token_split: False -> True" in report.changed


def test_overlap_moe_alone_switches_the_spec_and_the_moe_config():
    args = fake_args(overlap_tp="off", overlap_moe="signal", tensor_model_parallel_size=1, sequence_parallel=False,
                     num_experts=8)
    report = patch.apply(args, log=quiet)
    assert report.active and args.spec == list(patch.SPEC)
    assert patch.get_overlap_config().method == "off"   # the dense layers: overlap_tp's, overlap off
    assert patch.get_moe_overlap_config() == OverlapConfig(method="signal", transport="nccl", comm_sms=8)   # NCCL8
    assert patch.get_settings().moe is patch.get_moe_overlap_config()
    assert "MoE layers on" in str(report) and len(report.changed) == 2   # the settings and --spec
    assert patch.apply(args, log=quiet).changed == []


@pytest.mark.parametrize("overlap_tp, overlap_moe", [("signal", "off"), ("off", "signal"), ("signal", "decompose")])
def test_moe_models_get_our_moe_layer_only_with_overlap_moe(monkeypatch, overlap_tp, overlap_moe):
    """--overlap-moe off keeps the MoE module Megatron's own spec builds in the MLP slot."""
    pytest.importorskip("megatron.core", reason="the layer spec needs megatron-core")
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.experts import SequentialMLP

    from overlap_tp.megatron.moe_layer import OverlapGroupedMLP, OverlapMoELayer
    monkeypatch.setattr(transformer_block, "get_num_layers_to_build", lambda config, vp_stage=None: config.num_layers)
    patch.apply(fake_args(overlap_tp=overlap_tp, overlap_moe=overlap_moe, num_experts=4), log=quiet)
    transformer = SimpleNamespace(num_moe_experts=4, moe_grouped_gemm=False, qk_layernorm=False,
                                  multi_latent_attention=False, qk_l2_norm=False, normalization="RMSNorm",
                                  num_layers=2, transformer_impl="local")
    spec = patch.overlap_layer_spec(transformer).layer_specs[0]
    mlp = spec.submodules.mlp   # a ModuleSpec, or a functools.partial on megatron-core >= 0.19
    module, submodules = (mlp.module, mlp.submodules) if hasattr(mlp, "module") else (mlp.func, mlp.keywords["submodules"])
    experts = getattr(submodules.experts, "module", getattr(submodules.experts, "func", submodules.experts))
    if overlap_moe == "off":
        assert module is MoELayer and experts is SequentialMLP
    else:
        assert module is OverlapMoELayer and experts is OverlapGroupedMLP
    assert "pre_mlp_layernorm." not in spec.submodules.sharded_state_dict_keys_map   # as Megatron's TE MoE spec


@pytest.mark.parametrize("impl, regime", [(None, "eager"), ("none", "eager"), ("local", "graphs"),
                                          ("full_iteration", "graphs")])
def test_the_tuner_times_as_the_run_executes(impl, regime):
    """Under --cuda-graph-impl local / full_iteration, `auto` times its candidates as CUDA graph replays (said once in
    the report); eager runs keep eager timing and change nothing."""
    from overlap_tp.tune import timing
    args = fake_args(overlap_tp="auto") if impl is None else fake_args(overlap_tp="auto", cuda_graph_impl=impl)
    report = patch.apply(args, log=quiet)
    assert timing.regime() == regime
    said = [line for line in report.changed if "the tuner times its candidates" in line]
    assert said == (["the tuner times its candidates as CUDA graph replays"] if regime == "graphs" else [])
    assert not [line for line in patch.apply(args, log=quiet).changed if "tuner" in line]
