"""What the GPU tests share: how many ranks they run on, NaN-poisoned allocator memory, the relative error, captured
replays against eager steps, two ranks run as scripts."""
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


def replays_equal_eager(step, steps, rank, replays=8, before=None, late=False, what=""):
    """step(x, g) -> tensors, run eagerly on every (x, g) of `steps`, then captured once (CapturedCalls, on copies of
    steps[0]) and replayed `replays` times with steps[i % len(steps)] copied in: every replay's tensors equal its
    eager step's bit for bit. before(i): called before eager step i and before each replay of it (for example to
    load step i's weights); late: rank 1 sleeps 0.1 s before every third replay (a peer arriving late)."""
    from overlap_tp.tune.timing import CapturedCalls
    eager = []
    for i, (x, g) in enumerate(steps):
        if before is not None:
            before(i)
        # detached: a kept output would keep its autograd graph, whose parameters' AccumulateGrad nodes remember the
        # stream of this eager step (the legacy default stream), and the captured backward would then sync with it
        eager.append([t.detach().clone() for t in step(x, g)])
    static_x, static_g = steps[0][0].clone(), steps[0][1].clone()
    captured = CapturedCalls(step, [(static_x, static_g)], warmup=2)
    for replay in range(replays):
        i = replay % len(steps)
        if before is not None:
            before(i)
        static_x.copy_(steps[i][0])
        static_g.copy_(steps[i][1])
        if late and rank == 1 and replay % 3 == 1:
            torch.cuda._sleep(100_000_000)
        captured.graph.replay()
        torch.cuda.synchronize()
        for j, (got, want) in enumerate(zip(captured.outputs[0], eager[i])):
            assert torch.equal(got, want), f"{what}replay {replay} rank {rank}: tensor {j} differs from the eager step"
    del captured
    torch.cuda.synchronize()


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
