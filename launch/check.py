"""The launchers' offline check and their argument errors.

`overlap-tp-pretrain --check ARGS`, `overlap-tp-run --check [SCRIPT] ARGS` and the recipes' `CHECK=1` run
Megatron's own argument parser and `validate_args`, then overlap_tp's `validate_overlap_args`, then build Megatron's
TransformerConfig from the arguments (its own checks of the shapes against the parallel sizes), in this process:
no torch.distributed, no CUDA (Megatron's few device queries are answered as for a Hopper GPU, compute capability
9.0, the one overlap_tp's kernels need). Prints `ok` or the error in one line; returns 0 or 2. The world size is
$WORLD_SIZE where set (the recipes set it), else the smallest one the parallel sizes fit. The environment counts
as it will in the run (Megatron reads CUDA_DEVICE_MAX_CONNECTIONS, overlap_tp its OVERLAP_TP_* variables).

`refuse` is how both launchers end on an OverlapArgumentError: the message once, on rank 0, no traceback, status 2.
"""
import contextlib
import io
import logging
import math
import os
import sys
import traceback
import warnings

HOPPER = (9, 0)


def refuse(prog, error):
    """Print `prog: error` on rank 0 only (every rank of the job meets the same error) and return 2."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{prog}: {error}", file=sys.stderr, flush=True)
    return 2


class _UsageError(Exception):
    """argparse's error, raised instead of printing Megatron's usage (hundreds of flags) and exiting."""


def _raise_usage_error(message):
    raise _UsageError(message)


def _group_sizes(args):
    """(tensor x context x pipeline, expert-tensor x expert x pipeline): the two products the job's ranks divide."""
    size = lambda name, default=1: getattr(args, name, None) or default   # noqa: E731
    tp, pp = size("tensor_model_parallel_size"), size("pipeline_model_parallel_size")
    return (tp * size("context_parallel_size") * pp,
            size("expert_tensor_parallel_size", tp) * size("expert_model_parallel_size") * pp)


def smallest_world(args):
    """The fewest ranks Megatron's parallel sizes fit."""
    return math.lcm(*_group_sizes(args))


def _check_expert_layout(args):
    """What Megatron checks only when it builds its process groups: the ranks divide the expert layout too."""
    experts = _group_sizes(args)[1]
    if args.world_size % experts:
        raise ValueError(f"world size ({args.world_size}) is not divisible by expert-tensor x expert x pipeline "
                         f"parallel sizes ({experts})")


def _describe(error):
    """One line for a failed check; an assert without a message is named by its source line."""
    if isinstance(error, AssertionError) and not str(error):
        frame = traceback.extract_tb(error.__traceback__)[-1]
        return f"{frame.line} failed ({os.path.basename(frame.filename)}:{frame.lineno})"
    return " ".join(str(error).split())


@contextlib.contextmanager
def _as_hopper(arguments):
    """Megatron's device queries in validate_args answered without touching CUDA."""
    import torch
    saved = arguments.__dict__.get("get_device_arch_version"), torch.cuda.get_device_capability
    arguments.get_device_arch_version = lambda: HOPPER[0]
    torch.cuda.get_device_capability = lambda device=None: HOPPER
    try:
        yield
    finally:
        if saved[0] is None:
            del arguments.get_device_arch_version
        else:
            arguments.get_device_arch_version = saved[0]
        torch.cuda.get_device_capability = saved[1]


def _validated(argv, defaults):
    """Megatron's parse and validation plus overlap_tp's on `argv`; returns (args, overlap_tp's notes)."""
    from megatron.training import arguments

    from overlap_tp.launch.pretrain import extra_args_provider
    from overlap_tp.megatron.validation import validate_overlap_args

    def provider(parser):
        parser = extra_args_provider(parser)
        parser.error = _raise_usage_error
        return parser

    saved_argv, sys.argv = sys.argv, [sys.argv[0]] + list(argv)
    try:
        with _as_hopper(arguments):
            args = arguments.parse_args(extra_args_provider=provider)
            if "WORLD_SIZE" not in os.environ:
                args.world_size = smallest_world(args)
            arguments.validate_args(args, dict(defaults or {}))
            _check_expert_layout(args)
            notes = validate_overlap_args(args, warn=None)
            config = getattr(arguments, "core_transformer_config_from_args", None)
            if config is not None:   # the model config's own checks: heads against TP, MoE against EP, ...
                config(args)
            return args, notes
    finally:
        sys.argv = saved_argv


@contextlib.contextmanager
def _logging_off():
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def _quietly(argv, defaults):
    """(args, overlap_tp's notes, None) or (None, None, the problem), Megatron's output swallowed (its import
    warnings, torch's log lines and Megatron's table of every argument)."""
    from overlap_tp.launch.pretrain import HOW_TO_GET_MEGATRON
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            warnings.catch_warnings(), _logging_off():
        warnings.simplefilter("ignore")
        try:
            import megatron.training.arguments  # noqa: F401
        except ImportError as error:
            return None, None, HOW_TO_GET_MEGATRON.format(error=error)
        try:
            return *_validated(argv, defaults), None
        except Exception as error:   # Megatron's asserts and ValueErrors, argparse's errors, OverlapArgumentError
            return None, None, _describe(error)


def check(prog, argv, *, defaults=None, quiet=False, path=None):
    """Parse and validate `argv` as the launch would (see the module's docstring); `path`: a folder put first on
    sys.path meanwhile (a Megatron-LM checkout's script folder). Prints the error and returns 2, or returns 0 after
    printing overlap_tp's notes and `ok (world size N)`, unless `quiet` (the run will give the notes itself)."""
    if path:
        sys.path.insert(0, path)
    try:
        args, notes, problem = _quietly(argv, defaults)
    finally:
        if path:
            sys.path.remove(path)
    if problem:
        return refuse(prog, problem)
    if not quiet:
        for note in notes:
            print(f"{prog}: note: {' '.join(note.split())}", file=sys.stderr)
        print(f"ok (world size {args.world_size})")
    return 0
