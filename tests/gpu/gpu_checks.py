"""What the GPU tests share: how many ranks they run on, NaN-poisoned allocator memory, the relative error."""
import os

import pytest
import torch

WORLD_ENV = "OVERLAP_TP_GPU_WORLD"


def gpu_world() -> int:
    """The ranks (one GPU each) a multi-GPU test runs on: $OVERLAP_TP_GPU_WORLD, else every GPU here
    (t = 2 on the H200 pair, t = 4 / 8 on the larger machines). Skips the test below 2 GPUs."""
    available = torch.cuda.device_count()
    world = int(os.environ.get(WORLD_ENV, available))
    if world < 2 or available < world:
        pytest.skip(f"needs {max(world, 2)} GPUs, {available} here")
    return world


def poison_allocator(nbytes=1 << 30):
    """Fill freed caching-allocator memory with NaN so that an unwritten output element shows."""
    torch.full((nbytes // 2,), float("nan"), dtype=torch.bfloat16, device="cuda")


def rel_error(got, ref):
    return float((got.float() - ref).norm() / ref.norm())
