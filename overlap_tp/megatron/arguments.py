"""overlap_tp's command-line flags for Megatron training.

`add_overlap_args(parser)` is an `extra_args_provider` for Megatron's
`megatron.training.arguments.parse_args` / `parse_and_validate_args` (it adds the argument group
"overlap_tp" and returns the parser); it works the same on a plain `argparse.ArgumentParser`.
`validate_overlap_args(args)` runs after Megatron's own `validate_args` (which turns
`--sequence-parallel` off at TP=1) and checks the combination with Megatron's flags, with messages
that say what to change. Both touch only attributes that exist on `args`, reading Megatron's with
`getattr(..., default)`, so a plain namespace in a test works too. `validate_overlap_args` also checks
the OVERLAP_TP_* environment variables (`validate_overlap_env`), so a bad value stops the run at start
rather than at its first use, mid-training.

    --overlap-tp {off,signal,decompose,auto}   OverlapConfig.method for the TP/SP linear layers (off)
    --overlap-tp-transport {auto,nccl,p2p}     OverlapConfig.transport per op kind (auto, see layer_configs)
    --overlap-tp-copy-lanes N                  OverlapConfig.copy_lanes (1)
    --overlap-tp-chunk-by {auto,rows,peer}     OverlapConfig.chunk_by (auto)
    --overlap-tp-rs-transfer {auto,epilogue,copy}  OverlapConfig.rs_transfer (auto)
    --overlap-tp-comm-sms N                    OverlapConfig.comm_sms (default 16; the expert ops 4)
    --overlap-tp-tune-cache PATH               where the per-shape tuner keeps its plans (default: see
                                               tune_cache_path)
    --overlap-tp-layers                        use overlap_tp's layer spec even with --overlap-tp off
    --no-overlap-tp-fused-norms                Megatron's TransformerLayer between overlap_tp's linears (A/B)
    --overlap-tp-gather-in-place               norms write into qkv's / fc1's own gathered buffers (off)
    --overlap-tp-defer-wgrad                   fc1's wgrad runs beside proj's backward AllGather (off)
    --overlap-tp-token-split                   each micro-batch as two interleaved halves of sequences (off)
    --overlap-tp-peak-tflops TFLOPS            per-GPU peak for the logged MFU (989, H100/H200 bf16)
    --overlap-moe {off,signal,decompose,auto}  OverlapConfig.method for the MoE expert ops (off)
    --overlap-moe-transport {nccl,p2p}         OverlapConfig.transport for the MoE expert ops (nccl)
"""
import argparse
import dataclasses
import os
import warnings

from overlap_tp.ops.config import CHUNK_BY, EXPERT_OP_DEFAULTS, METHODS, RS_TRANSFERS, TRANSPORTS, OverlapConfig

MOE_TRANSPORTS = ("nccl", "p2p")   # --overlap-moe-transport
from overlap_tp.ops import replay
from overlap_tp.ops.watchdog import timeout_from_env

GROUP_TITLE = "overlap_tp"
# --overlap-tp-transport: "auto" picks per op kind (layer_configs), the others are OverlapConfig.transport.
TRANSPORT_FLAGS = ("auto",) + TRANSPORTS
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
    """Add the "overlap_tp" argument group to `parser` and return the parser (Megatron's contract).

    Adding twice to the same parser is a no-op, so a launcher and a user's own provider can both call it.
    """
    if "--overlap-tp" in getattr(parser, "_option_string_actions", {}):
        return parser
    group = parser.add_argument_group(
        title=GROUP_TITLE,
        description="Overlap the tensor-/sequence-parallel GEMMs with their communication "
                    "(overlap_tp signaled GEMMs). Off by default: Megatron runs unchanged.")
    group.add_argument(
        "--overlap-tp", choices=list(_ordered(METHODS)), default="off",
        help="How the TP/SP linear layers (qkv, proj, fc1, fc2) run their GEMM + collective. "
             "off: Megatron's own layers, untouched. signal: a persistent Triton GEMM signals each group "
             "of finished tiles (or stores them into their owner's buffer) so the transfer starts while the "
             "GEMM runs. decompose: cuBLAS GEMMs per region or chunk, the transfer of one beside the GEMM of "
             "the next. auto: chosen per shape by the tuner. Needs --sequence-parallel and TP > 1.")
    group.add_argument(
        "--overlap-tp-transport", choices=list(TRANSPORT_FLAGS), default="auto",
        help="How data moves for --overlap-tp signal and decompose: nccl (one NCCL collective per group of "
             "tiles or chunk) or p2p (peer-to-peer through symmetric memory over NVLink, CUDA only: the GEMM "
             "epilogue stores into the owner's buffer for GEMM+ReduceScatter, copy-engine pulls for "
             "AllGather+GEMM, or a pull kernel with --overlap-tp-comm-sms N; GEMM+AllReduce keeps nccl). "
             "auto (default): AllGather+GEMM and "
             "GEMM+ReduceScatter on p2p with their GEMMs on every SM, GEMM+AllReduce on nccl: no NCCL SM next "
             "to a sequence-parallel GEMM, the combination that measured fastest at TP 2 under CUDA graphs "
             "for both methods (docs/perf/s11/README.md, docs/perf/s20/README.md).")
    group.add_argument(
        "--overlap-tp-comm-sms", type=int, default=None, metavar="N",
        help="SMs left to the collective: the GEMM runs on (SMs - N) and NCCL is capped at N CTAs; "
             "0 gives the GEMM every SM. With --overlap-tp-transport p2p and --overlap-tp signal, N > 0 runs the "
             "AllGathers' pulls as one kernel per call on those N SMs instead of the copy engines, with the call's "
             "handshakes inside it: faster where the AllGather is short (the smoke's shapes), slower where the GEMM "
             "needs the SMs (the 8B shapes); --overlap-tp auto measures it. Default: OverlapConfig's "
             "default (16) for NCCL, 0 for the p2p transports, 4 for the MoE expert ops.")
    group.add_argument(
        "--overlap-tp-copy-lanes", type=int, default=None, metavar="N",
        help="Streams the p2p AllGathers' copy-engine pulls are split over (ag_gemm and the backward's re-gather, "
             "--overlap-tp-transport p2p or auto): several copy engines can then move one chunk at once. "
             "Default: 1 (the comm stream alone).")
    group.add_argument(
        "--overlap-tp-chunk-by", choices=CHUNK_BY, default=None,
        help="How the p2p AllGathers' copy-engine pulls are cut into chunks (OverlapConfig.chunk_by): rows (each "
             "chunk the same rows of every peer, TP - 1 copies per chunk) or peer (each chunk one peer's rows, one "
             "copy, as PyTorch's async-TP pulls whole shards). peer needs --overlap-tp signal or decompose on the "
             "p2p transport (--overlap-tp-transport p2p or auto), one copy lane and, for signal, no pull SMs. "
             "Default: auto, peer where TP > 2 and the signaled AllGathers pull that way (faster on every 8B and 70B "
             "AllGather shape at TP 4, session 35), else rows.")
    group.add_argument(
        "--overlap-tp-rs-transfer", choices=RS_TRANSFERS, default=None,
        help="How the signaled GEMM+ReduceScatters on the p2p transport move the peers' partial sums "
             "(OverlapConfig.rs_transfer): epilogue (the GEMM's epilogue stores them into the owners' buffers over "
             "NVLink) or copy (the GEMM stores them locally and the copy engines push each owner's rows as soon as "
             "they are stored; the SMs stay with the GEMM and the work after it). Needs --overlap-tp signal, "
             "decompose or auto on the p2p transport (p2p or auto). Default: auto, copy for signal where TP > 2, "
             "else epilogue.")
    group.add_argument(
        "--overlap-tp-tune-cache", type=str, default=None, metavar="PATH",
        help="File where the per-shape tuner (--overlap-tp auto) keeps its measured plans, so "
             f"tuning happens once per shape and machine (exported as {TUNE_CACHE_ENV}). Default: "
             f"${TUNE_CACHE_ENV}, else {TUNE_CACHE_FILE} in the --save folder (a resumed run reuses the "
             "plans), else none (plans kept in memory for the run only; nothing is written).")
    group.add_argument(
        "--overlap-tp-layers", action="store_true",
        help="Use overlap_tp's layer spec even with --overlap-tp off: its modules then run cuBLAS then "
             "the collective on one stream (Megatron's sequence). An A/B baseline that differs from "
             "--overlap-tp signal only in the overlap, and a way to run --sequence-parallel where "
             "neither Transformer Engine nor Apex provides Megatron's SP norm.")
    group.add_argument(
        "--no-overlap-tp-fused-norms", dest="overlap_tp_fused_norms", action="store_false",
        help="Build Megatron's own TransformerLayer around overlap_tp's linears and norms: its bias-dropout-add, "
             "then the RMSNorm, as separate kernels, and every reduce-scatter summed before its consumer. By "
             "default overlap_tp's layer runs each bias-dropout-add and the norm after it as one kernel, which "
             "also sums the p2p reduce-scatter's partials (linear_proj, linear_fc2) and normalizes the next "
             "layer's input. An A/B of those fusions; the GEMMs' overlap is unchanged.")
    group.add_argument(
        "--overlap-tp-gather-in-place", action="store_true",
        help="linear_qkv and a dense MLP's linear_fc1 own their gathered input buffers, and the norm before each "
             "writes its rows straight into this rank's region there: the forward's AllGather+GEMM stages no "
             "copy, and the backward reads the gathered input still in place instead of gathering it again. "
             "Costs (TP - 1) sequence shards of memory per such layer (about 2 GB per GPU at llama3-8b, 32 "
             "layers, TP 2, s 8192). Needs overlap_tp's fused layer, --overlap-tp signal or decompose on the p2p "
             "transport; off with activation recomputation, pipeline parallelism or CPU offloading (a warning "
             "says why). Off by default.")
    group.add_argument(
        "--overlap-tp-defer-wgrad", action="store_true",
        help="With --overlap-tp-gather-in-place: linear_fc1's backward leaves its weight-gradient GEMM to "
             "linear_proj's backward, which runs it while its dgrad AllGather pulls the peers' rows (fc1's gathered "
             "input is still in its own buffer): that AllGather no longer waits with nothing beside it (one 8B layer "
             "at TP 4 under CUDA graphs: -2.3%%, docs/perf/s32; llama3-8b at TP 4 end to end: -0.9%% per "
             "iteration, s33). It pays under --cuda-graph-impl local or full_iteration; eagerly, with one hardware "
             "queue, the wgrad waits behind the pulls (a warning says so). The gradient is the same bits, returned "
             "to autograd from linear_proj's backward (DDP's hooks see it as any other). Off by default; the llama3 "
             "recipes turn it on at TP >= 4 under graphs.")
    group.add_argument(
        "--overlap-tp-token-split", action="store_true",
        help="Run each micro-batch of b sequences (b even, --micro-batch-size >= 2) as two halves of b/2 sequences, "
             "interleaved layer by layer so that one half's ReduceScatter and AllGather transfers run beside the "
             "other half's attention and MLP (issue 22's token split; TokenWeave, Domino). Each half runs its own "
             "plans and buffers (twice the p2p receive and gathered buffers). The result is the unsplit layer's up "
             "to the GEMMs' summation order. Needs overlap_tp's fused layer with sequence parallelism; a layer that "
             "recomputes or offloads activations, or a micro-batch of odd size, runs whole (a warning says why). "
             "Off by default.")
    group.add_argument(
        "--overlap-tp-peak-tflops", type=float, default=None, metavar="TFLOPS",
        help="Per-GPU peak for the MFU that overlap_tp logs. Default: $OVERLAP_TP_PEAK_TFLOPS, else "
             "989 (H100/H200 SXM dense BF16).")
    group.add_argument(
        "--no-overlap-tp-stats", dest="overlap_tp_stats", action="store_false",
        help="Do not sample overlap statistics. By default the step logged every --log-interval times "
             "each overlapped GEMM+collective call on the GPU against its GEMM alone and its collective "
             "alone on the same shapes (measured once per shape, outside the logged step time) and logs "
             "exposed communication (ms per step beyond the GEMMs, >= 0) and communication hidden (0-1), "
             "in total and per op kind; left out, with the reason, for CUDA-graph replays and host-bound steps.")
    group.add_argument(
        "--overlap-moe", choices=list(_ordered(METHODS)), default="off",
        help="How MoE layers run their token all-to-all and expert GEMMs. off: Megatron's own MoE "
             "layer, untouched. signal / decompose / auto: overlap_tp's OverlapMoELayer, whose "
             "dispatch all-to-all is overlapped with the grouped fc1 GEMM (a2a_gemm) and whose fc2 "
             "GEMM with the combine all-to-all (gemm_a2a); methods as for --overlap-tp, but auto tries "
             "off, signal and decompose in each layer's first calls and keeps the fastest (the EP group's slowest "
             "rank decides; a warning names the choice), transport per --overlap-moe-transport, "
             "--overlap-tp-comm-sms applies. Needs --num-experts, "
             "--moe-token-dispatcher-type alltoall and --expert-tensor-parallel-size 1.")
    group.add_argument(
        "--overlap-moe-transport", choices=list(MOE_TRANSPORTS), default="nccl",
        help="How the expert ops move tokens for --overlap-moe signal (and auto's signal). nccl (default): "
             "NCCL send / receive per group of rows on a communicator capped at --overlap-tp-comm-sms CTAs. "
             "p2p (CUDA, symmetric memory over NVLink): the copy engines, no SM and no NCCL kernel "
             "(a2a_gemm pulls each chunk from the peers' copies of their tokens, gemm_a2a pushes each "
             "group's rows into the peers' receive buffers); its GEMMs get every SM (comm_sms 0 unless "
             "--overlap-tp-comm-sms says otherwise).")
    return parser


def _ordered(methods):
    """off first (the default), then the rest in OverlapConfig's order."""
    return ("off",) + tuple(m for m in methods if m != "off")


def _warn(message):
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        warnings.warn(message, stacklevel=3)


def tune_cache_path(args):
    """Where the tuner of this training run keeps its plans: --overlap-tp-tune-cache, else
    $OVERLAP_TP_TUNE_CACHE, else overlap_tp_tune.json in Megatron's --save folder (the run's own output,
    kept with its checkpoints), else None (no file)."""
    given = getattr(args, "overlap_tp_tune_cache", None) or os.environ.get(TUNE_CACHE_ENV)
    if given:
        return given
    save = getattr(args, "save", None)
    return os.path.join(save, TUNE_CACHE_FILE) if save else None


def validate_overlap_env(args=None):
    """Check the OVERLAP_TP_* overrides in os.environ (and the tune cache location `args` gives, if any);
    raise OverlapArgumentError with a one-line message naming the variable. The watchdog's and the eager replays'
    variables are parsed by their own readers, so what passes here is what the ops will accept."""
    raw = os.environ.get(PEAK_TFLOPS_ENV)
    if raw:   # empty = unset, as overlap_tp.training.throughput.peak_tflops reads it
        try:
            peak = float(raw)
        except ValueError:
            peak = None
        if peak is None or not (0 < peak < float("inf")):
            raise OverlapArgumentError(f"{PEAK_TFLOPS_ENV}={raw!r}: expected a positive number (the per-GPU peak "
                                       "TFLOP/s the logged MFU divides by)")
    try:
        timeout_from_env()
        replay.from_env()
    except ValueError as error:
        raise OverlapArgumentError(str(error)) from None
    from overlap_tp.tune.cache import location_problem
    flag = getattr(args, "overlap_tp_tune_cache", None)
    what, cache = ("--overlap-tp-tune-cache", flag) if flag else (TUNE_CACHE_ENV, os.environ.get(TUNE_CACHE_ENV))
    if not cache and getattr(args, "overlap_tp", "off") == "auto":   # only auto tunes: else --save is Megatron's
        what, cache = "the tune cache in --save", tune_cache_path(args)
    problem = cache and location_problem(cache)
    if problem:
        raise OverlapArgumentError(f"{what}: {problem}")


def validate_overlap_args(args, *, warn=_warn):
    """Check overlap_tp's flags against Megatron's, and the OVERLAP_TP_* environment; raise
    OverlapArgumentError with what to change.

    Call it after Megatron's `validate_args`. May set `args.overlap_tp = "off"` (TP=1: nothing to
    overlap). Returns the list of warnings it gave (each also passed to `warn`).
    """
    validate_overlap_env(args)
    given = []

    def note(message):
        given.append(message)
        if warn is not None:
            warn(message)

    method = getattr(args, "overlap_tp", "off")
    if method not in METHODS:
        raise OverlapArgumentError(f"--overlap-tp {method!r}: expected one of {_ordered(METHODS)}")
    transport = getattr(args, "overlap_tp_transport", "auto")
    if transport not in TRANSPORT_FLAGS:
        raise OverlapArgumentError(f"--overlap-tp-transport {transport!r}: expected one of {TRANSPORT_FLAGS}")
    peak = getattr(args, "overlap_tp_peak_tflops", None)
    if peak is not None and not peak > 0:
        raise OverlapArgumentError(f"--overlap-tp-peak-tflops {peak!r}: expected a positive number")
    comm_sms = getattr(args, "overlap_tp_comm_sms", None)
    if comm_sms is not None and (isinstance(comm_sms, bool) or not isinstance(comm_sms, int) or comm_sms < 0):
        raise OverlapArgumentError(f"--overlap-tp-comm-sms {comm_sms!r}: expected an integer >= 0")
    lanes = getattr(args, "overlap_tp_copy_lanes", None)
    if lanes is not None and (isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < 1):
        raise OverlapArgumentError(f"--overlap-tp-copy-lanes {lanes!r}: expected an integer >= 1")
    if transport == "p2p" and method == "signal" and (comm_sms or 0) > 0 and (lanes or 1) > 1:
        raise OverlapArgumentError(f"--overlap-tp-copy-lanes {lanes} splits the copy engines' pulls, and "
                                   f"--overlap-tp-comm-sms {comm_sms} with --overlap-tp-transport p2p runs them on SMs "
                                   "instead: give one of the two")

    if getattr(args, "overlap_tp_chunk_by", None) == "peer":
        if method not in ("signal", "decompose") or transport == "nccl" or (lanes or 1) > 1 or (
                method == "signal" and transport == "p2p" and (comm_sms or 0) > 0):
            raise OverlapArgumentError(
                f"--overlap-tp-chunk-by peer with --overlap-tp {method} --overlap-tp-transport {transport}"
                f"{f' --overlap-tp-copy-lanes {lanes}' if lanes else ''}"
                f"{f' --overlap-tp-comm-sms {comm_sms}' if comm_sms else ''}: the AllGathers then pull one peer's rows "
                "per chunk with one copy-engine copy, which --overlap-tp signal or decompose on the p2p transport "
                "(p2p or auto), one copy lane and no pull SMs do. Change those, or drop --overlap-tp-chunk-by.")

    if getattr(args, "overlap_tp_rs_transfer", None) == "copy" and (method not in ("signal", "decompose", "auto")
                                                                   or transport == "nccl"):
        raise OverlapArgumentError(
            f"--overlap-tp-rs-transfer copy with --overlap-tp {method} --overlap-tp-transport {transport}: the copy "
            "engines push the GEMM's partials on the p2p transport, which --overlap-tp signal, decompose (or auto) "
            "with --overlap-tp-transport p2p or auto runs. Change those, or drop --overlap-tp-rs-transfer.")

    if getattr(args, "overlap_tp_gather_in_place", False):
        if method not in ("signal", "decompose", "auto") or transport == "nccl":
            raise OverlapArgumentError(
                f"--overlap-tp-gather-in-place with --overlap-tp {method} --overlap-tp-transport {transport}: the "
                "norms write into the AllGathers' own peer-to-peer buffers, which --overlap-tp signal, decompose or "
                "auto with --overlap-tp-transport p2p (or auto) uses. Change those, or drop "
                "--overlap-tp-gather-in-place (the llama3 recipes add it by default: GATHER_IN_PLACE=0).")
        if method == "auto":
            note("--overlap-tp-gather-in-place with --overlap-tp auto: linear_qkv and linear_fc1 gather in place where "
                 "the tuner picks signal or decompose on p2p for their AllGather, and through the shared buffer "
                 "where it picks another path")
        if not getattr(args, "overlap_tp_fused_norms", True):
            raise OverlapArgumentError(
                "--overlap-tp-gather-in-place with --no-overlap-tp-fused-norms: gathering in place is wired by "
                "overlap_tp's layer (OverlapTransformerLayer), which that flag replaces with Megatron's. Drop one.")

    if getattr(args, "overlap_tp_defer_wgrad", False):
        if not getattr(args, "overlap_tp_gather_in_place", False):
            raise OverlapArgumentError(
                "--overlap-tp-defer-wgrad needs --overlap-tp-gather-in-place: linear_fc1's deferred weight gradient "
                "reads its gathered input from the layer's own buffer, which only gathering in place keeps until the "
                "backward. Add it, or drop --overlap-tp-defer-wgrad.")
        # Megatron's mode "none", and neither of its older graph flags
        if getattr(args, "cuda_graph_impl", None) == "none" and not (
                getattr(args, "enable_cuda_graph", False) or getattr(args, "external_cuda_graph", False)):
            note("--overlap-tp-defer-wgrad without CUDA graphs (--cuda-graph-impl none): linear_fc1's wgrad still runs "
                 "inside linear_proj's backward, with the same gradient, but eagerly, with one hardware queue "
                 "(CUDA_DEVICE_MAX_CONNECTIONS=1), its launch waits behind the AllGather's pulls, so it hides "
                 "nothing; it was measured faster under --cuda-graph-impl local only (docs/perf/s33)")

    if getattr(args, "overlap_tp_token_split", False):
        if method == "off":
            raise OverlapArgumentError(
                "--overlap-tp-token-split with --overlap-tp off: the split puts one half's overlapped transfers beside "
                "the other half's compute; with the overlap off there is none. Turn --overlap-tp on, or drop the flag.")
        if not getattr(args, "overlap_tp_fused_norms", True):
            raise OverlapArgumentError(
                "--overlap-tp-token-split with --no-overlap-tp-fused-norms: the split is run by overlap_tp's layer "
                "(OverlapTransformerLayer), which that flag replaces with Megatron's. Drop one.")
        if not getattr(args, "sequence_parallel", False):
            raise OverlapArgumentError(
                "--overlap-tp-token-split without --sequence-parallel: the split hides the sequence-parallel "
                "AllGathers and ReduceScatters. Add --sequence-parallel, or drop the flag.")
        mbs = getattr(args, "micro_batch_size", None)
        if mbs is not None and mbs % 2:
            raise OverlapArgumentError(
                f"--overlap-tp-token-split with --micro-batch-size {mbs}: the split runs two halves of the micro-batch's "
                "sequences, so it needs an even micro-batch size (e.g. --micro-batch-size 2 with the same global batch).")

    moe = getattr(args, "overlap_moe", "off")
    if moe not in METHODS:
        raise OverlapArgumentError(f"--overlap-moe {moe!r}: expected one of {_ordered(METHODS)}")

    use_layers = method != "off" or getattr(args, "overlap_tp_layers", False)
    if moe != "off":
        _validate_moe(args, moe, comm_sms)
    elif not use_layers:
        return given

    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    if tp == 1:
        if method != "off":
            note(f"--overlap-tp {method} with --tensor-model-parallel-size 1: there is no TP "
                 "communication to overlap; running with --overlap-tp off.")
            args.overlap_tp = method = "off"
        if moe == "off":
            if getattr(args, "overlap_tp_layers", False):
                note("--overlap-tp-layers with --tensor-model-parallel-size 1: Megatron's own layers are "
                     "used (nothing to communicate).")
                args.overlap_tp_layers = False
            return given
        use_layers = False

    if use_layers:
        flag, off = (f"--overlap-tp {method}" if method != "off" else "--overlap-tp-layers"), "--overlap-tp off"
    else:   # only the MoE layers: the dense layers come from the same spec, with the overlap off
        flag, off = f"--overlap-moe {moe}", "--overlap-moe off"
    if tp > 1 and not getattr(args, "sequence_parallel", False):
        raise OverlapArgumentError(
            f"{flag} needs --sequence-parallel. overlap_tp's Megatron layers replace the sequence-"
            "parallel pairs AllGather+GEMM (qkv, fc1) and GEMM+ReduceScatter (proj, fc2). Without "
            "SP, Megatron's row-parallel layers use GEMM+AllReduce (and the column-parallel ones an "
            "AllReduce of the input gradient), which these layers do not replace. Add "
            f"--sequence-parallel (same math, half the bytes per collective), or use {off}.")
    moe_layer_freq = getattr(args, "moe_layer_freq", 1)
    if getattr(args, "num_experts", None) and moe_layer_freq not in (1, None):
        raise OverlapArgumentError(
            f"{flag} with --moe-layer-freq {moe_layer_freq}: overlap_tp's layer spec makes every layer an "
            f"MoE layer of --num-experts experts. Drop --moe-layer-freq, or use {off}.")
    if getattr(args, "tp_comm_overlap", False):
        raise OverlapArgumentError(
            f"{flag} with --tp-comm-overlap: both overlap the same TP communication (Transformer "
            f"Engine userbuffers vs overlap_tp). Pick one: drop --tp-comm-overlap, or use {off}.")
    spec = getattr(args, "spec", None)
    if spec and not _is_our_spec(spec):
        raise OverlapArgumentError(
            f"{flag} sets the transformer layer spec itself (overlap_tp.megatron.layer_spec."
            f"get_gpt_layer_overlap_spec); --spec {' '.join(spec)} sets it too and one of them would "
            "be silently ignored. Remove --spec to train with overlap_tp's layers, or use "
            f"{off} to keep your spec.")
    normalization = getattr(args, "normalization", "RMSNorm")
    if normalization != "RMSNorm":
        raise OverlapArgumentError(
            f"{flag} with --normalization {normalization}: overlap_tp's layer spec provides RMSNorm "
            f"only (OverlapRMSNorm, sequence-parallel). Use --normalization RMSNorm, or {off}.")
    if getattr(args, "fp8", None):
        raise OverlapArgumentError(
            f"{flag} with --fp8-format: the overlapped GEMMs are bf16/fp16. Use --bf16, or {off}.")
    for name, what in (("yaml_cfg", "--yaml-cfg"),
                       ("multi_latent_attention", "--multi-latent-attention"),
                       ("heterogeneous_layers_config_path", "--heterogeneous-layers-config-path"),
                       ("experimental_attention_variant", "--experimental-attention-variant")):
        if getattr(args, name, None):
            raise OverlapArgumentError(
                f"{flag} with {what}: that path builds its own layer specs, which overlap_tp does not "
                f"replace yet. Use {off}.")
    if method in ("signal", "decompose") and tp >= 8:
        note(f"--overlap-tp {method} with --tensor-model-parallel-size {tp}: at TP 8 each rank's GEMMs are short "
             "and the layers are host-bound, and the overlapped layers measured 34-63% slower than with "
             "--overlap-tp off on 8 x H200 (docs/perf/t8/README.md). Consider --overlap-tp auto (per-shape "
             "choice, off where overlap does not pay) or --overlap-tp off.")
    if getattr(args, "transformer_impl", "local") == "transformer_engine":
        note(f"{flag} with --transformer-impl transformer_engine: overlap_tp's layer spec takes "
             "precedence over it where TP communication happens. qkv/proj/fc1/fc2 become overlap_tp "
             "modules and the norms in front of them separate OverlapRMSNorm modules (TE's fused "
             "LayerNorm+Linear is not used); core attention, the q/k layernorms and the final norm are "
             "TE's where Transformer Engine imports, else PyTorch SDPA and OverlapRMSNorm. "
             "Pass --transformer-impl local to silence this.")
    return given


def _validate_moe(args, moe, comm_sms):
    """--overlap-moe's own requirements (the MoE layer refuses the rest of what it does not implement
    when the model is built, naming the config field)."""
    flag = f"--overlap-moe {moe}"
    if not getattr(args, "num_experts", None):
        raise OverlapArgumentError(
            f"{flag} needs an MoE model (--num-experts N): it overlaps the MoE token all-to-all with the "
            "expert GEMMs. For dense models use --overlap-tp.")
    dispatcher = getattr(args, "moe_token_dispatcher_type", "allgather")
    if dispatcher != "alltoall":
        raise OverlapArgumentError(
            f"{flag} with --moe-token-dispatcher-type {dispatcher}: overlap_tp's MoE layer carries the "
            "alltoall dispatcher's all-to-all (Megatron's default dispatcher is allgather). Add "
            "--moe-token-dispatcher-type alltoall, or use --overlap-moe off.")
    expert_tp = getattr(args, "expert_tensor_parallel_size", None) or getattr(args, "tensor_model_parallel_size", 1)
    if (expert_tp or 1) > 1:
        raise OverlapArgumentError(
            f"{flag} with expert tensor parallelism {expert_tp}: the expert ops run whole experts on each "
            "rank of the expert-parallel group (Megatron's --expert-tensor-parallel-size defaults to "
            "--tensor-model-parallel-size). Add --expert-tensor-parallel-size 1, or use --overlap-moe off.")
    if getattr(args, "add_bias_linear", False):
        raise OverlapArgumentError(
            f"{flag} with expert biases: the grouped expert GEMMs have none. Add --disable-bias-linear, or use "
            "--overlap-moe off.")
    for name, what in (("moe_shared_expert_overlap", "--moe-shared-expert-overlap"),
                       ("overlap_moe_expert_parallel_comm", "--overlap-moe-expert-parallel-comm")):
        if getattr(args, name, False):
            raise OverlapArgumentError(
                f"{flag} with {what}: that overlap runs inside Megatron's token dispatcher, which overlap_tp's "
                f"MoE layer replaces (shared experts then run before routing, as in Megatron's MoELayer). "
                f"Drop {what}, or use --overlap-moe off.")
    transport = getattr(args, "overlap_moe_transport", "nccl")
    if transport not in MOE_TRANSPORTS:
        raise OverlapArgumentError(f"--overlap-moe-transport {transport!r}: expected one of {MOE_TRANSPORTS}")
    if moe in ("signal", "auto") and comm_sms == 0 and transport == "nccl":   # auto tries signal
        raise OverlapArgumentError(
            f"{flag} with --overlap-tp-comm-sms 0: a2a_gemm's signaled GEMM spins on ready flags that NCCL "
            "kernels raise, so NCCL needs SMs the GEMM does not hold. Give --overlap-tp-comm-sms >= 1, or "
            "--overlap-moe-transport p2p (the copy engines need none).")


def _is_our_spec(spec):
    from overlap_tp.megatron_patches.apply import is_overlap_spec
    return is_overlap_spec(spec)


def overlap_config_kwargs(args):
    """The OverlapConfig fields that the flags set (only those given; the rest keep their defaults), for
    gemm_rs; `layer_configs` derives the other op kinds' configs from them."""
    transport = getattr(args, "overlap_tp_transport", "auto")
    kwargs = {"method": getattr(args, "overlap_tp", "off"), "transport": "nccl" if transport == "auto" else transport}
    if getattr(args, "overlap_tp_comm_sms", None) is not None:
        kwargs["comm_sms"] = args.overlap_tp_comm_sms
    if getattr(args, "overlap_tp_copy_lanes", None) is not None:
        kwargs["copy_lanes"] = args.overlap_tp_copy_lanes
    if getattr(args, "overlap_tp_chunk_by", None) is not None:
        kwargs["chunk_by"] = args.overlap_tp_chunk_by
    if getattr(args, "overlap_tp_rs_transfer", None) is not None:
        kwargs["rs_transfer"] = args.overlap_tp_rs_transfer
    return kwargs


def layer_configs(args):
    """The dense layers' OverlapConfig per op kind ("ag_gemm", "gemm_rs", "gemm_ar") from the flags.
    gemm_ar runs nccl (its p2p transport, ops/p2p.py P2PAllReduce, is not yet measured in layers). With
    --overlap-tp-transport auto and --overlap-tp signal or decompose, ag_gemm pulls the peers' rows with the copy
    engines and gemm_rs stores its partials into the owners' buffers from the GEMM's epilogue (signal) or cuBLAS's
    (decompose: one GEMM per owner's region), both p2p with their GEMMs on every SM (comm_sms 0: nothing runs next to
    them), while gemm_ar runs nccl with --overlap-tp-comm-sms. Measured under graphs at t = 2 (docs/perf/s20/README.md): cuBLAS over p2p
    beat cuBLAS chunks over NCCL on all 8 public s 8192 shapes. On CPU tensors (gloo) the p2p transports do not
    exist: use --overlap-tp-transport nccl there."""
    config = OverlapConfig(**overlap_config_kwargs(args))
    nccl = dataclasses.replace(config, transport="nccl")
    ag = rs = config
    transport = getattr(args, "overlap_tp_transport", "auto")
    if transport == "auto" and config.method in ("signal", "decompose"):
        ag = rs = dataclasses.replace(config, transport="p2p", comm_sms=0)
    elif transport == "p2p":
        # nothing runs beside the p2p ReduceScatter's GEMM, and nothing beside the AllGather's unless asked:
        # --overlap-tp-comm-sms N gives its pulls N SMs
        rs = dataclasses.replace(config, comm_sms=0)
        if getattr(args, "overlap_tp_comm_sms", None) is None:
            ag = rs
    return {"ag_gemm": ag, "gemm_rs": rs, "gemm_ar": nccl}


def moe_overlap_config_kwargs(args):
    """The OverlapConfig fields of the MoE expert ops that the flags set: --overlap-moe's method,
    --overlap-moe-transport (p2p: comm_sms 0) and --overlap-tp-comm-sms over the expert ops' defaults
    (config.EXPERT_OP_DEFAULTS), whatever --overlap-tp-transport says."""
    kwargs = dict(EXPERT_OP_DEFAULTS, method=getattr(args, "overlap_moe", "off"))
    if getattr(args, "overlap_moe_transport", "nccl") == "p2p":
        kwargs.update(transport="p2p", comm_sms=0)
    if getattr(args, "overlap_tp_comm_sms", None) is not None:
        kwargs["comm_sms"] = args.overlap_tp_comm_sms
    return kwargs


def build_parser():
    """A stand-alone parser with only overlap_tp's flags (tests, `--help`)."""
    return add_overlap_args(argparse.ArgumentParser(prog="overlap_tp", allow_abbrev=False))


if __name__ == "__main__":   # `python -m overlap_tp.megatron.arguments --help`: the flags, no Megatron needed
    build_parser().parse_args()
