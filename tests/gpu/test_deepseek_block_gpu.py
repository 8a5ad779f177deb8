"""The DeepSeek-V3-style pieces together at TP 2 / EP 2 as two processes on ONE GPU (peers_on_one_gpu.py maps their p2p
buffers through CUDA IPC; the group is gloo):
- OverlapMoELayer with a shared expert (SharedExpertMLP on overlap_tp's linears, before routing) and its experts on
  the p2p transport against Megatron's MoELayer with the same shared expert (test_moe_layer_gpu.py's parity check, at
  EP 2);
- a two-layer decoder block from overlap_tp's specs as `--moe-layer-freq "[0,1]"` builds it: a dense layer, then an
  MoE layer with a shared expert, both with multi-latent attention (TP 2 with sequence parallelism; the dense ops and
  the expert ops on their p2p transports, signaled) against the same block of Megatron's layers (MLASelfAttention on
  its ColumnParallelLinear / RowParallelLinear, its dense MLP, its MoELayer with the alltoall dispatcher), built from
  the same seed, the routing forced alike (overlap_tp.bench.moe_layer.force_routing): equal parameters, and output,
  input grad and every parameter grad within bf16 rounding. Megatron's own collectives run on the gloo group (its
  TP AllGathers / ReduceScatters through host copies, test_mla_gpu.py).
Run: `pytest -m gpu tests/gpu/test_deepseek_block_gpu.py` (about a minute)."""
import functools
import os

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from gpu_checks import rel_error
from problems import per_expert

pytestmark = pytest.mark.gpu

T = 2
SEQ, BATCH, HIDDEN, EXPERTS = 1024, 2, 1024, 4


def _on_one_gpu(rank, world, check):
    from peers_on_one_gpu import install
    os.environ.setdefault("OVERLAP_TP_WATCHDOG_S", "120")
    torch.cuda.set_device(0)
    install()
    check(rank, world)


def _check_shared_expert_parity(rank, world):
    import test_moe_layer_gpu as moe_tests
    from test_p2p_one_gpu import EXPERT_P2P
    moe_tests.METHODS.clear()
    moe_tests.METHODS["signal"] = EXPERT_P2P
    moe_tests._check_parity(rank, world, "zipf", 4096, dict(hidden=1024, ffn=2048, moe_shared_expert_intermediate_size=2048))


def test_shared_expert_moe_layer_matches_megatrons_at_ep2_on_one_gpu():
    run_distributed(T, _on_one_gpu, _check_shared_expert_parity, backend="gloo")


def _config():
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    return MLATransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=8, ffn_hidden_size=2816, multi_latent_attention=True,
        q_lora_rank=512, kv_lora_rank=256, qk_head_dim=64, qk_pos_emb_head_dim=32, v_head_dim=64, rope_type="rope",
        normalization="RMSNorm", qk_layernorm=True, params_dtype=torch.bfloat16, bf16=True,
        tensor_model_parallel_size=T, sequence_parallel=True, hidden_dropout=0.0, attention_dropout=0.0,
        add_bias_linear=False, gated_linear_unit=True, init_method_std=0.02, apply_rope_fusion=False,
        num_moe_experts=EXPERTS, moe_layer_freq=[0, 1], moe_ffn_hidden_size=1024,
        moe_shared_expert_intermediate_size=1024, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=T, expert_tensor_parallel_size=1, moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2, bias_activation_fusion=True, activation_func=torch.nn.functional.silu)


def _block(ours, config, seed=1234):
    import test_layers_gpu as L
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
    from overlap_tp.bench.reference_spec import get_gpt_layer_megatron_reference_spec
    from overlap_tp.megatron.layer_spec import get_gpt_layer_overlap_spec
    from overlap_tp.megatron.norm import OverlapRMSNorm
    from overlap_tp.megatron_patches.apply import megatron_moe_spec
    if ours:   # every op kind 'off' until the test sets its configs (never 'auto' by accident)
        settings = L._settings()
        specs = [get_gpt_layer_overlap_spec(multi_latent_attention=True, qk_layernorm=True, settings=settings),
                 get_gpt_layer_overlap_spec(num_experts=EXPERTS, multi_latent_attention=True, qk_layernorm=True,
                                            settings=settings)]
    else:
        specs = [get_gpt_layer_megatron_reference_spec(multi_latent_attention=True, qk_layernorm=True)
                 for _ in range(2)]
        specs[1].submodules.mlp = megatron_moe_spec(config)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return TransformerBlock(config, TransformerBlockSubmodules(layer_specs=specs, layer_norm=OverlapRMSNorm)).cuda()


def _grads(block):
    """Every parameter's grad by Megatron's name; the sequence-parallel ones (the norms) all-reduced over TP, as
    Megatron's finalize_model_grads does."""
    grads = per_expert(block, lambda p: p.grad if p.grad is not None else torch.zeros_like(p))
    for name, param in block.named_parameters():
        if getattr(param, "sequence_parallel", False):
            host = grads[name].float().cpu()
            dist.all_reduce(host)
            grads[name] = host.cuda()
    return grads


def _check_block(rank, world):
    import test_layers_gpu as L
    from test_mla_gpu import megatron_collectives_through_host
    from test_p2p_one_gpu import EXPERT_P2P
    from megatron.core import parallel_state as ps
    from overlap_tp.bench.moe_layer import force_routing, routing_offsets
    from overlap_tp.megatron.layers import set_overlap_config
    from overlap_tp.megatron.moe_layer import set_moe_overlap_config
    L._quiet()
    ps.initialize_model_parallel(tensor_model_parallel_size=world, expert_model_parallel_size=world,
                                 expert_tensor_parallel_size=1)
    config = _config()
    offsets = routing_offsets(SEQ // world * BATCH, EXPERTS, world, "zipf", rank)
    x, g = next(L._fresh_steps(5 + rank, SEQ // world, HIDDEN, 1, batch=BATCH))
    results = {}
    with megatron_collectives_through_host():
        for ours in (True, False):
            block = _block(ours, config)
            if ours:
                set_overlap_config(block, L._p2p_configs("signal"))
                set_moe_overlap_config(block, EXPERT_P2P)
            force_routing(block.layers[1].mlp, offsets)
            xi = x.clone().requires_grad_(True)
            out = block(hidden_states=xi, attention_mask=None)
            out = out[0] if isinstance(out, tuple) else out
            out.backward(g)
            results[ours] = (out.detach(), xi.grad, per_expert(block, lambda p: p.detach().clone()), _grads(block))
            del block
    torch.cuda.synchronize()
    got, want = results[True], results[False]
    assert got[2].keys() == want[2].keys(), (sorted(got[2]), sorted(want[2]))
    for name in got[2]:
        assert torch.equal(got[2][name], want[2][name]), f"parameter {name} differs at build"
    assert rel_error(got[0], want[0].float()) < 1e-2, "output"
    assert rel_error(got[1], want[1].float()) < 2e-2, "input grad"
    for name, grad in got[3].items():
        if float(want[3][name].float().norm()) == 0:   # an expert that received no token
            assert not grad.any(), name
            continue
        assert rel_error(grad, want[3][name].float()) < 3e-2, f"grad of {name}"
    dist.barrier()
    ps.destroy_model_parallel()


def test_dense_then_moe_mla_block_matches_megatrons_at_tp2_ep2_on_one_gpu():
    run_distributed(T, functools.partial(_on_one_gpu, check=_check_block), backend="gloo")
