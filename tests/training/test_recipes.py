"""The training recipes: present, valid bash, and the flags they pass parse in overlap_tp's parser (and,
where megatron.training is importable, in Megatron's own); the launcher says how to get Megatron. DRY_RUN=1 prints
what the run launches (through stand-ins for python's import probes and torchrun), NPROC follows TP, a layout TP
does not divide is one line, CHECK=1 validates without a GPU, and recipes/README.md lists every variable read."""
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from overlap_tp.megatron.arguments import build_parser
from overlap_tp.megatron.settings_from_args import settings_from_args
from overlap_tp.megatron.validation import validate_overlap_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = ("smoke", "llama3-8b", "llama3-70b-proxy", "mixtral-proxy")
MOE_PROXIES = ("mixtral-proxy", "deepseek-v3-proxy", "qwen3-moe-proxy")   # they pass OVERLAP to --overlap-moe too
LLAMA_FLAGS = ("--normalization", "--swiglu", "--disable-bias-linear", "--group-query-attention",
               "--position-embedding-type", "--bf16", "--log-throughput", "--wandb-project", "--tensorboard-dir",
               "--sequence-parallel", "--untie-embeddings-and-output-weights")
# A stand-in interpreter for the recipes' probes: `-c "import NAME"` succeeds for the names in $FAKE_IMPORTS only,
# the preflight passes (no GPU here); everything else is this Python.
FAKE_PYTHON = """#!/bin/sh
if [ "$1" = -c ]; then
  case "$2" in
    *preflight*) exit 0 ;;
    "import "*) for name in $FAKE_IMPORTS; do [ "$2" = "import $name" ] && exit 0; done; exit 1 ;;
  esac
fi
exec {python} "$@"
"""
# A stand-in torchrun: records its arguments (NUL-separated) and its environment.
FAKE_TORCHRUN = """#!/bin/sh
printf '%s\\0' "$@" > "$FAKE_RECORD.args"
env > "$FAKE_RECORD.env"
"""

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def recipe_variables():
    """The environment variables the recipes read: every ${NAME:-...} / ${NAME-...} in recipes/*.sh."""
    names = set()
    for script in os.listdir(os.path.join(ROOT, "recipes")):
        if script.endswith(".sh"):
            names |= set(re.findall(r"\$\{([A-Z][A-Z0-9_]*):?-", open(os.path.join(ROOT, "recipes", script)).read()))
    return names


@pytest.fixture(scope="session")
def fakes(tmp_path_factory):
    """A folder with the stand-in python and torchrun."""
    folder = tmp_path_factory.mktemp("fakes")
    for name, text in (("python", FAKE_PYTHON.format(python=sys.executable)), ("torchrun", FAKE_TORCHRUN)):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


def run_recipe(name, *extra, imports=("wandb",), fakes_folder=None, **env):
    """Run recipes/NAME.sh with `env` over a clean environment (none of the recipes' variables set), its import
    probes answered by the stand-in interpreter: `imports` are the modules that import."""
    environ = {k: v for k, v in os.environ.items() if k not in recipe_variables() | {"DRY_RUN", "CHECK"}}
    if fakes_folder is not None:
        environ.update(PYTHON=str(fakes_folder / "python"), FAKE_IMPORTS=" ".join(imports))
    environ.update(env)
    return subprocess.run(["bash", os.path.join(ROOT, "recipes", f"{name}.sh"), *extra], env=environ, cwd=ROOT,
                          capture_output=True, text=True)


def pasted(printed):
    """What bash runs when `printed` (DRY_RUN's `env ASSIGNMENTS... COMMAND...`) is pasted: its words."""
    words = subprocess.run(["bash", "-c", "env() { printf '%s\\0' \"$@\"; }\n" + printed], capture_output=True,
                           check=True).stdout.decode()
    return words.split("\0")[:-1]


def dry_run(name, *extra, fakes_folder, imports=("wandb",), **env):
    """(the environment assignments, the command) DRY_RUN=1 prints, and its stderr."""
    result = run_recipe(name, *extra, fakes_folder=fakes_folder, imports=imports, DRY_RUN="1", **env)
    assert result.returncode == 0, result.stderr
    words = pasted(result.stdout)
    start = words.index("torchrun")
    return words[:start], words[start:], result.stderr


@pytest.fixture
def recipe_argv(fakes):
    """The Megatron command line a recipe would launch (DRY_RUN=1 prints it), on a machine where wandb imports and
    Transformer Engine and Apex do not."""
    def argv(name, *extra, **env):
        command = dry_run(name, *extra, fakes_folder=fakes, **env)[1]
        assert command[0] == "torchrun" and "overlap_tp.launch.pretrain" in command
        return command[command.index("overlap_tp.launch.pretrain") + 1:]
    return argv


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
@pytest.mark.parametrize("overlap", ["auto", "signal", "off"])
def test_recipe_flags_parse_and_validate(name, overlap, recipe_argv):
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


def test_llama_shapes(recipe_argv):
    eight = recipe_argv("llama3-8b")
    assert [flag(eight, f) for f in ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
                                     "--num-query-groups", "--seq-length", "--vocab-size")] == \
        ["32", "4096", "14336", "32", "8", "8192", "128256"]
    seventy = recipe_argv("llama3-70b-proxy")
    assert [flag(seventy, f) for f in ("--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
                                       "--num-query-groups", "--seq-length")] == ["8192", "28672", "64", "8", "8192"]
    assert flag(recipe_argv("llama3-70b-proxy", NUM_LAYERS="10"), "--num-layers") == "10"
    # one mode for every recipe: auto times cuBLAS over p2p (decompose), signal and off per shape (the mode each
    # recipe used to pick by hand: benchmarks/results.jsonl); OVERLAP picks another
    assert (flag(seventy, "--overlap-tp"), flag(eight, "--overlap-tp")) == ("auto", "auto")
    assert flag(recipe_argv("llama3-70b-proxy", OVERLAP="signal"), "--overlap-tp") == "signal"
    seventy_t4 = recipe_argv("llama3-70b-proxy", TP="4", NPROC="4")
    assert (flag(seventy_t4, "--overlap-tp"), flag(seventy_t4, "--tensor-model-parallel-size")) == ("auto", "4")
    assert flag(recipe_argv("llama3-70b-proxy", TP="4", NPROC="4", OVERLAP="decompose"), "--overlap-tp") == "decompose"
    assert flag(recipe_argv("smoke"), "--overlap-tp") == "auto"
    assert flag(recipe_argv("smoke", OVERLAP="signal"), "--overlap-tp") == "signal"


def test_llama3_8b_micro_batch_where_measured_faster(recipe_argv):
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


OURS = re.compile(r"^--(no-)?overlap-")


def megatron_namespace(argv):
    """The recipe's flags parsed by overlap_tp's parser, with the Megatron values its settings read."""
    args, _ = build_parser().parse_known_args(argv)
    args.tensor_model_parallel_size = int(flag(argv, "--tensor-model-parallel-size"))
    args.sequence_parallel = "--sequence-parallel" in argv
    args.cuda_graph_impl = flag(argv, "--cuda-graph-impl") if "--cuda-graph-impl" in argv else "none"
    return args


@pytest.mark.parametrize("name", RECIPES + tuple(name for name in MOE_PROXIES if name not in RECIPES))
def test_recipes_pass_one_overlap_flag_and_nothing_else_of_ours(name, recipe_argv):
    """--overlap-tp auto (and --overlap-moe auto for the MoE recipes) is all of overlap_tp's a recipe passes, at every
    TP and graph mode; what the recipes used to hand-pick (gathering in place in the llama3 recipes, fc1's wgrad beside
    proj's AllGather at TP >= 4 under graphs) auto decides for the run."""
    for env in ({}, dict(TP="4", NPROC="4"), dict(GRAPHS="none"), dict(TP="4", NPROC="4", GRAPHS="local")):
        argv = recipe_argv(name, **env)
        ours = [word for word in argv if OURS.match(word)]
        assert ours == (["--overlap-tp", "--overlap-moe"] if name in MOE_PROXIES else ["--overlap-tp"]), (env, ours)
        assert flag(argv, "--overlap-tp") == "auto"
        if name in MOE_PROXIES:
            assert flag(argv, "--overlap-moe") == "auto"
        settings = settings_from_args(megatron_namespace(argv))
        assert settings.gather_in_place, env
        graphs = "--cuda-graph-impl" in argv
        assert settings.defer_wgrad == (env.get("TP") == "4" and graphs), env
        assert not settings.token_split
    assert [w for w in recipe_argv(name, OVERLAP="off") if OURS.match(w) and w != "--overlap-tp-layers"] == (
        ["--overlap-tp", "--overlap-moe"] if name in MOE_PROXIES else ["--overlap-tp"])


def test_auto_keeps_its_tune_cache_with_the_run(fakes):
    """With OVERLAP=auto the tuner's decisions go next to the run's log (OVERLAP_TP_TUNE_CACHE in the run's
    environment: a second run into the same OUT_DIR measures nothing before its first step); TUNE_CACHE moves them;
    the other modes do not tune and get none."""
    def cache(**env):
        assignments = dry_run("smoke", fakes_folder=fakes, **env)[0]
        found = [a.split("=", 1)[1] for a in assignments if a.startswith("OVERLAP_TP_TUNE_CACHE=")]
        return found[0] if found else None
    assert cache() == "runs/smoke-auto/overlap_tp_tune.json"
    assert cache(OUT_DIR="/tmp/x") == "/tmp/x/overlap_tp_tune.json"
    assert cache(TUNE_CACHE="/tmp/t.json") == "/tmp/t.json"
    for env in (dict(OVERLAP="signal"), dict(OVERLAP="off")):
        assert cache(**env) is None, env


def test_mixtral_shapes_and_moe_layout(recipe_argv):
    argv = recipe_argv("mixtral-proxy")
    assert [flag(argv, f) for f in ("--hidden-size", "--ffn-hidden-size", "--num-experts", "--moe-router-topk",
                                    "--num-attention-heads", "--num-query-groups", "--seq-length")] == \
        ["4096", "14336", "8", "2", "32", "8", "4096"]
    assert [flag(argv, f) for f in ("--tensor-model-parallel-size", "--expert-model-parallel-size",
                                    "--expert-tensor-parallel-size", "--moe-token-dispatcher-type")] == \
        ["2", "2", "1", "alltoall"]
    assert (flag(argv, "--overlap-tp"), flag(argv, "--overlap-moe")) == ("auto", "auto")
    baseline = recipe_argv("mixtral-proxy", "--overlap-moe", "signal", OVERLAP="off")
    args, _ = build_parser().parse_known_args(baseline)
    assert (args.overlap_tp, args.overlap_moe) == ("off", "signal")   # the MoE overlap alone: flags after win
    # dropless MoE: eager by default (megatron-core 0.19.2's local graphs abort on its own MoE layer); per-layer
    # graphs when asked for capture attention only; other graph modes add no scope
    assert "--cuda-graph-impl" not in argv and "--cuda-graph-modules" not in argv
    local = recipe_argv("mixtral-proxy", GRAPHS="local")
    assert flag(local, "--cuda-graph-impl") == "local" and flag(local, "--cuda-graph-modules") == "attn"
    assert "--cuda-graph-modules" not in recipe_argv("mixtral-proxy", GRAPHS="full_iteration")


def test_graph_mode_is_the_same_for_both_sides(recipe_argv):
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


def test_knobs_and_extra_flags_pass_through(recipe_argv):
    argv = recipe_argv("smoke", "--overlap-tp-config", "/tmp/overlap.json", OVERLAP="decompose", WANDB_PROJECT="")
    args, _ = build_parser().parse_known_args(argv)
    assert (args.overlap_tp, args.overlap_tp_config) == ("decompose", "/tmp/overlap.json")
    assert "--wandb-project" not in argv
    argv = recipe_argv("smoke", "--overlap-tp", "off", "--train-iters", "3")
    assert argv[-4:] == ["--overlap-tp", "off", "--train-iters", "3"]  # given last: they win
    assert build_parser().parse_known_args(argv)[0].overlap_tp == "off"


@pytest.mark.parametrize("name", RECIPES + ("deepseek-v3-proxy", "qwen3-moe-proxy"))
def test_a_short_run_warms_up_for_less_than_its_length(name, recipe_argv):
    """Megatron asserts warmup < decay: TRAIN_ITERS below a recipe's warmup (a few first steps) shortens the warmup."""
    argv = recipe_argv(name, TRAIN_ITERS="3")
    assert (flag(argv, "--train-iters"), flag(argv, "--lr-warmup-iters")) == ("3", "2")
    argv = recipe_argv(name, TRAIN_ITERS="1")
    assert (flag(argv, "--train-iters"), flag(argv, "--lr-warmup-iters")) == ("1", "0")
    argv = recipe_argv(name)
    assert 0 < int(flag(argv, "--lr-warmup-iters")) < int(flag(argv, "--train-iters"))


def test_fp8_passes_megatrons_own_flags(recipe_argv, fakes):
    argv = recipe_argv("llama3-8b", FP8="hybrid/blockwise")
    assert (flag(argv, "--fp8-format"), flag(argv, "--fp8-recipe")) == ("hybrid", "blockwise")
    assert flag(argv, "--tensorboard-dir").startswith("runs/llama3-8b-auto-fp8-hybrid-blockwise/")
    assert "--fp8-format" not in recipe_argv("llama3-8b")
    bad = run_recipe("smoke", fakes_folder=fakes, DRY_RUN="1", FP8="e5m2/delayed")
    assert bad.returncode == 2 and bad.stdout == "" and "FP8=e5m2/delayed: expected FORMAT/RECIPE" in bad.stderr


def test_recipe_flags_in_megatrons_parser(monkeypatch, recipe_argv):
    arguments = pytest.importorskip(
        "megatron.training.arguments",
        reason="megatron.training is not importable (megatron-core >= 0.19 on Python >= 3.12 ships it)")
    from overlap_tp.megatron.arguments import add_overlap_args
    for name in RECIPES:
        monkeypatch.setattr(sys, "argv", ["pretrain"] + recipe_argv(name))
        args = arguments.parse_args(extra_args_provider=add_overlap_args)
        assert args.overlap_tp == "auto" and args.sequence_parallel and args.swiglu   # every recipe's one flag


@pytest.mark.parametrize("flags", [["--help"], ["--check", "--num-layers", "2"]])
def test_launcher_without_megatron_training_says_how_to_get_it(tmp_path, flags):
    """A `megatron` package that fails to import stands in for a machine without megatron.training (--help and
    --check need no GPU, so the GPU count does not speak first)."""
    (tmp_path / "megatron").mkdir()
    (tmp_path / "megatron" / "__init__.py").write_text("raise ImportError('no megatron here')\n")
    result = subprocess.run([sys.executable, "-m", "overlap_tp.launch.pretrain", *flags], capture_output=True,
                            text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(tmp_path)})
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


def test_preflight_counts_gpus_before_importing_megatron():
    """On a machine without GPUs the preflight's one line is all it prints: Megatron, whose import warns at length
    there, is not imported."""
    code = ("import sys; from overlap_tp.launch.pretrain import preflight; code = preflight(2); "
            "print('megatron' in sys.modules); sys.exit(code)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 1 and result.stdout == "False\n"
    assert result.stderr == "overlap-tp-pretrain: 2 rank(s) per node need as many CUDA GPUs; 0 visible here\n"


# ---- what the recipes print and launch ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama3-8b", "smoke"])
def test_nproc_follows_tp(fakes, name):
    def nproc(**env):
        command = dry_run(name, fakes_folder=fakes, **env)[1]
        return command[command.index("--nproc-per-node") + 1], flag(command, "--tensor-model-parallel-size")

    assert nproc() == ("2", "2")
    assert nproc(TP="4") == ("4", "4") and nproc(TP="8") == ("8", "8")
    assert nproc(TP="4", NPROC="8") == ("8", "4")   # data parallel 2: a multiple of TP is kept
    assert nproc(TP="4", NPROC="2", NNODES="2") == ("2", "4")   # TP across the two nodes' 4 ranks


@pytest.mark.parametrize("env, message", [
    (dict(TP="4", NPROC="2"), "[recipe] NPROC=2 x NNODES=1 = 2 ranks is not a multiple of TP=4: set NPROC to a "
                              "multiple of TP, or leave it unset (it follows TP)"),
    (dict(TP="4", NPROC="6", NNODES="1"), "[recipe] NPROC=6 x NNODES=1 = 6 ranks is not a multiple of TP=4"),
    (dict(NPROC="two"), "[recipe] NPROC=two: expected a positive whole number"),
    (dict(NNODES="0"), "[recipe] NNODES=0: expected a positive whole number"),
])
@pytest.mark.parametrize("mode", ["DRY_RUN", "CHECK", None])
def test_a_layout_tp_does_not_divide_is_refused_in_one_line(fakes, tmp_path, env, message, mode):
    """Refused before anything is printed, checked or launched (exit 2), whichever way the recipe runs."""
    if mode:
        env = {**env, mode: "1"}
    result = run_recipe("llama3-8b", fakes_folder=fakes, FAKE_RECORD=str(tmp_path / "torchrun"),
                        PATH=f"{fakes}:{os.environ['PATH']}", **env)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(message), result.stderr
    assert not (tmp_path / "torchrun.args").exists()


def test_dry_run_is_one_flag_per_line_and_pastes_back(fakes):
    result = run_recipe("llama3-8b", "--recompute-granularity", "selective", "--data-path", "my data/x",
                        fakes_folder=fakes, imports=("wandb",), DRY_RUN="1")
    lines = result.stdout.splitlines()
    assert lines[0].startswith("env NCCL_NVLS_ENABLE=0 ") and lines[1] == "torchrun \\"
    assert all(line.endswith(" \\") for line in lines[:-1]) and not lines[-1].endswith("\\")
    for line in lines[2:]:   # "  --flag [value...]": one flag, its values quoted for the shell
        words = shlex.split(line.rstrip(" \\"))
        assert line.startswith("  -") and words[0].startswith("-"), line
        assert not any(word.startswith("--") for word in words[1:]), line
    assert lines[-1] == "  --data-path my\\ data/x"
    assignments, command, _ = dry_run("llama3-8b", "--recompute-granularity", "selective", "--data-path", "my data/x",
                                      fakes_folder=fakes)
    assert command[-4:] == ["--recompute-granularity", "selective", "--data-path", "my data/x"]
    assert assignments == ["NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1", "NVSHMEM_DISABLE_NVLS=1",
                           "PYTHONUNBUFFERED=1", "CUDA_DEVICE_MAX_CONNECTIONS=1",
                           "OVERLAP_TP_TUNE_CACHE=runs/llama3-8b-auto/overlap_tp_tune.json", "WANDB_MODE=offline"]


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("imports", [(), ("wandb", "transformer_engine"), ("apex", "fused_weight_gradient_mlp_cuda")])
def test_dry_run_prints_what_the_run_launches(fakes, tmp_path, name, imports):
    """The run (through a stand-in torchrun) gets the very words and environment DRY_RUN=1 prints, whatever this
    machine has installed."""
    env = dict(OUT_DIR=str(tmp_path / "out"), OVERLAP="off", FAKE_RECORD=str(tmp_path / "torchrun"),
               PATH=f"{fakes}:{os.environ['PATH']}")
    assignments, command, _ = dry_run(name, "--train-iters", "3", fakes_folder=fakes, imports=imports, **env)
    result = run_recipe(name, "--train-iters", "3", fakes_folder=fakes, imports=imports, **env)
    assert result.returncode == 0, result.stderr
    launched = (tmp_path / "torchrun.args").read_text().split("\0")[:-1]
    assert ["torchrun"] + launched == command
    environment = (tmp_path / "torchrun.env").read_text().splitlines()
    assert all(assignment in environment for assignment in assignments)


def test_dry_run_follows_what_imports_here(fakes):
    """Transformer Engine, Apex and wandb are probed for the dry run as for the run: the printed command is the one
    this machine would launch."""
    bare = dry_run("mixtral-proxy", fakes_folder=fakes, imports=(), OVERLAP="off")[1]
    assert flag(bare, "--transformer-impl") == "local" and "--wandb-project" not in bare
    for added in ("--no-gradient-accumulation-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
                  "--no-masked-softmax-fusion", "--overlap-tp-layers"):
        assert added in bare, added
    assert "--moe-grouped-gemm" not in bare
    te = dry_run("mixtral-proxy", fakes_folder=fakes, imports=("transformer_engine",), OVERLAP="off")[1]
    assert flag(te, "--transformer-impl") == "transformer_engine" and "--moe-grouped-gemm" in te
    assert not {"--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--overlap-tp-layers"} & set(te)
    apex = dry_run("smoke", fakes_folder=fakes, imports=("apex",), OVERLAP="off")[1]
    assert "--no-gradient-accumulation-fusion" in apex and "--overlap-tp-layers" not in apex
    assert "--no-persist-layer-norm" not in apex
    assert flag(dry_run("smoke", fakes_folder=fakes, TRANSFORMER_IMPL="transformer_engine")[1],
                "--transformer-impl") == "transformer_engine"


def test_wandb_off_is_one_clear_line(fakes):
    assignments, command, err = dry_run("smoke", fakes_folder=fakes, imports=())
    assert "--wandb-project" not in command and not any(a.startswith("WANDB_MODE=") for a in assignments)
    assert [line for line in err.splitlines() if "W&B" in line] == [
        '[recipe] W&B off: wandb is not installed (pip install -e ".[wandb]"; WANDB_PROJECT= hides this line)']
    assert "W&B" not in dry_run("smoke", fakes_folder=fakes, imports=(), WANDB_PROJECT="")[2]
    assignments, command, err = dry_run("smoke", fakes_folder=fakes, imports=("wandb",), WANDB_MODE="online")
    assert flag(command, "--wandb-project") == "overlap_tp" and "WANDB_MODE=online" in assignments and "W&B" not in err


def test_check_runs_megatrons_and_our_validation_without_a_gpu(fakes):
    """CHECK=1: Megatron's parser and validation plus overlap_tp's, for the job's world size; `ok` or one line."""
    pytest.importorskip("megatron.training.arguments", reason="megatron.training: megatron-core >= 0.19",
                        exc_type=ImportError)
    ok = run_recipe("smoke", fakes_folder=fakes, CHECK="1")
    assert (ok.returncode, ok.stdout) == (0, "ok (world size 2)\n"), ok.stderr
    bad = run_recipe("llama3-8b", fakes_folder=fakes, CHECK="1", TP="3")
    assert (bad.returncode, bad.stdout) == (2, "")
    assert bad.stderr.splitlines() == ["overlap-tp-pretrain: num_attention_heads (32) must be a multiple of "
                                       "tensor_model_parallel_size (3)."]


@pytest.mark.parametrize("name, extra, env, message", [
    ("llama3-8b", [], dict(TP="4"), None),
    ("mixtral-proxy", [], dict(EP="4"), "world size (2) is not divisible by expert-tensor x expert x pipeline"),
    ("mixtral-proxy", [], dict(EP="4", NPROC="4"), None),
    ("smoke", ["--tp-comm-overlap"], dict(OVERLAP="signal"), "--overlap-tp signal with --tp-comm-overlap: both "
                                                             "overlap the same TP communication"),
    ("smoke", ["--overlap-tp-config", os.path.join(ROOT, "tests", "data", "overlap_nccl_in_place.json")],
     dict(OVERLAP="signal"), "--overlap-tp-config"),
    ("llama3-70b-proxy", ["--overlap-tp", "bogus"], {}, "argument --overlap-tp: invalid choice: 'bogus'"),
    ("smoke", ["--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
])
def test_check_of_recipe_commands(recipe_argv, monkeypatch, capsys, name, extra, env, message):
    """launch/check.py on what the recipes launch, in this process: the recipe's own world size, their environment."""
    pytest.importorskip("megatron.training.arguments", reason="megatron.training: megatron-core >= 0.19",
                        exc_type=ImportError)
    from overlap_tp.launch.check import check
    from overlap_tp.launch.pretrain import DEFAULTS
    argv = recipe_argv(name, *extra, **env)
    world = int(env.get("NPROC", env.get("TP", "2")))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    code = check("overlap-tp-pretrain", argv, defaults=DEFAULTS)
    out, err = capsys.readouterr()
    if message is None:
        assert (code, out) == (0, f"ok (world size {world})\n"), err
    else:
        assert (code, out) == (2, "") and err.count("\n") == 1 and err.startswith(f"overlap-tp-pretrain: {message}"), err


def test_readme_lists_every_variable_the_recipes_read():
    readme = open(os.path.join(ROOT, "recipes", "README.md")).read()
    table = set(re.findall(r"^\| `([A-Z][A-Z0-9_]*)", readme, re.M))
    read = recipe_variables() | {"DRY_RUN", "CHECK"}
    assert read <= table, f"recipes/README.md's table lacks {sorted(read - table)}"
    assert not table - read, f"recipes/README.md lists variables no recipe reads: {sorted(table - read)}"


def test_recipe_docs_carry_no_run_history_and_name_real_entry_points():
    readme = open(os.path.join(ROOT, "recipes", "README.md")).read()
    assert not re.search(r"\bs\d+\b|[Ss]ession \d|docs/perf/", readme)
    for folder in ("recipes", "launch"):
        for file in os.listdir(os.path.join(ROOT, folder)):
            text = open(os.path.join(ROOT, folder, file)).read() if file.endswith((".sh", ".py", ".md")) else ""
            assert "overlap_tp.report" not in text, file   # the report is overlap_tp.training.report


TE_IMPORTS = ("wandb", "transformer_engine")


@pytest.mark.parametrize("name", RECIPES)
def test_te_baselines_are_the_off_run_on_megatrons_te_layers(fakes, name):
    """OVERLAP=te / te-ub: Megatron's Transformer Engine layers (overlap_tp's off), te-ub with --tp-comm-overlap and
    UB_SKIPMC=1; otherwise the very command of OVERLAP=off on the same machine: model, batch, graphs, logging."""
    off_env, off, _ = dry_run(name, fakes_folder=fakes, imports=TE_IMPORTS, OVERLAP="off")
    for mode in ("te", "te-ub"):
        env, command, _ = dry_run(name, fakes_folder=fakes, imports=TE_IMPORTS, OVERLAP=mode)
        assert flag(command, "--transformer-impl") == "transformer_engine" and flag(command, "--overlap-tp") == "off"
        assert ("--tp-comm-overlap" in command) == (mode == "te-ub") and ("UB_SKIPMC=1" in env) == (mode == "te-ub")
        if "--num-experts" in command:
            assert flag(command, "--overlap-moe") == "off"
        same = [w.replace(f"{name}-{mode}", f"{name}-off") for w in command if w != "--tp-comm-overlap"]
        assert same == off, sorted(set(same) ^ set(off))
        assert [a for a in env if a != "UB_SKIPMC=1"] == off_env


@pytest.mark.parametrize("imports, env, message", [
    (("wandb",), dict(OVERLAP="te"), "[recipe] OVERLAP=te runs Megatron's Transformer Engine layers: "
                                     "transformer_engine does not import here"),
    (TE_IMPORTS, dict(OVERLAP="te-ub", TRANSFORMER_IMPL="local"), "[recipe] OVERLAP=te-ub runs Megatron's "
                                                                  "Transformer Engine layers: not with "
                                                                  "TRANSFORMER_IMPL=local"),
    (TE_IMPORTS, dict(OVERLAP="te-ub", TP="1"), "[recipe] OVERLAP=te-ub: --tp-comm-overlap needs TP >= 2"),
])
def test_te_baselines_refuse_what_they_cannot_run(fakes, imports, env, message):
    result = run_recipe("smoke", fakes_folder=fakes, imports=imports, DRY_RUN="1", **env)
    assert result.returncode == 2 and result.stdout == "" and result.stderr.startswith(message), result.stderr


def test_te_baseline_at_tp1_is_megatrons_te_layers(fakes):
    """TP=1 OVERLAP=te (the one-GPU run of tests/gpu/test_te_gpu.py): one rank, Megatron's TE layers."""
    command = dry_run("smoke", fakes_folder=fakes, imports=TE_IMPORTS, OVERLAP="te", TP="1")[1]
    assert flag(command, "--nproc-per-node") == "1" and flag(command, "--tensor-model-parallel-size") == "1"
    assert flag(command, "--transformer-impl") == "transformer_engine" and flag(command, "--overlap-tp") == "off"
    assert "--tp-comm-overlap" not in command and "--overlap-tp-layers" not in command


def test_te_ub_flags_pass_megatrons_validation(fakes):
    """CHECK=1 on OVERLAP=te-ub: Megatron accepts --tp-comm-overlap with the recipe's flags (sequence parallel at
    TP 2); --no-rope-fusion only because Transformer Engine is a stand-in here (Megatron asks TE for its RoPE)."""
    pytest.importorskip("megatron.training.arguments", reason="megatron.training: megatron-core >= 0.19",
                        exc_type=ImportError)
    result = run_recipe("smoke", "--no-rope-fusion", fakes_folder=fakes, imports=TE_IMPORTS, CHECK="1",
                        OVERLAP="te-ub")
    assert (result.returncode, result.stdout) == (0, "ok (world size 2)\n"), result.stderr
