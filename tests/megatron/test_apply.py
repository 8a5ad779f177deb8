"""megatron_patches.apply: off leaves Megatron's args untouched; on switches the spec and the layers'
OverlapConfig; applying twice changes nothing more."""
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
    try:
        from overlap_tp.megatron import layers
    except ImportError:
        layers = None
    saved = {op: layers.get_default_overlap_config(op) for op in layers.OP_KINDS} if layers else None
    if layers:
        from overlap_tp.megatron import moe_layer
        saved_moe = moe_layer.get_default_moe_overlap_config()
    yield
    patch.reset()
    if layers:
        layers.set_default_overlap_config(**saved)
        moe_layer.set_default_moe_overlap_config(saved_moe)


def fake_args(**overrides):
    values = dict(overlap_tp="signal", overlap_tp_transport="nccl", overlap_tp_comm_sms=8,
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
    assert len(report.changed) == 2  # the OverlapConfig and --spec


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


def test_layers_receive_the_config():
    pytest.importorskip("megatron.core", reason="overlap_tp.megatron.layers needs megatron-core")
    from overlap_tp.megatron import layers
    patch.apply(fake_args(overlap_tp_transport="p2p"), log=quiet)
    assert layers.get_default_overlap_config("gemm_rs").transport == "p2p"
    assert layers.get_default_overlap_config("ag_gemm").transport == "p2p"
    assert layers.get_default_overlap_config("gemm_ar").transport == "nccl"  # the flags keep gemm_ar on NCCL
    # --overlap-tp-comm-sms 8: the AllGather's pulls get 8 SMs, the p2p ReduceScatter's GEMM every SM, NCCL's 8 CTAs
    assert [layers.get_default_overlap_config(op).comm_sms for op in ("ag_gemm", "gemm_rs", "gemm_ar")] == [8, 0, 8]
    patch.apply(fake_args(overlap_tp_transport="auto"), log=quiet)   # the flag's default
    assert layers.get_default_overlap_config("ag_gemm") == OverlapConfig(method="signal", transport="p2p", comm_sms=0)
    assert layers.get_default_overlap_config("gemm_rs") == OverlapConfig(method="signal", transport="p2p", comm_sms=0)
    assert layers.get_default_overlap_config("gemm_ar") == OverlapConfig(method="signal", transport="nccl", comm_sms=8)
    assert patch.get_overlap_config("ag_gemm").transport == "p2p"


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
    """--no-overlap-tp-fused-norms: every layer of the block spec is Megatron's TransformerLayer around our
    linears and norms (the A/B of the fused bias-dropout-add + norm kernels); the report says so, and applying
    the default again brings OverlapTransformerLayer back."""
    pytest.importorskip("megatron.core", reason="the layer spec needs megatron-core")
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from overlap_tp.megatron.norm import OverlapRMSNorm
    from overlap_tp.megatron.transformer_layer import OverlapTransformerLayer
    monkeypatch.setattr(transformer_block, "get_num_layers_to_build", lambda config, vp_stage=None: config.num_layers)
    transformer = SimpleNamespace(num_moe_experts=None, moe_grouped_gemm=False, qk_layernorm=False,
                                  multi_latent_attention=False, qk_l2_norm=False, normalization="RMSNorm",
                                  num_layers=2)
    report = patch.apply(fake_args(overlap_tp_fused_norms=False), log=quiet)
    assert any("Megatron's TransformerLayer" in line for line in report.changed)
    spec = patch.overlap_layer_spec(transformer).layer_specs[0]
    assert spec.module is TransformerLayer
    assert spec.submodules.input_layernorm is OverlapRMSNorm
    assert spec.submodules.self_attention.submodules.linear_proj.__module__ == "overlap_tp.megatron.layers"
    report = patch.apply(fake_args(), log=quiet)
    assert any("fused bias-dropout-add + norm" in line for line in report.changed)
    assert patch.overlap_layer_spec(transformer).layer_specs[0].module is OverlapTransformerLayer


def test_gather_in_place_reaches_the_layers_and_is_reported():
    pytest.importorskip("megatron.core", reason="overlap_tp.megatron.layers needs megatron-core")
    from overlap_tp.megatron import layers
    try:
        report = patch.apply(fake_args(overlap_tp_gather_in_place=True), log=quiet)
        assert layers.gather_in_place_default() is True
        assert any("own gathered buffers" in line for line in report.changed)
        report = patch.apply(fake_args(overlap_tp_gather_in_place=True), log=quiet)
        assert not any("gathered" in line for line in report.changed)     # idempotent
        report = patch.apply(fake_args(), log=quiet)
        assert layers.gather_in_place_default() is False
        assert any("stage their inputs" in line for line in report.changed)
        report = patch.apply(fake_args(overlap_tp_gather_in_place=True, overlap_tp_defer_wgrad=True), log=quiet)
        assert layers.defer_wgrad_default() is True
        assert any("inside linear_proj's backward" in line for line in report.changed)
        report = patch.apply(fake_args(overlap_tp_gather_in_place=True), log=quiet)
        assert layers.defer_wgrad_default() is False
        assert any("in its own backward" in line for line in report.changed)
    finally:
        patch.reset()
    assert layers.gather_in_place_default() is False and layers.defer_wgrad_default() is False


def test_token_split_reaches_the_layers_and_is_reported():
    pytest.importorskip("megatron.core", reason="overlap_tp.megatron.transformer_layer needs megatron-core")
    from overlap_tp.megatron import transformer_layer
    try:
        report = patch.apply(fake_args(overlap_tp_token_split=True), log=quiet)
        assert transformer_layer.token_split_default() is True
        assert any("two interleaved halves" in line for line in report.changed)
        report = patch.apply(fake_args(overlap_tp_token_split=True), log=quiet)
        assert not any("halves" in line for line in report.changed)     # idempotent
        report = patch.apply(fake_args(), log=quiet)
        assert transformer_layer.token_split_default() is False
        assert any("runs whole" in line for line in report.changed)
    finally:
        patch.reset()
    assert transformer_layer.token_split_default() is False


def test_overlap_moe_alone_switches_the_spec_and_the_moe_config():
    pytest.importorskip("megatron.core", reason="overlap_tp.megatron.moe_layer needs megatron-core")
    from overlap_tp.megatron import moe_layer
    args = fake_args(overlap_tp="off", overlap_moe="signal", tensor_model_parallel_size=1, sequence_parallel=False,
                     num_experts=8)
    report = patch.apply(args, log=quiet)
    assert report.active and args.spec == list(patch.SPEC)
    assert patch.get_overlap_config().method == "off"   # the dense layers: overlap_tp's, overlap off
    assert patch.get_moe_overlap_config() == OverlapConfig(method="signal", groups=2, comm_sms=8)   # fake_args sets 8 SMs
    assert moe_layer.get_default_moe_overlap_config() is patch.get_moe_overlap_config()
    assert "MoE layers on" in str(report) and len(report.changed) == 3   # two configs and --spec
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
