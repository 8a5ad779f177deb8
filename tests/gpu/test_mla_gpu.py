"""Multi-latent attention (overlap_tp.megatron.mla) at TP 2 on ONE GPU: two processes share it (peers_on_one_gpu.py
maps their p2p buffers through CUDA IPC; the TP group is gloo). An MLA TransformerLayer from overlap_tp's spec, its
up-projections' AllGather+GEMM and linear_proj's GEMM+ReduceScatter on the p2p transports (the signaled GEMM, and
cuBLAS: method decompose), forward and backward against Megatron's own MLA layer (MLASelfAttention on its
ColumnParallelLinear / RowParallelLinear and TransformerLayer, get_gpt_layer_megatron_reference_spec) built from the
same seed: equal parameters, and output, input grad and every parameter grad within bf16 rounding, with a query latent
and without, on dense and packed (THD) sequences. Megatron's own collectives (its down projections' and the reference's
AllGathers and ReduceScatters) run on the gloo group through host copies (gloo has no CUDA reduce-scatter); nothing
of overlap_tp's is on gloo.
Under CUDA graphs: where Transformer Engine imports, the down projections are TELinear (no communication) and the
layer is captured forward + backward and replayed bit for bit against the eager step; without it the down projections
are Megatron's ColumnParallelLinear, whose gloo AllGathers no graph can capture here (the test says so and skips).
Run: `pytest -m gpu tests/gpu/test_mla_gpu.py` (about a minute)."""
import contextlib
import functools
import os

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from gpu_checks import rel_error, replays_equal_eager

pytestmark = pytest.mark.gpu

T = 2
SEQ, BATCH = 1024, 2


class _Done:
    def wait(self, *args, **kwargs):
        return True


def _host_all_gather(output, input_, group=None, async_op=False, **unused):
    staged = torch.empty(output.shape, dtype=output.dtype)
    dist.all_gather_into_tensor(staged, input_.contiguous().cpu(), group=group)
    output.copy_(staged)
    return _Done() if async_op else None


def _host_reduce_scatter(output, input_, group=None, async_op=False, **unused):
    staged = input_.float().contiguous().cpu()
    rows = output.shape[0]
    parts = list(staged.split(rows))
    result = torch.empty(output.shape, dtype=torch.float32)
    dist.reduce_scatter(result, parts, group=group)
    output.copy_(result)
    return _Done() if async_op else None


@contextlib.contextmanager
def megatron_collectives_through_host():
    """Megatron's tensor-parallel AllGather / ReduceScatter (tensor_parallel.layers and .mappings) on the gloo group
    through host copies (fp32 sums)."""
    from megatron.core.tensor_parallel import layers, mappings
    saved = [(m, n, getattr(m, n)) for m in (layers, mappings) for n in ("dist_all_gather_func",
                                                                          "dist_reduce_scatter_func")]
    for module, name, _ in saved:
        setattr(module, name, _host_all_gather if "gather" in name else _host_reduce_scatter)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def _te():
    try:
        import transformer_engine  # noqa: F401
        return True
    except ImportError:
        return False


def _config(q_lora_rank, deterministic=False):
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    return MLATransformerConfig(
        num_layers=1, hidden_size=1024, num_attention_heads=8, ffn_hidden_size=2816, multi_latent_attention=True,
        q_lora_rank=q_lora_rank, kv_lora_rank=256, qk_head_dim=64, qk_pos_emb_head_dim=32, v_head_dim=64,
        rope_type="rope", normalization="RMSNorm", qk_layernorm=q_lora_rank is not None, params_dtype=torch.bfloat16,
        bf16=True, tensor_model_parallel_size=T, sequence_parallel=True, hidden_dropout=0.0, attention_dropout=0.0,
        add_bias_linear=False, gated_linear_unit=True, init_method_std=0.02, deterministic_mode=deterministic,
        apply_rope_fusion=False)


def _build(ours, config, seed=77):
    import test_layers_gpu as L
    from megatron.core.transformer.spec_utils import build_module
    from overlap_tp.bench.reference_spec import get_gpt_layer_megatron_reference_spec
    from overlap_tp.megatron.layer_spec import get_gpt_layer_overlap_spec
    make = get_gpt_layer_overlap_spec if ours else get_gpt_layer_megatron_reference_spec
    L._seed(seed, "cuda")
    settings = {"settings": L._settings()} if ours else {}   # ours: every op kind 'off' until the test sets its own
    return build_module(make(multi_latent_attention=True, qk_layernorm=config.qk_layernorm, **settings),
                        config=config, layer_number=1).cuda()


def _fwd_bwd(layer, x, g, **kwargs):
    layer.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(True)
    out, _ = layer(hidden_states=xi, attention_mask=None, **kwargs)
    out.backward(g)
    grads = {}
    for name, p in layer.named_parameters():
        grad = p.grad.float()
        if getattr(p, "sequence_parallel", False):   # Megatron's finalize_model_grads all-reduces these over TP
            host = grad.cpu()
            dist.all_reduce(host)
            grad = host.cuda()
        grads[name] = grad
    return out.detach(), xi.grad, grads


def _check_parity(rank, world, q_lora_rank, packed, method):
    from peers_on_one_gpu import install
    import test_layers_gpu as L
    from megatron.core.packed_seq_params import PackedSeqParams
    from overlap_tp.megatron.layers import set_overlap_config
    os.environ.setdefault("OVERLAP_TP_WATCHDOG_S", "120")
    torch.cuda.set_device(0)
    install()
    L._quiet()
    ps = L._setup(world, "cuda")
    config = _config(q_lora_rank)
    seq, batch = (SEQ * BATCH, 1) if packed else (SEQ, BATCH)
    kwargs = {}
    if packed:   # four sequences of different lengths in one row
        cu = torch.tensor([0, 300, 1100, 1124, seq], dtype=torch.int32, device="cuda")
        kwargs["packed_seq_params"] = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                      max_seqlen_q=924, max_seqlen_kv=924)
    x, g = next(L._fresh_steps(5 + rank, seq // world, config.hidden_size, 1, batch=batch))
    with megatron_collectives_through_host():
        ours = _build(True, config)
        set_overlap_config(ours, L._p2p_configs(method))
        theirs = _build(False, config)
        for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
            assert torch.equal(a, b), f"parameter {name} differs at build"
        got = _fwd_bwd(ours, x, g, **kwargs)
        want = _fwd_bwd(theirs, x, g, **kwargs)
    torch.cuda.synchronize()
    assert rel_error(got[0], want[0].float()) < 1e-2, "output"
    assert rel_error(got[1], want[1].float()) < 2e-2, "input grad"
    for name, grad in got[2].items():
        assert rel_error(grad, want[2][name]) < 3e-2, f"grad of {name}"
    dist.barrier()
    ps.destroy_model_parallel()


@pytest.mark.parametrize("method", ["signal", "decompose"])
@pytest.mark.parametrize("q_lora_rank, packed", [(512, False), (None, False), (512, True)],
                         ids=["q_latent", "no_q_latent", "q_latent_packed"])
def test_mla_layer_matches_megatrons_at_t2_on_one_gpu(q_lora_rank, packed, method):
    run_distributed(T, functools.partial(_check_parity, q_lora_rank=q_lora_rank, packed=packed, method=method),
                    backend="gloo")


def _check_captured(rank, world):
    from peers_on_one_gpu import install
    import test_layers_gpu as L
    from overlap_tp.megatron.layers import set_overlap_config
    os.environ.setdefault("OVERLAP_TP_WATCHDOG_S", "120")
    torch.cuda.set_device(0)
    install()
    L._quiet()
    L._deterministic()
    ps = L._setup(world, "cuda")
    layer = _build(True, _config(512, deterministic=True))
    set_overlap_config(layer, L._p2p_configs("signal"))
    steps = list(L._fresh_steps(9 + rank, SEQ // world, 1024, 4))
    replays_equal_eager(lambda x, g: L._fwd_bwd([layer], x, g), steps, rank)
    dist.barrier()
    ps.destroy_model_parallel()


def test_mla_layer_captured_replays_bit_for_bit_at_t2_on_one_gpu():
    if not _te():
        pytest.skip("without Transformer Engine MLA's down projections are Megatron's ColumnParallelLinear, whose "
                    "AllGathers run on the gloo group here: no CUDA graph can capture them")
    run_distributed(T, _check_captured, backend="gloo")
