"""Multi-latent attention on overlap_tp's spec: the slots hold what overlap_tp.megatron.mla says, and a sequence-parallel
MLA TransformerLayer at TP 2 (gloo, overlap off) gives Megatron's own MLA layer's output, input grad and parameter
grads (Megatron's MLASelfAttention on its ColumnParallelLinear / RowParallelLinear and TransformerLayer, built from the
same seed: equal weights), with and without a query latent, dense and packed sequences (THD)."""
import os
import sys
import warnings

import pytest
import torch

pytest.importorskip("megatron.core", reason="the layer spec needs megatron-core")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.tensor_parallel.layers import ColumnParallelLinear  # noqa: E402
from megatron.core.transformer.identity_op import IdentityOp  # noqa: E402
from megatron.core.transformer.multi_latent_attention import MLASelfAttention  # noqa: E402

from distributed import run_distributed  # noqa: E402
from overlap_tp.megatron.layer_spec import OverlapQKRMSNorm, get_gpt_layer_overlap_spec  # noqa: E402
from overlap_tp.megatron.layers import OverlapColumnParallelLinear, OverlapRowParallelLinear  # noqa: E402
from overlap_tp.megatron.transformer_layer import OverlapTransformerLayer  # noqa: E402

SEQ, BATCH, HIDDEN = 16, 2, 64


def _te():
    try:
        import transformer_engine  # noqa: F401
        return True
    except ImportError:
        return False


def test_mla_spec_slots():
    spec = get_gpt_layer_overlap_spec(multi_latent_attention=True, qk_layernorm=True)
    assert spec.module is OverlapTransformerLayer
    attention = spec.submodules.self_attention
    assert attention.module is MLASelfAttention
    sub = attention.submodules
    for name in ("linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj"):
        assert getattr(sub, name) is OverlapColumnParallelLinear, name
    assert sub.linear_proj is OverlapRowParallelLinear
    assert sub.q_layernorm is OverlapQKRMSNorm and sub.kv_layernorm is OverlapQKRMSNorm
    if not _te():
        assert sub.linear_q_down_proj is ColumnParallelLinear and sub.linear_kv_down_proj is ColumnParallelLinear
    plain = get_gpt_layer_overlap_spec(multi_latent_attention=True).submodules.self_attention.submodules
    assert plain.q_layernorm is IdentityOp and plain.kv_layernorm is IdentityOp
    assert "input_layernorm." not in spec.submodules.sharded_state_dict_keys_map
    with pytest.raises(NotImplementedError, match="qk_l2_norm"):
        get_gpt_layer_overlap_spec(multi_latent_attention=True, qk_l2_norm=True)


def test_mla_linears_are_built_with_the_specs_settings():
    """Given OverlapSettings, every overlap_tp linear of the MLA slot is built with them (ModuleSpec params)."""
    from overlap_tp import OverlapConfig
    from overlap_tp.megatron.settings import OverlapSettings
    settings = OverlapSettings().with_configs(OverlapConfig(method="off"))
    sub = get_gpt_layer_overlap_spec(multi_latent_attention=True, qk_layernorm=True,
                                     settings=settings).submodules.self_attention.submodules
    for name, cls in (("linear_q_proj", OverlapColumnParallelLinear), ("linear_q_up_proj", OverlapColumnParallelLinear),
                      ("linear_kv_up_proj", OverlapColumnParallelLinear), ("linear_proj", OverlapRowParallelLinear)):
        entry = getattr(sub, name)
        assert entry.module is cls and entry.params["settings"] is settings, name


def _mla_config(world, q_lora_rank, qk_layernorm):
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MLATransformerConfig(
            num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=128, multi_latent_attention=True,
            q_lora_rank=q_lora_rank, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
            rope_type="rope", rotary_base=10000, normalization="RMSNorm", qk_layernorm=qk_layernorm,
            use_cpu_initialization=True, params_dtype=torch.bfloat16, bf16=True, tensor_model_parallel_size=world,
            sequence_parallel=True, hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
            gated_linear_unit=True, init_method_std=0.05, apply_rope_fusion=False)


def _rel_error(got, want):
    want = want.double()
    return float((got.double() - want).norm() / max(want.norm(), 1e-12))


def _check_mla_layer(rank, world, q_lora_rank, qk_layernorm, packed):
    """Our MLA layer against Megatron's at TP `world` with SP, from one seed."""
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.spec_utils import build_module

    from overlap_tp import OverlapConfig
    from overlap_tp.bench.reference_spec import get_gpt_layer_megatron_reference_spec, megatron_sp_on_cpu
    from overlap_tp.megatron import layers
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    config = _mla_config(world, q_lora_rank, qk_layernorm)
    gen = torch.Generator().manual_seed(3)
    seq, batch = (SEQ * BATCH, 1) if packed else (SEQ, BATCH)
    x_full = torch.randn(seq, batch, HIDDEN, generator=gen).to(torch.bfloat16)
    g_full = torch.randn(seq, batch, HIDDEN, generator=gen).to(torch.bfloat16)
    rows = seq // world
    kwargs = {}
    if packed:   # sequences of 6, 10, 9 and 7 tokens in one row
        cu = torch.tensor([0, 6, 16, 25, 32], dtype=torch.int32)
        kwargs["packed_seq_params"] = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                      max_seqlen_q=10, max_seqlen_kv=10)

    def run(spec, ours):
        torch.manual_seed(21)
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        with megatron_sp_on_cpu():
            try:
                model_parallel_cuda_manual_seed(21)
            except Exception:   # noqa: BLE001 - no CUDA: CPU initialisation draws from torch's generator
                pass
            layer = build_module(spec, config=config, layer_number=1)
            if ours:
                layers.set_overlap_config(layer, OverlapConfig(method="off", transport="nccl"))
            x = x_full[rank * rows:(rank + 1) * rows].clone().requires_grad_()
            out, _ = layer(x, attention_mask=None, **kwargs)
            out.backward(g_full[rank * rows:(rank + 1) * rows])
        grads = {}
        for name, p in layer.named_parameters():
            grad = p.grad.double()
            if getattr(p, "sequence_parallel", False):   # Megatron's finalize_model_grads all-reduces these over TP
                dist.all_reduce(grad)
            grads[name] = grad
        return out.detach(), x.grad, {n: p.detach().clone() for n, p in layer.named_parameters()}, grads

    ours = run(get_gpt_layer_overlap_spec(multi_latent_attention=True, qk_layernorm=qk_layernorm), True)
    theirs = run(get_gpt_layer_megatron_reference_spec(multi_latent_attention=True, qk_layernorm=qk_layernorm), False)
    assert ours[2].keys() == theirs[2].keys(), (sorted(ours[2]), sorted(theirs[2]))
    for name in ours[2]:
        assert torch.equal(ours[2][name], theirs[2][name]), f"parameter {name} differs at build"
    # the output within bf16 rounding (overlap_tp's layer adds the residual and normalizes in one kernel, in fp32,
    # Megatron's rounds the bias-dropout-add to bf16 first); the gradients check the attention itself
    for what, got, want, tol in (("output", ours[0], theirs[0], 1e-2), ("input grad", ours[1], theirs[1], 1e-2)):
        assert _rel_error(got, want) < tol, f"{what}: relative error {_rel_error(got, want):.3g}"
    for name, grad in ours[3].items():
        error = _rel_error(grad, theirs[3][name])
        assert error < 2e-2, f"grad of {name}: relative error {error:.3g}"


@pytest.mark.parametrize("q_lora_rank, qk_layernorm, packed", [(24, True, False), (None, False, False),
                                                                (24, True, True)])
def test_mla_layer_matches_megatrons(q_lora_rank, qk_layernorm, packed):
    run_distributed(2, _check_mla_layer, q_lora_rank, qk_layernorm, packed)


def test_multi_latent_attention_flag_is_accepted():
    from types import SimpleNamespace

    from overlap_tp.megatron.validation import validate_overlap_args
    args = SimpleNamespace(overlap_tp="signal", tensor_model_parallel_size=2, sequence_parallel=True,
                           normalization="RMSNorm", transformer_impl="local", multi_latent_attention=True,
                           qk_layernorm=True)
    assert validate_overlap_args(args, warn=None) == []
