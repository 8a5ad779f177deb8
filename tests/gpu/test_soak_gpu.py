"""Soak: 10,000 back-to-back overlapped calls with randomly drawn ops, shapes, methods and transports, each
checked against the sequential path on the same inputs (run on the device: `pytest -m gpu
tests/gpu/test_soak_gpu.py`; about a minute at t = 2). Every rank draws the same sequence (one seed), so
the ranks' calls match; inputs differ per rank. No hang (the watchdog is set to 60 s), no mismatch."""
import os
import random

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from gpu_checks import gpu_world
from overlap_tp import OverlapConfig, ag_gemm, gemm_ar, gemm_rs

pytestmark = pytest.mark.gpu

CALLS = int(os.environ.get("OVERLAP_TP_SOAK_CALLS", 10000))
SHAPES = [(1024, 1024, 512), (2048, 4096, 1024), (4096, 2048, 4096), (2 * 520, 1000, 512), (256, 128, 64)]
CONFIGS = {
    "rs": [OverlapConfig(method="signal", transport="nccl"),
           OverlapConfig(method="signal", transport="nccl", groups=3, comm_sms=8),
           OverlapConfig(method="signal", transport="p2p", comm_sms=0),
           OverlapConfig(method="decompose", transport="nccl", chunks=2)],
    "ar": [OverlapConfig(method="signal", transport="nccl", groups=2),
           OverlapConfig(method="decompose", transport="nccl", chunks=3)],
    "ag": [OverlapConfig(method="signal", transport="p2p", comm_sms=0),
           OverlapConfig(method="signal", transport="p2p", comm_sms=0, groups=3),
           OverlapConfig(method="signal", transport="nccl", groups=2, comm_sms=16),
           OverlapConfig(method="decompose", transport="nccl", chunks=2)],
}
OFF = OverlapConfig(method="off")


def _soak(rank, world):
    os.environ["OVERLAP_TP_WATCHDOG_S"] = "60"
    group = dist.group.WORLD
    draw = random.Random(2026)            # the same sequence on every rank
    torch.manual_seed(100 + rank)
    run = {"rs": gemm_rs, "ar": gemm_ar, "ag": ag_gemm}
    worst, pending = 0.0, []
    for call in range(CALLS):
        op = draw.choice(("rs", "ar", "ag"))
        m, n, k = draw.choice(SHAPES)
        config = draw.choice(CONFIGS[op])
        rows = m // world if op == "ag" else m
        a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        got = run[op](a, w, group, config=config)
        ref = run[op](a, w, group, config=OFF).float()
        # errors stay on the GPU and are read every 200 calls, so the calls run back to back
        pending.append(((got.float() - ref).norm() / ref.norm(), (call, op, (m, n, k), config)))
        if len(pending) == 200 or call == CALLS - 1:
            errors = torch.stack([e for e, _ in pending]).tolist()
            for error, (_, what) in zip(errors, pending):
                assert error < 1e-2, (what, error)
            worst, pending = max([worst] + errors), []
    torch.cuda.synchronize()
    if rank == 0:
        print(f"soak: {CALLS} calls, worst relative error against off {worst:.2e}")


def test_soak_random_calls_match_the_sequential_path():
    run_distributed(gpu_world(), _soak, backend="nccl")
