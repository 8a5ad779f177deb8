"""`overlap-tp-run SCRIPT [ARGS...]` / `python -m overlap_tp.launch.run SCRIPT [ARGS...]`: run a Megatron-LM
training script unchanged, with overlap_tp.

Use it under torchrun in place of the script:

    torchrun --nproc-per-node 2 -m overlap_tp.launch.run /path/to/Megatron-LM/pretrain_gpt.py \\
        --tensor-model-parallel-size 2 --sequence-parallel ... --overlap-tp auto

What it does before running SCRIPT as `__main__` (with SCRIPT's folder first on sys.path and
sys.argv = [SCRIPT, ARGS...], as `python SCRIPT ARGS...` would):

- Megatron's parser gets overlap_tp's argument group: `megatron.training.arguments.parse_args` is
  wrapped so the `extra_args_provider` it is given (the script's own, if any) runs first and
  `overlap_tp.megatron.arguments.add_overlap_args` after it.
- after Megatron's `validate_args`, `validate_overlap_args` and `megatron_patches.apply` run once on
  the validated arguments (apply points `--spec` at overlap_tp's layer spec when the overlap is on).
- `overlap_tp.training.throughput.install_training_log_hook()`: the `[overlap_tp]` log line and scalars.
- `overlap_tp.training.fp8_steps.install_fp8_weight_steps()`: FP8 layers quantize their weights once per step.
- `overlap_tp.launch.pretrain.separate_adam_steps()`: where megatron-core runs torch's AdamW (no Apex or
  Transformer Engine), each parameter keeps its own Adam step after a distributed-optimizer checkpoint load (a
  resumed run otherwise advances one shared step per parameter: see that function).
- `get_model` is checked: when overlap_tp's layers were asked for and the model Megatron built has
  none of them (a builder that ignores `--spec`), the run stops there, before the first step, naming
  SCRIPT.

SCRIPT must parse its arguments through `megatron.training` (every Megatron-LM `pretrain_*.py` does);
one that ends without doing so is reported. An error in overlap_tp's flags (OverlapArgumentError) is one line on
rank 0, status 2. `overlap-tp-run --check [SCRIPT] ARGS` runs Megatron's argument checks and overlap_tp's on the CPU
and prints `ok` or the error (launch/check.py). The two-line alternative for your own script (no
launcher) and `--spec overlap_tp.megatron_patches.spec signal`: README.md, "You already have a
Megatron-LM script".

Needs `megatron.training`: megatron-core >= 0.19 (Python >= 3.12), or a Megatron-LM checkout on
PYTHONPATH or next to SCRIPT (Megatron-LM's scripts import the `megatron` folder beside them).
"""
import argparse
import functools
import os
import runpy
import sys

from overlap_tp.launch.check import check, refuse

PROG = "overlap-tp-run"
USAGE = (f"{PROG} SCRIPT [ARGS...]   (under torchrun, in place of SCRIPT)\n"
         f"       {PROG} --check [SCRIPT] ARGS   (Megatron's and overlap_tp's argument checks only, on the CPU)")


class LaunchError(SystemExit):
    """One line that says what is wrong and what to do (raised before or instead of the run)."""

    def __init__(self, message):
        super().__init__(f"{PROG}: {message}")


def _help_parser():
    from overlap_tp.megatron.arguments import add_overlap_args
    summary = __doc__.split("What it does")[0].strip()   # the user tier follows at once, the details last
    parser = argparse.ArgumentParser(
        prog=PROG, usage=USAGE, description=summary, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="ARGS are the script's and Megatron's flags plus overlap_tp's (above); "
               f"`{PROG} SCRIPT --help` lists them all (needs megatron.training). What the launcher does "
               f"before SCRIPT runs: `python -m pydoc overlap_tp.launch.run`; the flags: docs/flags.md.")
    return add_overlap_args(parser)


def check_script(script):
    """The script's absolute path, or a LaunchError naming what is wrong with it."""
    if not os.path.exists(script):
        raise LaunchError(f"training script {script!r} does not exist (give the path of a Megatron-LM "
                          "script such as Megatron-LM/pretrain_gpt.py)")
    if not os.path.isfile(script):
        raise LaunchError(f"training script {script!r} is not a file")
    if not script.endswith(".py"):
        raise LaunchError(f"training script {script!r} is not a Python file (.py)")
    return os.path.abspath(script)


def require_megatron_training(script):
    """megatron.training must import, looked up as the script will see it (its folder first)."""
    folder = os.path.dirname(script)
    sys.path.insert(0, folder)
    try:
        import megatron.training.arguments  # noqa: F401
        import megatron.training.training  # noqa: F401
    except ImportError as error:   # also megatron-core >= 0.17 on Python < 3.12 (typing.override)
        sys.path.remove(folder)
        raise LaunchError(
            f"{os.path.basename(script)} needs megatron.training, which does not import here ({error}). "
            "It ships with megatron-core >= 0.19 on Python >= 3.12 (pip install -e \".[megatron]\"), or "
            "comes with a Megatron-LM checkout (the `megatron` folder next to the script, or on PYTHONPATH).")
    sys.path.remove(folder)


class Launch:
    """The hooks of one run of `script`: Megatron's parse_args / validate_args / get_model wrapped.

    `apply` and `validate` are overlap_tp's (tests pass recorders); `state` says what happened.
    """

    def __init__(self, script, *, validate=None, apply=None, is_overlap_module=None, training_hooks=True):
        from overlap_tp.megatron.validation import validate_overlap_args
        from overlap_tp.megatron_patches import apply as patches
        self.script = script
        self.name = os.path.basename(script)
        self.validate = validate or validate_overlap_args
        self.apply = apply or patches.apply
        self.is_overlap_module = is_overlap_module or _is_overlap_module
        self.training_hooks = training_hooks   # the throughput log and the prebuilt dataset helpers
        self.parsed = False
        self.applied = []   # the args objects apply ran on (once each)
        self.reports = []

    # -- the wrappers ---------------------------------------------------------------------------
    def parse_args(self, original):
        from overlap_tp.megatron.arguments import add_overlap_args

        @functools.wraps(original)
        def parse_args(extra_args_provider=None, *args, **kwargs):
            def provider(parser):
                if extra_args_provider is not None:   # the script's own flags first, as Megatron would
                    parser = extra_args_provider(parser)
                return repair_help_strings(add_overlap_args(parser))
            self.parsed = True
            return original(provider, *args, **kwargs)

        parse_args._overlap_tp_launch = self
        return parse_args

    def validate_args(self, original):
        @functools.wraps(original)
        def validate_args(args, *rest, **kwargs):
            result = original(args, *rest, **kwargs)
            self.after_validation(result if result is not None else args)
            return result

        validate_args._overlap_tp_launch = self
        return validate_args

    def get_model(self, original):
        @functools.wraps(original)
        def get_model(*args, **kwargs):
            model = original(*args, **kwargs)
            self.check_model(model)
            return model

        get_model._overlap_tp_launch = self
        return get_model

    # -- what runs inside them ------------------------------------------------------------------
    def after_validation(self, args):
        if any(a is args for a in self.applied):
            return
        if not hasattr(args, "overlap_tp"):   # a parse that did not go through our parse_args
            raise LaunchError(f"{self.name} validated Megatron arguments without overlap_tp's flags: it does "
                              "not parse through megatron.training.arguments.parse_args")
        self.validate(args)
        self.reports.append(self.apply(args))
        self.applied.append(args)

    def wanted(self):
        return any(getattr(report, "active", False) for report in self.reports)

    def check_model(self, model):
        """Stop before training when overlap_tp's layers were asked for and the model has none."""
        if not self.wanted():
            return
        modules = model if isinstance(model, (list, tuple)) else [model]
        if any(self.is_overlap_module(m) for chunk in modules for m in chunk.modules()):
            return
        raise LaunchError(
            f"{self.name} built its model without overlap_tp's layers although --overlap-tp / "
            "--overlap-tp-layers / --overlap-moe asked for them: its model builder does not read --spec "
            "(overlap_tp's layer spec is handed over through --spec). Use a script whose builder honours "
            "--spec (Megatron-LM's pretrain_gpt.py), or build the model with "
            "overlap_tp.megatron.layer_spec.get_gpt_layer_overlap_spec yourself (docs/layers.md).")

    # -- installing -----------------------------------------------------------------------------
    def install(self):
        """Wrap Megatron's functions where the script will look them up (module attributes)."""
        from megatron.training import arguments, training
        for name, wrap in (("parse_args", self.parse_args), ("validate_args", self.validate_args)):
            original = _unwrapped(getattr(arguments, name))
            for module in _megatron_training_modules():
                if _unwrapped(getattr(module, name, None)) is original:
                    setattr(module, name, wrap(original))
        training.get_model = self.get_model(_unwrapped(training.get_model))
        if self.training_hooks:
            from overlap_tp.launch.pretrain import separate_adam_steps, use_prebuilt_dataset_helpers
            from overlap_tp.training.fp8_steps import install_fp8_weight_steps
            from overlap_tp.training.throughput import install_training_log_hook
            use_prebuilt_dataset_helpers()
            separate_adam_steps()
            install_training_log_hook()
            install_fp8_weight_steps()


def _unwrapped(function):
    """Megatron's own function behind a Launch's wrapper (a second Launch replaces the first's)."""
    return function.__wrapped__ if hasattr(function, "_overlap_tp_launch") else function


def _megatron_training_modules():
    """The loaded megatron.training modules: arguments.py itself (parse_and_validate_args calls its
    globals), and those that bound parse_args / validate_args by name (0.16/0.17: initialize.py)."""
    return [m for n, m in list(sys.modules.items())
            if (n == "megatron.training" or n.startswith("megatron.training.")) and m is not None]


def repair_help_strings(parser):
    """Escape the lone '%' of help strings argparse cannot format, so `--help` prints instead of raising
    (megatron-core 0.19's --moe-paged-stash-buffer-size-factor-cuda says "10%)."). Returns the parser."""
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.help:
            try:
                formatter._expand_help(action)
            except (ValueError, TypeError, KeyError):
                action.help = action.help.replace("%", "%%")
    return parser


def _is_overlap_module(module):
    from overlap_tp.megatron.layers import OverlapColumnParallelLinear, OverlapRowParallelLinear
    from overlap_tp.megatron.moe_layer import OverlapMoELayer
    return isinstance(module, (OverlapColumnParallelLinear, OverlapRowParallelLinear, OverlapMoELayer))


def run(script, argv, *, launch=None):
    """Run `script` as __main__ with `argv` under overlap_tp's hooks; returns the Launch."""
    script = check_script(script)
    require_megatron_training(script)
    launch = launch or Launch(script)
    launch.install()
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script] + list(argv)
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        if exit_.code not in (None, 0) or launch.parsed:
            raise
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    if launch.parsed:   # the script trained: free what would hang the exit (launch/pretrain.py says why)
        from overlap_tp.launch.pretrain import release_full_iteration_graphs
        release_full_iteration_graphs()
    if not launch.parsed:
        raise LaunchError(f"{launch.name} ended without parsing Megatron's arguments "
                          "(megatron.training.arguments.parse_args was never called), so overlap_tp could not "
                          "be applied: is it a Megatron-LM training script?")
    return launch


def require_gpus():
    """One GPU per local rank, or one clear line."""
    import torch
    if not torch.cuda.is_available():
        raise LaunchError("no CUDA GPU is visible here (torch.cuda.is_available() is False); Megatron "
                          "training runs one rank per GPU")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    count = torch.cuda.device_count()
    if count < local:
        raise LaunchError(f"{local} ranks on this node (LOCAL_WORLD_SIZE) but {count} visible GPU(s)")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        _help_parser().print_help()
        return 0 if argv else 2
    if argv[0] == "--check":
        return check_main(argv[1:])
    script, rest = argv[0], argv[1:]
    if script.startswith("-"):
        raise LaunchError(f"expected the training script first, got the flag {script!r} (usage: {PROG} SCRIPT "
                          f"[ARGS...], or {PROG} --check [SCRIPT] ARGS)")
    check_script(script)
    if not any(flag in rest for flag in ("-h", "--help")):
        require_gpus()
    from overlap_tp.megatron.arguments import OverlapArgumentError
    try:
        run(script, rest)
    except OverlapArgumentError as error:   # once, on rank 0, no traceback (every rank stops alike)
        return refuse(PROG, error)
    return 0


def check_main(argv):
    """`--check [SCRIPT] ARGS`: Megatron's parser and validation plus overlap_tp's, no GPU (launch/check.py). With
    SCRIPT, megatron is looked up as the script will see it (its folder first); the script's own extra flags, if
    it adds any, are unknown to the check."""
    folder = None
    if argv and not argv[0].startswith("-"):
        folder, argv = os.path.dirname(check_script(argv[0])), argv[1:]
    return check(PROG, argv, path=folder)


if __name__ == "__main__":
    sys.exit(main())
