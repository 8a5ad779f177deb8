"""Megatron's tensor-parallel linear layers on the overlapped ops (docs/layers.md).

    OverlapColumnParallelLinear   drop-in for megatron.core.tensor_parallel.ColumnParallelLinear
    OverlapRowParallelLinear      drop-in for megatron.core.tensor_parallel.RowParallelLinear

Same constructor keywords, parameters (names, shapes, initialisation through Megatron's own
helpers, so equal weights for the same seed), tensor-parallel attributes, `sharded_state_dict` and
`forward(x[s, b, h]) -> (out, bias_or_None)` as Megatron's. What runs (DESIGN.md section 2):

    column, sequence parallel:  fwd ag_gemm            dgrad gemm_rs(dY, W.T)   wgrad dY.T @ AG(X) (re-gathered beside
                                                                                  the dgrad: copy engines with p2p)
    column, no SP:              fwd local GEMM          dgrad gemm_ar(dY, W.T)   wgrad dY.T @ X
    row, sequence parallel:     fwd gemm_rs             dgrad ag_gemm(dZ, W.T)   wgrad AG(dZ).T @ Y (the gathered dZ reused)
    row, no SP:                 fwd gemm_ar             dgrad local GEMM         wgrad dZ.T @ Y

Which method each op runs comes from an `OverlapConfig` per op kind ("ag_gemm", "gemm_rs", "gemm_ar"):
the layer's `overlap_config` attribute (constructor keyword; one OverlapConfig for every op kind, or a
dict by op kind) or, where it is None or names no config for the op kind, the module default set with
`set_default_overlap_config`. Both are read at every call, so a training integration may set them after
the model is built (`set_overlap_config(model, ...)` sets every layer of a model).
"""
import contextlib
import math
import warnings
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch.nn.parameter import Parameter

try:
    from megatron.core.tensor_parallel.layers import (
        _initialize_affine_weight_cpu,
        _initialize_affine_weight_gpu,
        set_tensor_model_parallel_attributes,
    )
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
    from megatron.core.utils import divide, get_pg_rank, get_pg_size, get_tensor_model_parallel_group_if_none
except ImportError as error:  # pragma: no cover - exercised only without megatron-core
    raise ImportError("overlap_tp.megatron.layers needs megatron-core (pip install 'overlap_tp[megatron]' or "
                      "'megatron-core>=0.16')") from error

from overlap_tp.kernels.fused_add_rmsnorm import accept_deferred_grad
from overlap_tp.ops.config import OverlapConfig, resolve_auto
from overlap_tp.ops.ag_gemm import OwnGather, ag_gemm, ag_gemm_plan, gather_rows
from overlap_tp.ops.gemm_ar import gemm_ar
from overlap_tp.ops.gemm_rs import gemm_rs

try:
    import fused_weight_gradient_mlp_cuda  # apex: Megatron's fused fp32 wgrad accumulation
except ImportError:
    fused_weight_gradient_mlp_cuda = None

__all__ = ["OP_KINDS", "OverlapColumnParallelLinear", "OverlapRowParallelLinear", "get_default_overlap_config",
           "defer_wgrad_default", "deferring_wgrad", "gather_in_place_default", "gathering_in_place",
           "plan_instance", "set_default_overlap_config", "set_defer_wgrad", "set_gather_in_place",
           "set_op_observer", "set_overlap_config", "WgradHandoff"]

OP_KINDS = ("ag_gemm", "gemm_rs", "gemm_ar")
LayerOverlapConfig = Union[None, OverlapConfig, Mapping[str, OverlapConfig]]

_default_configs: Dict[str, OverlapConfig] = {op: OverlapConfig() for op in OP_KINDS}


def _check_overlap_config(value: LayerOverlapConfig) -> LayerOverlapConfig:
    if value is None or isinstance(value, OverlapConfig):
        return value
    if isinstance(value, Mapping):
        unknown = set(value) - set(OP_KINDS)
        if unknown:
            raise ValueError(f"overlap_config: unknown op kinds {sorted(unknown)}; expected keys from {OP_KINDS}")
        for op, config in value.items():
            if config is not None and not isinstance(config, OverlapConfig):
                raise TypeError(f"overlap_config[{op!r}] must be an OverlapConfig, got {type(config).__name__}")
        return dict(value)
    raise TypeError(f"overlap_config must be None, an OverlapConfig or a dict by op kind {OP_KINDS}; "
                    f"got {type(value).__name__}")


def set_default_overlap_config(config: Optional[OverlapConfig] = None, **per_op: OverlapConfig):
    """The configs layers use where their own `overlap_config` names none: `config` for every op kind,
    then the keywords (ag_gemm=, gemm_rs=, gemm_ar=) for single op kinds."""
    per_op = _check_overlap_config(per_op) or {}
    if config is not None:
        _check_overlap_config(config)
        for op in OP_KINDS:
            _default_configs[op] = config
    for op, value in per_op.items():
        if value is not None:
            _default_configs[op] = value


def get_default_overlap_config(op: str) -> OverlapConfig:
    if op not in OP_KINDS:
        raise ValueError(f"unknown op kind {op!r}; expected one of {OP_KINDS}")
    return _default_configs[op]


_gather_in_place = [False]


def set_gather_in_place(on: bool):
    """Whether OverlapTransformerLayers built from now on have their norms write straight into linear_qkv's and a
    dense linear_fc1's own gathered buffers (OverlapColumnParallelLinear.gather_in_place; `--overlap-tp-gather-in-place`)."""
    _gather_in_place[0] = bool(on)


def gather_in_place_default() -> bool:
    return _gather_in_place[0]


@contextlib.contextmanager
def _switched(setting: list, on: bool):
    """setting[0] = on for the layers built inside the block; the previous value is back after it."""
    previous = setting[0]
    setting[0] = bool(on)
    try:
        yield
    finally:
        setting[0] = previous


def gathering_in_place(on: bool = True):
    """set_gather_in_place(on) for the layers built inside the block; the previous setting is back after it."""
    return _switched(_gather_in_place, on)


_defer_wgrad = [False]


def set_defer_wgrad(on: bool):
    """Whether OverlapTransformerLayers built from now on leave linear_fc1's weight gradient to linear_proj's backward,
    to run while proj's dgrad AllGather pulls (WgradHandoff; `--overlap-tp-defer-wgrad`). Takes effect with gathering
    in place (set_gather_in_place), where fc1's gathered input stays in its own buffer until the backward."""
    _defer_wgrad[0] = bool(on)


def defer_wgrad_default() -> bool:
    return _defer_wgrad[0]


def deferring_wgrad(on: bool = True):
    """set_defer_wgrad(on) for the layers built inside the block; the previous setting is back after it."""
    return _switched(_defer_wgrad, on)


_plan_instance = [0]


@contextlib.contextmanager
def plan_instance(instance: int):
    """The layers' overlapped ops called inside the block run the plans of `instance` (ops.common.cached_plan), and so
    does the backward of what the block's forwards recorded; a layer gathering in place writes into a gathered buffer
    of that instance. The token split (OverlapTransformerLayer) runs its second half in plan_instance(1), so that both
    halves' calls of one shape can be in flight at once, each with its own buffers and synchronisation state."""
    previous = _plan_instance[0]
    _plan_instance[0] = instance
    try:
        yield
    finally:
        _plan_instance[0] = previous


class WgradHandoff:
    """A column-parallel layer's weight-gradient GEMM left to a row-parallel layer's backward that autograd runs after
    it, to run between that backward's AllGather start and its GEMM (AgGemm.start/finish): one layer's linear_fc1 and
    linear_proj (OverlapTransformerLayer, `--overlap-tp-defer-wgrad`).

    Why: in a layer's backward, linear_proj's dgrad AllGather+GEMM waits for the pre-MLP norm's backward, which waits
    for fc1's dgrad; its pulls (at TP 4 on the 8B layer ~0.2 ms against a 0.09 ms GEMM, docs/perf/s32) had nothing to
    run beside. fc1's wgrad GEMM (~0.6 ms there) depends on neither, so it moves there: under a CUDA graph the copy
    engines pull proj's rows while the SMs run fc1's wgrad, and proj's dgrad GEMM then finds its rows in place
    (measured: that op 0.275 -> 0.090 ms, the layer -2.3%). Eagerly, with one hardware queue, the wgrad's launch waits
    behind the pulls enqueued before it (AgGemm.start), so the move pays under graphs only.

    How the gradient gets home: fc1's weight is also an input of proj's autograd Function (`consumer_input`, passed at
    proj's forward), so fc1's backward returns no weight gradient and proj's backward returns it, computed by the
    same _weight_grad (main_grad accumulation and Megatron's dummy with gradient_accumulation_fusion). Autograd sums
    the two edges and accumulates fc1's weight once, after proj's backward: DDP's hooks, --overlap-grad-reduce and
    the gradient capture of Megatron's CUDA graphs see it as any other weight's. Bit for bit the undeferred path.

    Armed by proj's forward (its backward will run and return fc1's weight gradient); a wgrad left and never taken is
    a RuntimeError at proj's next forward, never a silently missing gradient."""

    __slots__ = ("producer", "armed", "pending")

    def __init__(self, producer: torch.nn.Module):
        self.producer = producer   # the column-parallel layer whose wgrad is left (its .weight is read at each forward)
        self.armed = False         # the consumer's forward took the producer's weight as an input: its backward runs
        self.pending = None        # the wgrad left by the producer's backward: a function returning its gradient

    def consumer_input(self, grad_enabled: bool) -> Optional[torch.Tensor]:
        """At the consumer's forward: the producer's weight, as an extra input of the consumer's Function (None where
        autograd records nothing, or the weight needs no gradient); arms the handoff accordingly."""
        if self.pending is not None:
            raise RuntimeError("overlap_tp: linear_fc1's deferred weight gradient was never run (linear_proj's "
                               "backward did not come after fc1's); turn --overlap-tp-defer-wgrad off")
        weight = getattr(self.producer, "weight", None)
        self.armed = grad_enabled and weight is not None and weight.requires_grad
        return weight if self.armed else None

    def leave(self, wgrad: Callable[[], Optional[torch.Tensor]]) -> bool:
        """Leave `wgrad` (returns the weight's gradient for autograd) to the consumer's backward; False (run it
        yourself) where the consumer's forward did not take the weight."""
        if not self.armed or self.pending is not None:
            return False
        self.pending = wgrad
        return True

    def take(self) -> Optional[Callable[[], Optional[torch.Tensor]]]:
        wgrad, self.pending = self.pending, None
        return wgrad


def _resolve_config(layer_config: LayerOverlapConfig, op: str) -> OverlapConfig:
    if isinstance(layer_config, OverlapConfig):
        return layer_config
    if isinstance(layer_config, Mapping) and layer_config.get(op) is not None:
        return layer_config[op]
    return _default_configs[op]


def set_overlap_config(model: torch.nn.Module, config: LayerOverlapConfig):
    """Set `overlap_config` on every overlapped linear layer of `model`; returns how many were set."""
    config = _check_overlap_config(config)
    count = 0
    for module in model.modules():
        if isinstance(module, (OverlapColumnParallelLinear, OverlapRowParallelLinear)):
            module.overlap_config = config
            count += 1
    return count


# Training telemetry (overlap_tp.training.sampling) observes the layers' synchronous op calls through this
# hook: observer(kind, call, a, w, group) runs call() (the op on a, w) and returns its output.
_op_observer = None


def set_op_observer(observer: Optional[Callable]):
    """Route every synchronous gemm_rs / gemm_ar / ag_gemm call of the layers through `observer` (None: off)."""
    global _op_observer
    _op_observer = observer


def _observed(kind: str, call: Callable[[], Any], a: torch.Tensor, w: torch.Tensor, group):
    return call() if _op_observer is None else _op_observer(kind, call, a, w, group)


# ---------------------------------------------------------------------------------------------------
# Checks shared by both layers
# ---------------------------------------------------------------------------------------------------

def _check_megatron_config(config, layer: str):
    """Refuse what the layers do not implement, before any weight exists."""
    for option in ("fp8", "fp4"):
        if getattr(config, option, None):
            raise NotImplementedError(f"{layer}: config.{option}={getattr(config, option)!r} is not supported "
                                      f"(the overlapped ops are bf16/fp16 GEMMs); use Transformer Engine's layers")
    if getattr(config, "delay_wgrad_compute", False):
        raise NotImplementedError(f"{layer}: config.delay_wgrad_compute=True is not supported (backward_dw would "
                                  f"have to replay the wgrad); turn it off")
    if getattr(config, "defer_embedding_wgrad_compute", False):
        raise NotImplementedError(f"{layer}: config.defer_embedding_wgrad_compute=True is not supported; "
                                  f"use Megatron's ColumnParallelLinear for the output layer")
    dtype = getattr(config, "params_dtype", torch.float32)
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{layer}: config.params_dtype={dtype}: the overlapped ops run bf16 or fp16 GEMMs "
                         f"(train with --bf16 or --fp16)")


def _flatten_input(x: torch.Tensor, features: int, layer: str) -> torch.Tensor:
    if x.dim() < 2 or x.shape[-1] != features:
        raise ValueError(f"{layer}: expected input [..., {features}] (Megatron's [s, b, h]); got {tuple(x.shape)}")
    x2d = x.reshape(-1, features)
    return x2d if x2d.is_contiguous() else x2d.contiguous()


_addmm_out_dtype_works = True


def _accumulate_wgrad(main_grad: torch.Tensor, dy: torch.Tensor, x: torch.Tensor):
    """main_grad += dy.T @ x; an fp32 main_grad accumulates the bf16/fp16 GEMM in fp32 where the backend can."""
    global _addmm_out_dtype_works
    if main_grad.dtype == dy.dtype:
        main_grad.addmm_(dy.t(), x)
        return
    if main_grad.dtype != torch.float32:
        raise RuntimeError(f"gradient_accumulation_fusion: unsupported main_grad dtype {main_grad.dtype}")
    if main_grad.is_cuda and fused_weight_gradient_mlp_cuda is not None:
        fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x, dy, main_grad)   # Megatron's own kernel
        return
    if main_grad.is_cuda and _addmm_out_dtype_works:
        try:
            torch.addmm(main_grad, dy.t(), x, out_dtype=torch.float32, out=main_grad)
            return
        except (TypeError, RuntimeError):
            _addmm_out_dtype_works = False
    main_grad.add_(dy.t().matmul(x))   # the GEMM rounds to dy's dtype once, as the unfused path does


def _weight_grad(ctx, weight: torch.Tensor, dy: torch.Tensor, x: torch.Tensor):
    """The wgrad dy.T @ x, or with gradient_accumulation_fusion its accumulation into weight.main_grad and
    what Megatron's DDP expects back (Megatron's LinearWithGradAccumulationAndAsyncCommunication): a dummy
    grad (zeros with zero_out_wgrad) with grad_added_to_main_grad = True where DDP tracks it, else None."""
    if not ctx.gradient_accumulation_fusion:
        return dy.t().matmul(x)
    main_grad = ctx.main_grad
    weight.main_grad = main_grad    # the layer may have been reused (MTP): restore what forward saw
    _accumulate_wgrad(main_grad, dy, x)
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    grad_weight = make(main_grad.shape, dtype=x.dtype, device=x.device, requires_grad=False)
    weight.grad_added_to_main_grad = True
    return grad_weight


class _LinearArgs:
    """What a layer's autograd Function needs besides tensors."""

    __slots__ = ("group", "sequence_parallel", "allreduce_dgrad", "gradient_accumulation_fusion", "layer_config",
                 "defer_sum", "deferred_sum", "dgrad_link", "own_gather", "wgrad_handoff", "instance")

    def __init__(self, group, sequence_parallel, allreduce_dgrad, gradient_accumulation_fusion, layer_config,
                 defer_sum=False, dgrad_link=None, own_gather=None, wgrad_handoff=None):
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.allreduce_dgrad = allreduce_dgrad
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.layer_config = layer_config
        self.defer_sum = defer_sum      # row, SP: leave a p2p reduce-scatter's sum to the output's consumer
        self.deferred_sum = None        # ... and here is what it left (ops.p2p.DeferredSum), for the module
        self.dgrad_link = dgrad_link    # column, SP: the input norm's DeferredGrad (the dgrad's p2p sum left to it)
        self.own_gather = own_gather    # column, SP: the layer's OwnGather, whose claimed region is this input
        self.wgrad_handoff = wgrad_handoff   # column: where its wgrad may be left; row: where one may wait for it
        self.instance = _plan_instance[0]    # the ops' plans, forward and backward (plan_instance)

    def config(self, op):
        return _resolve_config(self.layer_config, op)


def _save_common(ctx, weight, bias, args: _LinearArgs):
    ctx.args = args
    ctx.use_bias = bias is not None
    ctx.gradient_accumulation_fusion = args.gradient_accumulation_fusion and weight.requires_grad
    # Kept on ctx, not saved: the layer may be reused (MTP), so no version check (as Megatron does).
    ctx.main_grad = getattr(weight, "main_grad", None) if ctx.gradient_accumulation_fusion else None


def _check_main_grad(weight, fusion):
    """Called in the module's forward, where grad mode is the caller's (not inside Function.forward)."""
    if fusion and weight.requires_grad and torch.is_grad_enabled() and getattr(weight, "main_grad", None) is None:
        raise RuntimeError("gradient_accumulation_fusion=True needs weight.main_grad (an fp32 buffer, "
                           "allocated by Megatron's DistributedDataParallel) before the forward")


# ---------------------------------------------------------------------------------------------------
# Autograd Functions
# ---------------------------------------------------------------------------------------------------

class _ColumnParallelFn(torch.autograd.Function):
    """y = AG(x) @ W.T + b (SP) or x @ W.T + b; x [M(/t), K], W [N/t, K]."""

    @staticmethod
    def forward(ctx, x, weight, bias, args: _LinearArgs):
        _save_common(ctx, weight, bias, args)
        ctx.x_shape = x.shape
        ctx.kept_gathered = args.own_gather is not None
        if ctx.kept_gathered:
            # x is the layer's own gathered buffer's region, written by the norm: nothing staged, and the gathered
            # input stays in that buffer (the layer's alone) until the backward, which reads it with no re-gather
            out, gathered = _observed("ag_gemm", lambda: args.own_gather.ag_gemm(x, weight, bias, args.config("ag_gemm")),
                                      x, weight, args.group)
            ctx.save_for_backward(gathered, weight)
            return out
        if args.sequence_parallel:
            # The gathered input is not kept: backward re-gathers it (Megatron's choice; keeping it
            # costs t times this layer's input activation memory).
            out = _observed("ag_gemm", lambda: ag_gemm(x, weight, args.group, bias=bias, config=args.config("ag_gemm"),
                                                       instance=args.instance), x, weight, args.group)
        else:
            out = torch.matmul(x, weight.t())
            if bias is not None:
                out = out + bias
        ctx.save_for_backward(x, weight)
        return out

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors   # x: the gathered input where kept_gathered
        args = ctx.args
        dy = dy.contiguous()
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gathered, gathering = x, None
        if need_dw and args.sequence_parallel and not ctx.kept_gathered:   # beside the dgrad below (p2p: copy engines)
            gathering = gather_rows(x, args.group, args.config("ag_gemm"))
        dx = reducing_dx = None
        if need_dx:
            # The dgrad's reduction (SP: reduce-scatter, else all-reduce) is left running behind the
            # wgrad GEMM, as Megatron does, and joined after it.
            if args.sequence_parallel:
                reducing_dx = gemm_rs(dy, weight.t(), args.group, config=args.config("gemm_rs"), async_op=True,
                                      instance=args.instance)
            elif args.allreduce_dgrad:
                reducing_dx = gemm_ar(dy, weight.t(), args.group, config=args.config("gemm_ar"), async_op=True)
            else:
                dx = dy.matmul(weight)
        if gathering is not None:
            gathered = gathering.wait()
        dw = None
        handoff = args.wgrad_handoff
        # the gathered input is kept in the layer's own buffer until its next forward: the wgrad can wait for the
        # row-parallel backward that follows (WgradHandoff), which returns the gradient; that backward needs our dx
        # (it reaches it through the norm)
        if need_dw and not (ctx.kept_gathered and need_dx and handoff is not None and
                            handoff.leave(lambda: _weight_grad(ctx, weight, dy, gathered))):
            dw = _weight_grad(ctx, weight, dy, gathered)
        link = args.dgrad_link
        if (reducing_dx is not None and reducing_dx.deferred_sum is not None and link is not None
                and not link.shared):
            # the input norm's backward kernel sums the t received partials itself (p2p transport): dx only stands
            # for the gradient in autograd, unwritten (kernels/fused_add_rmsnorm.py DeferredGrad)
            dx = torch.empty(ctx.x_shape, dtype=dy.dtype, device=dy.device)
            link.defer(dx, reducing_dx.deferred_sum)
        elif reducing_dx is not None:
            dx = reducing_dx.wait()
        db = dy.sum(dim=0) if ctx.use_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None


class _RowParallelFn(torch.autograd.Function):
    """z = RS(y @ W.T) + b (SP) or AR(y @ W.T) + b; y [M, K/t], W [N, K/t]."""

    @staticmethod
    def forward(ctx, y, weight, bias, args: _LinearArgs, handed_weight=None):
        """handed_weight: the weight whose gradient args.wgrad_handoff may leave to this backward (an input only so
        that autograd takes that gradient from here); unused by the forward."""
        _save_common(ctx, weight, bias, args)
        if args.sequence_parallel and args.defer_sum:   # not observed: its sum lands in the consumer's kernel
            pending = gemm_rs(y, weight, args.group, bias=bias, config=args.config("gemm_rs"), async_op=True,
                              instance=args.instance)
            if pending.deferred_sum is None:   # not the p2p transport: nothing to defer
                out = pending.wait()
            else:
                # The consumer's kernel sums the received partials itself (OverlapTransformerLayer's fused
                # bias-dropout-add + norm); until then `out` only stands for the output in autograd, unwritten.
                args.deferred_sum = pending.deferred_sum
                out = torch.empty(y.shape[0] // get_pg_size(args.group), weight.shape[0], dtype=y.dtype,
                                  device=y.device)
        elif args.sequence_parallel:
            out = _observed("gemm_rs", lambda: gemm_rs(y, weight, args.group, bias=bias, config=args.config("gemm_rs"),
                                                       instance=args.instance), y, weight, args.group)
        else:
            out = _observed("gemm_ar", lambda: gemm_ar(y, weight, args.group, bias=bias, config=args.config("gemm_ar")),
                            y, weight, args.group)
        ctx.save_for_backward(y, weight)
        return out

    @staticmethod
    def backward(ctx, dz):
        y, weight = ctx.saved_tensors
        args = ctx.args
        dz = dz.contiguous()
        need_dy, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy, dz_full = None, dz
        # a column-parallel layer's wgrad left to run beside this backward's AllGather (WgradHandoff); its gradient
        # goes out through handed_weight
        wgrad = args.wgrad_handoff.take() if args.wgrad_handoff is not None else None
        handed_grad = None
        if wgrad is not None and not (args.sequence_parallel and need_dy):   # no AllGather to run it beside
            handed_grad, wgrad = wgrad(), None
        if args.sequence_parallel:
            if need_dy and wgrad is not None:
                dy, dz_full, handed_grad = _ag_gemm_around(dz, weight.t(), args, wgrad)
            elif need_dy:   # the gathered dZ comes back with the dgrad and is reused for the wgrad
                dy, dz_full = _observed("ag_gemm", lambda: ag_gemm(dz, weight.t(), args.group, config=args.config("ag_gemm"),
                                                                   return_gathered=True, instance=args.instance),
                                        dz, weight.t(), args.group)
            elif need_dw:
                dz_full = gather_rows(dz, args.group, args.config("ag_gemm")).wait()
        elif need_dy:
            dy = dz.matmul(weight)
        dw = _weight_grad(ctx, weight, dz_full, y) if need_dw else None
        # SP: this rank's rows only; the bias carries sequence_parallel=True, so Megatron's
        # finalize_model_grads all-reduces it over the TP group (as for Megatron's own layer).
        db = dz.sum(dim=0) if ctx.use_bias and ctx.needs_input_grad[2] else None
        return dy, dw, db, None, handed_grad


def _ag_gemm_around(dz: torch.Tensor, wt: torch.Tensor, args: _LinearArgs, between: Callable[[], Any]):
    """ag_gemm(dz, wt, return_gathered=True) with between() run after its transfers were issued and before its GEMM
    (AgGemm.start/finish: the signaled method; any other method runs between() first, then the call): (out, gathered,
    what between() returned). Not observed by the telemetry hook: the call is two calls here."""
    plan = ag_gemm_plan(dz, wt, args.group, args.config("ag_gemm"), args.instance)
    if plan.method != "signal":
        result = between()
        return (*plan(dz, wt, return_gathered=True), result)
    started = plan.start(dz)
    result = between()
    return (*plan.finish(started, wt, return_gathered=True), result)


def _gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class _GatherLastDim(torch.autograd.Function):
    """Column `gather_output`: all-gather the output along the last dim; backward keeps this rank's part."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        t, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(t, dim=-1)[rank].contiguous(), None


class _ScatterLastDim(torch.autograd.Function):
    """Row `input_is_parallel=False`: keep this rank's part of the last dim; backward all-gathers it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        t, rank = dist.get_world_size(group), dist.get_rank(group)
        return x.chunk(t, dim=-1)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


# ---------------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------------

class _OverlapLinearBase(torch.nn.Module):
    overlap_config: LayerOverlapConfig

    def _init_common(self, config, is_expert, tp_group, overlap_config, layer):
        _check_megatron_config(config, layer)
        self.config = config
        self.is_expert = is_expert
        self.expert_parallel = getattr(config, "expert_model_parallel_size", 1) > 1
        self.tp_group = get_tensor_model_parallel_group_if_none(tp_group, is_expert=is_expert)
        world_size, rank = get_pg_size(self.tp_group), get_pg_rank(self.tp_group)
        self.explicit_expert_comm = is_expert and (world_size > 1 or self.expert_parallel)
        if self.explicit_expert_comm:
            raise NotImplementedError(f"{layer}: MoE expert layers (is_expert=True with TP or EP > 1) are not "
                                      f"implemented yet; use Megatron's expert layers")
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        self.overlap_config = _check_overlap_config(overlap_config)
        # Megatron's hook adding a default empty _extra_state for state dict
        self._register_load_state_dict_pre_hook(
            lambda state_dict, prefix, *args, **kwargs: state_dict.setdefault(f"{prefix}_extra_state"))
        return world_size, rank

    def __setattr__(self, name, value):
        if name == "overlap_config":
            value = _check_overlap_config(value)
        super().__setattr__(name, value)

    def _new_param(self, *shape):
        device = None if self.config.use_cpu_initialization else torch.cuda.current_device()
        return Parameter(torch.empty(*shape, device=device, dtype=self.config.params_dtype))

    def _init_weight(self, output_size, input_size, per_partition, partition_dim, init_method, stride,
                     keep_master_weight_for_test, rank, world_size, params_dtype_kw):
        """Megatron's own initialisation, so weights equal Megatron's for the same seed."""
        config = self.config
        if not config.perform_initialization:
            set_tensor_model_parallel_attributes(self.weight, True, partition_dim, stride)
            return
        if config.use_cpu_initialization:
            extra = {"params_dtype": config.params_dtype} if params_dtype_kw else {}
            self.master_weight = _initialize_affine_weight_cpu(
                self.weight, output_size, input_size, per_partition, partition_dim, init_method, stride=stride,
                return_master_weight=keep_master_weight_for_test, rank=rank, world_size=world_size, **extra)
        else:
            _initialize_affine_weight_gpu(self.weight, init_method, partition_dim=partition_dim, stride=stride,
                                          is_expert=self.is_expert)

    def backward_dw(self) -> None:
        """The wgrad runs inside backward (delay_wgrad_compute is refused at construction), so there is
        nothing left to compute here; Megatron's own layers behave the same."""
        if getattr(self.config, "delay_wgrad_compute", False):
            raise NotImplementedError(f"{type(self).__name__}: config.delay_wgrad_compute=True is not supported")

    def set_extra_state(self, state: Any):
        """Extra state is ignored"""

    def get_extra_state(self) -> None:
        """Keep compatibility with TE state dict."""
        return None

    def _sharded(self, prefix, sharded_offsets, metadata, axis_map):
        state_dict = self.state_dict(prefix="", keep_vars=True)
        dp_cp_group = metadata.get("dp_cp_group") if metadata else None
        tp_group = self.tp_group if dp_cp_group is not None else None   # both or neither (Megatron's rule)
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, axis_map, sharded_offsets,
                                                   tp_group=tp_group, dp_cp_group=dp_cp_group)


class OverlapColumnParallelLinear(_OverlapLinearBase):
    """Y = X A + b with A split along its output dimension (Megatron's ColumnParallelLinear).

    Sequence parallel: forward ag_gemm (all-gather of the sequence shards + GEMM); backward dgrad
    gemm_rs(dY, W.T) and wgrad dY.T @ AG(X) with X re-gathered (asynchronously, behind the dgrad).
    Without SP: forward is the local GEMM (identity on the input); backward dgrad gemm_ar(dY, W.T).

    sum_dgrad_in_norm: set by the module whose norm output is this layer's only input consumer
    (OverlapTransformerLayer: linear_qkv, a dense MLP's linear_fc1). The dgrad's p2p reduce-scatter then leaves its
    t partials to the norm's backward kernel, which sums them as it reads them (one pass over the input gradient and
    one launch less; kernels/fused_add_rmsnorm.py DeferredGrad, the backward mirror of defer_sum_next); an input
    that is not an overlap_tp norm's output, or a norm output with a second consumer, runs the sum as before.

    gather_in_place: set by the module whose norm output is this layer's only input (OverlapTransformerLayer, with
    set_gather_in_place(True)). The norm then writes its rows straight into this layer's own gathered buffer
    (input_buffer, ops.ag_gemm.OwnGather): the forward's AllGather stages nothing, and the backward's wgrad reads the
    gathered input still in that buffer, with no re-gather. Only where the ag_gemm config is the p2p transport with
    method signal or decompose, on CUDA; elsewhere input_buffer returns None and the layer runs as before.
    """

    sum_dgrad_in_norm = False
    gather_in_place = False
    wgrad_handoff = None    # a WgradHandoff to leave the wgrad to (OverlapTransformerLayer: linear_fc1 in place)
    _auto_in_place = None   # ((auto config, m, dtype, device), the tuner's config for it): asked once per shape

    def __init__(self, input_size, output_size, *, config, init_method: Callable, bias=True, gather_output=False,
                 stride=1, keep_master_weight_for_test=False, skip_bias_add=False,
                 skip_weight_param_allocation: bool = False, embedding_activation_buffer=None,
                 grad_output_buffer=None, is_expert: bool = False, tp_comm_buffer_name: Optional[str] = None,
                 disable_grad_reduce: bool = False, tp_group=None, name: Optional[str] = None,
                 overlap_config: LayerOverlapConfig = None, **unused_kwargs):
        super().__init__()
        layer = type(self).__name__
        if embedding_activation_buffer is not None or grad_output_buffer is not None:
            raise NotImplementedError(f"{layer}: embedding_activation_buffer / grad_output_buffer "
                                      f"(defer_embedding_wgrad_compute) are not supported")
        self.input_size, self.output_size = input_size, output_size
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.disable_grad_reduce = disable_grad_reduce
        self.tp_comm_buffer_name, self.name = tp_comm_buffer_name, name
        world_size, rank = self._init_common(config, is_expert, tp_group, overlap_config, layer)
        self.output_size_per_partition = divide(output_size, world_size)

        if not skip_weight_param_allocation:
            self.weight = self._new_param(self.output_size_per_partition, self.input_size)
            self._init_weight(output_size, input_size, self.output_size_per_partition, 0, init_method, stride,
                              keep_master_weight_for_test, rank, world_size, params_dtype_kw=False)
            setattr(self.weight, "allreduce", not (self.is_expert and self.expert_parallel))
        else:
            self.weight = None

        if bias:
            self.bias = self._new_param(self.output_size_per_partition)
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
            if config.perform_initialization:
                with torch.no_grad():
                    self.bias.zero_()
            setattr(self.bias, "allreduce", not (self.is_expert and self.expert_parallel))
        else:
            self.register_parameter("bias", None)

        self.sequence_parallel = config.sequence_parallel
        if self.sequence_parallel and world_size <= 1:
            warnings.warn("`sequence_parallel` is set to `True`, but tensor model parallel size "
                          f"is {world_size}. Disabling sequence parallel.")
            self.sequence_parallel = False
        if self.sequence_parallel and gather_output:
            raise ValueError(f"{layer}: gather_output=True with sequence_parallel is not supported "
                             f"(the output would be sequence-gathered and hidden-gathered)")
        self.allreduce_dgrad = world_size > 1 and not self.sequence_parallel and not disable_grad_reduce
        self._own_gathers = {}   # {plan instance: OwnGather}: the gathered buffers (gather_in_place; plan_instance)

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """input_ [s(/t with SP), b, h] -> ([s, b, output_size/t] (or gathered), bias if skip_bias_add)."""
        if weight is None:
            if self.weight is None:
                raise RuntimeError("weight was not supplied to OverlapColumnParallelLinear forward pass "
                                   "and skip_weight_param_allocation is True.")
            weight = self.weight
        elif weight.shape != (self.output_size_per_partition, self.input_size):
            raise RuntimeError(f"supplied weight's shape is {tuple(weight.shape)}, "
                               f"not {(self.output_size_per_partition, self.input_size)} as expected")
        gather_output = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather_output and self.sequence_parallel:
            raise ValueError("OverlapColumnParallelLinear: gather_output=True with sequence_parallel is not supported")
        bias = self.bias if not self.skip_bias_add else None
        x2d = _flatten_input(input_, self.input_size, type(self).__name__)
        link = (accept_deferred_grad(input_) if self.sum_dgrad_in_norm and self.sequence_parallel
                and torch.is_grad_enabled() else None)
        own = (next((own for own in self._own_gathers.values() if own.holds(x2d)), None) if self.sequence_parallel
               else None)
        args = _LinearArgs(self.tp_group, self.sequence_parallel, self.allreduce_dgrad,
                           self.gradient_accumulation_fusion, self.overlap_config, dgrad_link=link, own_gather=own,
                           wgrad_handoff=self.wgrad_handoff if own is not None else None)
        _check_main_grad(weight, self.gradient_accumulation_fusion)
        out2d = _ColumnParallelFn.apply(x2d, weight, bias, args)
        rows = input_.shape[0] * (get_pg_size(self.tp_group) if self.sequence_parallel else 1)
        output = out2d.view(rows, *input_.shape[1:-1], self.output_size_per_partition)
        if gather_output and get_pg_size(self.tp_group) > 1:
            output = _GatherLastDim.apply(output, self.tp_group)
        return output, (self.bias if self.skip_bias_add else None)

    def input_buffer(self, shape, dtype, device) -> Optional[torch.Tensor]:
        """Where the producer of this layer's next input ([s/t, b, h] `shape`, `dtype`) writes it: this rank's region
        of the layer's own gathered buffer, claimed on the current stream (gather_in_place); None where the layer
        gathers through the shared path (not in place, no SP, not CUDA, or an ag_gemm config other than the p2p
        transport with method signal or decompose). The buffer is built at the first call, collectively.
        method 'auto' is resolved here for this shape, by the tuner (collectively, once: its decision is kept, so the
        ag_gemm call that follows runs the same config): in place where it picks signal or decompose on p2p."""
        device = torch.device(device)
        if (not self.gather_in_place or not self.sequence_parallel or shape[-1] != self.input_size
                or dtype not in (torch.bfloat16, torch.float16)):
            return None
        m = math.prod(shape) // self.input_size
        if self._in_place_config(m, dtype, device) is None:
            return None
        instance = _plan_instance[0]
        own = self._own_gathers.get(instance)
        if own is None or not own.fits(m, self.input_size, dtype, device):
            self._own_gathers[instance] = own = None   # a new shape: the old buffer goes (symmetric memory, freed)
            own = self._own_gathers[instance] = OwnGather(self.tp_group, m, self.input_size, dtype, device, instance)
        return own.claim().view(shape)

    def _in_place_config(self, m: int, dtype, device: torch.device) -> Optional[OverlapConfig]:
        """The ag_gemm config this layer's forward runs on an [m, k] shard if it can gather in place
        (OwnGather.supports), else None. 'auto' is resolved by the tuner for the gathered shape, as the ag_gemm call
        will resolve it (the tuner keeps its decision: the same config). The answer is kept per shape, so a forward
        asks the tuner only when the shape or the config changed."""
        config = _resolve_config(self.overlap_config, "ag_gemm")
        if config.method == "auto" and device.type == "cuda":   # CPU tensors: the op runs auto as off
            key = (config, m, dtype, device)
            if self._auto_in_place is None or self._auto_in_place[0] != key:
                self._auto_in_place = (key, resolve_auto("ag_gemm", m * get_pg_size(self.tp_group),
                                                         self.output_size_per_partition, self.input_size, dtype,
                                                         device, self.tp_group, config))
            config = self._auto_in_place[1]
        return config if OwnGather.supports(config, device) else None

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Sharding along axis 0, bias sharded (as Megatron's ColumnParallelLinear)."""
        return self._sharded(prefix, sharded_offsets, metadata, {"weight": 0, "bias": 0})

    def __repr__(self):
        tp = self.output_size // self.output_size_per_partition
        return (f"{type(self).__name__}(in_features={self.input_size}, out_features={self.output_size}, "
                f"bias={self.bias is not None}, TP={tp}, sequence_parallel={self.sequence_parallel})")


class OverlapRowParallelLinear(_OverlapLinearBase):
    """Y = X A + b with A split along its input dimension (Megatron's RowParallelLinear).

    Sequence parallel: forward gemm_rs (GEMM + reduce-scatter to the sequence shards, bias added once);
    backward dgrad ag_gemm(dZ, W.T, return_gathered=True), the gathered dZ reused for wgrad.
    Without SP: forward gemm_ar; backward dgrad is the local GEMM.

    defer_sum_next: set by the module that consumes this layer's next output (OverlapTransformerLayer, for
    linear_proj under its fused bias-dropout-add + norm), cleared by the next forward. When that forward's
    reduce-scatter runs on the p2p transport, its sum is left to the consumer's kernel: the output is then
    unwritten and carries `overlap_tp_deferred_sum` (ops.p2p.DeferredSum), which the consumer must run.
    """

    defer_sum_next = False
    deferred_sum = None   # the last forward's DeferredSum (None: its output was written), for the consumer's check
    wgrad_handoff = None  # a WgradHandoff whose wgrad the backward runs beside its AllGather (linear_proj)

    def __init__(self, input_size, output_size, *, config, init_method: Callable, bias: bool,
                 input_is_parallel: bool, skip_bias_add: bool, stride: int = 1,
                 keep_master_weight_for_test: bool = False, is_expert: bool = False,
                 tp_comm_buffer_name: Optional[str] = None, tp_group=None, name: Optional[str] = None,
                 overlap_config: LayerOverlapConfig = None, **unused_kwargs):
        super().__init__()
        layer = type(self).__name__
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.tp_comm_buffer_name, self.name = tp_comm_buffer_name, name
        self.sequence_parallel = config.sequence_parallel
        if self.sequence_parallel and not input_is_parallel:
            raise RuntimeError("To enable `sequence_parallel`, `input_is_parallel` must be `True`")
        world_size, rank = self._init_common(config, is_expert, tp_group, overlap_config, layer)
        self.input_size_per_partition = divide(input_size, world_size)

        self.weight = self._new_param(self.output_size, self.input_size_per_partition)
        self._init_weight(output_size, input_size, self.input_size_per_partition, 1, init_method, stride,
                          keep_master_weight_for_test, rank, world_size, params_dtype_kw=True)
        setattr(self.weight, "allreduce", not (self.is_expert and self.expert_parallel))

        if bias:
            self.bias = self._new_param(self.output_size)
            if config.perform_initialization:
                with torch.no_grad():
                    self.bias.zero_()
            setattr(self.bias, "allreduce", not (self.is_expert and self.expert_parallel))
            setattr(self.bias, "sequence_parallel", self.sequence_parallel)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """input_ [s, b, input_size/t] -> ([s(/t with SP), b, output_size], bias if skip_bias_add)."""
        if not self.input_is_parallel:
            input_ = _ScatterLastDim.apply(input_, self.tp_group)
        y2d = _flatten_input(input_, self.input_size_per_partition, type(self).__name__)
        bias = self.bias if not self.skip_bias_add else None
        defer_sum, self.defer_sum_next = self.defer_sum_next, False
        handoff = self.wgrad_handoff
        # linear_fc1's weight, whose gradient our backward may return (WgradHandoff)
        handed = handoff.consumer_input(torch.is_grad_enabled()) if handoff is not None else None
        args = _LinearArgs(self.tp_group, self.sequence_parallel, False, self.gradient_accumulation_fusion,
                           self.overlap_config, defer_sum=defer_sum, wgrad_handoff=handoff)
        t = get_pg_size(self.tp_group)
        if self.sequence_parallel and input_.shape[0] % t:
            raise ValueError(f"OverlapRowParallelLinear: sequence length {input_.shape[0]} is not divisible by the "
                             f"tensor-parallel size {t} (sequence parallel)")
        _check_main_grad(self.weight, self.gradient_accumulation_fusion)
        out2d = _RowParallelFn.apply(y2d, self.weight, bias, args, handed)
        rows = input_.shape[0] // t if self.sequence_parallel else input_.shape[0]
        output = out2d.view(rows, *input_.shape[1:-1], self.output_size)
        self.deferred_sum = args.deferred_sum
        if args.deferred_sum is not None:   # unwritten until the consumer runs it: see defer_sum_next
            output.overlap_tp_deferred_sum = args.deferred_sum
        return output, (self.bias if self.skip_bias_add else None)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Sharding along axis 1, bias not sharded (as Megatron's RowParallelLinear)."""
        return self._sharded(prefix, sharded_offsets, metadata, {"weight": 1})

    def __repr__(self):
        tp = self.input_size // self.input_size_per_partition
        return (f"{type(self).__name__}(in_features={self.input_size}, out_features={self.output_size}, "
                f"bias={self.bias is not None}, TP={tp}, sequence_parallel={self.sequence_parallel})")
