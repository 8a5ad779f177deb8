"""The checks of overlap_tp's flags after parsing: `validate_overlap_args(args)` runs after Megatron's own
`validate_args` (which turns `--sequence-parallel` off at TP=1) and checks the combination with Megatron's flags and
the expert config file, with messages that say what to change. It touches only attributes that exist on `args`,
reading Megatron's with `getattr(..., default)`, so a plain namespace in a test works too. It also checks the
OVERLAP_TP_* environment variables (`validate_overlap_env`), so a bad value stops the run at start rather than at its
first use, mid-training.
"""
import os
import warnings

from overlap_tp.megatron.arguments import (MODES, PEAK_TFLOPS_ENV, TUNE_CACHE_ENV, OverlapArgumentError,
                                           tune_cache_path)
from overlap_tp.megatron.config_file import read_config_file
from overlap_tp.megatron.settings_from_args import graphs_on, settings_from_args
from overlap_tp.ops import replay
from overlap_tp.ops.resolve import fill_defaults
from overlap_tp.ops.watchdog import timeout_from_env


def _warn(message):
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        warnings.warn(message, stacklevel=3)


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
    if method not in MODES:
        raise OverlapArgumentError(f"--overlap-tp {method!r}: expected one of {MODES}")
    peak = getattr(args, "overlap_tp_peak_tflops", None)
    if peak is not None and not peak > 0:
        raise OverlapArgumentError(f"--overlap-tp-peak-tflops {peak!r}: expected a positive number")
    moe = getattr(args, "overlap_moe", "off")
    if moe not in MODES:
        raise OverlapArgumentError(f"--overlap-moe {moe!r}: expected one of {MODES}")
    settings = settings_from_args(args)   # reads and checks --overlap-tp-config
    _validate_layer_switches(args, method, settings, note)


    use_layers = method != "off" or getattr(args, "overlap_tp_layers", False)
    if moe != "off":
        _validate_moe(args, moe, settings.moe, note)
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
        recipe = getattr(getattr(args, "fp8_recipe", "delayed"), "value", getattr(args, "fp8_recipe", "delayed"))
        if args.fp8 not in ("e4m3", "hybrid") or recipe not in ("tensorwise", "blockwise"):
            raise OverlapArgumentError(
                f"{flag} with --fp8-format {args.fp8} --fp8-recipe {recipe}: overlap_tp's FP8 layers run "
                f"--fp8-format e4m3 or hybrid with --fp8-recipe tensorwise or blockwise (current scaling; "
                f"docs/fp8.md). Change the recipe, or use {off}.")
        if moe != "off":
            raise OverlapArgumentError(
                f"--overlap-moe {moe} with --fp8-format: the expert ops are bf16 (docs/fp8.md). Use --overlap-moe "
                f"off, or --bf16.")
        if method == "decompose":
            raise OverlapArgumentError(
                "--overlap-tp decompose with --fp8-format: the FP8 ops run the FP8 signaled GEMM (method signal) or "
                "method off; cuBLAS per chunk has no FP8 path. Use --overlap-tp signal or auto.")
        if method == "auto":
            note("--overlap-tp auto with --fp8-format: the FP8 linears run method signal (the tuner times bf16 "
                 "GEMMs); transport and chunking are resolved as for bf16.")
    for name, what in (("yaml_cfg", "--yaml-cfg"),
                       ("heterogeneous_layers_config_path", "--heterogeneous-layers-config-path"),
                       ("experimental_attention_variant", "--experimental-attention-variant")):
        if getattr(args, name, None):
            raise OverlapArgumentError(
                f"{flag} with {what}: that path builds its own layer specs, which overlap_tp does not "
                f"replace yet. Use {off}.")
    if method in ("signal", "decompose") and tp >= 8:
        note(f"--overlap-tp {method} with --tensor-model-parallel-size {tp}: at TP 8 each rank's GEMMs are short "
             "and the layers are host-bound, and the overlapped layers measured slower than with "
             "--overlap-tp off on 8 x H200 (docs/performance.md). Consider --overlap-tp auto (per-shape "
             "choice, off where overlap does not pay) or --overlap-tp off.")
    if getattr(args, "transformer_impl", "local") == "transformer_engine":
        note(f"{flag} with --transformer-impl transformer_engine: overlap_tp's layer spec takes "
             "precedence over it where TP communication happens. qkv/proj/fc1/fc2 become overlap_tp "
             "modules and the norms in front of them separate OverlapRMSNorm modules (TE's fused "
             "LayerNorm+Linear is not used); core attention, the q/k layernorms and the final norm are "
             "TE's where Transformer Engine imports, else PyTorch SDPA and OverlapRMSNorm. "
             "Pass --transformer-impl local to silence this.")
    return given


def _validate_layer_switches(args, method, settings, note):
    """The layer switches on, against the run: those the config file turns on are refused where they cannot run
    (LAYER_RULES turn the others on only where they can)."""
    where = "--overlap-tp-config"
    source = getattr(args, "overlap_tp_config", None)
    explicit = read_config_file(source).get("layers", {}) if source is not None else {}
    ag = settings.ag_gemm
    if settings.gather_in_place:
        if ag.method not in ("signal", "decompose", "auto") or ag.transport == "nccl":
            raise OverlapArgumentError(
                f"{where} layers.gather_in_place with ag_gemm method {ag.method!r}, transport {ag.transport!r}: the "
                "norms write into the AllGathers' own peer-to-peer buffers, which --overlap-tp signal, decompose or "
                "auto on the p2p transport uses. Change those, or drop layers.gather_in_place.")
        if method == "auto" and "gather_in_place" in explicit:
            note("gathering in place with --overlap-tp auto: linear_qkv and linear_fc1 gather in place where the "
                 "tuner picks signal or decompose on p2p for their AllGather, and through the shared buffer where "
                 "it picks another path")
        if not settings.fused_norms:
            raise OverlapArgumentError(
                f"{where} layers.gather_in_place with layers.fused_norms false: gathering in place is wired by "
                "overlap_tp's layer (OverlapTransformerLayer), which fused_norms false replaces with Megatron's. "
                "Drop one.")
    if settings.defer_wgrad:
        if not settings.gather_in_place:
            raise OverlapArgumentError(
                f"{where} layers.defer_wgrad without gathering in place: linear_fc1's deferred weight gradient reads "
                "its gathered input from the layer's own buffer, which only gathering in place keeps until the "
                "backward. Set layers.gather_in_place true, or drop layers.defer_wgrad.")
        if not graphs_on(args):
            note("the deferred wgrad without CUDA graphs (--cuda-graph-impl none): linear_fc1's wgrad still runs "
                 "inside linear_proj's backward, with the same gradient, but eagerly, with one hardware queue "
                 "(CUDA_DEVICE_MAX_CONNECTIONS=1), its launch waits behind the AllGather's pulls, so it hides "
                 "nothing; it measured faster under --cuda-graph-impl local only (docs/performance.md)")
    if settings.token_split:
        if method == "off":
            raise OverlapArgumentError(
                f"{where} layers.token_split with --overlap-tp off: the split puts one half's overlapped transfers "
                "beside the other half's compute; with the overlap off there is none. Turn --overlap-tp on, or drop "
                "layers.token_split.")
        if not settings.fused_norms:
            raise OverlapArgumentError(
                f"{where} layers.token_split with layers.fused_norms false: the split is run by overlap_tp's layer "
                "(OverlapTransformerLayer), which fused_norms false replaces with Megatron's. Drop one.")
        if not getattr(args, "sequence_parallel", False):
            raise OverlapArgumentError(
                f"{where} layers.token_split without --sequence-parallel: the split hides the sequence-parallel "
                "AllGathers and ReduceScatters. Add --sequence-parallel, or drop layers.token_split.")
        mbs = getattr(args, "micro_batch_size", None)
        if mbs is not None and mbs % 2:
            raise OverlapArgumentError(
                f"{where} layers.token_split with --micro-batch-size {mbs}: the split runs two halves of the "
                "micro-batch's sequences, so it needs an even micro-batch size (e.g. --micro-batch-size 2 with the "
                "same global batch).")


def _validate_moe(args, moe, expert, note):
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
            f"{flag} with expert tensor parallelism {expert_tp}: the expert ops (all-to-all + grouped GEMM) move "
            "whole tokens between the expert-parallel ranks and run each expert's whole fc1 / fc2 on one rank; an "
            "expert split over an expert-TP group would need an AllGather and a ReduceScatter inside them, which they "
            "do not carry (Megatron's --expert-tensor-parallel-size defaults to --tensor-model-parallel-size). Add "
            "--expert-tensor-parallel-size 1 (spread the experts with --expert-model-parallel-size instead), or use "
            "--overlap-moe off (Megatron's MoE layer, between overlap_tp's dense layers).")
    if getattr(args, "add_bias_linear", False):
        raise OverlapArgumentError(
            f"{flag} with expert biases: the grouped expert GEMMs have none. Add --disable-bias-linear, or use "
            "--overlap-moe off.")
    if getattr(args, "moe_shared_expert_overlap", False):
        note(f"{flag} with --moe-shared-expert-overlap: that overlap runs the shared experts inside Megatron's token "
             "dispatcher, which overlap_tp's MoE layer replaces. The shared experts run before routing, as Megatron's "
             "MoELayer runs them without the flag, on overlap_tp's dense linears (their AllGather and ReduceScatter "
             "overlapped with their own GEMMs), and the dispatch / combine all-to-alls are overlapped with the routed "
             "experts' GEMMs (docs/moe_layer.md); running with --moe-shared-expert-overlap off.")
        args.moe_shared_expert_overlap = False
    for name, what in (("overlap_moe_expert_parallel_comm", "--overlap-moe-expert-parallel-comm"),):
        if getattr(args, name, False):
            raise OverlapArgumentError(
                f"{flag} with {what}: that overlap runs inside Megatron's token dispatcher, which overlap_tp's "
                f"MoE layer replaces (shared experts then run before routing, as in Megatron's MoELayer). "
                f"Drop {what}, or use --overlap-moe off.")
    expert = fill_defaults(expert, "a2a_gemm", "cuda", 1)   # the expert ops' config as they will resolve it
    if moe in ("signal", "auto") and expert.comm_sms == 0 and expert.transport == "nccl":   # auto tries signal
        raise OverlapArgumentError(
            f"{flag} with expert.comm_sms 0 on the nccl transport (--overlap-tp-config): a2a_gemm's signaled GEMM "
            "spins on ready flags that NCCL kernels raise, so NCCL needs SMs the GEMM does not hold. Give "
            "expert.comm_sms >= 1, or expert.transport p2p (the copy engines need none).")


def _is_our_spec(spec):
    from overlap_tp.megatron_patches.apply import is_overlap_spec
    return is_overlap_spec(spec)
