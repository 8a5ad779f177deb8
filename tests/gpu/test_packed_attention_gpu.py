"""Packed sequences (THD) through SDPAttention on the GPU, without Transformer Engine: a packed row of sequences of
different lengths gives, token for token, the outputs and q / k / v gradients of the same sequences run one at a time
(within bf16 rounding), on both paths: varlen_attn (bf16, no dropout) and the document-masked SDPA (the math kernel
under --deterministic-mode, which is also bit for bit the same run to run). One GPU.
Run: `pytest -m gpu tests/gpu/test_packed_attention_gpu.py`."""
from types import SimpleNamespace

import pytest
import torch

from gpu_checks import rel_error

pytestmark = pytest.mark.gpu

HEADS, GROUPS, HEAD_DIM = 8, 4, 128


def attention(deterministic, mask_type=None):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from overlap_tp.megatron.attention import SDPAttention
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
                               deterministic_mode=deterministic)
    one_rank = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
    return SDPAttention(config, 1, mask_type or AttnMaskType.causal, "self", pg_collection=one_rank)


def fwd_bwd(core, q, k, v, grad, **kwargs):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = core(q, k, v, None, **kwargs)
    out.backward(grad)
    torch.cuda.synchronize()
    return [out.detach(), q.grad, k.grad, v.grad]


def packed_case(lengths, seed):
    from megatron.core.packed_seq_params import PackedSeqParams
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tokens = sum(lengths)
    q = torch.randn(tokens, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(tokens, GROUPS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    grad = torch.randn(tokens, HEADS * HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                             max_seqlen_kv=max(lengths))
    return q, k, v, grad, packed


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("lengths", [[1000, 24, 3000, 72], [4096], [128] * 16, [1, 2047, 513]])
def test_packed_row_is_each_sequence_alone(deterministic, lengths):
    from overlap_tp.megatron import packed_attention
    q, k, v, grad, packed = packed_case(lengths, sum(lengths))
    core = attention(deterministic)
    assert packed_attention.uses_varlen(q, packed, causal=True, dropout_p=0.0, deterministic=deterministic) \
        is (not deterministic)
    got = fwd_bwd(core, q, k, v, grad, packed_seq_params=packed)
    start = 0
    for length in lengths:
        end = start + length
        alone = fwd_bwd(core, q[start:end, None], k[start:end, None], v[start:end, None], grad[start:end, None])
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, alone):
            part = a[start:end]
            ref = b.reshape(part.shape).float()   # dq of a one-token sequence is exactly zero: an absolute floor
            assert float((part.float() - ref).norm()) <= 2e-2 * float(ref.norm()) + 1e-3, \
                f"{lengths}: {name} of tokens {start}:{end}"
        start = end
    if deterministic:
        again = fwd_bwd(core, q, k, v, grad, packed_seq_params=packed)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, again):
            assert torch.equal(a, b), f"{lengths}: {name} differs between two identical runs"


def test_varlen_and_masked_paths_agree():
    q, k, v, grad, packed = packed_case([700, 1300, 48], 3)
    varlen = fwd_bwd(attention(False), q, k, v, grad, packed_seq_params=packed)
    masked = fwd_bwd(attention(True), q, k, v, grad, packed_seq_params=packed)
    for name, a, b in zip(("out", "dq", "dk", "dv"), varlen, masked):
        assert rel_error(a, b.float()) < 2e-2, name
