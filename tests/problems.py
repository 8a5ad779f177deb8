"""Inputs and checks shared by the tests (CPU and GPU)."""
import pytest
import torch

SMALL_TILES = dict(block_m=16, block_n=32, block_k=16)   # small enough for the Triton interpreter


def dense_problem(m, n, k, seed, bias):
    """a[m, k], w[n, k] and (if bias) b[n] in bf16, from their own seed."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    return a, w, b


def rel_error(got, ref):
    return float((got.double() - ref).norm() / ref.norm())


def assert_each_raises(cases):
    """Every (call, message pattern) pair raises a ValueError whose message matches."""
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()


def staged_as_rows(staging, plan):
    """A row_slice plan's staging matrix read back in C's row order: group g's collective moves staging rows
    [src_lo, src_hi) = t blocks of (dst_hi - dst_lo) rows, block k holding rows [dst_lo, dst_hi) of region k
    (what reduce_scatter delivers to rank k); a row no collective delivers stays NaN."""
    t, m_local = plan.world, plan.m // plan.world
    out = torch.full((plan.m, plan.n), float("nan"), dtype=staging.dtype, device=staging.device)
    for c in plan.collectives:
        rows = c.dst_hi - c.dst_lo
        for k in range(t):
            out[k * m_local + c.dst_lo:k * m_local + c.dst_hi] = staging[c.src_lo + k * rows:c.src_lo + (k + 1) * rows]
    return out


def per_expert(block, value):
    """Megatron's parameter names -> value(param) for every parameter of `block`; OverlapGroupedMLP's stacked weights
    (and their grads) split per local expert under SequentialMLP's names."""
    out = {}
    for name, param in block.named_parameters():
        item = value(param)
        if name.endswith(("experts.weight1", "experts.weight2")):
            linear = "linear_fc1" if name.endswith("1") else "linear_fc2"
            prefix = name[:-len("weight1")]
            out.update({f"{prefix}local_experts.{e}.{linear}.weight": item[e] for e in range(item.shape[0])})
        else:
            out[name] = item
    return out
