"""overlap-tp-run (overlap_tp.launch.run) on stub scripts: overlap_tp's flags are parsed by the script's own
Megatron parser next to the script's extra flags, apply runs once after validation, a model without
overlap_tp's layers stops the run naming the script, and bad scripts are one clear error.

The stub scripts sit next to a stand-in `megatron/training` package, the layout of a Megatron-LM checkout
(its scripts import the `megatron` folder beside them); the stand-in keeps the structure the launcher
hooks into (0.19: parse_and_validate_args calls its module's parse_args / validate_args; 0.16/0.17:
initialize.py binds them by name). The real megatron modules are set aside while a stub runs."""
import sys
import textwrap
from types import SimpleNamespace

import pytest

from overlap_tp.launch import run as launcher

STAND_IN = {
    "megatron/__init__.py": "",
    "megatron/training/__init__.py": "",
    "megatron/training/arguments.py": """
        import argparse

        def parse_args(extra_args_provider=None, ignore_unknown_args=False):
            parser = argparse.ArgumentParser(allow_abbrev=False)
            parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
            parser.add_argument("--sequence-parallel", action="store_true")
            parser.add_argument("--spec", nargs="*", default=None)
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            return parser.parse_args()

        def validate_args(args, defaults={}):
            args.validated = True
            return args

        def parse_and_validate_args(extra_args_provider=None, ignore_unknown_args=False, args_defaults={}):
            args = parse_args(extra_args_provider, ignore_unknown_args)
            validate_args(args, args_defaults)
            return args
        """,
    "megatron/training/initialize.py": """
        from megatron.training.arguments import parse_args, validate_args

        def initialize_megatron(extra_args_provider=None):
            args = parse_args(extra_args_provider)
            validate_args(args)
            return args
        """,
    "megatron/training/training.py": """
        def get_model(model_provider_func, *args, **kwargs):
            return [model_provider_func()]
        """,
}

SCRIPT_019 = """
    import megatron.training
    import torch
    from megatron.training import training
    from megatron.training.arguments import parse_and_validate_args

    def own_args(parser):
        group = parser.add_argument_group("mine")
        group.add_argument("--my-flag", type=int, default=0)
        return parser

    args = parse_and_validate_args(extra_args_provider=own_args)
    megatron.training.RESULT = {"args": args, "main": __name__ == "__main__"}
    megatron.training.RESULT["model"] = training.get_model(lambda: torch.nn.Linear(2, 2))
    """

SCRIPT_016 = """
    import megatron.training
    from megatron.training.initialize import initialize_megatron

    megatron.training.RESULT = {"args": initialize_megatron()}
    """

SCRIPT_NO_MEGATRON = """
    print("hello")
    """


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """A folder laid out as a Megatron-LM checkout with the stand-in; real megatron modules set aside."""
    for name, text in STAND_IN.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for name in [n for n in sys.modules if n == "megatron" or n.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, name)   # restored after the test, stand-ins dropped
    yield tmp_path
    for name in [n for n in sys.modules if n == "megatron" or n.startswith("megatron.")]:
        if getattr(sys.modules[name], "__file__", "") and str(tmp_path) in sys.modules[name].__file__:
            del sys.modules[name]


def write(folder, name, text):
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return str(path)


class Recorder:
    """apply and validate stand-ins: what they were called with."""

    def __init__(self, active=True):
        self.active = active
        self.applied, self.validated = [], []

    def validate(self, args):
        self.validated.append(args)

    def apply(self, args):
        self.applied.append(args)
        return SimpleNamespace(active=self.active and args.overlap_tp != "off")


def launch_for(script, recorder, overlap_module=lambda module: False):
    return launcher.Launch(script, validate=recorder.validate, apply=recorder.apply,
                           is_overlap_module=overlap_module, training_hooks=False)


def result():
    return sys.modules["megatron.training"].RESULT


def test_flags_parsed_apply_once_and_the_scripts_own_flags_kept(checkout):
    script = write(checkout, "pretrain_stub.py", SCRIPT_019)
    recorder = Recorder()
    launcher.run(script, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--my-flag", "7",
                          "--overlap-tp", "signal", "--overlap-tp-config", "/tmp/overlap.json"],
                 launch=launch_for(script, recorder, overlap_module=lambda m: True))
    args = result()["args"]
    assert result()["main"]   # run as __main__
    assert args.my_flag == 7 and args.overlap_tp == "signal" and args.overlap_tp_config == "/tmp/overlap.json"
    assert args.validated   # Megatron's own validation ran before ours
    assert recorder.applied == [args] and recorder.validated == [args]


def test_older_megatron_that_parses_inside_initialize(checkout):
    script = write(checkout, "pretrain_old.py", SCRIPT_016)
    recorder = Recorder()
    launcher.run(script, ["--overlap-tp", "decompose"], launch=launch_for(script, recorder))
    args = result()["args"]
    assert args.overlap_tp == "decompose" and recorder.applied == [args]


def test_a_model_without_our_layers_stops_naming_the_script(checkout):
    script = write(checkout, "pretrain_ignores_spec.py", SCRIPT_019)
    with pytest.raises(SystemExit, match=r"overlap-tp-run: pretrain_ignores_spec.py built its model without "
                                         r"overlap_tp's layers"):
        launcher.run(script, ["--overlap-tp", "signal"], launch=launch_for(script, Recorder()))


def test_overlap_off_needs_no_layers_of_ours(checkout):
    script = write(checkout, "pretrain_stub.py", SCRIPT_019)
    recorder = Recorder()
    launcher.run(script, ["--overlap-tp", "off"], launch=launch_for(script, recorder))
    assert len(result()["model"]) == 1 and len(recorder.applied) == 1


def test_a_script_without_megatrons_parse(checkout):
    script = write(checkout, "hello.py", SCRIPT_NO_MEGATRON)
    with pytest.raises(SystemExit, match="hello.py ended without parsing Megatron's arguments"):
        launcher.run(script, [], launch=launch_for(script, Recorder()))


def test_script_help_is_megatrons_with_our_group(checkout, capsys):
    script = write(checkout, "pretrain_stub.py", SCRIPT_019)
    with pytest.raises(SystemExit) as exit_:
        launcher.run(script, ["--help"], launch=launch_for(script, Recorder()))
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--overlap-tp [MODE]" in out and "{off,auto,signal,decompose}" in out and "--my-flag" in out


@pytest.mark.parametrize("path, message", [
    ("does/not/exist.py", "does not exist"),
    (".", "is not a file"),
    ("setup.cfg", "is not a Python file"),
])
def test_bad_script_paths(tmp_path, monkeypatch, path, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "setup.cfg").write_text("")
    with pytest.raises(SystemExit, match=f"overlap-tp-run: training script .* {message}"):
        launcher.main([path, "--overlap-tp", "signal"])


def test_flag_instead_of_script_and_bare_help(capsys):
    with pytest.raises(SystemExit, match="expected the training script first"):
        launcher.main(["--overlap-tp", "signal"])
    assert launcher.main(["--help"]) == 0   # lists overlap_tp's flags without Megatron
    text = capsys.readouterr().out
    assert "--overlap-tp-config" in text
    # the user tier first and short: its group within the first screen, before the expert tier and the details
    lines = text.splitlines()
    user = next(i for i, line in enumerate(lines) if line.startswith("overlap_tp:"))
    assert user < 25 and user < next(i for i, line in enumerate(lines) if line.startswith("overlap_tp (expert):"))
    assert "separate_adam_steps" not in text
    assert launcher.main([]) == 2


def test_no_gpu_is_one_line(tmp_path, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    script = write(tmp_path, "pretrain_gpt.py", SCRIPT_NO_MEGATRON)
    with pytest.raises(SystemExit, match="overlap-tp-run: no CUDA GPU is visible"):
        launcher.main([script, "--overlap-tp", "signal"])


REAL_SCRIPT = """
    import megatron.training
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.arguments import parse_and_validate_args

    def own_args(parser):
        parser.add_argument_group("mine").add_argument("--my-flag", type=int, default=0)
        return parser

    args = parse_and_validate_args(extra_args_provider=own_args, args_defaults={"tokenizer_type": "NullTokenizer"})
    megatron.training.RESULT = {"args": args, "model_config": gpt_config_from_args(args)}
    """


def test_real_megatron_parse_validate_and_model_config(tmp_path, monkeypatch):
    """pretrain_gpt.py's own sequence (core_v0.19.0) on megatron-core's megatron.training: our group in its
    parser, apply after its validate_args, and the model config's layer spec is overlap_tp's block spec."""
    pytest.importorskip("megatron.training", reason="megatron.training: megatron-core >= 0.19 on Python >= 3.12",
                        exc_type=ImportError)
    argument_utils = pytest.importorskip("megatron.training.argument_utils", exc_type=ImportError)
    if not hasattr(argument_utils, "gpt_config_from_args"):
        pytest.skip("megatron.training < 0.19 has no gpt_config_from_args")
    import megatron.training
    from megatron.training import arguments, global_vars

    from overlap_tp.megatron_patches import apply as patches
    from overlap_tp.megatron_patches import spec as spec_module
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9, raising=False)   # no GPU here
    for name, value in (("CUDA_DEVICE_MAX_CONNECTIONS", "1"), ("WORLD_SIZE", "2"), ("RANK", "0"),
                        ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    for name in ("_GLOBAL_ARGS", "_GLOBAL_TOKENIZER", "_GLOBAL_TIMERS", "_GLOBAL_NUM_MICROBATCHES_CALCULATOR"):
        if hasattr(global_vars, name):
            monkeypatch.setattr(global_vars, name, None)
    try:
        from megatron.core import num_microbatches_calculator as microbatches
        monkeypatch.setattr(microbatches, "_GLOBAL_NUM_MICROBATCHES_CALCULATOR", None)
    except (ImportError, AttributeError):
        pass
    script = write(tmp_path, "pretrain_stub.py", REAL_SCRIPT)
    try:
        launcher.run(script, [
            "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
            "--max-position-embeddings", "128", "--micro-batch-size", "1", "--vocab-size", "1000",
            "--tensor-model-parallel-size", "2", "--sequence-parallel", "--normalization", "RMSNorm", "--bf16",
            "--train-iters", "2", "--no-gradient-accumulation-fusion", "--transformer-impl", "local",
            "--my-flag", "3", "--overlap-tp", "signal"], launch=launcher.Launch(script, training_hooks=False))
        args = megatron.training.RESULT["args"]
        assert args.my_flag == 3 and args.overlap_tp == "signal" and args.spec == list(patches.SPEC)
        layer_spec = megatron.training.RESULT["model_config"].transformer_layer_spec
        assert layer_spec is spec_module.flags
    finally:
        patches.reset()


def test_help_strings_argparse_cannot_format_are_repaired(capsys):
    """megatron-core 0.19 has a help string with a lone '%' ("10%)."): --help would raise instead of printing."""
    import argparse
    parser = argparse.ArgumentParser(prog="megatron")
    parser.add_argument("--factor", type=float, help="Magnitude is headroom (e.g. 1.10 = 10%).")
    parser.add_argument("--fine", default=3, help="default %(default)s")
    with pytest.raises(ValueError):
        parser.format_help()
    launcher.repair_help_strings(parser)
    text = parser.format_help()
    assert "1.10 = 10%)." in text and "default 3" in text


def test_full_iteration_graphs_are_released_after_training(monkeypatch):
    """Megatron's full-iteration graphs (a class attribute) are freed once training returns, so they are not
    torn down next to the NCCL communicators at interpreter exit (where runs hung on the GPUs)."""
    from overlap_tp.launch import pretrain

    released = []

    class Graph:
        def __del__(self):
            released.append(self)

    wrapper = SimpleNamespace(cuda_graph={"training": Graph(), "validation": None},
                              result={"training": object(), "validation": None})
    module = SimpleNamespace(FullCudaGraphWrapper=wrapper)
    monkeypatch.setitem(sys.modules, "megatron.core.full_cuda_graph", module)
    monkeypatch.setattr("torch.cuda.synchronize", lambda *a, **k: None)
    pretrain.release_full_iteration_graphs()
    assert wrapper.cuda_graph == {"training": None, "validation": None}
    assert wrapper.result == {"training": None, "validation": None}
    assert len(released) == 1
    pretrain.release_full_iteration_graphs()   # nothing captured: a no-op


def test_adam_steps_are_separated_after_a_checkpoint_load(monkeypatch):
    """megatron-core without Apex/TE restores torch AdamW's `step` as one tensor shared by every parameter's state
    (DistributedOptimizer.load_state_dict), which AdamW then advances once per parameter per update. The launcher's
    patch gives each parameter its own step: one update after the load leaves every step at restored + 1, as in an
    uninterrupted run; without the patch the same load leaves them all at restored + (number of parameters)."""
    import torch
    from overlap_tp.launch import pretrain

    def megatron_like_load(self, state_dict):   # what megatron-core's load does with the step, on a real AdamW
        step = torch.tensor(float(state_dict["step"]))
        inner = self.optimizer.state_dict()
        for state in inner["state"].values():
            state["step"] = step
        self.optimizer.load_state_dict(inner)

    class DistributedOptimizer:
        load_state_dict = megatron_like_load

    module = SimpleNamespace(DistributedOptimizer=DistributedOptimizer, HAVE_APEX_OR_TE=False)
    monkeypatch.setitem(sys.modules, "megatron.core.optimizer.distrib_optimizer", module)
    monkeypatch.setitem(sys.modules, "megatron.core.optimizer", SimpleNamespace(distrib_optimizer=module))

    def steps_after_resume():
        params = [torch.nn.Parameter(torch.randn(4)) for _ in range(3)]
        optimizer = SimpleNamespace(optimizer=torch.optim.AdamW(params, lr=1e-2))
        for p in params:
            p.grad = torch.randn(4)
        optimizer.optimizer.step()   # the state a checkpoint holds
        DistributedOptimizer.load_state_dict(optimizer, {"step": 10})
        for p in params:
            p.grad = torch.randn(4)
        optimizer.optimizer.step()
        return [float(optimizer.optimizer.state[p]["step"]) for p in params]

    assert steps_after_resume() == [13.0, 13.0, 13.0]   # the sharing this patch is for
    assert pretrain.separate_adam_steps() is True
    assert steps_after_resume() == [11.0, 11.0, 11.0]
    assert pretrain.separate_adam_steps() is False      # idempotent
    module.HAVE_APEX_OR_TE = True                       # Apex / TE optimizers keep no per-parameter step tensor
    DistributedOptimizer.load_state_dict = megatron_like_load
    assert pretrain.separate_adam_steps() is False


@pytest.fixture
def no_training_hooks(monkeypatch):
    """main() installs the throughput log, the FP8 weight steps and the optimizer patch, which need megatron-core (not
    the stand-in)."""
    from overlap_tp.launch import pretrain
    from overlap_tp.training import fp8_steps, throughput
    monkeypatch.setattr(fp8_steps, "install_fp8_weight_steps", lambda: None)
    monkeypatch.setattr(pretrain, "use_prebuilt_dataset_helpers", lambda: None)
    monkeypatch.setattr(pretrain, "separate_adam_steps", lambda: None)
    monkeypatch.setattr(throughput, "install_training_log_hook", lambda: None)
    monkeypatch.setattr(launcher, "require_gpus", lambda: None)


@pytest.mark.parametrize("rank", ["0", "1"])
def test_an_overlap_argument_error_is_one_line_on_rank_0(checkout, no_training_hooks, monkeypatch, capsys, rank):
    """Every rank meets the error; rank 0 alone prints it, as one line without a traceback; status 2."""
    monkeypatch.setenv("RANK", rank)
    script = write(checkout, "pretrain_stub.py", SCRIPT_019)
    assert launcher.main([script, "--tensor-model-parallel-size", "2", "--overlap-tp", "signal"]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    if rank == "0":
        assert err.count("\n") == 1 and err.startswith("overlap-tp-run: --overlap-tp signal needs --sequence-parallel")
    else:
        assert err == ""


def test_check_with_the_scripts_megatron_and_no_gpu(checkout, monkeypatch, capsys):
    """--check [SCRIPT] ARGS: the parser and validation of the Megatron next to SCRIPT, then overlap_tp's; no GPU
    looked for, the script not run."""
    monkeypatch.setattr(launcher, "require_gpus", lambda: pytest.fail("--check looked for GPUs"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    script = write(checkout, "pretrain_stub.py", SCRIPT_019)
    argv = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--overlap-tp", "signal"]
    assert launcher.main(["--check", script] + argv) == 0
    assert capsys.readouterr().out == "ok (world size 2)\n"
    assert "megatron.training" in sys.modules and "RESULT" not in vars(sys.modules["megatron.training"])
    assert launcher.main(["--check", script] + argv[:2] + argv[3:]) == 2
    assert capsys.readouterr().err.startswith("overlap-tp-run: --overlap-tp signal needs --sequence-parallel")
    assert launcher.main(["--check", script, "--overlap-tp", "sideways"]) == 2
    assert "argument --overlap-tp: invalid choice: 'sideways'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="does not exist"):
        launcher.main(["--check", str(checkout / "missing.py")])
