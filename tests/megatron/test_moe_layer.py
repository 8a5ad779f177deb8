"""overlap_tp.megatron.moe_layer under gloo (2 and 4 CPU processes, EP = world, TP = 1) against Megatron's own
MoELayer (alltoall dispatcher, SequentialMLP experts), which runs on the CPU with the small workarounds of
`_megatron_on_cpu` (it asks for CUDA streams and devices).

- Both layers are built from the same seed: router, experts and shared experts come out equal
  (OverlapGroupedMLP initialises its stacked weights in SequentialMLP's order) and the expert weights
  carry Megatron's parallel attributes (allreduce, tensor_model_parallel, partition_dim / stride).
- Forward output and the input, router, expert and shared-expert grads agree (CASES): uniform routing,
  skewed routing (one expert takes most tokens), routing that sends every token to the last rank's experts
  (every other rank's tokens all leave it and it receives none); aux loss + z-loss throughout, capacity
  factor with and without padding to capacity, a plain (non-gated) activation, shared experts with a gate,
  moe_apply_probs_on_input, an fp32 sigmoid router. Method off everywhere; decompose and signal (the
  Triton kernel in the CPU interpreter) on the routing extremes.
- sharded_state_dict: the same sharded tensors (keys, shapes, offsets, fragmentation, replica ids, data)
  and _extra_state objects as Megatron's, with and without singleton_local_shards; a checkpoint written
  by either layer loads into the other (Megatron's own load pipeline, in memory).
- A TransformerLayer from get_gpt_layer_overlap_spec(num_experts=...) against the same spec with
  Megatron's MoE module in the MLP slot (what apply() keeps with --overlap-moe off).
- Method auto: its trial calls and the calls after its decision give Megatron's results; one method on every rank.
- Six SGD steps side by side (signal; inputs that repeat, so a cached routing comes back after the weights moved):
  every step's output and grads agree.
Each test spawns its processes once and checks every case inside (process start-up dominates).
"""
import contextlib
import os
import warnings

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core==0.16.1)")

from distributed import run_distributed  # noqa: E402
from overlap_tp import OverlapConfig  # noqa: E402
from problems import SMALL_TILES  # noqa: E402

H, FFN, SHARED_FFN, SEQ, BATCH, LOCAL_EXPERTS = 32, 48, 40, 8, 2, 2
OFF = OverlapConfig(method="off")
DECOMPOSE = OverlapConfig(method="decompose", groups=2, **SMALL_TILES)
SIGNAL = OverlapConfig(method="signal", groups=2, **SMALL_TILES)


class _NoStream:
    """What Megatron's alltoall dispatcher does with its CUDA D2H stream, on the CPU."""

    def wait_stream(self, stream):
        pass

    def record_event(self):
        return self

    def synchronize(self):
        pass


def _megatron_on_cpu():
    """Megatron's MoE asks for CUDA streams (the dispatcher's D2H copies) and moves the router weight to
    torch.cuda.current_device(), its checkpoint save synchronizes CUDA; megatron-core 0.16.1 without TE also
    misses `te_general_gemm`."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from megatron.core.transformer.moe import moe_utils, token_dispatcher
    torch.cuda.Stream = lambda *args, **kwargs: _NoStream()
    torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None   # dist_checkpointing's save
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # the all-to-all split sizes stay tensors on the CPU; gloo wants sequences (Megatron's GPU path: numpy)
    token_dispatcher.maybe_move_tensor_to_cpu = (
        lambda tensor, as_numpy=False, record_stream=False: tensor.numpy() if as_numpy and torch.is_tensor(tensor)
        else tensor)


def _init_megatron(world):
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=world)
    return ps


def _config(world, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig
    values = dict(num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=FFN,
                  num_moe_experts=LOCAL_EXPERTS * world, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                  expert_model_parallel_size=world, use_cpu_initialization=True, params_dtype=torch.bfloat16,
                  bf16=True, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                  add_bias_linear=False, init_method_std=0.05, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
    values.update(overrides)
    return TransformerConfig(**values)


def _spec(ours, shared):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
    from megatron.core.transformer.spec_utils import ModuleSpec
    from overlap_tp.megatron.moe_layer import OverlapGroupedMLP, OverlapMoELayer
    linears = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    experts = OverlapGroupedMLP if ours else ModuleSpec(module=SequentialMLP, submodules=linears)
    return ModuleSpec(module=OverlapMoELayer if ours else MoELayer,
                      submodules=MoESubmodules(experts=experts,
                                               shared_experts=ModuleSpec(module=SharedExpertMLP, submodules=linears)
                                               if shared else None))


def _build(ours, config, overlap_config=OFF):
    from megatron.core.transformer.spec_utils import build_module
    torch.manual_seed(1234)
    layer = build_module(_spec(ours, config.moe_shared_expert_intermediate_size is not None), config=config)
    layer.set_layer_number(1)
    if ours:
        layer.experts.overlap_config = overlap_config
    return layer


def rel_error(got, ref):
    ref = ref.double()
    return float((got.double() - ref).norm() / max(ref.norm(), 1e-12))


def _close(got, ref, what, tol=2e-2):
    got = torch.zeros_like(ref) if got is None else got
    assert got.shape == ref.shape, (what, tuple(got.shape), tuple(ref.shape))
    err = rel_error(got, ref)
    assert err < tol, f"{what}: relative error {err:.3g}"


def _by_megatron_name(layer, get):
    """Megatron's parameter name -> get(param); OverlapGroupedMLP's stacked weights split per expert."""
    out = {}
    for name, param in layer.named_parameters():
        value = get(param)
        if name.endswith(("experts.weight1", "experts.weight2")):
            linear = "linear_fc1" if name.endswith("1") else "linear_fc2"
            for expert in range(value.shape[0]):
                out[f"{name[:-len('weight1')]}local_experts.{expert}.{linear}.weight"] = value[expert]
        else:
            out[name] = value
    return out


def _weight(param):
    return param.detach()


def _grad(param):
    return param.grad if param.grad is not None else torch.zeros_like(param)


def _attributes(param, partition_dim_offset=0):
    """Megatron's parallel attributes; a stacked [L, ...] weight's partition_dim is one further."""
    return (param.tensor_model_parallel, param.partition_dim + partition_dim_offset, param.partition_stride,
            param.allreduce, param.requires_grad)


def _route_to(layer, experts, strength):
    """Bias the router so every token prefers `experts` (strength ~ how strongly); the input carries +1 on
    hidden unit 0, so logit e gains strength * bias[e]."""
    with torch.no_grad():
        for expert, bias in experts.items():
            layer.router.weight[expert, 0] += strength * bias


def _run(layer, x, g):
    x = x.detach().clone().requires_grad_(True)
    out, bias = layer(x)
    assert bias is None
    out.backward(g)
    return out.detach(), x.grad


# name -> (TransformerConfig overrides, router bias {expert: strength})
CASES = {
    "uniform": ({}, {}),
    "skewed": ({}, {0: 1.5}),
    "all to the last rank": ({}, {-2: 3.0, -1: 2.5}),
    "gelu, no GLU": (dict(gated_linear_unit=False, activation_func=torch.nn.functional.gelu), {}),
    "capacity 1.0, drop": (dict(moe_expert_capacity_factor=1.0), {0: 1.0}),
    "capacity 1.5, pad": (dict(moe_expert_capacity_factor=1.5, moe_pad_expert_input_to_capacity=True), {}),
    "shared experts + gate": (dict(moe_shared_expert_intermediate_size=SHARED_FFN, moe_shared_expert_gate=True), {}),
    "probs on input, top-1": (dict(moe_apply_probs_on_input=True, moe_router_topk=1, moe_router_pre_softmax=True),
                              {0: 0.5}),
    "fp32 router, sigmoid": (dict(moe_router_dtype="fp32", moe_router_score_function="sigmoid",
                                  moe_router_topk_scaling_factor=2.0), {}),
}


def _check_layers(rank, world, plan):
    """Every (case, OverlapConfig) of `plan`: ours against Megatron's MoELayer, same seed, same inputs."""
    gen = torch.Generator().manual_seed(100 + rank)
    for case, overlap_config in plan:
        overrides, bias = CASES[case]
        config = _config(world, **overrides)
        ours, ref = _build(True, config, overlap_config), _build(False, config)
        ref_weights = _by_megatron_name(ref, _weight)
        assert _by_megatron_name(ours, _weight).keys() == ref_weights.keys(), case
        for name, weight in _by_megatron_name(ours, _weight).items():
            assert torch.equal(weight, ref_weights[name]), f"{case}: {name} init differs from Megatron's"
        for stacked, linear in ((ours.experts.weight1, ref.experts.local_experts[0].linear_fc1.weight),
                                (ours.experts.weight2, ref.experts.local_experts[0].linear_fc2.weight)):
            assert _attributes(stacked) == _attributes(linear, partition_dim_offset=1), case
        for layer in (ours, ref):
            _route_to(layer, bias, strength=8.0)
        x = torch.randn(SEQ, BATCH, H, generator=gen)
        x[..., 0] = 1.0
        x = x.to(torch.bfloat16)
        counts = ours.token_counts(ours.router(x)[1])
        if case == "skewed":
            assert counts[:, 0].sum() > counts[:, 1:].sum(dim=0).max(), counts
        elif case == "all to the last rank":   # every other rank receives nothing, sends everything
            assert counts[:, :-LOCAL_EXPERTS].sum() == 0 and counts[:, -LOCAL_EXPERTS:].min() > 0, counts
        g = torch.randn(SEQ, BATCH, H, generator=gen).to(torch.bfloat16)
        out, dx = _run(ours, x, g)
        out_ref, dx_ref = _run(ref, x, g)
        what = f"{case}, {overlap_config.method} (world {world}, rank {rank})"
        _close(out, out_ref, what + " output")
        _close(dx, dx_ref, what + " input grad")
        ref_grads = _by_megatron_name(ref, _grad)
        for name, grad in _by_megatron_name(ours, _grad).items():
            _close(grad, ref_grads[name], f"{what} {name} grad", tol=3e-2)


def _check_transformer_layer(rank, world):
    """A TransformerLayer from get_gpt_layer_overlap_spec(num_experts=...) against the same spec with the
    MoE module Megatron's own spec builds in the MLP slot (what apply() keeps with --overlap-moe off)."""
    from megatron.core.transformer.spec_utils import build_module
    from overlap_tp.megatron.layer_spec import get_gpt_layer_overlap_spec
    from overlap_tp.megatron.layers import set_overlap_config
    from overlap_tp.megatron_patches.apply import megatron_moe_spec
    from overlap_tp.megatron.moe_layer import OverlapMoELayer, set_moe_overlap_config
    config = _config(world, normalization="RMSNorm", num_query_groups=2, hidden_dropout=0.0, attention_dropout=0.0)
    spec = get_gpt_layer_overlap_spec(num_experts=config.num_moe_experts, normalization="RMSNorm")
    twin = get_gpt_layer_overlap_spec(num_experts=config.num_moe_experts, normalization="RMSNorm")
    twin.submodules.mlp = megatron_moe_spec(config)
    gen = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(SEQ, BATCH, H, generator=gen).to(torch.bfloat16)
    g = torch.randn(SEQ, BATCH, H, generator=gen).to(torch.bfloat16)
    runs = []
    for layer_spec in (spec, twin):
        torch.manual_seed(99)
        layer = build_module(layer_spec, config=config, layer_number=1)
        set_overlap_config(layer, OFF)
        set_moe_overlap_config(layer, SIGNAL)
        runs.append((layer, *_run(layer, x, g)))
    (layer, out, dx), (ref, out_ref, dx_ref) = runs
    assert isinstance(layer.mlp, OverlapMoELayer) and layer.is_moe_layer and layer.fused_attn_norm
    assert type(ref.mlp).__name__ == "MoELayer"
    _close(out, out_ref, "TransformerLayer output")
    _close(dx, dx_ref, "TransformerLayer input grad")
    weights, ref_weights = _by_megatron_name(layer, _weight), _by_megatron_name(ref, _weight)
    grads, ref_grads = _by_megatron_name(layer, _grad), _by_megatron_name(ref, _grad)
    assert weights.keys() == ref_weights.keys()
    for name in weights:
        assert torch.equal(weights[name], ref_weights[name]), f"TransformerLayer {name}: init differs"
        _close(grads[name], ref_grads[name], f"TransformerLayer {name} grad", tol=3e-2)
    assert "pre_mlp_layernorm.weight" in layer.sharded_state_dict()   # kept, as Megatron's TE MoE spec


def _check_auto(rank, world):
    """method auto: the trial calls (off, signal and decompose in turn) and the calls after the decision all give Megatron's
    results, and every rank keeps the same method."""
    import torch.distributed as dist

    from overlap_tp.megatron.moe_auto import METHODS, TRIALS, WARMUP
    config = _config(world)
    ours = _build(True, config, OverlapConfig(method="auto", groups=2, **SMALL_TILES))
    ref = _build(False, config)
    gen = torch.Generator().manual_seed(300 + rank)
    x = torch.randn(SEQ, BATCH, H, generator=gen).to(torch.bfloat16)
    g = torch.randn(SEQ, BATCH, H, generator=gen).to(torch.bfloat16)
    out_ref, dx_ref = _run(ref, x, g)
    for call in range(len(METHODS) * (WARMUP + TRIALS) + 1):   # the default schedule, then the call that decides
        ours.zero_grad(set_to_none=True)
        out, dx = _run(ours, x, g)
        _close(out, out_ref, f"auto call {call} output")
        _close(dx, dx_ref, f"auto call {call} input grad")
    chosen = [None] * world
    dist.all_gather_object(chosen, ours.experts._trial.chosen)
    assert chosen[0] in METHODS and chosen == chosen[:1] * world, chosen
    assert ours.experts.layer_name == "MoE layer 1"


def _check_ep2(rank, world, plan):
    _megatron_on_cpu()
    ps = _init_megatron(world)
    _check_layers(rank, world, plan)
    _check_auto(rank, world)
    _check_checkpoints(rank, world, ps)
    _check_transformer_layer(rank, world)
    ps.destroy_model_parallel()


def _check_ep4(rank, world, plan):
    _megatron_on_cpu()
    ps = _init_megatron(world)
    _check_layers(rank, world, plan)
    ps.destroy_model_parallel()


def test_ep2_layer_and_checkpoints_match_megatron():
    """Every case with method off, the routing extremes with decompose and signal (interpreted kernel)."""
    plan = [(case, OFF) for case in CASES] + [(case, config) for case in ("skewed", "all to the last rank")
                                              for config in (DECOMPOSE, SIGNAL)]
    run_distributed(2, _check_ep2, plan)


def test_ep4_layer_matches_megatron():
    run_distributed(4, _check_ep4, [(case, config) for case in ("uniform", "all to the last rank")
                                    for config in (OFF, SIGNAL)])


def _check_training_steps(rank, world):
    """Ours (signal) and Megatron's MoELayer trained side by side: each step a new input (three inputs, twice: a
    routing seen before comes back, its cached state reused, after the weights moved), the same SGD update of every
    parameter from each layer's own grads; every step's output, input grad and parameter grads agree. What one
    forward + backward cannot show: state that outlives a step (per-routing plans, buffers, the router's) going
    stale once the weights and the routing change (on GPUs such state once made mixtral-proxy's loss leave off's after
    7 steps)."""
    _megatron_on_cpu()
    _init_megatron(world)
    from megatron.core import parallel_state as ps
    config = _config(world)
    ours, ref = _build(True, config, SIGNAL), _build(False, config)
    gen = torch.Generator().manual_seed(300 + rank)
    inputs = []
    for _ in range(3):
        x = torch.randn(SEQ, BATCH, H, generator=gen)
        x[..., 0] = 1.0
        inputs.append((x.to(torch.bfloat16), torch.randn(SEQ, BATCH, H, generator=gen).to(torch.bfloat16)))
    lr = 0.05
    for step, (x, g) in enumerate(inputs + inputs):
        for layer in (ours, ref):
            layer.zero_grad(set_to_none=True)
        out, dx = _run(ours, x, g)
        out_ref, dx_ref = _run(ref, x, g)
        what = f"step {step} (world {world}, rank {rank})"
        _close(out, out_ref, what + " output", tol=3e-2)
        _close(dx, dx_ref, what + " input grad", tol=3e-2)
        grads, ref_grads = _by_megatron_name(ours, _grad), _by_megatron_name(ref, _grad)
        for name, grad in grads.items():
            _close(grad, ref_grads[name], f"{what} {name} grad", tol=5e-2)
        with torch.no_grad():   # plain SGD on every parameter, from each layer's own grads
            for layer, layer_grads in ((ours, grads), (ref, ref_grads)):
                for name, weight in _by_megatron_name(layer, _weight).items():
                    weight.sub_(lr * layer_grads[name].to(weight.dtype))
    ps.destroy_model_parallel()


def test_ep2_training_steps_match_megatron():
    run_distributed(2, _check_training_steps)


# ---------------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------------

def _sharded_summary(sharded_state_dict):
    """Every sharded tensor / object, factories built, as comparable tuples (data included)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories
    apply_factories(sharded_state_dict)
    summary = []
    for value in nested_values(sharded_state_dict):
        if isinstance(value, ShardedTensor):
            summary.append(("tensor", value.key, tuple(value.local_shape), tuple(value.global_shape),
                            tuple(value.global_offset), tuple(value.axis_fragmentations), value.replica_id,
                            value.prepend_axis_num, value.dtype, tuple(value.data.float().flatten().tolist())))
        else:
            assert isinstance(value, ShardedObject), type(value)
            summary.append(("object", value.key, value.global_shape, value.global_offset, value.replica_id,
                            value.data))
    return sorted(summary, key=repr)


def _load_checkpoint_of(source, target):
    """Load into `target` what a distributed checkpoint written by `source` holds, without the files (the
    writer forks, which can hang next to gloo's threads): Megatron's own load_preprocess, every shard found
    by (key, global offset) among the shards `source` writes, then Megatron's factory merges."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factories, apply_factory_merges
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
    written = source.sharded_state_dict()
    apply_factories(written)
    saved = {(value.key, tuple(value.global_offset)): value.data for value in nested_values(written)}
    sharded, nonpersistent, factories = load_preprocess(target.sharded_state_dict())
    assert not nonpersistent
    dict_list_map_inplace(lambda value: _copy(saved[(value.key, tuple(value.global_offset))]), sharded)
    target.load_state_dict(apply_factory_merges(sharded, factories))


def _copy(data):
    return data.clone() if torch.is_tensor(data) else data


def _check_checkpoints(rank, world, ps):
    """Our sharded_state_dict equals Megatron's (factories built), and a checkpoint written by either
    layer loads into the other."""
    for gated in (True, False):
        config = _config(world, gated_linear_unit=gated, moe_shared_expert_intermediate_size=SHARED_FFN)
        ours, ref = _build(True, config), _build(False, config)
        for singleton in (False, True):
            metadata = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True),
                        "singleton_local_shards": singleton}
            offsets = ((0, 3, 5),)   # e.g. layer 3 of 5, as a TransformerBlock passes it
            got = _sharded_summary(ours.sharded_state_dict("decoder.layers.mlp.", offsets, dict(metadata)))
            want = _sharded_summary(ref.sharded_state_dict("decoder.layers.mlp.", offsets, dict(metadata)))
            assert got == want, f"gated={gated} singleton={singleton}: sharded state dicts differ"
        # a checkpoint written by either layer loads into the other
        for source, into_ours in ((ref, True), (ours, False)):
            target = _build(into_ours, config)
            with torch.no_grad():
                for param in target.parameters():
                    param.zero_()
            _load_checkpoint_of(source, target)
            loaded, wanted = _by_megatron_name(target, _weight), _by_megatron_name(source, _weight)
            assert loaded.keys() == wanted.keys()
            for name, weight in loaded.items():
                assert torch.equal(weight, wanted[name]), f"gated={gated} into ours={into_ours}: {name}"


def _graph_config(**overrides):
    """The options check_moe_config reads, at values it accepts."""
    from types import SimpleNamespace
    values = dict(moe_token_dispatcher_type="alltoall", expert_tensor_parallel_size=1, add_bias_linear=False,
                  fp8=None, fp4=None, moe_router_padding_for_quantization=False, moe_shared_expert_overlap=False,
                  moe_latent_size=None, overlap_moe_expert_parallel_comm=False,
                  overlap_dispatch_backward_with_experts_wgrad=False, delay_wgrad_compute=False,
                  transformer_impl="local", cuda_graph_impl="none", cuda_graph_modules=None,
                  moe_pad_expert_input_to_capacity=False, moe_expert_capacity_factor=None,
                  recompute_granularity=None, recompute_modules=None, moe_apply_probs_on_input=False,
                  moe_router_topk=2)
    values.update(overrides)
    return SimpleNamespace(**values)


@pytest.mark.parametrize("impl, modules", [("local", None), ("full_iteration", None), ("local", ["moe"])])
def test_cuda_graphs_over_the_moe_layer_need_static_token_counts(impl, modules):
    """Dropless routing sends the counts to the host every step: refused under Megatron's graphs, naming the
    flags that make the sizes static; with padding to capacity the layer is built (its counts are host
    constants, so the expert ops' plans are reused by every replay)."""
    from overlap_tp.megatron.moe_layer import check_moe_config
    with pytest.raises(NotImplementedError, match="--moe-pad-expert-input-to-capacity"):
        check_moe_config(_graph_config(cuda_graph_impl=impl, cuda_graph_modules=modules))
    check_moe_config(_graph_config(cuda_graph_impl=impl, cuda_graph_modules=modules,
                                   moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True))
    with pytest.raises(NotImplementedError, match="--moe-expert-capacity-factor"):   # padding without a capacity
        check_moe_config(_graph_config(cuda_graph_impl=impl, cuda_graph_modules=modules,
                                       moe_pad_expert_input_to_capacity=True))
    check_moe_config(_graph_config(cuda_graph_impl="local", cuda_graph_modules=["attn"]))   # attention only
