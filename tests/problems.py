"""Inputs and checks shared by the CPU op tests."""
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
