"""Layer benchmark: one Llama TransformerLayer, forward + backward, on overlap_tp's spec against Megatron's
own linears and against the same layer with no TP communication at all.

    torchrun --nproc-per-node 2 -m overlap_tp.bench layer --out OUT_DIR
    TRITON_INTERPRET=1 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --tiny --out /tmp/layer   # CPU, gloo

Shapes (BENCHMARKS.md): Llama-3-8B (h 4096, 32 heads, 8 KV heads, FFN 14336) and Llama-3-70B (h 8192, 64
heads, 8 KV heads, FFN 28672), `smoke` (recipes/smoke.sh's layer: h 1024, 16 heads, 4 KV heads, FFN 2816;
run it with --seq 2048 --micro-batch 2) and `mid` (BENCHMARKS.md's mid-size model: h 3072, 24 heads, 8 KV heads,
FFN 8192, --seq 4096; under NCCL_P2P_DISABLE=1 with the NCCL transports only: the high-communication proxy);
s = 8192, micro-batch 1, TP = the process count (2), sequence parallel
(at TP 1, one process: no sequence parallelism, no communication: what our layers compute against Megatron's), bf16, SwiGLU, RMSNorm, no biases, RoPE, no dropout, Megatron's bias-SwiGLU and bias-dropout-add fusions on
(as in training), gradient_accumulation_fusion off (Megatron's needs Apex). Configurations, all in one
process on the same inputs and the same weights:

  megatron      get_gpt_layer_megatron_reference_spec: Megatron's TransformerLayer and
                ColumnParallelLinear / RowParallelLinear (its SP path: all-gather / reduce-scatter through
                NCCL, sequential); norms and core attention are the same modules as ours
  nocomm        the same Megatron layer inside reference_spec.no_tp_communication(): every TP collective
                replaced by a local op of the same output shape (the no-communication counterfactual;
                a count of torch.distributed calls during its check step must be 0)
  off           get_gpt_layer_overlap_spec (OverlapTransformerLayer, fused bda + pre-MLP norm), method off
  signal        the same, method signal with the default OverlapConfig (NCCL per-group collectives,
                comm_sms 16; `--overlap-tp signal` with every op on nccl in the config file)
  decompose     the same, method decompose (chunks 4)
  signal-agp2p  signal with ag_gemm on the copy-engine p2p transport (comm_sms 0), gemm_rs on NCCL
  signal-p2p    signal with ag_gemm and gemm_rs both on the p2p transports (comm_sms 0; what
                `--overlap-tp signal` runs on CUDA: the resolver's default transports)
  decompose-p2p cuBLAS over the same p2p transports: gemm_rs one GEMM per owner's region into its buffer,
                ag_gemm the local rows' GEMM while the copy engines pull the peers' rows in 4 chunks (the
                default; what `--overlap-tp decompose` runs on CUDA)
  auto          (not in the default list) method auto: the tuner's pick per op shape (measures on first use)
  mixed-p2p, signal-p2p-lanes2, signal-p2p-sm16
                (not in the default list) signal-p2p with, in turn: cuBLAS's regions for the ReduceScatters; the
                AllGathers' copy-engine pulls over two streams; the AllGathers' pulls by a kernel on 16 SMs
  signal-p2p-inplace, decompose-p2p-inplace, auto-inplace
                (not in the default list) signal-p2p / decompose-p2p / auto with the layer built under
                OverlapSettings.gather_in_place: the norms write into linear_qkv's and
                linear_fc1's own gathered buffers, no staging copy, no re-gather in the backward (auto: where the
                tuner picks signal or decompose on p2p for their AllGathers)
  signal-p2p-inplace-dw
                (not in the default list) signal-p2p-inplace with OverlapSettings.defer_wgrad:
                linear_fc1's wgrad GEMM runs inside linear_proj's backward, between its dgrad AllGather's start and
                its GEMM (wgrad_handoff.WgradHandoff)
  signal-p2p-byrows-inplace-dw, signal-p2p-rsepilogue-inplace-dw
                (not in the default list) signal-p2p-inplace-dw with, in turn: the AllGathers' pulls cut by rows at
                any t (chunk_by 'rows'); the ReduceScatters' partials stored by the GEMM's epilogue at any t
                (rs_transfer 'epilogue'; signal-p2p pushes them with the copy engines where t > 2)
  signal-p2p-rscopy-inplace
                (not in the default list) signal-p2p-inplace with the partials pushed by the copy engines at any t
                (rs_transfer 'copy'; the epilogue's stores at t = 2 by default)
  mixed-p2p-rscopy-inplace-dw
                (not in the default list) signal-p2p-inplace-dw with the ReduceScatters' GEMMs by cuBLAS, one per
                region into a local staging matrix, each region pushed by the copy engines after its GEMM (method
                'decompose', rs_transfer 'copy')
  te, te-ub     (not in the default list; Transformer Engine installed, --device cuda) Megatron's own TE layer
                (get_gpt_layer_with_transformer_engine_spec: TE's fused RMSNorm+Linear for qkv and fc1, TE's row
                linears, TEDotProductAttention; SP through TE's NCCL collectives), and the same with
                `--tp-comm-overlap`: TE's userbuffers, initialised as Megatron does (initialize_ub, shape
                [s * b, h], bf16, TE's default overlap methods, NCCL bootstrap) with UB_SKIPMC=1 (no NVLink
                multicast). TE's linears overlap only with SP: at t = 1 te-ub runs with userbuffers initialised
                and no linear on them (column 'UB linears' counts those that are; te_baselines.py)
  <any of ours>-fp8
                (not in the default list; TP >= 2) that configuration with the layer's TP linears in FP8
                (docs/fp8.md): Megatron's config.fp8 / fp8_recipe from --fp8 FORMAT/RECIPE (default e4m3/tensorwise),
                fwd, dgrad and wgrad; the weights quantized at every step (a step here is one micro-batch: a run
                of several micro-batches per optimizer step quantizes them once, training/fp8_steps.py). Checked
                against megatron's bf16 layer within --fp8-check-tol (the FP8 rounding of the operands)
  <any of ours>-split, <any of ours>-fp8-split
                (not in the default list; --micro-batch even) that configuration with the layer built under
                OverlapSettings.token_split: the micro-batch's sequences in two halves, run
                interleaved so that one half's transfers run beside the other half's compute

Every configuration except nocomm is checked against `megatron` on the first input set before it is
timed (output, input grad and every parameter grad, max relative error <= --check-tol; the TE layers' fused norm
weights compared as the norms'); every layer that passed is kept. Times: CUDA events around each forward +
backward, inputs rotated over --input-sets sets; the --reps steps of each configuration are spread over --rounds interleaved rounds (each round times every
configuration in turn, --warmup untimed steps and a barrier before each block), so a drift of the machine
during the run falls on all configurations alike; ms is the median of all its steps, the slowest rank's;
"t/megatron per round" gives the range of the ratio over the rounds (the noise of the comparison). Ratios:
t/megatron (the target for signal on the 8B layer: <= 0.95, i.e. >= 5% faster) and t/nocomm (target
<= 1.05). The report (JSON + Markdown, rewritten after every configuration) names the command, git
commit, device, versions and CUDA_DEVICE_MAX_CONNECTIONS (Megatron's training sets it to 1; the recipes too).
"""
import argparse
import contextlib
import functools
import gc
import gzip
import json
import os
import shutil
import tempfile
import traceback
import warnings

import torch
import torch.distributed as dist

from overlap_tp.bench import te_baselines
from overlap_tp.tune import report
from overlap_tp.tune.timing import CapturedCalls, queued_ms, slowest_median, timed_samples
from overlap_tp.ops import symmetric
from overlap_tp.ops.config import OverlapConfig

MODELS = {
    "l8b": dict(hidden=4096, heads=32, groups=8, ffn=14336),
    "l70b": dict(hidden=8192, heads=64, groups=8, ffn=28672),
    "smoke": dict(hidden=1024, heads=16, groups=4, ffn=2816),   # recipes/smoke.sh's layer (--seq 2048 --micro-batch 2)
    # BENCHMARKS.md's mid-size model (run it with --seq 4096): with NCCL slowed (NCCL_P2P_DISABLE=1) and only the NCCL
    # transports (megatron, nocomm, off, signal, decompose), the high-communication proxy of larger TP
    "mid": dict(hidden=3072, heads=24, groups=8, ffn=8192),
    "tiny": dict(hidden=64, heads=4, groups=2, ffn=128),      # --tiny: CPU plumbing
}
DEFAULT_CONFIGS = "megatron,nocomm,off,signal,decompose,signal-agp2p,signal-p2p,decompose-p2p"
CPU_CONFIGS = "megatron,nocomm,off,signal,decompose"
SMALL_TILES = dict(block_m=16, block_n=32, block_k=16)         # Triton's interpreter on the CPU
TARGET_VS_MEGATRON = 0.95
TARGET_VS_NOCOMM = 1.05
GPU_MS_SLACK = 1.02   # a GPU-only (queued) time above this times the span is flagged, not compared


def configurations(device_type):
    """name -> (spec 'ours' | 'megatron', overlap_config for our layers or None, counterfactual?)."""
    tiles = SMALL_TILES if device_type == "cpu" else {}
    signal = OverlapConfig(method="signal", transport="nccl", **tiles)
    p2p = OverlapConfig(method="signal", transport="p2p", comm_sms=0)
    decompose_p2p = OverlapConfig(method="decompose", transport="p2p", comm_sms=0)   # chunks: the flag's default
    p2p_lanes2 = OverlapConfig(method="signal", transport="p2p", comm_sms=0, copy_lanes=2)
    p2p_sm16 = OverlapConfig(method="signal", transport="p2p", comm_sms=16)
    p2p_rows = OverlapConfig(method="signal", transport="p2p", comm_sms=0, chunk_by="rows")
    p2p_epilogue = OverlapConfig(method="signal", transport="p2p", comm_sms=0, rs_transfer="epilogue")
    p2p_copy = OverlapConfig(method="signal", transport="p2p", comm_sms=0, rs_transfer="copy")
    decompose_p2p_copy = OverlapConfig(method="decompose", transport="p2p", comm_sms=0, rs_transfer="copy")
    return {
        "megatron": ("megatron", None, False),
        "nocomm": ("megatron", None, True),
        "te": ("te", None, False),
        "te-ub": ("te-ub", None, False),
        "off": ("ours", OverlapConfig(method="off"), False),
        "signal": ("ours", signal, False),
        "decompose": ("ours", OverlapConfig(method="decompose", transport="nccl", chunks=4), False),
        "signal-agp2p": ("ours", {"ag_gemm": p2p, "gemm_rs": signal, "gemm_ar": signal}, False),
        "signal-p2p": ("ours", {"ag_gemm": p2p, "gemm_rs": p2p, "gemm_ar": signal}, False),
        "decompose-p2p": ("ours", {"ag_gemm": decompose_p2p, "gemm_rs": decompose_p2p, "gemm_ar": signal}, False),
        # per op the GEMM that measured faster over p2p on most s 8192 shapes (docs/performance.md): the signaled one behind
        # the AllGather's per-chunk flags, cuBLAS's regions for the ReduceScatter (no remote stores from Triton)
        "mixed-p2p": ("ours", {"ag_gemm": p2p, "gemm_rs": decompose_p2p, "gemm_ar": signal}, False),
        # signal-p2p with the AllGathers' pulls split over two streams (two copy engines at once, where they scale)
        "signal-p2p-lanes2": ("ours", {"ag_gemm": p2p_lanes2, "gemm_rs": p2p, "gemm_ar": signal}, False),
        # signal-p2p with the AllGathers' pulls by a kernel on 16 SMs (the GEMM behind them on the others)
        "signal-p2p-sm16": ("ours", {"ag_gemm": p2p_sm16, "gemm_rs": p2p, "gemm_ar": signal}, False),
        "auto": ("ours", OverlapConfig(method="auto"), False),
        "signal-p2p-inplace": ("ours", {"ag_gemm": p2p, "gemm_rs": p2p, "gemm_ar": signal}, False),
        "decompose-p2p-inplace": ("ours", {"ag_gemm": decompose_p2p, "gemm_rs": decompose_p2p, "gemm_ar": signal},
                                  False),
        # auto, gathering in place where the tuner picks signal or decompose on p2p for linear_qkv's / linear_fc1's
        # AllGather (OverlapColumnParallelLinear._in_place_config)
        "auto-inplace": ("ours", OverlapConfig(method="auto"), False),
        "signal-p2p-inplace-dw": ("ours", {"ag_gemm": p2p, "gemm_rs": p2p, "gemm_ar": signal}, False),
        # the same with the AllGathers' pulls cut by rows at any t (signal-p2p pulls one peer per chunk where t > 2:
        # chunk_by 'auto')
        "signal-p2p-byrows-inplace-dw": ("ours", {"ag_gemm": p2p_rows, "gemm_rs": p2p, "gemm_ar": signal}, False),
        # the same with the ReduceScatters' partials stored by the GEMM's epilogue at any t (signal-p2p pushes them
        # with the copy engines where t > 2: rs_transfer 'auto')
        "signal-p2p-rsepilogue-inplace-dw": ("ours", {"ag_gemm": p2p, "gemm_rs": p2p_epilogue, "gemm_ar": signal},
                                             False),
        # signal-p2p-inplace with the partials pushed by the copy engines at any t (rs_transfer 'copy')
        "signal-p2p-rscopy-inplace": ("ours", {"ag_gemm": p2p, "gemm_rs": p2p_copy, "gemm_ar": signal}, False),
        # signal-p2p-inplace-dw with cuBLAS's GEMMs per region for the ReduceScatters, each region pushed by the copy
        # engines (beside the copies at t = 4 the signaled GEMM runs slower than cuBLAS: docs/performance.md)
        "mixed-p2p-rscopy-inplace-dw": ("ours", {"ag_gemm": p2p, "gemm_rs": decompose_p2p_copy, "gemm_ar": signal},
                                        False),
    }


IN_PLACE_SUFFIX = "-inplace"   # a configuration whose layer gathers in place (OverlapSettings)
DEFER_WGRAD_SUFFIX = "-inplace-dw"   # ... and defers fc1's wgrad
FP8_SUFFIX = "-fp8"       # after any of ours: the layer's TP linears run FP8 (--fp8)
SPLIT_SUFFIX = "-split"   # after any of ours (or its -fp8): the layer runs the token split (needs --micro-batch 2, 4, ..)


def base_of(name: str) -> str:
    """The configurations() entry a configuration name builds on (without -fp8 and -split)."""
    return name.removesuffix(SPLIT_SUFFIX).removesuffix(FP8_SUFFIX)


def is_fp8(name: str) -> bool:
    return name.removesuffix(SPLIT_SUFFIX).endswith(FP8_SUFFIX)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m overlap_tp.bench layer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="l8b,l70b", help="comma list of " + ",".join(MODELS))
    p.add_argument("--configs", default=None,
                   help=f"comma list, in order (megatron first); default {DEFAULT_CONFIGS} "
                        f"(CPU: {CPU_CONFIGS}); also: auto, and Transformer Engine's layer: te, te-ub "
                        "(--tp-comm-overlap)")
    p.add_argument("--seq", type=int, default=8192, help="sequence length s (the layer sees s/t rows per rank)")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--reps", type=int, default=50, help="timed forward+backward steps (median)")
    p.add_argument("--rounds", type=int, default=5,
                   help="interleaved rounds the --reps steps of every configuration are spread over")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before each configuration's block")
    p.add_argument("--input-sets", type=int, default=3)
    p.add_argument("--check-tol", type=float, default=3e-2,
                   help="max relative error against megatron (output, input grad, parameter grads)")
    p.add_argument("--fp8", default="e4m3/tensorwise", metavar="FORMAT/RECIPE",
                   help="the -fp8 configurations' Megatron --fp8-format (e4m3, hybrid) and --fp8-recipe "
                        "(tensorwise, blockwise)")
    p.add_argument("--fp8-check-tol", type=float, default=0.25,
                   help="--check-tol of the -fp8 configurations (e4m3 operands: about 2**-4 relative per element; "
                        "e5m2 gradients under hybrid: 2**-3)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--fusions", choices=("on", "off"), default=None,
                   help="Megatron's bias-SwiGLU / bias-dropout-add fusions (torch.compile); default on for cuda, "
                        "off for cpu")
    p.add_argument("--tiny", action="store_true",
                   help="CPU plumbing run: --device cpu --models tiny --seq 32 --reps 4 --rounds 2 --warmup 1 --input-sets 2")
    p.add_argument("--out", default="runs/bench", help="folder for the JSON + Markdown report (rank 0)")
    p.add_argument("--name", default="layer", help="report file name (without extension)")
    p.add_argument("--graphs", action="store_true",
                   help="time every configuration (Megatron's layer and the counterfactual too) as replays of a "
                        "CUDA graph holding --input-sets forward+backward steps, captured once per configuration")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after timing each configuration, profile --profile-steps steps (torch.profiler, CPU + "
                        "CUDA) and write DIR/<model>_<config>_rank<r>.json.gz (Chrome trace); with --graphs, one "
                        "replay of the timed graph (--input-sets steps) instead, so the trace is what was timed "
                        "(no launch gaps): DIR/<model>_<config>_graph_rank<r>.json.gz")
    p.add_argument("--profile-steps", type=int, default=3)
    args = p.parse_args(argv)
    if args.tiny:
        args.device, args.models, args.seq, args.reps, args.rounds, args.warmup, args.input_sets = (
            "cpu", "tiny", 32, 4, 2, 1, 2)
    if args.graphs and args.device != "cuda":
        p.error("--graphs needs --device cuda (CUDA graphs)")
    if args.fusions is None:
        args.fusions = "on" if args.device == "cuda" else "off"
    if args.configs is None:
        args.configs = CPU_CONFIGS if args.device == "cpu" else DEFAULT_CONFIGS
    configs = args.configs.split(",")
    ours = {name for name, (kind, _, _) in configurations(args.device).items() if kind == "ours"}
    unknown = {name for name in configs if base_of(name) not in configurations(args.device)
               or (base_of(name) != name and base_of(name) not in ours)}
    if unknown:
        p.error(f"unknown configs {sorted(unknown)}")
    if any(name.endswith(SPLIT_SUFFIX) for name in configs) and args.micro_batch % 2:
        p.error(f"the {SPLIT_SUFFIX} configurations split the micro-batch in two halves: --micro-batch {args.micro_batch} "
                f"must be even")
    fmt, _, recipe = args.fp8.partition("/")
    if fmt not in ("e4m3", "hybrid") or recipe not in ("tensorwise", "blockwise"):
        p.error(f"--fp8 {args.fp8}: expected FORMAT/RECIPE with FORMAT e4m3 or hybrid, RECIPE tensorwise or "
                f"blockwise")
    if configs[0] != "megatron":
        p.error("--configs must start with megatron (the reference every other configuration is checked against)")
    te_configs = [name for name in configs if name in te_baselines.TE_SPECS]
    if te_configs and args.device != "cuda":
        p.error(f"{','.join(te_configs)}: Transformer Engine's layer needs --device cuda")
    if te_configs and (problem := te_baselines.te_problem()):
        p.error(f"{','.join(te_configs)}: {problem}")
    if args.rounds < 1 or args.reps < args.rounds:
        p.error(f"--rounds {args.rounds} with --reps {args.reps}: need 1 <= rounds <= reps")
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        p.error(f"unknown models {sorted(unknown)}")
    return args


# ---------------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------------

def fp8_layer_config(config, fp8: str):
    """config with Megatron's FP8 fields from FORMAT/RECIPE (--fp8)."""
    import dataclasses
    fmt, _, recipe = fp8.partition("/")
    return dataclasses.replace(config, fp8=fmt, fp8_recipe=recipe)


def layer_config(model, tp, device_type, fusions=None):
    from megatron.core.transformer.transformer_config import TransformerConfig
    shape = MODELS[model]
    if fusions is None:
        fusions = device_type == "cuda"   # torch.compile'd fusions: the GPU only
    return TransformerConfig(
        num_layers=1, hidden_size=shape["hidden"], ffn_hidden_size=shape["ffn"], num_attention_heads=shape["heads"],
        num_query_groups=shape["groups"], kv_channels=shape["hidden"] // shape["heads"], normalization="RMSNorm",
        layernorm_epsilon=1e-5, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=fusions,
        bias_dropout_fusion=fusions, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, params_dtype=torch.bfloat16, bf16=True, init_method_std=0.02,
        tensor_model_parallel_size=tp, sequence_parallel=tp > 1, use_cpu_initialization=device_type == "cpu")


def build_layer(spec_kind, config, device, seed=1234, in_place=False, defer_wgrad=False, token_split=False,
                tokens=None):
    """One TransformerLayer from our spec ('ours'), the Megatron reference spec ('megatron') or Megatron's TE spec
    ('te', 'te-ub': with userbuffers for `tokens` rows, te_baselines); in_place: ours, its norms writing into the
    column-parallel linears' own gathered buffers (OverlapSettings.gather_in_place); defer_wgrad: fc1's wgrad inside
    proj's backward (defer_wgrad); token_split: the micro-batch as two interleaved halves (token_split). Ours is built
    with every op kind 'off' (the configuration sets its own: never 'auto' by accident)."""
    from megatron.core.transformer.spec_utils import build_module
    if spec_kind in te_baselines.TE_SPECS:
        if spec_kind == "te-ub":
            te_baselines.initialize_userbuffers(tokens, config.hidden_size, config.tensor_model_parallel_size)
        torch.manual_seed(seed)
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(seed)
        return te_baselines.build_te_layer(spec_kind, config).to(device)
    if spec_kind == "ours":
        from overlap_tp.megatron.layer_spec import get_gpt_layer_overlap_spec
        from overlap_tp.megatron.settings import OverlapSettings
        settings = OverlapSettings(gather_in_place=in_place, defer_wgrad=defer_wgrad,
                                   token_split=token_split).with_configs(OverlapConfig(method="off"))
        spec = get_gpt_layer_overlap_spec(settings=settings)
    else:
        from overlap_tp.bench.reference_spec import get_gpt_layer_megatron_reference_spec
        spec = get_gpt_layer_megatron_reference_spec()
    torch.manual_seed(seed)
    if device.type == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(seed)
    return build_module(spec, config=config, layer_number=1).to(device)


def rotary_embedding(config, seq, device):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    rope = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0, rotary_base=500000,
                           use_cpu_initialization=device.type == "cpu")
    return rope(seq).to(device)


def step(layer, x, g, rope):
    """One forward + backward; returns (output, input grad)."""
    layer.zero_grad(set_to_none=True)
    x.grad = None
    out, _ = layer(x, attention_mask=None, rotary_pos_emb=rope)
    out.backward(g)
    return out, x.grad


def layer_flops(model, seq, micro_batch, tp):
    """Model FLOPs of one layer's forward + backward per GPU (3x the forward; causal attention halves
    the score and context GEMMs)."""
    shape = MODELS[model]
    h, ffn, heads, groups = shape["hidden"], shape["ffn"], shape["heads"], shape["groups"]
    d = h // heads
    tokens = seq * micro_batch
    linears = 2 * tokens * h * (h + 2 * groups * d) + 2 * tokens * h * h + 2 * tokens * h * 2 * ffn + 2 * tokens * ffn * h
    attention = 2 * 2 * micro_batch * seq * seq * h / 2
    return 3 * (linears + attention) / tp


# ---------------------------------------------------------------------------------------------------
# Timing and checks
# ---------------------------------------------------------------------------------------------------

def rel_error(got, ref):
    ref = ref.float()
    return float((got.float() - ref).norm() / max(float(ref.norm()), 1e-30))


def _capture(layer, x, g, rope, rename=str):
    """One step's output, input grad and parameter grads (keyed by rename(parameter name))."""
    out, dx = step(layer, x, g, rope)
    grads = {rename(n): p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach().clone(), dx.detach().clone(), grads


def _max_error(result, reference):
    out, dx, grads = result
    out_ref, dx_ref, grads_ref = reference
    errors = {"output": rel_error(out, out_ref), "input grad": rel_error(dx, dx_ref)}
    missing = set(grads_ref) ^ set(grads)
    if missing:
        raise RuntimeError(f"parameter grads differ in their names: {sorted(missing)}")
    for name, grad in grads.items():
        errors[name] = rel_error(grad, grads_ref[name])
    worst = max(errors, key=errors.get)
    return errors[worst], worst


def profile_steps(run_step, sets, steps, group, path):
    """Chrome trace of `steps` forward + backward steps (after a barrier), gzipped to `path`."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    dist.barrier(group)
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(steps):
            run_step(*sets[i % len(sets)])
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with tempfile.NamedTemporaryFile(suffix=".json") as raw:
        prof.export_chrome_trace(raw.name)
        with open(raw.name, "rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)


def _apply_overlap(layer, overlap):
    from overlap_tp.megatron.layers import set_overlap_config
    if overlap is not None and set_overlap_config(layer, overlap) != 4:
        raise RuntimeError("expected 4 overlapped linears in the layer")


# ---------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------

COLUMNS = [
    ("model", "model", "{}"), ("config", "config", "{}"), ("ms", "ms", "{:.3f}"),
    ("vs_megatron", "t/megatron", "{:.3f}"), ("rounds_vs_megatron", "t/megatron per round", "{}"),
    ("vs_nocomm", "t/nocomm", "{:.3f}"), ("tflops", "TFLOP/s/GPU", "{:.1f}"),
    ("gpu_ms", "GPU ms", "{:.3f}"), ("gpu_vs_megatron", "GPU/megatron", "{:.3f}"), ("gpu_note", "GPU ms note", "{}"),
    ("host_ms", "host ms", "{:.3f}"),
    ("check_err", "check err", "{:.1e}"), ("check_worst", "worst", "{}"), ("same_init", "init = megatron's", "{}"),
    ("collectives", "dist calls", "{}"), ("userbuffers", "UB linears", "{}"),
    ("peak_gib", "peak GiB", "{:.1f}"), ("symmetric_gib", "symmetric GiB", "{:.2f}"), ("error", "error", "{}"),
]


def _versions():
    out = {"CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")}
    try:
        import megatron.core
        out["megatron_core"] = megatron.core.__version__
    except (ImportError, AttributeError):
        out["megatron_core"] = None
    out["transformer_engine"] = te_baselines.te_version()
    out["UB_SKIPMC"] = os.environ.get("UB_SKIPMC")
    return out


def summarize(rows):
    """Per model: signal and the best of ours against megatron and nocomm, and the issue's targets."""
    lines, summary = [], {}
    for model in dict.fromkeys(r["model"] for r in rows):
        timed_rows = {r["config"]: r for r in rows if r["model"] == model and r.get("ms")}
        ours = {k: v for k, v in timed_rows.items() if k not in ("megatron", "nocomm", *te_baselines.TE_SPECS)}
        entry = {}
        if "nocomm" in timed_rows and "megatron" in timed_rows:
            # the best t/megatron that hiding all of Megatron's exposed communication could reach
            entry["nocomm_vs_megatron"] = timed_rows["nocomm"]["vs_megatron"]
        if "signal" in timed_rows and "megatron" in timed_rows:
            entry["signal_vs_megatron"] = timed_rows["signal"]["vs_megatron"]
            entry["target_vs_megatron_met"] = entry["signal_vs_megatron"] <= TARGET_VS_MEGATRON
        if "signal" in timed_rows and "nocomm" in timed_rows:
            entry["signal_vs_nocomm"] = timed_rows["signal"]["vs_nocomm"]
            entry["target_vs_nocomm_met"] = entry["signal_vs_nocomm"] <= TARGET_VS_NOCOMM
        if ours:
            best = min(ours, key=lambda k: ours[k]["ms"])
            entry["best_ours"] = best
            entry["best_ms"] = ours[best]["ms"]
            if "megatron" in timed_rows:
                entry["best_vs_megatron"] = ours[best]["vs_megatron"]
            if "nocomm" in timed_rows:
                entry["best_vs_nocomm"] = ours[best]["vs_nocomm"]
        for te in te_baselines.TE_SPECS:   # Transformer Engine's layer, without and with its userbuffers overlap
            if te in timed_rows and "megatron" in timed_rows:
                entry[f"{te}_vs_megatron"] = timed_rows[te]["vs_megatron"]
            if te in timed_rows and ours:
                entry[f"best_vs_{te}"] = ours[entry["best_ours"]]["ms"] / timed_rows[te]["ms"]
        gpu_ours = {k: v["gpu_vs_megatron"] for k, v in ours.items() if v.get("gpu_vs_megatron")}
        if gpu_ours:   # the same comparison with launch gaps removed (GPU ms): what a faster host would see
            entry["best_gpu_ours"] = min(gpu_ours, key=gpu_ours.get)
            entry["best_gpu_vs_megatron"] = gpu_ours[entry["best_gpu_ours"]]
        summary[model] = entry
        parts = [f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in entry.items()]
        lines.append(f"- {model}: " + ", ".join(parts))
    return summary, lines


def write_report(args, rows, command, group):
    if dist.get_rank(group) != 0:
        return
    summary, lines = summarize(rows)
    settings = dict(_versions(), seq=args.seq, micro_batch=args.micro_batch, tp=dist.get_world_size(group),
                    reps=args.reps, rounds=args.rounds, warmup=args.warmup, input_sets=args.input_sets,
                    check_tol=args.check_tol, fp8=args.fp8, fp8_check_tol=args.fp8_check_tol,
                    device=args.device, megatron_fusions=args.fusions, graphs=args.graphs)
    timing = ("each configuration's --input-sets steps captured once in a CUDA graph, the replays timed"
              if args.graphs else "eager, back-to-back steps")
    notes = (f"Times in ms ({timing}): one TransformerLayer forward + backward, median of reps (spread over interleaved "
             "rounds: every round times every configuration in turn), slowest rank; t/megatron per round: the "
             "ratio's range over the rounds. "
             "t/megatron and t/nocomm: this configuration's time over Megatron's layer and over the "
             f"no-communication counterfactual (targets for signal: <= {TARGET_VS_MEGATRON} and "
             f"<= {TARGET_VS_NOCOMM}); nocomm_vs_megatron in the summary is the floor of t/megatron that hiding all of "
             "Megatron's exposed communication would reach (its backward already overlaps the wgrad all-gather and "
             "the dgrad reduce-scatter). check err: max relative error against megatron over the output, the input "
             "grad and every parameter grad (worst: which); dist calls: torch.distributed collective calls during "
             "the check step (nocomm must show 0; our signal path uses its own NCCL communicator, not counted). "
             "GPU ms: the same step with every launch queued before the GPU starts it (no launch gaps); host ms: "
             "the host's time to enqueue it (tune.timing.queued_ms); ms above GPU ms is time the host set the pace. "
             "GPU/megatron: GPU ms over Megatron's. The queued run is not always the faster one: with several "
             f"streams its GPU ms has exceeded the span; a GPU ms above {GPU_MS_SLACK} x ms is flagged in 'GPU ms "
             "note' and left out of the ratios (and Megatron's flagged leaves every ratio out). peak GiB: torch's "
             "allocator; symmetric GiB: the symmetric memory the configuration allocated, outside it (a shape's "
             "shared buffers count where first built). te, te-ub: Megatron's Transformer Engine layer, without and "
             "with --tp-comm-overlap (userbuffers); UB linears: how many of its linears run a GEMM on userbuffers (0 at "
             "t = 1: TE overlaps only with sequence parallelism); best_vs_te / best_vs_te-ub in the summary: the best "
             "of ours over that layer's time.\n\n"
             "Settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()) + "\n\n" + "\n".join(lines))
    report.write(args.out, args.name, f"One Llama TransformerLayer forward + backward, TP = {settings['tp']}, "
                 f"{'SP' if settings['tp'] > 1 else 'no SP'}, s = {args.seq}", rows, COLUMNS, notes, command=command)
    path = os.path.join(args.out, args.name + ".json")
    with open(path) as f:
        data = json.load(f)
    data["settings"], data["summary"] = settings, summary
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _all_ok(ok, group, device):
    flag = torch.tensor([0.0 if ok else 1.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return float(flag) == 0.0


def _communication(nocomm):
    from overlap_tp.bench.reference_spec import no_tp_communication
    return no_tp_communication() if nocomm else contextlib.nullcontext()


def _prepare(name, table, config, weights, sets, rope, group, device):
    """Build configuration `name`'s layer with `weights` (None: keep its own: megatron's, the first), check it
    on sets[0] (megatron: capture the reference). Returns (row, layer or None, captured result or None)."""
    from overlap_tp.bench.reference_spec import count_collectives
    base, split = base_of(name), name.endswith(SPLIT_SUFFIX)
    spec_kind, overlap, nocomm = table[base]
    row, layer, result = {"config": name}, None, None
    before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    symmetric_before = symmetric.total()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rename = te_baselines.reference_name if spec_kind in te_baselines.TE_SPECS else str
    try:
        x = sets[0][0]
        layer = build_layer(spec_kind, config, device, in_place=base.endswith((IN_PLACE_SUFFIX, DEFER_WGRAD_SUFFIX)),
                            defer_wgrad=base.endswith(DEFER_WGRAD_SUFFIX), token_split=split,
                            tokens=x.shape[0] * x.shape[1] * dist.get_world_size(group))
        if split and not layer.token_split:
            raise RuntimeError("the layer does not split (a warning said why)")
        if spec_kind in te_baselines.TE_SPECS:
            row["userbuffers"] = te_baselines.active_userbuffers(layer)
        if weights is not None:
            params = {rename(n): p for n, p in layer.named_parameters()}
            if sorted(params) != sorted(weights):
                raise RuntimeError(f"parameter names differ from megatron's: {sorted(set(params) ^ set(weights))}")
            row["same_init"] = all(torch.equal(params[n], w) for n, w in weights.items())
            with torch.no_grad():
                for n, w in weights.items():
                    params[n].copy_(w)
        _apply_overlap(layer, overlap)
        with count_collectives() as counts, _communication(nocomm):
            result = _capture(layer, *sets[0], rope, rename)
        row["collectives"] = sum(counts.values())
        if nocomm and row["collectives"]:
            raise RuntimeError(f"the counterfactual still communicates: {counts}")
    except Exception as error:   # one configuration's failure must not lose the others' results
        traceback.print_exc()
        row["error"] = f"{type(error).__name__}: {error}"[:300]
    if device.type == "cuda":   # this configuration's own peak, above what the others already hold
        peak = torch.tensor((torch.cuda.max_memory_allocated() - before) / 2 ** 30, device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        row["peak_gib"] = float(peak)
    # symmetric memory is outside torch's allocator (not in peak GiB); a shape's shared buffers count where first built
    row["symmetric_gib"] = (symmetric.total() - symmetric_before) / 2 ** 30
    return row, layer, result


def bench_model(model, args, group, device, rows, command):
    """One model: every configuration built and checked against megatron's (all layers kept), then timed
    in interleaved rounds (each round times every configuration in turn, so a drift of the machine over the
    run falls on all of them alike), then the queued GPU-only time and the optional profile per configuration."""
    t = dist.get_world_size(group)
    if args.seq % t:
        raise ValueError(f"--seq {args.seq} is not divisible by the TP size {t}")
    config = layer_config(model, t, device.type, args.fusions == "on")
    hidden = config.hidden_size
    rope = rotary_embedding(config, args.seq, device)
    gen = torch.Generator(device=device).manual_seed(4321 + dist.get_rank(group))
    sets = []
    for _ in range(args.input_sets):
        x = torch.randn(args.seq // t, args.micro_batch, hidden, device=device, generator=gen).to(torch.bfloat16)
        g = torch.randn(args.seq // t, args.micro_batch, hidden, device=device, generator=gen).to(torch.bfloat16)
        sets.append((x.requires_grad_(True), g))
    table = configurations(device.type)
    model_rows, ready, reference, weights = {}, {}, None, None

    def report_row(row):
        if dist.get_rank(group) == 0:
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        write_report(args, rows, command, group)

    # 1. Build and check every configuration; keep the layers that passed on every rank.
    for name in args.configs.split(","):
        row, layer, result = _prepare(name, table, fp8_layer_config(config, args.fp8) if is_fp8(name) else config,
                                      weights, sets, rope, group, device)
        row = {"model": model, **row}
        if name == "megatron" and result is not None:
            reference = result
            weights = {n: p.detach().clone() for n, p in layer.named_parameters()}
        elif result is not None and not table[base_of(name)][2]:
            row["check_err"], row["check_worst"] = _max_error(result, reference)
            tol = args.fp8_check_tol if is_fp8(name) else args.check_tol
            if not row["check_err"] <= tol:
                row["error"] = f"check failed: {row['check_worst']} {row['check_err']:.3g} > {tol}"
        del result
        if _all_ok("error" not in row, group, device):
            ready[name] = functools.partial(step, layer, rope=rope)
        else:
            row.setdefault("error", "failed on another rank")
            del layer
            _free(device)
        model_rows[name] = row
        rows.append(row)
        report_row(row)
        if name == "megatron" and "megatron" not in ready:
            if dist.get_rank(group) == 0:
                print(f"{model}: the megatron reference failed; skipping this model", flush=True)
            return
    del reference, weights

    # 2. Interleaved rounds: every configuration's reps are spread over args.rounds rounds. With --graphs each
    # configuration is captured once (its communication context applies at capture; replays run no Python).
    captured = {}

    def attempt(name, what, fn):
        """fn() for configuration `name`; on a failure on any rank the configuration is dropped (named in its
        row) and None returned, on every rank alike."""
        result, ok = None, True
        try:
            result = fn()
        except Exception as error:   # one configuration's failure must not lose the others' results
            traceback.print_exc()
            model_rows[name]["error"] = f"{what}{type(error).__name__}: {error}"[:300]
            ok = False
        if not _all_ok(ok, group, device):
            model_rows[name].setdefault("error", f"{what}failed on another rank")
            del ready[name]
            captured.pop(name, None)
            return None
        return result

    def capture(name):
        with _communication(table[base_of(name)][2]):
            return CapturedCalls(ready[name], sets, warmup=args.warmup)

    def timed_round(name):
        if args.graphs:
            return captured[name].samples(per_round, group)
        with _communication(table[base_of(name)][2]):
            return timed_samples(ready[name], sets, per_round, group, warmup=args.warmup, device=device)

    if args.graphs:
        for name in list(ready):
            got = attempt(name, "capture: ", functools.partial(capture, name))
            if got is not None:
                captured[name] = got
        if "megatron" not in ready:
            return
    per_round = max(1, -(-args.reps // args.rounds))
    samples = {name: [] for name in ready}
    round_ms = {name: [] for name in ready}
    for _ in range(args.rounds):
        for name in list(ready):
            got = attempt(name, "", functools.partial(timed_round, name))
            if got is None:
                del samples[name], round_ms[name]
                continue
            samples[name] += got
            round_ms[name].append(slowest_median(got, group, device))
        if "megatron" not in ready:
            break

    if args.graphs and args.profile:   # one replay of each timed graph: the GPU timeline that was timed
        for name in list(captured):
            path = os.path.join(args.profile, f"{model}_{name}_graph_rank{dist.get_rank(group)}.json.gz")
            try:   # a failed profile costs its trace, never the configuration's timing
                profile_steps(lambda *_, graph=captured[name].graph: graph.replay(), sets, 1, group, path)
            except Exception as error:
                traceback.print_exc()
                model_rows[name]["profile_error"] = f"{type(error).__name__}: {error}"[:200]
    captured.clear()   # the graphs' memory pools, before the eager measurements below
    _free(device)

    # 3. Per configuration: the times and ratios, the queued GPU-only time, the profile.
    flops = layer_flops(model, args.seq, args.micro_batch, t)
    for name in ready:
        model_rows[name]["ms"] = slowest_median(samples[name], group, device)
        model_rows[name]["round_ms"] = round_ms[name]   # the JSON keeps each round's median (slowest rank)
    for name in ready:
        row = model_rows[name]
        row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
        for base in ("megatron", "nocomm"):
            if base in ready:
                row[f"vs_{base}"] = row["ms"] / model_rows[base]["ms"]
        if "megatron" in ready and name != "megatron":
            ratios = [a / b for a, b in zip(round_ms[name], round_ms["megatron"])]
            row["rounds_vs_megatron"] = f"{min(ratios):.3f}-{max(ratios):.3f}"
    for name in ready:
        row = model_rows[name]
        try:
            with _communication(table[base_of(name)][2]):
                if device.type == "cuda":
                    row["host_ms"], row["gpu_ms"] = queued_ms(ready[name], sets, group)
                if args.profile and not args.graphs:
                    profile_steps(ready[name], sets, args.profile_steps, group,
                                  os.path.join(args.profile, f"{model}_{name}_rank{dist.get_rank(group)}.json.gz"))
        except Exception as error:
            traceback.print_exc()
            row["error"] = f"{type(error).__name__}: {error}"[:300]
        if row.get("gpu_ms") and row["gpu_ms"] > GPU_MS_SLACK * row["ms"]:
            # A time without launch gaps cannot exceed the back-to-back span: the queued run went
            # slower than the normal one (it happens), so it bounds nothing.
            row["gpu_note"] = "GPU ms > span: not compared"
        elif row.get("gpu_ms") and model_rows["megatron"].get("gpu_ms") and "gpu_note" not in model_rows["megatron"]:
            row["gpu_vs_megatron"] = row["gpu_ms"] / model_rows["megatron"]["gpu_ms"]
        report_row(row)
    ready.clear()
    sets.clear()
    _free(device)


def run(args, group=None, command=None):
    """The benchmark on an initialized process group (one rank per GPU, or gloo on the CPU). Returns the
    rows (every rank)."""
    from megatron.core import parallel_state as ps
    warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*")
    group = group or dist.group.WORLD
    world = dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    command = command or f"torchrun --nproc-per-node {world} -m overlap_tp.bench layer"
    rows = []
    from overlap_tp.bench.reference_spec import megatron_sp_on_cpu
    try:
        with megatron_sp_on_cpu(device.type == "cpu"):
            for model in args.models.split(","):
                bench_model(model, args, ps.get_tensor_model_parallel_group(), device, rows, command)
    finally:
        te_baselines.release_userbuffers()
        ps.destroy_model_parallel()
    if dist.get_rank() == 0:
        print(report.markdown_table(rows, COLUMNS))
        for line in summarize(rows)[1]:
            print(line)
    return rows


def main(argv):
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("run under torchrun: torchrun --nproc-per-node 2 -m overlap_tp.bench layer ...")
        return 2
    command = "torchrun --nproc-per-node %s -m overlap_tp.bench layer %s" % (
        os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "?")), " ".join(argv))
    if args.device == "cuda":
        rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    else:
        if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
            print("--device cpu runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1 (before Python "
                  "starts; overlap_tp imports its kernels at import)")
            return 2
        dist.init_process_group("gloo")
    try:
        run(args, command=command)
    finally:
        dist.destroy_process_group()
    return 0
