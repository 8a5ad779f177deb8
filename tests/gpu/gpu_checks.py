"""What the GPU tests share: how many ranks they run on, NaN-poisoned allocator memory, the relative error, two
ranks run as scripts."""
import os
import socket
import subprocess
import sys
import time

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


def run_two_ranks(script: str, env: dict, timeout_s: float = 240):
    """`script` as ranks 0 and 1 of a two-process job (RANK, WORLD_SIZE, MASTER_ADDR / PORT set, on top of `env`);
    waits for rank 0 only, then kills whatever is left. Returns (rank 0's exit code, its stdout, its stderr, the
    time it ended)."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    ranks = [subprocess.Popen([sys.executable, "-c", script], env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        out, err = ranks[0].communicate(timeout=timeout_s)
        ended = time.time()
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
    return ranks[0].returncode, out, err, ended
