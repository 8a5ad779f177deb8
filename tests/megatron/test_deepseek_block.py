"""A DeepSeek-V3-style decoder block under gloo (2 CPU processes: TP 2 with sequence parallelism, EP 2, expert TP 1):
overlap_tp's block spec as `--moe-layer-freq "[0,1]"` builds it (apply.overlap_layer_spec: a dense layer, then an
OverlapMoELayer with a shared expert, both with multi-latent attention) against the same block of Megatron's layers
(its MLASelfAttention on ColumnParallelLinear / RowParallelLinear, its dense MLP, its MoELayer with the alltoall
dispatcher and SequentialMLP experts), built from the same seed with the routing forced alike: equal parameters, and
output, input grad and every parameter grad within bf16 rounding (methods off; tests/gpu/test_deepseek_block_gpu.py
runs the same on the GPU with the p2p transports)."""
import os
import sys

import pytest
import torch

pytest.importorskip("megatron.core", reason="the layer spec needs megatron-core")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from distributed import run_distributed  # noqa: E402
from problems import per_expert  # noqa: E402

SEQ, BATCH, HIDDEN, EXPERTS = 16, 2, 64, 4


def _config(world):
    import warnings
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MLATransformerConfig(
            num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=128, multi_latent_attention=True,
            q_lora_rank=24, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, rope_type="rope",
            normalization="RMSNorm", qk_layernorm=True, use_cpu_initialization=True, params_dtype=torch.bfloat16,
            bf16=True, tensor_model_parallel_size=world, sequence_parallel=True, hidden_dropout=0.0,
            attention_dropout=0.0, add_bias_linear=False, gated_linear_unit=True, init_method_std=0.05,
            apply_rope_fusion=False, num_moe_experts=EXPERTS, moe_layer_freq=[0, 1], moe_ffn_hidden_size=48,
            moe_shared_expert_intermediate_size=40, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
            expert_model_parallel_size=world, expert_tensor_parallel_size=1,
            moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2)


def _block(ours, config):
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules

    from overlap_tp import OverlapConfig
    from overlap_tp.bench.reference_spec import get_gpt_layer_megatron_reference_spec
    from overlap_tp.megatron.layers import set_overlap_config
    from overlap_tp.megatron.moe_layer import set_moe_overlap_config
    from overlap_tp.megatron.norm import OverlapRMSNorm
    from overlap_tp.megatron.settings import OverlapSettings
    from overlap_tp.megatron_patches import apply as patches
    if ours:   # what apply() builds with --overlap-tp / --overlap-moe on
        patches._APPLIED["settings"] = OverlapSettings(moe=OverlapConfig(method="off")).with_configs(
            OverlapConfig(method="off"))
        try:
            block_spec = patches.overlap_layer_spec(config)
        finally:
            patches.reset()
    else:
        specs = [get_gpt_layer_megatron_reference_spec(multi_latent_attention=True, qk_layernorm=True)
                 for _ in range(2)]
        specs[1].submodules.mlp = patches.megatron_moe_spec(config)
        block_spec = TransformerBlockSubmodules(layer_specs=specs, layer_norm=OverlapRMSNorm)
    torch.manual_seed(1234)
    block = TransformerBlock(config, block_spec)
    if ours:
        set_overlap_config(block, OverlapConfig(method="off", transport="nccl"))
        set_moe_overlap_config(block, OverlapConfig(method="off"))
    return block


def _rel_error(got, want):
    want = want.double()
    return float((got.double() - want).norm() / max(want.norm(), 1e-12))


def _check_block(rank, world):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from test_moe_layer import _megatron_on_cpu

    from overlap_tp.bench.moe_layer import force_routing, routing_offsets
    from overlap_tp.bench.reference_spec import megatron_sp_on_cpu
    from overlap_tp.megatron.moe_layer import OverlapMoELayer
    from overlap_tp.megatron.transformer_layer import OverlapTransformerLayer
    _megatron_on_cpu()
    ps.initialize_model_parallel(tensor_model_parallel_size=world, expert_model_parallel_size=world,
                                 expert_tensor_parallel_size=1)
    config = _config(world)
    rows = SEQ // world
    offsets = routing_offsets(rows * BATCH, EXPERTS, world, "zipf", rank)
    gen = torch.Generator().manual_seed(5 + rank)
    x = torch.randn(rows, BATCH, HIDDEN, generator=gen).to(torch.bfloat16)
    g = torch.randn(rows, BATCH, HIDDEN, generator=gen).to(torch.bfloat16)
    results = {}
    for ours in (True, False):
        block = _block(ours, config)
        if ours:
            assert all(type(layer) is OverlapTransformerLayer for layer in block.layers)
            assert type(block.layers[1].mlp) is OverlapMoELayer
            assert block.layers[1].mlp.shared_experts is not None
        force_routing(block.layers[1].mlp, offsets)
        xi = x.clone().requires_grad_(True)
        with megatron_sp_on_cpu():   # the block forks the CUDA RNG tracker under sequence parallelism
            out = block(hidden_states=xi, attention_mask=None)
            out = out[0] if isinstance(out, tuple) else out
            out.backward(g)
        grads = per_expert(block, lambda p: p.grad.double() if p.grad is not None else torch.zeros_like(p).double())
        for name, param in block.named_parameters():
            if getattr(param, "sequence_parallel", False):   # Megatron's finalize_model_grads all-reduces these
                dist.all_reduce(grads[name])
        results[ours] = (out.detach(), xi.grad, per_expert(block, lambda p: p.detach().clone()), grads)
    got, want = results[True], results[False]
    assert got[2].keys() == want[2].keys(), (sorted(got[2]), sorted(want[2]))
    for name in got[2]:
        assert torch.equal(got[2][name], want[2][name]), f"parameter {name} differs at build"
    assert _rel_error(got[0], want[0]) < 1e-2, f"output: {_rel_error(got[0], want[0]):.3g}"
    assert _rel_error(got[1], want[1]) < 2e-2, f"input grad: {_rel_error(got[1], want[1]):.3g}"
    for name, grad in got[3].items():
        if float(want[3][name].norm()) == 0:   # an expert that received no token
            assert not grad.any(), name
            continue
        error = _rel_error(grad, want[3][name])
        assert error < 3e-2, f"grad of {name}: relative error {error:.3g}"


def test_dense_then_moe_mla_block_matches_megatrons_at_tp2_ep2():
    run_distributed(2, _check_block)
