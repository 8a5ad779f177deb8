"""The DeepSeek-V3 and Qwen3-MoE proxy recipes: valid bash, the shapes and layouts they name, their flags accepted by
overlap_tp's and Megatron's validation (two GPUs, and TP 1 on one GPU), and the model they build: the layer spec from
Megatron's own arguments puts multi-latent attention, the dense first layer, the shared expert and the MoE layers where
the recipe says (test_recipes.py holds the stand-ins and the checks every recipe shares)."""
import os
import subprocess
import warnings

import pytest

from overlap_tp.megatron.arguments import build_parser
from test_recipes import ROOT, dry_run, fakes, flag, recipe_argv, run_recipe  # noqa: F401  (fixtures)

NEW_RECIPES = ("deepseek-v3-proxy", "qwen3-moe-proxy")


@pytest.mark.parametrize("name", NEW_RECIPES)
def test_scripts_are_valid_executable_bash(name):
    path = os.path.join(ROOT, "recipes", f"{name}.sh")
    subprocess.run(["bash", "-n", path], check=True)
    assert os.access(path, os.X_OK)


def test_deepseek_v3_proxy_shapes(recipe_argv):
    argv = recipe_argv("deepseek-v3-proxy")
    assert "--multi-latent-attention" in argv and "--qk-layernorm" in argv
    assert "--group-query-attention" not in argv
    assert [flag(argv, f) for f in ("--hidden-size", "--num-attention-heads", "--q-lora-rank", "--kv-lora-rank",
                                    "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim", "--ffn-hidden-size",
                                    "--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size",
                                    "--moe-shared-expert-intermediate-size", "--num-layers", "--moe-layer-freq")] == \
        ["7168", "128", "1536", "512", "128", "64", "128", "18432", "16", "4", "2048", "2048", "4", "([0]*1+[1]*3)"]
    assert [flag(argv, f) for f in ("--tensor-model-parallel-size", "--expert-model-parallel-size",
                                    "--expert-tensor-parallel-size", "--moe-token-dispatcher-type")] == \
        ["2", "2", "1", "alltoall"]
    assert flag(recipe_argv("deepseek-v3-proxy", NUM_LAYERS="6"), "--moe-layer-freq") == "([0]*1+[1]*5)"
    assert "--moe-shared-expert-overlap" not in argv
    args, _ = build_parser().parse_known_args(argv)
    assert (args.overlap_tp, args.overlap_moe) == ("auto", "auto")   # the recipes' default OVERLAP
    assert "--cuda-graph-impl" not in argv   # dropless MoE: eager unless GRAPHS says otherwise


def test_qwen3_moe_proxy_shapes(recipe_argv):
    argv = recipe_argv("qwen3-moe-proxy")
    assert "--group-query-attention" in argv and "--qk-layernorm" in argv and "--multi-latent-attention" not in argv
    assert "--moe-layer-freq" not in argv and "--moe-shared-expert-intermediate-size" not in argv   # every layer MoE
    assert [flag(argv, f) for f in ("--hidden-size", "--num-attention-heads", "--num-query-groups", "--kv-channels",
                                    "--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size", "--vocab-size",
                                    "--num-layers")] == ["2048", "32", "4", "128", "128", "8", "768", "151936", "6"]
    assert [flag(argv, f) for f in ("--tensor-model-parallel-size", "--expert-model-parallel-size",
                                    "--expert-tensor-parallel-size")] == ["2", "2", "1"]


def test_deepseek_v3_proxy_needs_a_dense_and_an_moe_layer(fakes):
    bad = run_recipe("deepseek-v3-proxy", fakes_folder=fakes, DRY_RUN="1", NUM_LAYERS="1")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "[recipe] NUM_LAYERS=1: expected a whole number >= 2 (the first layer is dense, the rest MoE)"]


@pytest.mark.parametrize("name", NEW_RECIPES)
@pytest.mark.parametrize("env", [{}, dict(OVERLAP="off"), dict(TP="1", EP="1", NUM_LAYERS="2")],
                         ids=["on", "off", "tp1_one_gpu"])
def test_megatron_and_overlap_tp_accept_the_recipe(recipe_argv, monkeypatch, capsys, name, env):
    pytest.importorskip("megatron.training.arguments", reason="megatron.training: megatron-core >= 0.19",
                        exc_type=ImportError)
    from overlap_tp.launch.check import check
    from overlap_tp.launch.pretrain import DEFAULTS
    argv = recipe_argv(name, **env)
    world = int(env.get("TP", "2"))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    code = check("overlap-tp-pretrain", argv, defaults=DEFAULTS)
    out, err = capsys.readouterr()
    assert (code, out) == (0, f"ok (world size {world})\n"), err


def _model_layer_specs(argv, monkeypatch):
    """The decoder layer specs overlap_tp builds for this command line: Megatron's parse and validation, overlap_tp's
    validation and apply, Megatron's TransformerConfig from the arguments, then the block spec (one stage)."""
    from megatron.core import parallel_state
    from megatron.training.arguments import core_transformer_config_from_args

    from overlap_tp.launch.check import _validated
    from overlap_tp.launch.pretrain import DEFAULTS
    from overlap_tp.megatron_patches import apply as patches
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args, _ = _validated(argv, DEFAULTS)
        patches.apply(args, log=lambda message: None)
        try:
            return patches.overlap_layer_spec(core_transformer_config_from_args(args)).layer_specs
        finally:
            patches.reset()


def _module(spec):
    return getattr(spec, "module", None) or getattr(spec, "func", None) or spec


def test_deepseek_v3_proxy_builds_mla_a_dense_first_layer_and_moe_layers_with_a_shared_expert(recipe_argv, monkeypatch):
    pytest.importorskip("megatron.training.arguments", reason="megatron.training: megatron-core >= 0.19",
                        exc_type=ImportError)
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from overlap_tp.megatron.layers import OverlapColumnParallelLinear
    from overlap_tp.megatron.moe_layer import OverlapMoELayer
    specs = _model_layer_specs(recipe_argv("deepseek-v3-proxy"), monkeypatch)
    assert [_module(s.submodules.mlp) for s in specs] == [MLP, OverlapMoELayer, OverlapMoELayer, OverlapMoELayer]
    for spec in specs:
        attention = spec.submodules.self_attention
        assert attention.module is MLASelfAttention
        assert _module(attention.submodules.linear_kv_up_proj) is OverlapColumnParallelLinear
        assert attention.submodules.linear_kv_up_proj.params["settings"].moe is not None   # apply's settings
    shared = specs[1].submodules.mlp.submodules.shared_experts
    assert _module(shared.submodules.linear_fc1) is OverlapColumnParallelLinear


def test_qwen3_moe_proxy_builds_every_layer_moe(recipe_argv, monkeypatch):
    pytest.importorskip("megatron.training.arguments", reason="megatron.training: megatron-core >= 0.19",
                        exc_type=ImportError)
    from megatron.core.transformer.attention import SelfAttention

    from overlap_tp.megatron.moe_layer import OverlapMoELayer
    specs = _model_layer_specs(recipe_argv("qwen3-moe-proxy"), monkeypatch)
    assert len(specs) == 6
    assert all(_module(s.submodules.mlp) is OverlapMoELayer for s in specs)
    assert all(s.submodules.self_attention.module is SelfAttention for s in specs)
