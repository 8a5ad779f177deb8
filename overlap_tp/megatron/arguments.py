"""overlap_tp's command-line flags for Megatron training (docs/flags.md).

`add_overlap_args(parser)` is an `extra_args_provider` for Megatron's `megatron.training.arguments.parse_args` /
`parse_and_validate_args` (it adds the argument groups and returns the parser); it works the same on a plain
`argparse.ArgumentParser`. The checks after parsing are validation.py's (`validate_overlap_args`); what the flags
build for the layers is settings_from_args.py's.

User tier (the argument group "overlap_tp"):

    --overlap-tp [MODE]    off (default), auto (the flag alone), signal, decompose: the TP/SP linear layers
    --overlap-moe [MODE]   likewise for the MoE layers' expert ops

Expert tier and run-time (the argument group "overlap_tp (expert)"):

    --overlap-tp-config FILE     per op kind, the plans' OverlapConfig fields; the layer switches (docs/config.md)
    --overlap-tp-tune-cache PATH where the per-shape tuner keeps its plans (default: see tune_cache_path)
    --overlap-tp-layers          overlap_tp's layer spec even with --overlap-tp off (an A/B baseline)
    --overlap-tp-peak-tflops T   per-GPU peak for the logged MFU (989, H100/H200 bf16)
    --no-overlap-tp-stats        no sampled overlap statistics
"""
import argparse
import os

GROUP_TITLE = "overlap_tp"
EXPERT_GROUP_TITLE = "overlap_tp (expert)"
MODES = ("off", "auto", "signal", "decompose")   # --overlap-tp / --overlap-moe: off (default), auto (the flag alone)
TUNE_CACHE_ENV = "OVERLAP_TP_TUNE_CACHE"
# The MFU's peak override, read later by overlap_tp.training.throughput, a layer this one may not import
# (tests/megatron/test_arguments.py checks the name against its). The watchdog's variable is read by
# overlap_tp.ops.watchdog; OVERLAP_TP_GIT_COMMIT (a label in benchmark records) and OVERLAP_TP_GPU_WORLD
# (the GPU tests' rank count) are not read by training.
PEAK_TFLOPS_ENV = "OVERLAP_TP_PEAK_TFLOPS"
TUNE_CACHE_FILE = "overlap_tp_tune.json"


class OverlapArgumentError(ValueError):
    """A flag combination overlap_tp cannot run; the message says what to change."""


def add_overlap_args(parser):
    """Add the "overlap_tp" argument groups to `parser` and return the parser (Megatron's contract): the user tier
    first, then the expert tier.

    Adding twice to the same parser is a no-op, so a launcher and a user's own provider can both call it.
    """
    if "--overlap-tp" in getattr(parser, "_option_string_actions", {}):
        return parser
    group = parser.add_argument_group(
        title=GROUP_TITLE,
        description="Overlap the tensor-/sequence-parallel GEMMs with their communication (overlap_tp). "
                    "Off by default: Megatron runs unchanged. `--overlap-tp` alone is `--overlap-tp auto`.")
    group.add_argument(
        "--overlap-tp", choices=list(MODES), nargs="?", const="auto", default="off", metavar="MODE",
        help="The TP/SP linear layers (qkv, proj, fc1, fc2). auto: per op shape, TP size and GPU, measured once "
             "and cached, with the transport, SMs, chunking and ReduceScatter transfer of each op and the layers' "
             "gathering in place and deferred wgrad decided for the run (docs/config.md). signal / decompose: that "
             "method everywhere (the rest decided as for auto). off: Megatron's layers. Needs --sequence-parallel "
             "and TP > 1. {off,auto,signal,decompose}")
    group.add_argument(
        "--overlap-moe", choices=list(MODES), nargs="?", const="auto", default="off", metavar="MODE",
        help="The MoE layers' token all-to-all and expert GEMMs (overlap_tp's OverlapMoELayer). auto: off, signal "
             "and decompose tried in each layer's first calls, the fastest kept. off: Megatron's MoE layer. Needs "
             "--num-experts, --moe-token-dispatcher-type alltoall and --expert-tensor-parallel-size 1. "
             "{off,auto,signal,decompose}")
    expert = parser.add_argument_group(
        title=EXPERT_GROUP_TITLE,
        description="What `auto` decides, set by hand (--overlap-tp-config), and the run's bookkeeping.")
    expert.add_argument(
        "--overlap-tp-config", type=str, default=None, metavar="FILE",
        help="A JSON or YAML file keyed by op kind (ag_gemm, gemm_rs, gemm_ar, expert) whose fields are the plans' "
             "OverlapConfig fields (transport, comm_sms, groups, chunk_by, rs_transfer, copy_lanes, ...), plus "
             "'layers' (gather_in_place, defer_wgrad, token_split, fused_norms). What it leaves out is decided as "
             "for auto. docs/config.md.")
    expert.add_argument(
        "--overlap-tp-tune-cache", type=str, default=None, metavar="PATH",
        help="File where the per-shape tuner (--overlap-tp auto) keeps its measured plans, so "
             f"tuning happens once per shape and machine (exported as {TUNE_CACHE_ENV}). Default: "
             f"${TUNE_CACHE_ENV}, else {TUNE_CACHE_FILE} in the --save folder (a resumed run reuses the "
             "plans), else none (plans kept in memory for the run only; nothing is written).")
    expert.add_argument(
        "--overlap-tp-layers", action="store_true",
        help="Use overlap_tp's layer spec even with --overlap-tp off: its modules then run cuBLAS then "
             "the collective on one stream (Megatron's sequence). An A/B baseline that differs from "
             "--overlap-tp signal only in the overlap, and a way to run --sequence-parallel where "
             "neither Transformer Engine nor Apex provides Megatron's SP norm.")
    expert.add_argument(
        "--overlap-tp-peak-tflops", type=float, default=None, metavar="TFLOPS",
        help="Per-GPU peak for the MFU that overlap_tp logs. Default: $OVERLAP_TP_PEAK_TFLOPS, else "
             "989 (H100/H200 SXM dense BF16).")
    expert.add_argument(
        "--no-overlap-tp-stats", dest="overlap_tp_stats", action="store_false",
        help="Do not sample overlap statistics. By default the step logged every --log-interval times "
             "each overlapped GEMM+collective call on the GPU against its GEMM alone and its collective "
             "alone on the same shapes (measured once per shape, outside the logged step time) and logs "
             "exposed communication (ms per step beyond the GEMMs, >= 0) and communication hidden (0-1), "
             "in total and per op kind; left out, with the reason, for CUDA-graph replays and host-bound steps.")
    # the user tier first in --help: Megatron adds its own groups before calling this provider
    ours = [g for g in parser._action_groups if g.title in (GROUP_TITLE, EXPERT_GROUP_TITLE)]
    rest = [g for g in parser._action_groups if g not in ours]
    parser._action_groups[:] = rest[:2] + ours + rest[2:]   # after argparse's positional arguments and options
    return parser


def tune_cache_path(args):
    """Where the tuner of this training run keeps its plans: --overlap-tp-tune-cache, else
    $OVERLAP_TP_TUNE_CACHE, else overlap_tp_tune.json in Megatron's --save folder (the run's own output,
    kept with its checkpoints), else None (no file)."""
    given = getattr(args, "overlap_tp_tune_cache", None) or os.environ.get(TUNE_CACHE_ENV)
    if given:
        return given
    save = getattr(args, "save", None)
    return os.path.join(save, TUNE_CACHE_FILE) if save else None


def build_parser():
    """A stand-alone parser with only overlap_tp's flags (tests, `--help`)."""
    return add_overlap_args(argparse.ArgumentParser(prog="overlap_tp", allow_abbrev=False))


if __name__ == "__main__":   # `python -m overlap_tp.megatron.arguments --help`: the flags, no Megatron needed
    build_parser().parse_args()
