"""The signaled GEMM kernel on its own, in the Triton CPU interpreter."""
import torch

from overlap_tp import OverlapConfig
from overlap_tp.kernels.signaled_gemm import signaled_gemm
from overlap_tp.plan import make_plan, p2p_plan

CONFIG = OverlapConfig(block_m=16, block_n=32, block_k=16)


def test_counters_count_each_groups_tiles():
    a = torch.randn(96, 32).to(torch.bfloat16)
    w = torch.randn(80, 32).to(torch.bfloat16)
    plan = make_plan("row_slice", 96, 80, 2, 16, 32, groups=3)
    staging = torch.full(plan.staging_shape, float("nan"), dtype=torch.bfloat16)
    counters = torch.zeros(plan.num_groups, dtype=torch.int32)
    for calls in (1, 2):
        signaled_gemm(a, w, staging, plan.tiles, counters, 3, CONFIG)
        assert counters.tolist() == [calls * g for g in plan.group_tiles]


def test_p2p_stores_reach_every_owner():
    """t ranks emulated in one process: each rank's kernel stores region k of its partial into rank k's
    buffer (addressed as an offset from its own); summing the slots gives the reduce-scatter, with the
    bias added exactly once, on the owner's own partial."""
    t, m, n, k = 2, 2 * 40, 72, 64
    a = torch.randn(m, k).to(torch.bfloat16)
    w = torch.randn(n, k).to(torch.bfloat16)
    bias = torch.randn(n).to(torch.bfloat16)
    buffers = [torch.full((m, n), float("nan"), dtype=torch.bfloat16) for _ in range(t)]
    k_local = k // t
    for rank in range(t):
        shard = slice(rank * k_local, (rank + 1) * k_local)
        offsets = torch.tensor([(b.data_ptr() - buffers[rank].data_ptr()) // 2 for b in buffers], dtype=torch.int64)
        assert (offsets % 16 == 0).all()
        plan = p2p_plan(m, n, t, rank, 16, 32)
        signaled_gemm(a[:, shard].contiguous(), w[:, shard].contiguous(), buffers[rank], plan.tiles,
                      torch.zeros(1, dtype=torch.int32), 3, CONFIG, bias, (rank * m // t, (rank + 1) * m // t),
                      dst_offsets=offsets)
    dense = a.double() @ w.double().t() + bias.double()
    for rank in range(t):
        got = buffers[rank].view(t, m // t, n).sum(0)
        ref = dense[rank * m // t:(rank + 1) * m // t]
        assert float((got.double() - ref).norm() / ref.norm()) < 1e-2
