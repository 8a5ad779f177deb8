"""What the GPU tests share: the 2-GPU skip, NaN-poisoned allocator memory, the relative error."""
import pytest
import torch


def needs_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")


def poison_allocator(nbytes=1 << 30):
    """Fill freed caching-allocator memory with NaN so that an unwritten output element shows."""
    torch.full((nbytes // 2,), float("nan"), dtype=torch.bfloat16, device="cuda")


def rel_error(got, ref):
    return float((got.float() - ref).norm() / ref.norm())
