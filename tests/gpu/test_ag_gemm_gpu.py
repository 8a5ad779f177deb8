"""ag_gemm on all GPUs here with NCCL (t = gpu_world()) (run on the device: `pytest -m gpu tests/gpu`).

Checked per shape, with fresh random inputs (different on each rank) and outputs allocated over
NaN-poisoned memory, for both transports (in-place NCCL broadcasts; copy-engine pulls from symmetric
memory) and the decomposition (NCCL, and cuBLAS over the copy-engine pulls):
- relative error against an fp32 reference no worse than the sequential path's (NCCL all-gather + cuBLAS);
- the signaled GEMM: bitwise equal to the same kernel run over the same tiles after a complete all-gather
  (overlap must not change a bit); the returned gathered input equals the all-gather;
- 200 back-to-back calls without a hang or a changed bit.
"""
import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from gpu_checks import gpu_world, poison_allocator, rel_error
from overlap_tp import OverlapConfig, ag_gemm
from overlap_tp.kernels.signaled_gemm import signaled_gemm
from overlap_tp.ops.plan_base import gemm_programs
from overlap_tp.ops.resolve import chunk_by_for, fill_defaults
from overlap_tp.ops.tile_rule import tile_for_shape
from overlap_tp.ops.tile_plan import ag_plan

pytestmark = pytest.mark.gpu

# BENCHMARKS.md AG+GEMM shapes (M, K, N_local) plus odd ones: M/t not a multiple of 128, N not a
# multiple of 256, a GEMM with fewer tiles than SMs.
BENCH_SHAPES = [(s, k, n) for s in (4096, 8192, 16384)
                for k, n in ((4096, 3072), (4096, 14336), (8192, 5120), (8192, 28672))]
ODD_SHAPES = [(2 * 1000, 1024, 4096), (2 * 520, 512, 1000), (256, 64, 128), (2 * 4096, 4096, 3072 + 64)]
CONFIGS = {
    "nccl": OverlapConfig(method="signal", transport="nccl", comm_sms=16),
    "p2p": OverlapConfig(method="signal", transport="p2p", comm_sms=0),
    "p2p/g8": OverlapConfig(method="signal", transport="p2p", comm_sms=0, groups=8),
    "cublas-p2p": OverlapConfig(method="decompose", transport="p2p", chunks=2),
    # the pulls split over extra streams (copy_lanes): the same protocol with each chunk's rows in parts
    "p2p/lanes2": OverlapConfig(method="signal", transport="p2p", comm_sms=0, copy_lanes=2),
    "cublas-p2p/lanes3": OverlapConfig(method="decompose", transport="p2p", chunks=2, copy_lanes=3),
    # the pulls by a kernel on the 16 SMs the GEMM's grid leaves free (kernels/peer_copy.py), same protocol
    "p2p/sm16": OverlapConfig(method="signal", transport="p2p", comm_sms=16),
    "p2p/g8/sm8": OverlapConfig(method="signal", transport="p2p", comm_sms=8, groups=8),
    # one peer's rows per chunk, one copy each (chunk_by 'peer'), and cuBLAS over them peer by peer
    "p2p/by-peer": OverlapConfig(method="signal", transport="p2p", comm_sms=0, chunk_by="peer"),
    # "p2p" is by peer where t > 2 (chunk_by 'auto'); the row chunks explicitly
    "p2p/by-rows": OverlapConfig(method="signal", transport="p2p", comm_sms=0, chunk_by="rows"),
    "p2p/by-peer/g3": OverlapConfig(method="signal", transport="p2p", comm_sms=0, chunk_by="peer", groups=3),
    "cublas-p2p/by-peer": OverlapConfig(method="decompose", transport="p2p", chunks=1, chunk_by="peer"),
}


def after_full_gather(gathered, w, config, rank, world):
    """The same kernel over the same tiles, with no waits, once every row is in place (the tile the op's plan
    resolves for the shape: tile_for_shape)."""
    m, k = gathered.shape
    config = fill_defaults(config, "ag_gemm", gathered.device, world)   # unset fields as the op resolves them
    config = chunk_by_for(tile_for_shape(config, m, w.shape[0], gemm_programs(gathered.device, config)), world)
    tiles = ag_plan(m, w.shape[0], k, world, rank, config.block_m, config.block_n, config.groups,
                    chunk_by=config.chunk_by).tiles.cuda()
    out = torch.empty(m, w.shape[0], dtype=gathered.dtype, device="cuda")
    signaled_gemm(gathered, w, out, tiles, None, gemm_programs(gathered.device, config), config)
    torch.cuda.synchronize()
    return out


def _check_shapes(rank, world, shapes):
    group = dist.group.WORLD
    for s, k, n in shapes:
        torch.manual_seed(1000 * s + k + n + rank)      # different shards per rank and per shape
        shard = torch.randn(s // world, k, device="cuda", dtype=torch.bfloat16)
        torch.manual_seed(k + n)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        full = torch.empty(s, k, device="cuda", dtype=torch.bfloat16)
        dist.all_gather_into_tensor(full, shard, group=group)
        ref = full.float() @ w.float().t()
        baseline_error = rel_error(ag_gemm(shard, w, group, config=OverlapConfig(method="off")), ref)
        for label, config in CONFIGS.items():
            poison_allocator()
            got, gathered = ag_gemm(shard, w, group, config=config, return_gathered=True)
            torch.cuda.synchronize()
            assert torch.isfinite(got).all(), (s, k, n, label, "unwritten or non-finite output")
            assert torch.equal(gathered, full), (s, k, n, label, "gathered input")
            error = rel_error(got, ref)
            assert error <= baseline_error * 1.05 + 1e-4, (s, k, n, label, error, baseline_error)
            if config.method == "signal":
                assert torch.equal(got, after_full_gather(full, w, config, rank, world)), (s, k, n, label)
            # the p2p transport returns the shape's one gathered buffer, which the next call of the shape refills:
            # holding it across that call is a RuntimeError (ops/p2p_gather.py GatherBuffer)
            del got, gathered
        decomposed = ag_gemm(shard, w, group, config=OverlapConfig(method="decompose", transport="nccl", chunks=4))
        assert rel_error(decomposed, ref) <= baseline_error * 1.05 + 1e-4


@pytest.mark.parametrize("shapes", [BENCH_SHAPES[:4], BENCH_SHAPES[4:8], BENCH_SHAPES[8:], ODD_SHAPES],
                         ids=["s4096", "s8192", "s16384", "odd"])
def test_ag_gemm(shapes):
    run_distributed(gpu_world(), _check_shapes, shapes, backend="nccl")


def _check_bias_and_back_to_back(rank, world):
    group = dist.group.WORLD
    torch.manual_seed(rank)
    shard = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.manual_seed(99)
    w = torch.randn(3072, 4096, device="cuda", dtype=torch.bfloat16) / 64
    bias = torch.randn(3072, device="cuda", dtype=torch.bfloat16)
    ref = ag_gemm(shard, w, group, bias=bias, config=OverlapConfig(method="off"))
    for label, config in CONFIGS.items():
        got = ag_gemm(shard, w, group, bias=bias, config=config)
        assert rel_error(got, ref.float()) < 1e-2, label
        outputs = [ag_gemm(shard, w, group, bias=bias, config=config) for _ in range(200)]   # no sync in between
        torch.cuda.synchronize()
        assert all(torch.equal(o, got) for o in outputs), f"{label}: results changed across back-to-back calls"


def test_bias_and_200_back_to_back_calls():
    run_distributed(gpu_world(), _check_bias_and_back_to_back, backend="nccl")


def _check_slow_peer(rank, world):
    """The GEMM on every SM spins on flags that a late peer's transfers raise: rank 1 starts its call
    2 s late (host) and, in a second round, behind 0.5 s of GPU work on its stream. Both complete with
    the right result (no SM is needed to release the spinning GEMM on the p2p transport's copy engines; the NCCL
    transport and the p2p pull kernel keep comm_sms free for their CTAs)."""
    import time
    group = dist.group.WORLD
    torch.manual_seed(rank)
    shard = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.manual_seed(7)
    w = torch.randn(3072, 4096, device="cuda", dtype=torch.bfloat16) / 64
    ref = ag_gemm(shard, w, group, config=OverlapConfig(method="off"))
    for label, config in CONFIGS.items():
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 1:
            time.sleep(2.0)
        got = ag_gemm(shard, w, group, config=config)
        torch.cuda.synchronize()
        assert torch.equal(got, ag_gemm(shard, w, group, config=config)), label
        assert rel_error(got, ref.float()) < 1e-2, label
        dist.barrier()
        if rank == 1:
            torch.cuda._sleep(1_000_000_000)   # 1e9 GPU clock cycles, ~0.5 s
        got = ag_gemm(shard, w, group, config=config)
        torch.cuda.synchronize()
        assert rel_error(got, ref.float()) < 1e-2, label


def test_late_peer_does_not_hang():
    run_distributed(gpu_world(), _check_slow_peer, backend="nccl")
