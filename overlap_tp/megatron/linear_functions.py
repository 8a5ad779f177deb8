"""The autograd Functions of overlap_tp's tensor-parallel linears (layers.py) and what they need besides tensors:
forward and backward through the overlapped ops (DESIGN.md section 2), the weight gradient (with Megatron's
gradient_accumulation_fusion), the op-kind configs a call runs (the layer's own, else its OverlapSettings'), and the
layer's op observer through which training observes the synchronous op calls (_LinearArgs.observe). The FP8
Functions: fp8_linear.py."""
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.distributed as dist

from megatron.core.utils import get_pg_size

from overlap_tp.megatron.settings import OverlapSettings
from overlap_tp.ops.ag_gemm import ag_gemm, ag_gemm_plan, gather_rows
from overlap_tp.ops.config import OverlapConfig
from overlap_tp.ops.gemm_ar import gemm_ar
from overlap_tp.ops.gemm_rs import gemm_rs

try:
    import fused_weight_gradient_mlp_cuda  # apex: Megatron's fused fp32 wgrad accumulation
except ImportError:
    fused_weight_gradient_mlp_cuda = None

LayerOverlapConfig = Union[None, OverlapConfig, Mapping[str, OverlapConfig]]


def _resolve_config(layer_config: LayerOverlapConfig, op: str, settings: OverlapSettings) -> OverlapConfig:
    """The layer's own config for op kind `op` where it names one, else the settings' (unset fields are left to the
    ops' resolver)."""
    if isinstance(layer_config, OverlapConfig):
        return layer_config
    if isinstance(layer_config, Mapping) and layer_config.get(op) is not None:
        return layer_config[op]
    return settings.config(op)


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


def weight_grad(ctx, weight: torch.Tensor, dy: torch.Tensor, x: torch.Tensor,
                product: Optional[Callable[[], torch.Tensor]] = None):
    """The wgrad dy.T @ x, or with gradient_accumulation_fusion its accumulation into weight.main_grad and
    what Megatron's DDP expects back (Megatron's LinearWithGradAccumulationAndAsyncCommunication): a dummy
    grad (zeros with zero_out_wgrad) with grad_added_to_main_grad = True where DDP tracks it, else None.
    product: computes dy.T @ x another way (the FP8 wgrad), in dy's dtype; then main_grad adds its result."""
    if not ctx.gradient_accumulation_fusion:
        return product() if product is not None else dy.t().matmul(x)
    main_grad = ctx.main_grad
    weight.main_grad = main_grad    # the layer may have been reused (MTP): restore what forward saw
    if product is not None:
        main_grad.add_(product())
    else:
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
                 "settings", "defer_sum", "deferred_sum", "dgrad_link", "own_gather", "wgrad_handoff", "instance",
                 "observer")

    def __init__(self, layer, allreduce_dgrad, defer_sum=False, dgrad_link=None, own_gather=None,
                 wgrad_handoff=None):
        """layer: the module calling (its group, sequence parallelism, wgrad fusion, configs, settings and plan
        instance are read at this call)."""
        self.group = layer.tp_group
        self.sequence_parallel = layer.sequence_parallel
        self.allreduce_dgrad = allreduce_dgrad
        self.gradient_accumulation_fusion = layer.gradient_accumulation_fusion
        self.layer_config = layer.overlap_config
        self.settings = layer.settings
        self.defer_sum = defer_sum      # row, SP: leave a p2p reduce-scatter's sum to the output's consumer
        self.deferred_sum = None        # ... and here is what it left (ops.p2p_reduction.DeferredSum), for the module
        self.dgrad_link = dgrad_link    # column, SP: the input norm's DeferredGrad (the dgrad's p2p sum left to it)
        self.own_gather = own_gather    # column, SP: the layer's OwnGather, whose claimed region is this input
        self.wgrad_handoff = wgrad_handoff   # column: where its wgrad may be left; row: where one may wait for it
        self.instance = layer.plan_instance   # the ops' plans, forward and backward (plan_instance)
        self.observer = layer.op_observer     # what the synchronous op calls run through (None: called directly)

    def config(self, op):
        return _resolve_config(self.layer_config, op, self.settings)

    def observe(self, kind: str, call: Callable[[], Any], a: torch.Tensor, w: torch.Tensor):
        """call() (the layer's synchronous op `kind` on a, w), through the layer's op observer where one is set
        (layers.set_op_observer): observer(kind, call, a, w, group) runs call() and returns its output."""
        return call() if self.observer is None else self.observer(kind, call, a, w, self.group)


def save_common(ctx, weight, bias, args: _LinearArgs):
    """What a linear's backward reads off ctx besides its saved tensors (the bf16 and the FP8 Functions alike)."""
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
        save_common(ctx, weight, bias, args)
        ctx.x_shape = x.shape
        ctx.kept_gathered = args.own_gather is not None
        if ctx.kept_gathered:
            # x is the layer's own gathered buffer's region, written by the norm: nothing staged, and the gathered
            # input stays in that buffer (the layer's alone) until the backward, which reads it with no re-gather
            out, gathered = args.observe("ag_gemm", lambda: args.own_gather.ag_gemm(x, weight, bias,
                                                                                    args.config("ag_gemm")),
                                         x, weight)
            ctx.save_for_backward(gathered, weight)
            return out
        if args.sequence_parallel:
            # The gathered input is not kept: backward re-gathers it (Megatron's choice; keeping it
            # costs t times this layer's input activation memory).
            out = args.observe("ag_gemm", lambda: ag_gemm(x, weight, args.group, bias=bias,
                                                          config=args.config("ag_gemm"), instance=args.instance),
                               x, weight)
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
                            handoff.leave(lambda: weight_grad(ctx, weight, dy, gathered))):
            dw = weight_grad(ctx, weight, dy, gathered)
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
        save_common(ctx, weight, bias, args)
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
            out = args.observe("gemm_rs", lambda: gemm_rs(y, weight, args.group, bias=bias,
                                                          config=args.config("gemm_rs"), instance=args.instance),
                               y, weight)
        else:
            out = args.observe("gemm_ar", lambda: gemm_ar(y, weight, args.group, bias=bias,
                                                          config=args.config("gemm_ar")), y, weight)
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
                dy, dz_full = args.observe("ag_gemm", lambda: ag_gemm(dz, weight.t(), args.group,
                                                                      config=args.config("ag_gemm"),
                                                                      return_gathered=True, instance=args.instance),
                                           dz, weight.t())
            elif need_dw:
                dz_full = gather_rows(dz, args.group, args.config("ag_gemm")).wait()
        elif need_dy:
            dy = dz.matmul(weight)
        dw = weight_grad(ctx, weight, dz_full, y) if need_dw else None
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
