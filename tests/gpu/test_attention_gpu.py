"""SDPAttention (the overlap spec's core attention without Transformer Engine) under Megatron's
--deterministic-mode: forward and backward bit for bit the same on every run (the math kernel; the flash kernel's
backward is not), and within bf16 rounding of the default kernel. One GPU.
Run: `pytest -m gpu tests/gpu/test_attention_gpu.py`."""
from types import SimpleNamespace

import pytest
import torch

from gpu_checks import rel_error

pytestmark = pytest.mark.gpu


def attention(deterministic):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from overlap_tp.megatron.attention import SDPAttention
    config = TransformerConfig(num_layers=1, hidden_size=1024, num_attention_heads=8, num_query_groups=4,
                               attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
                               deterministic_mode=deterministic)
    one_rank = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
    return SDPAttention(config, 1, AttnMaskType.causal, "self", pg_collection=one_rank)


def fwd_bwd(core, q, k, v, grad):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = core(q, k, v, attention_mask=None)
    out.backward(grad)
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("seq", [1024, 4096])
def test_deterministic_mode_is_bit_exact_run_to_run(seq):
    gen = torch.Generator(device="cuda").manual_seed(seq)
    q = torch.randn(seq, 1, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(seq, 1, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    grad = torch.randn(seq, 1, 8 * 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    core = attention(deterministic=True)
    runs = [fwd_bwd(core, q, k, v, grad) for _ in range(4)]
    for run in runs[1:]:
        for name, a, b in zip(("out", "dq", "dk", "dv"), runs[0], run):
            assert torch.equal(a, b), f"s {seq}: {name} differs between two identical runs"
    default = fwd_bwd(attention(deterministic=False), q, k, v, grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), runs[0], default):
        assert rel_error(a, b.float()) < 2e-2, f"s {seq}: {name} vs the default kernel"
