"""Megatron's tensor-parallel linear layers on the overlapped ops (docs/layers.md); their autograd Functions are
linear_functions.py's, the deferred wgrad's handoff wgrad_handoff.py's.

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
dict by op kind) or, where it is None or names no config for the op kind, the layer's settings (constructor keyword
`settings`, an OverlapSettings carried by the layer spec; megatron/settings.py). Both are read at every call, so a
training integration may set them after the model is built (`set_overlap_config(model, ...)` sets every layer of a
model). Fields a config leaves unset are filled per shape by the ops' resolver (ops/resolve.py).
"""
import math
import warnings
from typing import Any, Callable, Mapping, Optional, Tuple

import torch
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
    raise ImportError("overlap_tp.megatron.layers needs megatron-core (pip install -e '.[megatron]' in the checkout, or "
                      "'megatron-core>=0.16')") from error

from overlap_tp.kernels.fused_add_rmsnorm import accept_deferred_grad
from overlap_tp.megatron.fp8_linear import Fp8ColumnParallelFn, Fp8Recipe, Fp8RowParallelFn, Fp8WeightCache
from overlap_tp.megatron.linear_functions import (LayerOverlapConfig, _check_main_grad, _ColumnParallelFn,
                                                  _GatherLastDim, _LinearArgs, _resolve_config, _RowParallelFn,
                                                  _ScatterLastDim)
from overlap_tp.megatron.norm import fp8_rows
from overlap_tp.megatron.settings import DEFAULT_SETTINGS, OP_KINDS, OverlapSettings
from overlap_tp.ops.ag_gemm import OwnGather
from overlap_tp.ops.config import OverlapConfig
from overlap_tp.ops.resolve import resolve

__all__ = ["OP_KINDS", "OverlapColumnParallelLinear", "OverlapRowParallelLinear", "set_op_observer",
           "set_overlap_config"]


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


def set_overlap_config(model: torch.nn.Module, config: LayerOverlapConfig):
    """Set `overlap_config` on every overlapped linear layer of `model`; returns how many were set."""
    config = _check_overlap_config(config)
    count = 0
    for module in model.modules():
        if isinstance(module, (OverlapColumnParallelLinear, OverlapRowParallelLinear)):
            module.overlap_config = config
            count += 1
    return count


def set_op_observer(model: torch.nn.Module, observer: Optional[Callable]) -> int:
    """Route the synchronous gemm_rs / gemm_ar / ag_gemm calls of every overlapped linear layer of `model` through
    `observer(kind, call, a, w, group)`, which runs call() (the op on a, w) and returns its output (None: called
    directly, the default); returns how many layers were set. Training telemetry (overlap_tp.training.sampling)
    observes the layers this way."""
    count = 0
    for module in model.modules():
        if isinstance(module, (OverlapColumnParallelLinear, OverlapRowParallelLinear)):
            module.op_observer = observer
            count += 1
    return count


# ---------------------------------------------------------------------------------------------------
# Checks shared by both layers
# ---------------------------------------------------------------------------------------------------

def _check_megatron_config(config, layer: str):
    """Refuse what the layers do not implement, before any weight exists."""
    if getattr(config, "fp4", None):
        raise NotImplementedError(f"{layer}: config.fp4={config.fp4!r} is not supported (the overlapped ops are "
                                  f"bf16/fp16 or FP8 GEMMs); use Transformer Engine's layers")
    try:
        Fp8Recipe.of(config)
    except ValueError as error:
        raise NotImplementedError(f"{layer}: {error}") from None
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


# ---------------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------------

class _OverlapLinearBase(torch.nn.Module):
    overlap_config: LayerOverlapConfig
    # which plans of a shape the layer's ops run (ops.plan_base.cached_plan's instance), forward and the backward of what
    # the forward recorded; a layer gathering in place writes into a gathered buffer of that instance. The token split
    # (OverlapTransformerLayer) runs its second half with 1, so that both halves' calls of one shape can be in flight
    # at once, each with its own buffers and synchronisation state.
    plan_instance = 0
    # what the layer's synchronous op calls run through (set_op_observer); None: called directly
    op_observer: Optional[Callable] = None

    def _init_common(self, config, is_expert, tp_group, overlap_config, settings, layer):
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
        if settings is not None and not isinstance(settings, OverlapSettings):
            raise TypeError(f"{layer}: settings must be an OverlapSettings, got {type(settings).__name__}")
        self.settings = settings if settings is not None else DEFAULT_SETTINGS
        # FP8 (fp8_linear.py): Megatron's config.fp8 / fp8_recipe (the wgrad too with settings.fp8_wgrad); the
        # weights' FP8 copies
        self.fp8 = Fp8Recipe.of(config, self.settings.fp8_wgrad)
        self.fp8_weights = Fp8WeightCache() if self.fp8 is not None else None
        # Megatron's hook adding a default empty _extra_state for state dict
        self._register_load_state_dict_pre_hook(
            lambda state_dict, prefix, *args, **kwargs: state_dict.setdefault(f"{prefix}_extra_state"))
        return world_size, rank

    def _refuse_fp8_without_sequence_parallel(self, layer: str):
        if self.fp8 is not None and not self.sequence_parallel:
            raise NotImplementedError(f"{layer}: FP8 (config.fp8={self.config.fp8!r}) runs with sequence parallelism "
                                      f"at TP >= 2 (--sequence-parallel): the FP8 ops are the AllGather+GEMM and "
                                      f"GEMM+ReduceScatter; without it use Transformer Engine's layers")

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
    OverlapSettings.gather_in_place). The norm then writes its rows straight into this layer's own gathered buffer
    (input_buffer, ops.ag_gemm.OwnGather): the forward's AllGather stages nothing, and the backward's wgrad reads the
    gathered input still in that buffer, with no re-gather. Only where the ag_gemm config is the p2p transport with
    method signal or decompose, on CUDA; elsewhere input_buffer returns None and the layer runs as before.
    """

    sum_dgrad_in_norm = False
    gather_in_place = False
    wgrad_handoff = None    # a WgradHandoff to leave the wgrad to (OverlapTransformerLayer: linear_fc1 in place)
    _in_place_resolved = None   # ((config, m, dtype, device), its resolved config): asked once per shape

    def __init__(self, input_size, output_size, *, config, init_method: Callable, bias=True, gather_output=False,
                 stride=1, keep_master_weight_for_test=False, skip_bias_add=False,
                 skip_weight_param_allocation: bool = False, embedding_activation_buffer=None,
                 grad_output_buffer=None, is_expert: bool = False, tp_comm_buffer_name: Optional[str] = None,
                 disable_grad_reduce: bool = False, tp_group=None, name: Optional[str] = None,
                 overlap_config: LayerOverlapConfig = None,
                 settings: Optional[OverlapSettings] = None, **unused_kwargs):
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
        world_size, rank = self._init_common(config, is_expert, tp_group, overlap_config, settings, layer)
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
        self._refuse_fp8_without_sequence_parallel(layer)
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
        args = _LinearArgs(self, self.allreduce_dgrad, dgrad_link=link, own_gather=own,
                           wgrad_handoff=self.wgrad_handoff if own is not None else None)
        _check_main_grad(weight, self.gradient_accumulation_fusion)
        if self.fp8 is not None:   # the rows' FP8 copy, where the norm that produced them wrote one (norm.py)
            x8 = fp8_rows(input_, self.fp8.forward_format, self.fp8.row_scaling)
            out2d = Fp8ColumnParallelFn.apply(x2d, weight, bias, args, self.fp8, self.fp8_weights, x8)
        else:
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
                or dtype not in (torch.bfloat16, torch.float16) or self.fp8 is not None):
            return None
        m = math.prod(shape) // self.input_size
        if self._in_place_config(m, dtype, device) is None:
            return None
        instance = self.plan_instance
        own = self._own_gathers.get(instance)
        if own is None or not own.fits(m, self.input_size, dtype, device):
            self._own_gathers[instance] = own = None   # a new shape: the old buffer goes (symmetric memory, freed)
            own = self._own_gathers[instance] = OwnGather(self.tp_group, m, self.input_size, dtype, device, instance)
        return own.claim().view(shape)

    def _in_place_config(self, m: int, dtype, device: torch.device) -> Optional[OverlapConfig]:
        """The ag_gemm config this layer's forward runs on an [m, k] shard, resolved as the ag_gemm call will resolve it
        (ops/resolve.py; 'auto' by the tuner for the gathered shape, which keeps its decision: the same config), if it
        can gather in place (OwnGather.supports), else None. The answer is kept per shape, so a forward asks the
        resolver only when the shape or the config changed."""
        config = _resolve_config(self.overlap_config, "ag_gemm", self.settings)
        key = (config, m, dtype, device)
        if self._in_place_resolved is None or self._in_place_resolved[0] != key:
            t = get_pg_size(self.tp_group)
            self._in_place_resolved = (key, resolve(config, "ag_gemm", device=device, t=t, group=self.tp_group,
                                                    m=m * t, n=self.output_size_per_partition, k=self.input_size,
                                                    dtype=dtype))
        config = self._in_place_resolved[1]
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
    unwritten and carries `overlap_tp_deferred_sum` (ops.p2p_reduction.DeferredSum), which the consumer must run.
    """

    defer_sum_next = False
    deferred_sum = None   # the last forward's DeferredSum (None: its output was written), for the consumer's check
    wgrad_handoff = None  # a WgradHandoff whose wgrad the backward runs beside its AllGather (linear_proj)

    def __init__(self, input_size, output_size, *, config, init_method: Callable, bias: bool,
                 input_is_parallel: bool, skip_bias_add: bool, stride: int = 1,
                 keep_master_weight_for_test: bool = False, is_expert: bool = False,
                 tp_comm_buffer_name: Optional[str] = None, tp_group=None, name: Optional[str] = None,
                 overlap_config: LayerOverlapConfig = None,
                 settings: Optional[OverlapSettings] = None, **unused_kwargs):
        super().__init__()
        layer = type(self).__name__
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.tp_comm_buffer_name, self.name = tp_comm_buffer_name, name
        self.sequence_parallel = config.sequence_parallel
        if self.sequence_parallel and not input_is_parallel:
            raise RuntimeError("To enable `sequence_parallel`, `input_is_parallel` must be `True`")
        world_size, rank = self._init_common(config, is_expert, tp_group, overlap_config, settings, layer)
        self.input_size_per_partition = divide(input_size, world_size)
        self._refuse_fp8_without_sequence_parallel(layer)

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
        args = _LinearArgs(self, False, defer_sum=defer_sum, wgrad_handoff=handoff)
        t = get_pg_size(self.tp_group)
        if self.sequence_parallel and input_.shape[0] % t:
            raise ValueError(f"OverlapRowParallelLinear: sequence length {input_.shape[0]} is not divisible by the "
                             f"tensor-parallel size {t} (sequence parallel)")
        _check_main_grad(self.weight, self.gradient_accumulation_fusion)
        if self.fp8 is not None:   # its sum is not deferred and no wgrad handed to it (fp8_linear.py)
            out2d = Fp8RowParallelFn.apply(y2d, self.weight, bias, args, self.fp8, self.fp8_weights)
        else:
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
