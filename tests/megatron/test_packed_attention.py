"""Packed sequences (THD, Megatron's PackedSeqParams) through SDPAttention without Transformer Engine: a packed row of
sequences of different lengths gives, token for token, the outputs and gradients of the same sequences run one at a
time, in the core attention alone (causal, no mask, GQA, padded slots, tokens after the last sequence) and in a whole
sequence-parallel TransformerLayer from overlap_tp's spec at TP 2 with rotary embeddings (the linears see tokens only).
"""
import os
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core", reason="SDPAttention needs megatron-core")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from distributed import run_distributed  # noqa: E402
from overlap_tp.megatron import packed_attention  # noqa: E402
from overlap_tp.megatron.attention import SDPAttention  # noqa: E402

HEADS, GROUPS, HEAD_DIM = 4, 2, 8


def _attention(mask_type=AttnMaskType.causal, groups=GROUPS, **extra):
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=groups, attention_dropout=0.0, **extra)
    return SDPAttention(config, 1, mask_type, "self", pg_collection=SimpleNamespace(tp=SimpleNamespace(size=lambda: 1)))


def _cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)


def _fwd_bwd(core, q, k, v, grad, **kwargs):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = core(q, k, v, None, **kwargs)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _random(tokens, heads, gen, dtype=torch.float64):
    return torch.randn(tokens, heads, HEAD_DIM, generator=gen, dtype=dtype)


@pytest.mark.parametrize("mask_type", [AttnMaskType.causal, AttnMaskType.no_mask, AttnMaskType.padding_causal])
@pytest.mark.parametrize("groups", [GROUPS, HEADS])
@pytest.mark.parametrize("lengths, trailing", [([5, 1, 7, 3], 0), ([9], 0), ([2, 6, 4], 3), ([1, 1, 1, 1], 0)])
def test_packed_row_is_each_sequence_alone(mask_type, groups, lengths, trailing):
    gen = torch.Generator().manual_seed(sum(lengths) * 31 + trailing)
    core = _attention(mask_type, groups)
    tokens = sum(lengths) + trailing
    q, k, v = _random(tokens, HEADS, gen), _random(tokens, groups, gen), _random(tokens, groups, gen)
    grad = torch.randn(tokens, HEADS * HEAD_DIM, generator=gen, dtype=torch.float64)
    cu = _cu(lengths)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                             max_seqlen_kv=max(lengths))
    got = _fwd_bwd(core, q, k, v, grad, packed_seq_params=packed)
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist())) + ([(tokens - trailing, tokens)] if trailing else [])
    alone_type = AttnMaskType.causal if mask_type == AttnMaskType.padding_causal else mask_type
    for start, end in bounds:   # each sequence alone, Megatron's [s, b=1, heads, dim] layout
        alone = _fwd_bwd(core, q[start:end, None], k[start:end, None], v[start:end, None], grad[start:end, None],
                         attn_mask_type=alone_type)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, alone):
            torch.testing.assert_close(a[start:end], b.reshape(a[start:end].shape), rtol=1e-10, atol=1e-12,
                                       msg=lambda m: f"{name} of tokens {start}:{end}: {m}")


@pytest.mark.parametrize("mask_type", [AttnMaskType.causal, AttnMaskType.no_mask])
def test_padded_slots(mask_type):
    """cu_seqlens_q_padded: each sequence starts at its padded offset; its real tokens give what the sequence alone
    gives (the padding's output grad is zero: the loss masks padding out)."""
    gen = torch.Generator().manual_seed(7)
    core = _attention(mask_type)
    lengths, slots = [3, 5, 2], [4, 8, 4]
    tokens = sum(slots)
    q, k, v = _random(tokens, HEADS, gen), _random(tokens, GROUPS, gen), _random(tokens, GROUPS, gen)
    grad = torch.randn(tokens, HEADS * HEAD_DIM, generator=gen, dtype=torch.float64)
    cu, cu_padded = _cu(lengths), _cu(slots)
    real = torch.zeros(tokens, dtype=torch.bool)
    for start, length in zip(cu_padded[:-1].tolist(), lengths):
        real[start:start + length] = True
    grad[~real] = 0
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                             cu_seqlens_kv_padded=cu_padded, max_seqlen_q=max(slots), max_seqlen_kv=max(slots))
    got = _fwd_bwd(core, q, k, v, grad, packed_seq_params=packed)
    for start, length in zip(cu_padded[:-1].tolist(), lengths):
        end = start + length
        alone = _fwd_bwd(core, q[start:end, None], k[start:end, None], v[start:end, None], grad[start:end, None])
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, alone):
            torch.testing.assert_close(a[start:end], b.reshape(a[start:end].shape), rtol=1e-10, atol=1e-12,
                                       msg=lambda m: f"{name} of tokens {start}:{end}: {m}")
    # padding keys are seen by no real query
    assert torch.all(got[2][~real] == 0) and torch.all(got[3][~real] == 0)


def test_document_mask_is_block_diagonal_and_causal():
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=_cu([2, 3]), cu_seqlens_kv=_cu([2, 3]))
    mask = packed_attention.document_mask(packed, 6, 6, True, torch.device("cpu"))
    want = torch.zeros(6, 6, dtype=torch.bool)
    want[:2, :2] = torch.tril(torch.ones(2, 2, dtype=torch.bool))
    want[2:5, 2:5] = torch.tril(torch.ones(3, 3, dtype=torch.bool))
    want[5, 5] = True   # the token after the last sequence: a sequence of its own
    assert torch.equal(mask, want)


def test_varlen_is_chosen_only_where_it_can_run():
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=_cu([2, 3]), cu_seqlens_kv=_cu([2, 3]))
    cpu = torch.zeros(5, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    assert not packed_attention.uses_varlen(cpu, packed, causal=True, dropout_p=0.0, deterministic=False)
    fake_cuda = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)
    assert packed_attention.uses_varlen(fake_cuda, packed, causal=True, dropout_p=0.0, deterministic=False)
    assert not packed_attention.uses_varlen(fake_cuda, packed, causal=True, dropout_p=0.1, deterministic=False)
    assert not packed_attention.uses_varlen(fake_cuda, packed, causal=True, dropout_p=0.0, deterministic=True)
    assert not packed_attention.uses_varlen(SimpleNamespace(is_cuda=True, dtype=torch.float32), packed, causal=True,
                                            dropout_p=0.0, deterministic=False)
    padded = PackedSeqParams(qkv_format="thd", cu_seqlens_q=_cu([2, 3]), cu_seqlens_kv=_cu([2, 3]),
                             cu_seqlens_q_padded=_cu([4, 4]), cu_seqlens_kv_padded=_cu([4, 4]))
    assert packed_attention.uses_varlen(fake_cuda, padded, causal=True, dropout_p=0.0, deterministic=False)
    assert not packed_attention.uses_varlen(fake_cuda, padded, causal=False, dropout_p=0.0, deterministic=False)


def test_max_seqlen_from_cu_seqlens_where_not_given():
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=_cu([2, 5, 3]), cu_seqlens_kv=_cu([2, 5, 3]))
    assert packed_attention.max_seqlen(packed, "q", 10) == 5
    assert packed_attention.max_seqlen(packed, "q", 17) == 7   # the 7 tokens after the last sequence
    packed.max_seqlen_q = 6
    assert packed_attention.max_seqlen(packed, "q", 10) == 6


def test_packed_refusals_name_the_reason():
    core = _attention()
    q = torch.zeros(4, HEADS, HEAD_DIM)
    k = torch.zeros(4, GROUPS, HEAD_DIM)
    sbhd = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=_cu([4]), cu_seqlens_kv=_cu([4]))
    with pytest.raises(NotImplementedError, match="'thd'"):
        core(q, k, k, None, packed_seq_params=sbhd)
    thd = PackedSeqParams(qkv_format="thd", cu_seqlens_q=_cu([4]), cu_seqlens_kv=_cu([4]))
    with pytest.raises(NotImplementedError, match="attention_mask=None"):
        core(q, k, k, torch.zeros(1, 1, 4, 4, dtype=torch.bool), packed_seq_params=thd)


LENGTHS = [4, 2, 6, 4]   # each even: a sequence alone is sequence-parallel at TP 2 too


def _check_packed_layer(rank, world):
    """overlap_tp's TransformerLayer (SP, TP 2, overlap off on gloo) with rotary embeddings: the packed row [t, 1, h]
    gives each sequence's output, input grad and (summed over the sequences) parameter grads."""
    import warnings
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps
    import torch.distributed as dist
    from megatron.core.transformer.spec_utils import build_module

    from overlap_tp import OverlapConfig
    from overlap_tp.megatron import layers
    from overlap_tp.megatron.layer_spec import get_gpt_layer_overlap_spec
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=64, use_cpu_initialization=True, params_dtype=torch.bfloat16, bf16=True,
                               normalization="RMSNorm", tensor_model_parallel_size=world, sequence_parallel=True,
                               hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False, qk_layernorm=True,
                               gated_linear_unit=True, init_method_std=0.05, apply_rope_fusion=False)
    torch.manual_seed(5)
    layer = build_module(get_gpt_layer_overlap_spec(qk_layernorm=True), config=config, layer_number=1)
    layers.set_overlap_config(layer, OverlapConfig(method="off", transport="nccl"))
    rope = _rope
    gen = torch.Generator().manual_seed(11)
    tokens = sum(LENGTHS)
    x_full = torch.randn(tokens, 1, 32, generator=gen).to(torch.bfloat16)
    g_full = torch.randn(tokens, 1, 32, generator=gen).to(torch.bfloat16)

    def shard(t):   # this rank's sequence-parallel rows
        rows = t.shape[0] // world
        return t[rank * rows:(rank + 1) * rows].contiguous()

    def gather(t):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts)

    def run(x, g, **kwargs):
        layer.zero_grad(set_to_none=True)
        xi = shard(x).requires_grad_()
        out, _ = layer(xi, attention_mask=None, **kwargs)
        out.backward(shard(g))
        grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
        for name, grad in grads.items():   # the norms' weight grads are partial sums per rank: Megatron all-reduces
            if "layernorm" in name:        # them over TP (finalize_model_grads), and so does this test
                dist.all_reduce(grad)
        return gather(out.detach()), gather(xi.grad), grads

    cu = _cu(LENGTHS)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(LENGTHS),
                             max_seqlen_kv=max(LENGTHS))
    out, dx, grads = run(x_full, g_full, packed_seq_params=packed, rotary_pos_emb=rope(tokens))
    summed = {}
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone_out, alone_dx, alone_grads = run(x_full[start:end], g_full[start:end], rotary_pos_emb=rope(end - start))
        residual = x_full[start:end].double()   # the layer's branch, without the residual that would dominate it
        _close(out[start:end] - residual, alone_out - residual, f"output of tokens {start}:{end}", tol=4e-2)
        _close(dx[start:end], alone_dx, f"input grad of tokens {start}:{end}")
        for name, grad in alone_grads.items():
            summed[name] = summed.get(name, 0) + grad.double()
    for name, grad in grads.items():   # bf16 params: the packed wgrad sums all tokens in one GEMM
        _close(grad, summed[name], f"grad of {name}")
    # a wrong mask (every token attending across its sequence's bound) fails the checks above: the layer's branch
    # (output - residual) of the tokens after the first sequence differs by far more than their tolerance
    bad = run(x_full, g_full, rotary_pos_emb=rope(tokens))[0]
    branch = slice(LENGTHS[0], None)
    wrong = _rel_error(bad[branch] - x_full[branch], out[branch] - x_full[branch])
    assert wrong > 0.2, wrong


def _rel_error(got, want):
    want = want.double()
    return float((got.double() - want).norm() / max(want.norm(), 1e-12))


def _close(got, want, what, tol=1e-2):
    assert got.shape == want.shape, (what, tuple(got.shape), tuple(want.shape))
    error = _rel_error(got, want)
    assert error < tol, f"{what}: relative error {error:.3g}"


def _rope(seq, dim=8, base=10000.0):
    """Megatron's RotaryEmbedding.get_emb ([s, 1, 1, dim], positions 0..s-1) on the CPU (Megatron's moves to CUDA);
    with packed sequences Megatron's rotary applier restarts the positions at every sequence (cu_seqlens)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    return (torch.cat((freqs, freqs), dim=-1)[:, None, None, :], ) * 2   # (q, k)


def test_packed_layer_is_each_sequence_alone():
    run_distributed(2, _check_packed_layer)
