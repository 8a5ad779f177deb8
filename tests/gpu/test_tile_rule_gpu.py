"""The shape rule of the signaled GEMM's tile (OverlapConfig.tile_by_shape) in real plans, on ONE GPU (a one-rank
NCCL group): the plans of the smoke recipe's backward GEMMs run the narrow tile, the 8B layer's keep the default,
and every result equals cuBLAS's. Run: `pytest -m gpu tests/gpu/test_tile_rule_gpu.py`."""
import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from gpu_checks import poison_allocator, rel_error
from overlap_tp import OverlapConfig
from overlap_tp.ops.ag_gemm import AgGemm
from overlap_tp.ops.gemm_rs import GemmRS

pytestmark = pytest.mark.gpu


def _check(rank, world):
    poison_allocator()
    group = dist.group.WORLD
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = [  # (plan class, M, N, K, transport, comm SMs, block_n the rule gives on an H200's 132 SMs)
        (AgGemm, 4096, 512, 1024, "p2p", 0, 128),      # smoke proj dgrad
        (AgGemm, 4096, 1408, 1024, "p2p", 0, 128),     # smoke fc2 dgrad
        (GemmRS, 4096, 1408, 1024, "nccl", 0, 128),    # the same shape as a GEMM+RS on the NCCL transport
        (GemmRS, 4096, 1408, 1024, "nccl", 16, 256),   # on 116 SMs: 2 default waves against 4 narrow ones
        (AgGemm, 4096, 768, 1024, "p2p", 0, 256),      # smoke qkv fwd
        (GemmRS, 8192, 4096, 2048, "p2p", 0, 256),     # l8b proj fwd
    ]
    for cls, m, n, k, transport, comm_sms, block_n in cases:
        config = OverlapConfig(method="signal", transport=transport, comm_sms=comm_sms)
        plan = cls(group, m, n, k, torch.bfloat16, torch.device("cuda"), config)
        if torch.cuda.get_device_properties(0).multi_processor_count == 132:
            assert plan.config.block_n == block_n, (cls.__name__, m, n, plan.config)
        a = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).bfloat16()
        got = plan(a, w)
        assert not got.isnan().any(), (cls.__name__, m, n)
        assert rel_error(got, (a.float() @ w.float().t())) < 1e-2, (cls.__name__, m, n)


def test_small_gemms_take_the_narrow_tile_and_stay_exact():
    run_distributed(1, _check, backend="nccl")
