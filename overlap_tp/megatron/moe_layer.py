"""Megatron's MoE layer on overlap_tp's expert ops (docs/moe_layer.md).

    OverlapMoELayer     megatron.core.transformer.moe.moe_layer.MoELayer for the `mlp` slot of a layer spec
    OverlapGroupedMLP   its experts: every local expert's fc1 and fc2 weights as one stacked parameter each

What runs (alltoall-dispatcher semantics, expert TP = 1, EP >= 1):

    shared experts            Megatron's SharedExpertMLP, as MoELayer runs it (before routing)
    route                     Megatron's router (TopKRouter: aux losses, z-loss, capacity / token drop)
    counts                    per-expert token counts all-gathered over the EP group -> [ep, E] on the
                              host (the one host sync, where Megatron's alltoall dispatcher has its own)
    permute                   Megatron's moe_utils.permute (rows grouped by global expert)
    fc1 + dispatch            a2a_gemm(x, counts, weight1): the all-to-all overlapped with the grouped GEMM
    activation                SwiGLU (config.gated_linear_unit) or config.activation_func
    fc2 + combine             gemm_a2a(h, counts, weight2): the grouped GEMM overlapped with the all-to-all
    unpermute                 Megatron's moe_utils.unpermute with the routing probabilities (the
                              probability-weighted combine; moe_apply_probs_on_input scales the input instead)

The methods (off, signal, ...) come from an OverlapConfig: the experts' `overlap_config` attribute, or where
it is None their settings' (OverlapSettings.moe, carried by the layer spec; unset: every field left to the expert
ops' resolver, ops/resolve.py), read at every call.

Expert weights (OverlapGroupedMLP): weight1 [L, N, H] (N = 2F with a gated linear unit, gate rows first, as
Megatron's fc1) and weight2 [L, H, F]: expert l's slice is the nn.Linear weight of Megatron's
SequentialMLP `local_experts.{l}.linear_fc1.weight` / `linear_fc2.weight`, initialised in the same order
with the same init methods (equal weights for the same seed). The ops read the stacked parameters as they
are: no per-step stacking copy. `sharded_state_dict` writes every expert under SequentialMLP's keys and
sharding, so distributed checkpoints interchange with Megatron's SequentialMLP, GroupedMLP and TEGroupedMLP.
"""
import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.parameter import Parameter

try:
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
    from megatron.core.tensor_parallel.layers import (
        _initialize_affine_weight_cpu,
        _initialize_affine_weight_gpu,
        set_tensor_model_parallel_attributes,
    )
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.moe_utils import get_capacity, permute, unpermute
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_object_for_checkpoint
    from megatron.core.utils import get_pg_rank, get_pg_size
except ImportError as error:  # pragma: no cover - exercised only without megatron-core
    raise ImportError("overlap_tp.megatron.moe_layer needs megatron-core (pip install -e '.[megatron]' in the checkout, or "
                      "'megatron-core>=0.16')") from error

from overlap_tp.megatron.moe_auto import MethodTrial
from overlap_tp.ops import comm
from overlap_tp.ops.config import OverlapConfig
from overlap_tp.megatron.settings import DEFAULT_SETTINGS, OverlapSettings
from overlap_tp.ops.expert import a2a_gemm, gemm_a2a

__all__ = ["OverlapGroupedMLP", "OverlapMoELayer", "check_moe_config", "set_moe_overlap_config"]

def set_moe_overlap_config(model: torch.nn.Module, config: Optional[OverlapConfig]) -> int:
    """Set `overlap_config` on the experts of every OverlapMoELayer of `model`; returns how many were set."""
    count = 0
    for module in model.modules():
        if isinstance(module, OverlapGroupedMLP):
            module.overlap_config = config
            count += 1
    return count


def _check_overlap_config(config, what):
    if not isinstance(config, OverlapConfig):
        raise TypeError(f"{what} must be an OverlapConfig, got {type(config).__name__}")
    return config


def _captures_moe_in_cuda_graphs(config) -> bool:
    if getattr(config, "cuda_graph_impl", "none") == "none":
        return False
    scope = getattr(config, "cuda_graph_modules", None) or getattr(config, "cuda_graph_scope", None)  # 0.19 / 0.16
    scope = [scope] if isinstance(scope, str) or not isinstance(scope, (list, tuple)) else scope
    names = {getattr(item, "name", item) for item in scope if item is not None}
    return not names or "full" in names or bool(names & {"moe", "moe_router", "moe_preprocess"})


def check_moe_config(config, expert_tp_size: int = 1):
    """Refuse, before any weight exists, what OverlapMoELayer does not implement (messages say what to change)."""
    refuse = []
    if config.moe_token_dispatcher_type != "alltoall":
        refuse.append(f"moe_token_dispatcher_type={config.moe_token_dispatcher_type!r}: the expert ops carry "
                      f"the alltoall dispatcher's all-to-all (--moe-token-dispatcher-type alltoall)")
    if expert_tp_size > 1 or (getattr(config, "expert_tensor_parallel_size", None) or 1) > 1:
        refuse.append("expert tensor parallelism > 1: the expert ops move whole tokens between the EP ranks and run "
                      "each expert's whole fc1 / fc2 on one rank, with no AllGather / ReduceScatter inside an expert "
                      "(--expert-tensor-parallel-size 1, or Megatron's MoE layer: --overlap-moe off)")
    if config.add_bias_linear:
        refuse.append("expert biases (add_bias_linear=True): the grouped expert GEMMs have none "
                      "(--disable-bias-linear)")
    for option in ("fp8", "fp4"):
        if getattr(config, option, None):
            refuse.append(f"{option}={getattr(config, option)!r}: the expert ops are bf16/fp16 GEMMs")
    if getattr(config, "moe_router_padding_for_quantization", False):
        refuse.append("moe_router_padding_for_quantization: that pads routes for FP8/FP4 GEMMs")
    if config.moe_shared_expert_overlap:
        refuse.append("moe_shared_expert_overlap: it runs the shared experts inside Megatron's dispatcher, which "
                      "this layer replaces; without it they run as in MoELayer, before routing, on overlap_tp's dense "
                      "linears (drop --moe-shared-expert-overlap; validate_overlap_args turns it off with a warning)")
    if getattr(config, "moe_latent_size", None):
        refuse.append("moe_latent_size (MoE latent projections)")
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        refuse.append("overlap_moe_expert_parallel_comm: Megatron's 1F1B EP overlap drives its own dispatcher "
                      "(drop --overlap-moe-expert-parallel-comm; overlap_tp overlaps the all-to-all itself)")
    if getattr(config, "overlap_dispatch_backward_with_experts_wgrad", False):
        refuse.append("overlap_dispatch_backward_with_experts_wgrad")
    if getattr(config, "delay_wgrad_compute", False):
        refuse.append("delay_wgrad_compute: the expert wgrads run inside backward")
    if getattr(config, "transformer_impl", None) == "inference_optimized":
        refuse.append("transformer_impl='inference_optimized' (its inference dispatchers)")
    static_sizes = config.moe_expert_capacity_factor is not None and config.moe_pad_expert_input_to_capacity
    if _captures_moe_in_cuda_graphs(config) and not static_sizes:   # Megatron's own rule for its MoE graphs
        refuse.append("CUDA graphs over a dropless MoE layer: its token counts reach the host every step, so "
                      "the expert ops' sizes change between replays (capture with static sizes: "
                      "--moe-expert-capacity-factor F --moe-pad-expert-input-to-capacity; or capture attention "
                      "only, or cuda_graph_impl='none')")
    if config.recompute_granularity == "selective" and "moe_act" in (config.recompute_modules or ()):
        refuse.append("recompute_modules 'moe_act' (use 'moe' to recompute the whole MoE layer)")
    if config.moe_apply_probs_on_input and config.moe_router_topk != 1:
        refuse.append("moe_apply_probs_on_input with moe_router_topk != 1 (Megatron's rule too)")
    if refuse:
        raise NotImplementedError("OverlapMoELayer does not support " + "; ".join(refuse))


class OverlapGroupedMLP(MegatronModule):
    """The local experts of an OverlapMoELayer: weight1 [L, N, H] and weight2 [L, H, F], nn.Linear layout per
    expert (N = 2F with a gated linear unit). `forward(tokens, counts)` runs fc1 + dispatch (a2a_gemm), the
    activation and fc2 + combine (gemm_a2a) over the EP group.

    Parameters carry Megatron's attributes for expert weights: allreduce=False where Megatron's expert
    linears use the expert process groups (EP > 1, or expert TP different from TP), so Megatron's DDP
    reduces their grads over the expert data-parallel group; tensor_model_parallel with partition_dim the
    N (weight1) or F (weight2) axis. Their grads come from autograd (bf16/fp16), also with
    gradient_accumulation_fusion: Megatron's DDP hook adds them into main_grad.
    """

    def __init__(self, num_local_experts: int, config, pg_collection=None, name: Optional[str] = None,
                 overlap_config: Optional[OverlapConfig] = None, settings: Optional[OverlapSettings] = None):
        """Built by MoELayer like Megatron's experts (megatron-core >= 0.19 also passes `name`, unused); settings: the
        layer spec's OverlapSettings (its `moe` config where overlap_config is None)."""
        super().__init__(config=config)
        if pg_collection is None:
            raise ValueError("OverlapGroupedMLP needs the MoE layer's pg_collection (ep, expt_tp, expt_dp groups)")
        self.num_local_experts = num_local_experts
        self.ep_group, self.tp_group, self.dp_group = pg_collection.ep, pg_collection.expt_tp, pg_collection.expt_dp
        check_moe_config(config, get_pg_size(self.tp_group))
        if config.params_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"OverlapGroupedMLP: config.params_dtype={config.params_dtype}: the expert ops run "
                             f"bf16 or fp16 GEMMs (train with --bf16 or --fp16)")
        self.overlap_config = overlap_config
        if settings is not None and not isinstance(settings, OverlapSettings):
            raise TypeError(f"OverlapGroupedMLP: settings must be an OverlapSettings, got {type(settings).__name__}")
        self.settings = settings if settings is not None else DEFAULT_SETTINGS
        self.layer_name = name or "MoE experts"   # in method auto's messages; OverlapMoELayer names its layer
        self._trial = None   # method 'auto': its MethodTrial, made at the first call
        hidden, ffn = config.hidden_size, config.moe_ffn_hidden_size
        fc1_rows = 2 * ffn if config.gated_linear_unit else ffn
        fc1_stride = 2 if config.gated_linear_unit and not getattr(config, "use_kitchen", False) else 1
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight1 = Parameter(torch.empty(num_local_experts, fc1_rows, hidden, device=device,
                                             dtype=config.params_dtype))
        self.weight2 = Parameter(torch.empty(num_local_experts, hidden, ffn, device=device,
                                             dtype=config.params_dtype))
        if config.perform_initialization:
            # SequentialMLP's order: expert 0 fc1, expert 0 fc2, expert 1 fc1, ... (same RNG draws)
            for expert in range(num_local_experts):
                self._init_expert_weight(self.weight1[expert], config.init_method, 0, fc1_stride)
                self._init_expert_weight(self.weight2[expert], config.output_layer_init_method, 1, 1)
        use_expert_groups = (get_pg_size(self.ep_group) > 1
                             or (config.expert_tensor_parallel_size or config.tensor_model_parallel_size)
                             != config.tensor_model_parallel_size)
        for weight, partition_dim, stride in ((self.weight1, 1, fc1_stride), (self.weight2, 2, 1)):
            set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
            setattr(weight, "allreduce", not use_expert_groups)
        # the sharded state dict carries SequentialMLP's per-expert _extra_state objects; loading one
        # must not count them as unexpected (Megatron's GroupedMLP does the same)
        self.register_load_state_dict_post_hook(_drop_extra_state_keys)

    def _init_expert_weight(self, weight, init_method, partition_dim, stride):
        """Megatron's own initialisation of one expert's [out, in] weight (ColumnParallelLinear /
        RowParallelLinear with is_expert=True at expert TP = 1)."""
        if self.config.use_cpu_initialization:
            _initialize_affine_weight_cpu(weight, weight.shape[0], weight.shape[1], weight.shape[partition_dim],
                                          partition_dim, init_method, stride=stride,
                                          params_dtype=self.config.params_dtype, rank=0, world_size=1,
                                          skip_set_tensor_parallel_attributes=True)
        else:
            _initialize_affine_weight_gpu(weight, init_method, partition_dim, stride=stride, is_expert=True)

    def __setattr__(self, name, value):
        if name == "overlap_config" and value is not None:
            _check_overlap_config(value, "overlap_config")
        super().__setattr__(name, value)

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor,
                device_counts: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens [T, H] permuted by global expert, counts [ep, E] (host) -> expert outputs [T, H], same order.
        device_counts: the same counts on the GPU (OverlapMoELayer's), for the expert ops' tile tables."""
        config = (self.overlap_config if self.overlap_config is not None else self.settings.moe
                  if self.settings.moe is not None else OverlapConfig())
        timer = None
        if config.method in (None, "auto"):   # unset is auto: off, signal, decompose tried in the first calls, the
            # fastest kept (moe_auto.py)
            if self._trial is None:
                self._trial = MethodTrial(self.ep_group, tokens.device, what=self.layer_name)
            method, timer = self._trial.next_call()
            config = dataclasses.replace(config, method=method)
        if timer is not None:
            timer.record_start()
        # counts come from token_counts' all-gather (or the capacity, the same everywhere): equal on every rank by
        # construction, so the ops skip their per-routing cross-rank check (a round trip through the store)
        fc1 = a2a_gemm(tokens, counts, self.weight1, self.ep_group, config=config, counts_agreed=True,
                       device_counts=device_counts)
        out = gemm_a2a(self.activation(fc1), counts, self.weight2, self.ep_group, config=config, counts_agreed=True,
                       device_counts=device_counts)
        if timer is not None:
            timer.record_end()
        return out

    def activation(self, fc1: torch.Tensor) -> torch.Tensor:
        """Megatron's expert activation: GLU (activation of the first half times the second half, with
        config's clamp and linear offset) or config.activation_func; Megatron's fused SwiGLU where
        config.bias_activation_fusion picks it."""
        config = self.config
        if not config.gated_linear_unit:
            return config.activation_func(fc1)
        clamp = getattr(config, "activation_func_clamp_value", None)
        offset = getattr(config, "glu_linear_offset", 0.0)
        if config.bias_activation_fusion and config.activation_func is F.silu and clamp is None and offset == 0:
            return bias_swiglu_impl(fc1, None)
        x_glu, x_linear = torch.chunk(fc1, 2, dim=-1)
        if clamp is not None:
            x_glu = x_glu.clamp(min=None, max=clamp)
            x_linear = x_linear.clamp(min=-clamp, max=clamp)
        return config.activation_func(x_glu) * (x_linear + offset)

    def backward_dw(self):
        """The wgrads run inside backward (delay_wgrad_compute is refused at construction)."""

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """SequentialMLP's sharded tensors: expert g's fc1/fc2 weights under `{prefix}experts.linear_fc1.weight`
        / `linear_fc2.weight` at offset g of a prepended [E] axis (`{prefix}experts.{g}.` keys with
        metadata singleton_local_shards), a gated fc1 split into its two halves; plus SequentialMLP's
        per-expert _extra_state objects. One ShardedTensorFactory per stacked parameter, whose data is
        the parameter itself, so Megatron's optimizers find their states by it."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        singleton = metadata.get("singleton_local_shards", False)
        ep_rank, ep_size = get_pg_rank(self.ep_group), get_pg_size(self.ep_group)
        first, num_experts = ep_rank * self.num_local_experts, ep_size * self.num_local_experts
        dp_rank = get_pg_rank(self.dp_group)
        expert_prefix = f"{prefix}experts."

        def expert_offsets(expert):
            return tuple(sharded_offsets) if singleton else \
                (*sharded_offsets, (len(sharded_offsets), first + expert, num_experts))

        def build(glu):
            @torch.no_grad()
            def build_fn(key, data, replica_id, flattened_range):
                if flattened_range is not None:
                    raise NotImplementedError("OverlapGroupedMLP: flattened optimizer-state formats "
                                              "(fully_sharded_model_space) are not supported; use "
                                              "dp_reshardable or fully_reshardable")
                tensors = []
                for expert in range(self.num_local_experts):
                    offsets = expert_offsets(expert)
                    axis = len(offsets)
                    key_e = key.replace(expert_prefix, f"{expert_prefix}{first + expert}.") if singleton else key
                    if not glu:
                        parts = [(key_e, data[expert], ())]
                    elif singleton:
                        w, v = torch.chunk(data[expert], 2, dim=0)
                        parts = [(f"{key_e}_w", w, ()), (f"{key_e}_v", v, ())]
                    else:
                        w, v = torch.chunk(data[expert], 2, dim=0)
                        parts = [(key_e, w, ((axis, 0, 2),)), (key_e, v, ((axis, 1, 2),))]
                    tensors.append([ShardedTensor.from_rank_offsets(k, t, *offsets, *extra, replica_id=replica_id,
                                                                    prepend_axis_num=axis)
                                    for k, t, extra in parts])
                return tensors

            @torch.no_grad()
            def merge_fn(loaded):
                return torch.stack([torch.cat(parts) for parts in loaded])

            return build_fn, merge_fn

        sharded = {}
        for name, module, glu in (("weight1", "linear_fc1", self.config.gated_linear_unit),
                                  ("weight2", "linear_fc2", False)):
            build_fn, merge_fn = build(glu)
            sharded[f"{prefix}{name}"] = ShardedTensorFactory(f"{expert_prefix}{module}.weight", getattr(self, name),
                                                              build_fn, merge_fn, (0, 0, dp_rank))
        tp_rank = get_pg_rank(self.tp_group)
        for expert in range(self.num_local_experts):
            for module in ("linear_fc1", "linear_fc2"):
                key = f"{expert_prefix}{first + expert}.{module}._extra_state" if singleton else \
                    f"{expert_prefix}{module}._extra_state"
                sharded[f"{prefix}local_experts.{expert}.{module}._extra_state"] = make_sharded_object_for_checkpoint(
                    None, key, expert_offsets(expert), (0, tp_rank, dp_rank))
        return sharded

    def extra_repr(self):
        return (f"local_experts={self.num_local_experts}, weight1={tuple(self.weight1.shape)}, "
                f"weight2={tuple(self.weight2.shape)}, EP={get_pg_size(self.ep_group)}")


def _drop_extra_state_keys(module, incompatible_keys):
    for key in list(incompatible_keys.unexpected_keys):
        if key.endswith("_extra_state"):
            incompatible_keys.unexpected_keys.remove(key)


class OverlapMoELayer(MoELayer):
    """Megatron's MoELayer whose dispatch, experts and combine run as two overlapped ops:
    a2a_gemm (all-to-all + fc1) and gemm_a2a (fc2 + all-to-all), on OverlapGroupedMLP experts.

    Built like MoELayer (config, submodules with router / experts / shared_experts, layer_number,
    pg_collection and, on megatron-core >= 0.19, is_mtp_layer and name); `submodules.experts` must build an
    OverlapGroupedMLP. Megatron's router, aux losses, z-loss, capacity factor (with or without padding to
    capacity), moe_apply_probs_on_input, shared experts and "moe" / "shared_experts" recompute behave as in
    MoELayer; what does not is refused at construction (`check_moe_config`). Megatron's token dispatcher
    is not used (`token_dispatcher` is None).
    """

    def __init__(self, config, submodules=None, layer_number: Optional[int] = None, pg_collection=None, **kwargs):
        check_moe_config(config)
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         pg_collection=pg_collection, **kwargs)
        if not isinstance(self.experts, OverlapGroupedMLP):
            raise TypeError(f"OverlapMoELayer: submodules.experts built {type(self.experts).__name__}; the "
                            f"overlapped dispatch/combine needs OverlapGroupedMLP (get_gpt_layer_overlap_spec)")
        self.token_dispatcher = None   # tokens move through a2a_gemm / gemm_a2a
        self.experts.layer_name = f"MoE layer {layer_number}" if layer_number is not None else "MoE layer"
        self.ep_rank = get_pg_rank(self.ep_group)

    def set_layer_number(self, layer_number: int):
        super().set_layer_number(layer_number)
        self.experts.layer_name = f"MoE layer {layer_number}"   # method auto's messages name the layer

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None,
                padding_mask: Optional[torch.Tensor] = None):
        """hidden_states [s, b, h] (the sequence shard under SP) -> (output [s, b, h], None)."""
        if intermediate_tensors is not None:
            raise NotImplementedError("OverlapMoELayer: partial CUDA-graph capture (intermediate_tensors) is "
                                      "not supported")
        if self.training and self.attn_tp_group.size() > 1 and not self.config.sequence_parallel:
            raise ValueError("During training, performance may degrade if MoE and tensor parallelism"
                             "are enabled without also enabling sequence parallelism.")
        if padding_mask is not None:   # [b, s] -> [s, b], as MoELayer
            padding_mask = padding_mask.transpose(0, 1).bool()
        if self.moe_layer_recompute and self.training:
            output = tensor_parallel.checkpoint(self._forward, False, hidden_states, padding_mask)
        else:
            output = self._forward(hidden_states, padding_mask)
        return output, None

    def _forward(self, hidden_states, padding_mask):
        config = self.config
        shared_expert_output = self.shared_experts_compute(hidden_states)
        probs, routing_map = self.route(hidden_states, padding_mask)
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        device_counts, counts = self._counts(routing_map)
        drop_and_pad = config.moe_pad_expert_input_to_capacity
        on_input = config.moe_apply_probs_on_input
        # The permute's row count without waiting for the counts where Megatron's dispatcher knows it too (dropless:
        # every token to top-k experts), so the permute is queued before the host waits for the counts' copy
        dropless = config.moe_expert_capacity_factor is None and not drop_and_pad
        out_rows = tokens.shape[0] * config.moe_router_topk if dropless else int(counts()[self.ep_rank].sum())
        permuted, permuted_probs, sorted_indices = permute(
            tokens, routing_map, probs=probs if on_input else None, num_out_tokens=out_rows,
            fused=config.moe_permute_fusion, drop_and_pad=drop_and_pad)[:3]   # 0.19 returns two more
        counts = counts()
        sent = int(counts[self.ep_rank].sum())
        if sent != out_rows:
            raise RuntimeError(f"OverlapMoELayer: the router sent {sent} rows from this rank, the permute made "
                               f"{out_rows} (tokens x moe_router_topk for a dropless router)")
        if on_input:
            permuted = (permuted_probs.unsqueeze(-1) * permuted).to(permuted.dtype)
        expert_output = self.experts(permuted, counts, device_counts)
        output = unpermute(expert_output, sorted_indices, restore_shape=tokens.shape,
                           probs=None if on_input else probs, routing_map=routing_map,
                           fused=config.moe_permute_fusion, drop_and_pad=drop_and_pad)
        output = output.view(hidden_states.shape)
        if shared_expert_output is not None:
            output = output + shared_expert_output
        return output

    def token_counts(self, routing_map: torch.Tensor, wait: bool = True):
        """counts [ep, E] (CPU int64, equal on every EP rank): rows rank r sends to global expert e. wait=False:
        a function returning them, the copy to the host queued now and waited for at its call (work queued in
        between runs on the GPU while the host waits)."""
        host = self._counts(routing_map)[1]
        return host() if wait else host

    def _counts(self, routing_map: torch.Tensor):
        """(the counts on the GPU, or None where they are made on the host; token_counts(wait=False)): the expert
        ops build the dispatch's tile table from the GPU's copy, the host's arrives behind it."""
        counts = self._device_counts(routing_map)
        if not counts.is_cuda:
            counts = counts.cpu()
            return None, (lambda: counts)
        host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
        host.copy_(counts, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()

        def finish():
            copied.synchronize()
            return host
        return counts, finish

    def _device_counts(self, routing_map: torch.Tensor) -> torch.Tensor:
        """token_counts on routing_map's device (the capacity's on the host)."""
        ep = get_pg_size(self.ep_group)
        num_experts = self.config.num_moe_experts
        if self.config.moe_pad_expert_input_to_capacity:   # every (rank, expert) block is exactly `capacity` rows
            capacity = get_capacity(num_tokens=routing_map.shape[0] * self.config.moe_router_topk,
                                    num_experts=num_experts, capacity_factor=self.config.moe_expert_capacity_factor)
            if capacity > routing_map.shape[0]:
                raise ValueError(f"OverlapMoELayer: expert capacity {capacity} exceeds the {routing_map.shape[0]} "
                                 f"tokens of this rank; lower moe_expert_capacity_factor")
            return torch.full((ep, num_experts), capacity, dtype=torch.int64)
        local = routing_map.sum(dim=0, dtype=torch.int64).view(1, num_experts)
        return comm.all_gather_rows(local, self.ep_group)[0] if ep > 1 else local
