"""FP8 forward and dgrad of the overlapped linears: Megatron's `--fp8-format e4m3|hybrid` with `--fp8-recipe
tensorwise|blockwise`, on overlap_tp's FP8 ops (Transformer Engine not needed).

What runs in FP8, with sequence parallelism (the layers refuse FP8 without it):

    column (qkv, fc1)  forward  x [m, h] -quantize e4m3 (in the norm's pass where one feeds it: norm.fp8_rows)->
                                AllGather of x8 and its scales -FP8 GEMM, W8-> [t m, n] bf16
                       dgrad    dY [t m, n] -quantize (grad format)-> FP8 GEMM, W8.T -ReduceScatter of bf16
                                partials-> dX [m, h]
                       wgrad    bf16: dY.T @ AG(x), x re-gathered in bf16 beside the dgrad (as the bf16 layer);
                                in FP8 where asked (below)
    row (proj, fc2)    forward  y [M, k] -quantize e4m3-> FP8 GEMM, W8 -ReduceScatter of bf16 partials-> [M/t, n]
                       dgrad    dZ [M/t, n] -quantize (grad format)-> AllGather of dZ8 and its scales -FP8 GEMM,
                                W8.T-> dY [M, k] bf16
                       wgrad    bf16: the gathered dZ8 dequantized, transposed, @ y (the gathered gradient is
                                reused: no second AllGather); in FP8 where asked (below)

Scalings: tensorwise, one scale per tensor, each rank's shard its own (so no amax collective: the gathered operand
carries t scales); blockwise (DeepSeek-V3's), activations and gradients 1x128, weights 128x128 (kernels/fp8_quant.py).
Formats: forward operands e4m3; gradients e4m3 (recipe `e4m3`) or e5m2 (`hybrid`). Outputs, partial sums and
reductions stay bf16.

The weight gradient runs in bf16 unless OverlapSettings.fp8_wgrad (the config file's layers.fp8_wgrad) asks for FP8
and Megatron's config.fp8_wgrad allows it (`--no-fp8-wgrad` keeps bf16): measured, the FP8 wgrad with its two
quantizing passes runs at about the bf16 GEMM's speed (docs/fp8.md). In FP8 its operands are the gradient and the
input quantized along the tokens it contracts (K-major for wgmma), each read once in bf16 by a transposed quantizer
(quantize_1x128_transposed, 1x128 blocks along the tokens for both under blockwise, as DeepSeek-V3's wgrad, the
gradient in e4m3 there; quantize_tensorwise_transposed), then torch's scaled GEMM (cuBLAS: the wgrad overlaps no
communication, so it needs no signals), rounded to bf16 once and added to main_grad as the bf16 layer's unfused
path does. Blockwise needs the tokens a multiple of 128.

Weights: the weight and its transpose (the dgrad's K-major operand) are quantized in one pass (quantize_128x128 /
quantize_tensorwise with transposed=True), by the layer's Fp8WeightCache: at every call, or once per optimizer step
where the model's caches are kept per step (`keep_fp8_weights_per_step(model)`, then `new_fp8_step(model)` before
each step: overlap_tp's training hook does both). Kept, the two copies hold 2 bytes per weight element beside the
bf16 weight. A forward captured into a CUDA graph quantizes inside the graph (a replay then reads the weights of its
own step) and caches nothing.
"""
import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from overlap_tp.kernels import fp8_quant as Q
from overlap_tp.megatron.linear_functions import save_common, weight_grad
from overlap_tp.ops.ag_gemm import ag_gemm, gather_rows
from overlap_tp.ops.config import OverlapConfig
from overlap_tp.ops.fp8 import scaled_mm
from overlap_tp.ops.gemm_rs import gemm_rs

__all__ = ["Fp8Recipe", "Fp8WeightCache", "dequantize", "fp8_op_config", "fp8_weight_grad", "keep_fp8_weights_per_step",
           "new_fp8_step",
           "quantize_rows", "quantize_weight"]

# Megatron's --fp8-format -> (forward operands' format, gradients' format)
FORMATS = {"e4m3": ("e4m3", "e4m3"), "hybrid": ("e4m3", "e5m2")}
# Megatron's --fp8-recipe -> (activations' and gradients' scaling, weights' scaling)
SCALINGS = {"tensorwise": ("tensorwise", "tensorwise"), "blockwise": ("1x128", "128x128")}


@dataclass(frozen=True)
class Fp8Recipe:
    """How a layer runs FP8: Megatron's format ("e4m3" | "hybrid") and recipe ("tensorwise" | "blockwise"); wgrad:
    the weight gradient in FP8 too, else in bf16."""
    format: str
    recipe: str
    wgrad: bool = False

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"FP8 format {self.format!r}: overlap_tp's layers run --fp8-format e4m3 or hybrid")
        if self.recipe not in SCALINGS:
            raise ValueError(f"FP8 recipe {self.recipe!r}: overlap_tp's layers run current scaling, "
                             "--fp8-recipe tensorwise or blockwise (delayed scaling, MXFP8 and custom recipes are "
                             "Transformer Engine's)")

    @staticmethod
    def of(config, wgrad: bool = False) -> Optional["Fp8Recipe"]:
        """The recipe a Megatron TransformerConfig asks for (config.fp8, config.fp8_recipe), or None (no FP8); the
        wgrad in FP8 where `wgrad` (OverlapSettings.fp8_wgrad) and Megatron's config.fp8_wgrad both say so."""
        fmt = getattr(config, "fp8", None)
        if not fmt:
            return None
        recipe = getattr(config, "fp8_recipe", "delayed")
        return Fp8Recipe(fmt, getattr(recipe, "value", recipe),   # megatron.core.enums.Fp8Recipe: a str enum
                         wgrad and bool(getattr(config, "fp8_wgrad", True)))

    @property
    def forward_format(self) -> str:
        return FORMATS[self.format][0]

    @property
    def grad_format(self) -> str:
        return FORMATS[self.format][1]

    @property
    def wgrad_grad_format(self) -> str:
        """The gradient's format in the FP8 wgrad: the recipe's, except e4m3 under blockwise (cuBLAS's blockwise
        GEMM takes e4m3 operands only; the 1x128 scales keep a gradient's range, as DeepSeek-V3's recipe does)."""
        return "e4m3" if self.recipe == "blockwise" else self.grad_format

    @property
    def row_scaling(self) -> str:
        return SCALINGS[self.recipe][0]


@functools.lru_cache(maxsize=64)
def fp8_op_config(config: OverlapConfig) -> OverlapConfig:
    """The op config an FP8 call runs: the layer's, with method 'auto' (or unset) as 'signal' (the tuner times bf16
    GEMMs, so its choice says nothing of the FP8 ones; ops/fp8.py refuses 'auto' with FP8 operands). Kept per config
    (frozen): a call asks it every step."""
    return dataclasses.replace(config, method="signal") if config.method in (None, "auto") else config


def quantize_rows(x: torch.Tensor, fmt: str, scaling: str) -> Q.ScaledFp8:
    """An activation or gradient [rows, cols] (K-major: its columns are what the GEMM contracts), quantized with
    `scaling` ("tensorwise" | "1x128")."""
    if scaling == "1x128":
        return Q.quantize_1x128(x, fmt)
    return Q.quantize_tensorwise(x, fmt)


def quantize_weight(weight: torch.Tensor, recipe: Fp8Recipe) -> Tuple[Q.ScaledFp8, Q.ScaledFp8]:
    """(W8, W8.T): the weight [n, k] quantized e4m3 with the recipe's weight scaling, and its transpose [k, n] (the
    dgrad's K-major operand, the same scales), in one pass."""
    if recipe.recipe == "blockwise":
        return Q.quantize_128x128(weight, recipe.forward_format, transposed=True)
    return Q.quantize_tensorwise(weight, recipe.forward_format, transposed=True)


def fp8_weight_grad(dy: torch.Tensor, x: torch.Tensor, recipe: Fp8Recipe,
                    dy_t8: Optional[Q.ScaledFp8] = None) -> torch.Tensor:
    """dy.T @ x [n, k] in dy's dtype, from dy [M, n] (recipe.wgrad_grad_format) and x [M, k] (e4m3) each quantized
    along the M tokens it contracts (module docstring). dy_t8: dy.T quantized already (tensorwise: the transposed
    copy the dgrad's quantizer wrote beside its own, quantize_grad)."""
    if recipe.recipe == "blockwise":
        if dy.shape[0] % Q.BLOCK:
            raise ValueError(f"FP8 blockwise wgrad contracts over the tokens in 1x128 blocks: needs the tokens per "
                             f"step (sequence x micro-batch) a multiple of {Q.BLOCK}; got {dy.shape[0]}. Change the "
                             f"shape, or keep the weight gradient in bf16 with --no-fp8-wgrad")
        a = Q.quantize_1x128_transposed(dy, recipe.wgrad_grad_format)
        b = Q.quantize_1x128_transposed(x, recipe.forward_format)
    else:
        a = dy_t8 if dy_t8 is not None else Q.quantize_tensorwise_transposed(dy, recipe.wgrad_grad_format)
        b = Q.quantize_tensorwise_transposed(x, recipe.forward_format)
    out = torch.empty(a.q.shape[0], b.q.shape[0], dtype=dy.dtype, device=dy.device)
    scaled_mm(a, b, out)
    return out


def quantize_grad(dy: torch.Tensor, recipe: Fp8Recipe) -> Tuple[Q.ScaledFp8, Optional[Q.ScaledFp8]]:
    """(dY8 for the dgrad, dY.T8 for an FP8 wgrad or None). Tensorwise with the FP8 wgrad: both from one amax pass and
    one quantizing pass over dy (the same scale and format); otherwise dY8 alone (blockwise's wgrad blocks run along
    the tokens, so fp8_weight_grad quantizes its own copy)."""
    if recipe.wgrad and recipe.recipe == "tensorwise":
        return Q.quantize_tensorwise(dy, recipe.grad_format, transposed=True)
    return quantize_rows(dy, recipe.grad_format, recipe.row_scaling), None


def _wgrad(ctx, weight, dy, x, dy_t8=None):
    """The layer's weight gradient (linear_functions.weight_grad), its product in FP8 where the recipe says so."""
    product = (lambda: fp8_weight_grad(dy, x, ctx.recipe, dy_t8)) if ctx.recipe.wgrad else None
    return weight_grad(ctx, weight, dy, x, product)


def dequantize(x: Q.ScaledFp8, dtype: torch.dtype) -> torch.Tensor:
    """q * ds in `dtype` (through fp32), a gathered operand shard by shard with its own scales."""
    parts = []
    for shard in Q.shards(x):
        q = shard.q.float()
        if shard.scaling == "tensorwise":
            parts.append((q * shard.ds.reshape(())).to(dtype))
        elif shard.scaling == "1x128":
            rows, cols = q.shape
            ds = shard.ds.t().repeat_interleave(Q.BLOCK, dim=1)[:, :cols]   # [rows, cols]
            parts.append((q * ds).to(dtype))
        else:
            raise ValueError(f"dequantize: {shard.scaling!r} is a weight's scaling; activations and gradients are "
                             f"tensorwise or 1x128")
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class Fp8WeightCache:
    """The FP8 copies (W8, W8.T) of one layer's weight. get() quantizes at every call unless `per_step` is set; then
    the copies are kept until invalidate() (the next optimizer step: new_fp8_step), for the same weight tensor and
    recipe. A call under CUDA-graph capture quantizes inside the graph and keeps nothing."""

    def __init__(self):
        self.per_step = False
        self._kept = None   # ((weight's data_ptr, shape, dtype, recipe), (W8, W8.T))

    def get(self, weight: torch.Tensor, recipe: Fp8Recipe) -> Tuple[Q.ScaledFp8, Q.ScaledFp8]:
        capturing = weight.is_cuda and torch.cuda.is_current_stream_capturing()
        key = (weight.data_ptr(), tuple(weight.shape), weight.dtype, recipe)
        if self.per_step and not capturing and self._kept is not None and self._kept[0] == key:
            return self._kept[1]
        pair = quantize_weight(weight.detach(), recipe)
        self._kept = (key, pair) if self.per_step and not capturing else None
        return pair

    def invalidate(self):
        self._kept = None


def _caches(model):
    for chunk in (model if isinstance(model, (list, tuple)) else [model]):
        for module in chunk.modules():
            cache = getattr(module, "fp8_weights", None)
            if isinstance(cache, Fp8WeightCache):
                yield cache


def keep_fp8_weights_per_step(model) -> int:
    """Keep the FP8 weight copies of every FP8 layer of `model` (a module or a list of model chunks) from one
    optimizer step to the next (new_fp8_step must then run before each step); returns how many layers."""
    count = 0
    for cache in _caches(model):
        cache.per_step = True
        cache.invalidate()
        count += 1
    return count


def new_fp8_step(model) -> None:
    """The weights are about to change (an optimizer step): drop every kept FP8 weight copy of `model`."""
    for cache in _caches(model):
        cache.invalidate()


# ---------------------------------------------------------------------------------------------------
# Autograd Functions (sequence parallel)
# ---------------------------------------------------------------------------------------------------

def _kept(q, ds, scaling) -> Q.ScaledFp8:
    return Q.ScaledFp8(q, ds, scaling)


def _forward(ctx, op: str, run, a, weight, bias, args, recipe: Fp8Recipe, cache: Fp8WeightCache,
             a8: Optional[Q.ScaledFp8] = None):
    """Both linears' forward: the op `run` (ag_gemm or gemm_rs, of kind `op`) on `a` quantized by rows (or on `a8`,
    a's rows quantized already: the norm's FP8 copy) and the layer's W8, with what the backward needs kept on ctx
    (W8.T among it)."""
    w8, wt8 = cache.get(weight, recipe)
    if a8 is None:
        a8 = quantize_rows(a, recipe.forward_format, recipe.row_scaling)
    config = fp8_op_config(args.config(op))
    out = args.observe(op, lambda: run(a8, w8, args.group, bias=bias, config=config, instance=args.instance),
                       a, weight)
    save_common(ctx, weight, bias, args)
    ctx.recipe, ctx.wt_scaling = recipe, wt8.scaling
    ctx.save_for_backward(a, weight, wt8.q, wt8.ds)
    return out


class Fp8ColumnParallelFn(torch.autograd.Function):
    """y = AG(x) @ W.T + b in FP8 (module docstring); x [m, K] this rank's rows, W [N/t, K]."""

    @staticmethod
    def forward(ctx, x, weight, bias, args, recipe: Fp8Recipe, cache: Fp8WeightCache,
                x8: Optional[Q.ScaledFp8] = None):
        """args: the layer's linear_functions._LinearArgs (group, configs, plan instance, observer); cache: the
        layer's Fp8WeightCache; x8: x's rows quantized already (recipe.forward_format, recipe.row_scaling: the
        norm's FP8 copy, norm.fp8_rows), else x is quantized here."""
        return _forward(ctx, "ag_gemm", ag_gemm, x, weight, bias, args, recipe, cache, x8)

    @staticmethod
    def backward(ctx, dy):
        x, weight, wt_q, wt_ds = ctx.saved_tensors
        args, recipe = ctx.args, ctx.recipe
        dy = dy.contiguous()
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gathering = gather_rows(x, args.group, args.config("ag_gemm")) if need_dw else None
        reducing = dy_t8 = None
        if need_dx:
            dy8, dy_t8 = quantize_grad(dy, recipe)
            reducing = gemm_rs(dy8, _kept(wt_q, wt_ds, ctx.wt_scaling), args.group,
                               config=fp8_op_config(args.config("gemm_rs")),
                               async_op=True, instance=args.instance)
        dw = _wgrad(ctx, weight, dy, gathering.wait(), dy_t8) if need_dw else None
        dx = reducing.wait() if reducing is not None else None
        db = dy.sum(dim=0) if ctx.use_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None, None


class Fp8RowParallelFn(torch.autograd.Function):
    """z = RS(y @ W.T) + b in FP8 (module docstring); y [M, K/t], W [N, K/t]."""

    @staticmethod
    def forward(ctx, y, weight, bias, args, recipe: Fp8Recipe, cache: Fp8WeightCache):
        return _forward(ctx, "gemm_rs", gemm_rs, y, weight, bias, args, recipe, cache)

    @staticmethod
    def backward(ctx, dz):
        y, weight, wt_q, wt_ds = ctx.saved_tensors
        args, recipe = ctx.args, ctx.recipe
        dz = dz.contiguous()
        need_dy, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy = dw = None
        if need_dy or need_dw:
            dz8 = quantize_rows(dz, recipe.grad_format, recipe.row_scaling)
            config = fp8_op_config(args.config("ag_gemm"))
            if need_dy:
                dy, dz8_full = args.observe("ag_gemm", lambda: ag_gemm(
                    dz8, _kept(wt_q, wt_ds, ctx.wt_scaling), args.group, config=config, return_gathered=True,
                    instance=args.instance), dz, weight)
            else:
                dz8_full = None
            if need_dw:
                dz_full = (dequantize(dz8_full, dz.dtype) if dz8_full is not None
                           else gather_rows(dz, args.group, config).wait())
                dw = _wgrad(ctx, weight, dz_full, y)
        # this rank's rows only; the bias carries sequence_parallel=True, so Megatron's finalize_model_grads
        # all-reduces it over the TP group (as for the bf16 layer)
        db = dz.sum(dim=0) if ctx.use_bias and ctx.needs_input_grad[2] else None
        return dy, dw, db, None, None, None
