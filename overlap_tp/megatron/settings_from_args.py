"""The flags' OverlapSettings: `settings_from_args(args)`, what `megatron_patches.apply` carries to the layers.

    --overlap-tp MODE     every dense op kind's method (off, auto, signal, decompose); the resolver
                          (overlap_tp/ops/resolve.py) decides the rest of each op per shape, TP size and device
    --overlap-moe MODE    the expert ops' method (off: Megatron's MoE layer)
    --overlap-tp-config   the expert file (config_file.py): per op kind, any OverlapConfig field; the layer switches

The layer switches a file does not set are decided here, from the run (LAYER_RULES): that is what `auto` (and an
explicit method) decides beyond the ops.
"""
import dataclasses

from overlap_tp.megatron.config_file import read_config_file
from overlap_tp.megatron.settings import OP_KINDS, OverlapSettings
from overlap_tp.ops.config import OverlapConfig

# The layer switches where the config file leaves them out, and the measurements behind them (docs/performance.md):
#   gather_in_place  on wherever the layers overlap on the p2p AllGather the resolver picks (signal and decompose on
#                    CUDA; auto where the tuner picks them), with overlap_tp's fused layer and nothing that keeps
#                    several micro-batches' gathered inputs alive (recomputation, pipeline parallelism, offloading):
#                    the llama3 recipes' choice (benchmarks/e2e-tp2_h200x2_2026-11-28.md).
#   defer_wgrad      with gathering in place, at TP >= 4 under CUDA graphs (--cuda-graph-impl): faster per layer and
#                    end to end there, a tie at TP 2, nothing hidden eagerly.
#   token_split      off: measured slower (docs/performance.md, The token split); the config file turns it on.
#   fused_norms      on: the fused bias-dropout-add + norm; off only as an A/B (the config file).
#   fp8_wgrad        off: the FP8 wgrad with its two transposed quantizers measured 1.03x (tensorwise) and 0.92x
#                    (blockwise) the bf16 GEMM on the 8B layer's wgrads at TP 2 (benchmarks/fp8-gemm_h100x1_2026-12-07.md);
#                    the config file turns it on.
LAYER_RULES = ("gather_in_place", "defer_wgrad", "token_split", "fused_norms", "fp8_wgrad")


def graphs_on(args) -> bool:
    """Whether the run captures CUDA graphs (Megatron's --cuda-graph-impl, or its older graph flags)."""
    return (str(getattr(args, "cuda_graph_impl", "none") or "none") != "none"
            or getattr(args, "enable_cuda_graph", False) or getattr(args, "external_cuda_graph", False))


def _keeps_inputs_alive_reason(args):
    """Why gathering in place cannot run in this run (None: it can)."""
    if getattr(args, "recompute_granularity", None) is not None:
        return "activations are recomputed"
    if (getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1:
        return "pipeline parallelism keeps several micro-batches' gathered inputs alive"
    if getattr(args, "cpu_offloading", False) or getattr(args, "fine_grained_activation_offloading", False):
        return "activations are offloaded to the CPU"
    return None


def settings_from_args(args) -> OverlapSettings:
    """The OverlapSettings of these arguments: the dense configs from --overlap-tp and the file, the expert ops'
    from --overlap-moe and the file (None with --overlap-moe off), the layer switches from the file, else LAYER_RULES.
    Reads only attributes that exist on `args` (a plain namespace works)."""
    method = getattr(args, "overlap_tp", "off") or "off"
    moe = getattr(args, "overlap_moe", "off") or "off"
    source = getattr(args, "overlap_tp_config", None)
    content = read_config_file(source) if source is not None else {}
    configs = {op: OverlapConfig(**{"method": method, **content.get(op, {})}) for op in OP_KINDS}
    moe_config = None if moe == "off" else OverlapConfig(**{"method": moe, **content.get("expert", {})})
    layers = content.get("layers", {})
    fused_norms = layers.get("fused_norms", True)
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    overlapped = configs["ag_gemm"].method != "off"
    in_place = layers.get("gather_in_place")
    if in_place is None:
        in_place = (overlapped and tp > 1 and fused_norms and getattr(args, "sequence_parallel", False)
                    and configs["ag_gemm"].transport in (None, "p2p") and _keeps_inputs_alive_reason(args) is None)
    defer = layers.get("defer_wgrad")
    if defer is None:
        defer = in_place and tp >= 4 and graphs_on(args)
    return dataclasses.replace(OverlapSettings(**configs), moe=moe_config, fused_norms=fused_norms,
                               gather_in_place=in_place, defer_wgrad=defer,
                               token_split=layers.get("token_split", False),
                               fp8_wgrad=layers.get("fp8_wgrad", False))
