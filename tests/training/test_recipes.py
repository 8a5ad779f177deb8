"""The training recipes: present, valid bash, and the flags they pass parse in overlap_tp's parser (and,
where megatron.training is importable, in Megatron's own); the launcher says how to get Megatron."""
import os
import shlex
import shutil
import subprocess
import sys

import pytest

from overlap_tp.megatron.arguments import build_parser, validate_overlap_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = ("smoke", "llama3-8b", "llama3-70b-proxy", "mixtral-proxy")
LLAMA_FLAGS = ("--normalization", "--swiglu", "--disable-bias-linear", "--group-query-attention",
               "--position-embedding-type", "--bf16", "--log-throughput", "--wandb-project", "--tensorboard-dir",
               "--sequence-parallel", "--untie-embeddings-and-output-weights")

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def recipe_argv(name, *extra, **env):
    """The Megatron command line a recipe would launch (DRY_RUN=1 prints it)."""
    environ = {k: v for k, v in os.environ.items()
               if k not in ("OVERLAP", "TRANSPORT", "COMM_SMS", "TP", "EP", "NUM_LAYERS", "WANDB_PROJECT",
                            "RDZV_ENDPOINT", "GRAPHS", "GATHER_IN_PLACE", "DEFER_WGRAD", "TUNE_CACHE",
                            "OUT_DIR", "MBS", "GBS", "TOKEN_SPLIT")}
    environ.update(DRY_RUN="1", **env)
    out = subprocess.run(["bash", os.path.join(ROOT, "recipes", f"{name}.sh"), *extra], env=environ,
                         capture_output=True, text=True, check=True).stdout
    argv = shlex.split(out)
    assert argv[0] == "torchrun" and "overlap_tp.launch.pretrain" in argv
    return argv[argv.index("overlap_tp.launch.pretrain") + 1:]


def flag(argv, name):
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("path", [f"recipes/{r}.sh" for r in RECIPES] + ["recipes/common.sh",
                                                                          "launch/slurm_template.sh"])
def test_scripts_exist_and_are_valid_bash(path):
    full = os.path.join(ROOT, path)
    assert os.path.isfile(full)
    subprocess.run(["bash", "-n", full], check=True)
    if not path.endswith("common.sh"):
        assert os.access(full, os.X_OK), f"{path} is not executable"


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("overlap", ["signal", "off"])
def test_recipe_flags_parse_and_validate(name, overlap):
    argv = recipe_argv(name, OVERLAP=overlap)
    args, megatron_flags = build_parser().parse_known_args(argv)
    assert args.overlap_tp == overlap
    for name_ in LLAMA_FLAGS:
        assert name_ in argv, name_
    assert flag(argv, "--normalization") == "RMSNorm" and flag(argv, "--tensor-model-parallel-size") == "2"
    assert "--overlap-tp" not in megatron_flags
    megatron = dict(tensor_model_parallel_size=int(flag(argv, "--tensor-model-parallel-size")),
                    sequence_parallel="--sequence-parallel" in argv, normalization=flag(argv, "--normalization"),
                    transformer_impl=flag(argv, "--transformer-impl"))
    if "--num-experts" in argv:   # the MoE flags --overlap-moe checks
        assert args.overlap_moe == overlap and "--overlap-moe" not in megatron_flags
        megatron.update(num_experts=int(flag(argv, "--num-experts")), add_bias_linear="--disable-bias-linear" not in argv,
                        moe_token_dispatcher_type=flag(argv, "--moe-token-dispatcher-type"),
                        expert_tensor_parallel_size=int(flag(argv, "--expert-tensor-parallel-size")))
    for key, value in megatron.items():
        setattr(args, key, value)
    assert validate_overlap_args(args, warn=None) == []


def test_llama_shapes():
    eight = recipe_argv("llama3-8b")
    assert [flag(eight, f) for f in ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
                                     "--num-query-groups", "--seq-length", "--vocab-size")] == \
        ["32", "4096", "14336", "32", "8", "8192", "128256"]
    seventy = recipe_argv("llama3-70b-proxy")
    assert [flag(seventy, f) for f in ("--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
                                       "--num-query-groups", "--seq-length")] == ["8192", "28672", "64", "8", "8192"]
    assert flag(recipe_argv("llama3-70b-proxy", NUM_LAYERS="10"), "--num-layers") == "10"
    # the mode measured fastest per recipe: cuBLAS over p2p (decompose) at the 70B shapes at TP 2, signal there at
    # TP 4 and at 8B, auto for the smoke (benchmarks/results.jsonl)
    assert (flag(seventy, "--overlap-tp"), flag(eight, "--overlap-tp")) == ("decompose", "signal")
    assert flag(recipe_argv("llama3-70b-proxy", OVERLAP="signal"), "--overlap-tp") == "signal"
    seventy_t4 = recipe_argv("llama3-70b-proxy", TP="4", NPROC="4")
    assert (flag(seventy_t4, "--overlap-tp"), flag(seventy_t4, "--tensor-model-parallel-size")) == ("signal", "4")
    assert "--overlap-tp-gather-in-place" in seventy_t4
    assert flag(recipe_argv("llama3-70b-proxy", TP="4", NPROC="4", OVERLAP="decompose"), "--overlap-tp") == "decompose"
    assert flag(recipe_argv("smoke"), "--overlap-tp") == "auto"
    assert flag(recipe_argv("smoke", OVERLAP="signal"), "--overlap-tp") == "signal"


def test_llama3_8b_micro_batch_where_measured_faster():
    """Two sequences per micro-batch at TP 2 and 4, the same global batch (both sides faster, ours more:
    benchmarks/e2e-tp2_h200x2_2026-11-28.md, e2e-tp4_h200x4_2026-11-28.md); one at TP 8, not measured there; MBS
    overrides, on both sides alike."""
    micro = "--micro-batch-size"
    for overlap in ("signal", "off"):
        assert flag(recipe_argv("llama3-8b", OVERLAP=overlap), micro) == "2"
        assert flag(recipe_argv("llama3-8b", OVERLAP=overlap, TP="4", NPROC="4"), micro) == "2"
        assert flag(recipe_argv("llama3-8b", OVERLAP=overlap, TP="8", NPROC="8"), micro) == "1"
        assert flag(recipe_argv("llama3-8b", OVERLAP=overlap, MBS="1"), micro) == "1"
    assert flag(recipe_argv("llama3-8b"), "--global-batch-size") == "8"
    assert flag(recipe_argv("llama3-70b-proxy"), micro) == "1"


def test_gather_in_place_and_defer_wgrad_where_measured_faster_and_only_where_they_apply():
    """llama3-8b and llama3-70b-proxy gather in place by default (measured faster end to end), and at TP >= 4
    under graphs defer fc1's wgrad as well (faster there, a tie at TP 2); never with the overlap off or auto, nor over NCCL (the flags would
    be refused); GATHER_IN_PLACE / DEFER_WGRAD=0/1 override a recipe's defaults."""
    in_place = "--overlap-tp-gather-in-place"
    for name in ("llama3-8b", "llama3-70b-proxy"):
        for overlap in ("signal", "decompose"):
            argv = recipe_argv(name, OVERLAP=overlap)
            assert in_place in argv, (name, overlap)
            args, _ = build_parser().parse_known_args(argv)
            args.tensor_model_parallel_size, args.sequence_parallel = 2, True
            args.normalization, args.transformer_impl = "RMSNorm", "local"
            assert args.overlap_tp_gather_in_place and validate_overlap_args(args, warn=None) == []
        for env in (dict(OVERLAP="off"), dict(OVERLAP="auto"), dict(TRANSPORT="nccl"), dict(GATHER_IN_PLACE="0")):
            assert in_place not in recipe_argv(name, **env), (name, env)
    assert in_place not in recipe_argv("smoke") and in_place not in recipe_argv("mixtral-proxy")
    assert in_place in recipe_argv("smoke", GATHER_IN_PLACE="1", OVERLAP="signal")
    # DEFER_WGRAD: with gathering in place only (the flag needs it); the llama3 recipes' default at TP >= 4 under
    # graphs (measured faster there), off at TP 2 (a tie), eagerly and elsewhere
    defer = "--overlap-tp-defer-wgrad"
    for name in ("llama3-8b", "llama3-70b-proxy"):
        assert defer not in recipe_argv(name) and defer in recipe_argv(name, DEFER_WGRAD="1")
        assert defer in recipe_argv(name, TP="4") and defer in recipe_argv(name, TP="8", GRAPHS="full_iteration")
        for env in (dict(TP="4", GRAPHS="none"), dict(TP="4", DEFER_WGRAD="0"), dict(TP="4", GATHER_IN_PLACE="0"),
                    dict(TP="4", OVERLAP="off"), dict(DEFER_WGRAD="1", GATHER_IN_PLACE="0")):
            assert defer not in recipe_argv(name, **env), (name, env)
        args, _ = build_parser().parse_known_args(recipe_argv(name, TP="4"))
        args.tensor_model_parallel_size, args.sequence_parallel = 4, True
        args.normalization, args.transformer_impl = "RMSNorm", "local"
        assert args.overlap_tp_defer_wgrad and validate_overlap_args(args, warn=None) == []
    assert defer not in recipe_argv("smoke", TP="4") and defer not in recipe_argv("mixtral-proxy", TP="4")


def test_auto_keeps_its_tune_cache_with_the_run():
    """With OVERLAP=auto the tuner's decisions go next to the run's log (a second run into the same OUT_DIR measures
    nothing before its first step); TUNE_CACHE moves them; the other modes do not tune and get no cache flag."""
    cache = "--overlap-tp-tune-cache"
    assert flag(recipe_argv("smoke"), cache) == "runs/smoke-auto/overlap_tp_tune.json"
    assert flag(recipe_argv("smoke", OUT_DIR="/tmp/x"), cache) == "/tmp/x/overlap_tp_tune.json"
    assert flag(recipe_argv("llama3-8b", OVERLAP="auto", TUNE_CACHE="/tmp/t.json"), cache) == "/tmp/t.json"
    for env in (dict(OVERLAP="signal"), dict(OVERLAP="off")):
        assert cache not in recipe_argv("smoke", **env), env
    args, _ = build_parser().parse_known_args(recipe_argv("smoke"))
    assert args.overlap_tp == "auto" and args.overlap_tp_tune_cache == "runs/smoke-auto/overlap_tp_tune.json"


def test_mixtral_shapes_and_moe_layout():
    argv = recipe_argv("mixtral-proxy")
    assert [flag(argv, f) for f in ("--hidden-size", "--ffn-hidden-size", "--num-experts", "--moe-router-topk",
                                    "--num-attention-heads", "--num-query-groups", "--seq-length")] == \
        ["4096", "14336", "8", "2", "32", "8", "4096"]
    assert [flag(argv, f) for f in ("--tensor-model-parallel-size", "--expert-model-parallel-size",
                                    "--expert-tensor-parallel-size", "--moe-token-dispatcher-type")] == \
        ["2", "2", "1", "alltoall"]
    assert (flag(argv, "--overlap-tp"), flag(argv, "--overlap-moe")) == ("signal", "signal")
    baseline = recipe_argv("mixtral-proxy", "--overlap-moe", "signal", OVERLAP="off")
    args, _ = build_parser().parse_known_args(baseline)
    assert (args.overlap_tp, args.overlap_moe) == ("off", "signal")   # the MoE overlap alone: flags after win
    # dropless MoE: eager by default (megatron-core 0.19.2's local graphs abort on its own MoE layer); per-layer
    # graphs when asked for capture attention only; other graph modes add no scope
    assert "--cuda-graph-impl" not in argv and "--cuda-graph-modules" not in argv
    local = recipe_argv("mixtral-proxy", GRAPHS="local")
    assert flag(local, "--cuda-graph-impl") == "local" and flag(local, "--cuda-graph-modules") == "attn"
    assert "--cuda-graph-modules" not in recipe_argv("mixtral-proxy", GRAPHS="full_iteration")


def test_graph_mode_is_the_same_for_both_sides():
    """GRAPHS picks Megatron's --cuda-graph-impl for on and off alike; each recipe's default is the mode measured
    fastest for it (smoke: full_iteration, the dense others: local; mixtral-proxy: none, as Megatron's local graphs
    abort on its MoE layer)."""
    for overlap in ("off", "signal"):
        argv = recipe_argv("smoke", OVERLAP=overlap)
        assert flag(argv, "--cuda-graph-impl") == "full_iteration" and "--no-check-for-nan-in-loss-and-grad" in argv
        assert flag(recipe_argv("llama3-8b", OVERLAP=overlap), "--cuda-graph-impl") == "local"
    assert flag(recipe_argv("smoke", GRAPHS="local"), "--cuda-graph-impl") == "local"
    assert "--cuda-graph-impl" not in recipe_argv("smoke", GRAPHS="none")
    bad = subprocess.run(["bash", os.path.join(ROOT, "recipes", "smoke.sh")], env={**os.environ, "DRY_RUN": "1",
                                                                                    "GRAPHS": "always"},
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "GRAPHS=always" in bad.stderr


def test_knobs_and_extra_flags_pass_through():
    argv = recipe_argv("smoke", OVERLAP="decompose", TRANSPORT="p2p", COMM_SMS="0", WANDB_PROJECT="")
    args, _ = build_parser().parse_known_args(argv + ["--overlap-tp-tune-cache", "/tmp/c.json"])
    assert (args.overlap_tp, args.overlap_tp_transport, args.overlap_tp_comm_sms) == ("decompose", "p2p", 0)
    assert "--wandb-project" not in argv
    argv = recipe_argv("smoke", "--overlap-tp", "off", "--train-iters", "3")
    assert argv[-4:] == ["--overlap-tp", "off", "--train-iters", "3"]  # given last: they win
    assert build_parser().parse_known_args(argv)[0].overlap_tp == "off"


def test_recipe_flags_in_megatrons_parser(monkeypatch):
    arguments = pytest.importorskip(
        "megatron.training.arguments",
        reason="megatron.training is not importable (megatron-core >= 0.19 on Python >= 3.12 ships it)")
    from overlap_tp.megatron.arguments import add_overlap_args
    for name in RECIPES:
        monkeypatch.setattr(sys, "argv", ["pretrain"] + recipe_argv(name))
        args = arguments.parse_args(extra_args_provider=add_overlap_args)
        # each recipe's measured-fastest default
        mode = {"llama3-70b-proxy": "decompose", "smoke": "auto"}.get(name, "signal")
        assert args.overlap_tp == mode and args.sequence_parallel and args.swiglu


def test_launcher_without_megatron_training_says_how_to_get_it():
    try:
        import megatron.training.training  # noqa: F401
        pytest.skip("megatron.training is importable here")
    except ImportError:
        pass
    result = subprocess.run([sys.executable, "-m", "overlap_tp.launch.pretrain", "--num-layers", "2"],
                            capture_output=True, text=True)
    assert result.returncode != 0
    assert "megatron-core >= 0.19" in result.stderr and "Python >= 3.12" in result.stderr
    assert "Megatron-LM checkout on PYTHONPATH" in result.stderr


def test_preflight_is_one_line_without_gpus(monkeypatch, capsys):
    """recipes/common.sh calls preflight before torchrun: no deep Megatron traceback on a CPU machine."""
    import torch

    from overlap_tp.launch import pretrain
    monkeypatch.setattr(pretrain, "require_megatron_training", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pretrain.preflight(2) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "2 rank(s) per node need as many CUDA GPUs; 0 visible here" in err
