"""The dense ops on ONE GPU (t = 1, a one-rank NCCL group): every method and transport of gemm_rs, gemm_ar and
ag_gemm against torch's matmul, eager and after a captured graph's replays, with fresh inputs every call. At
t = 1 the collectives move nothing, but every host-side step of a call runs (the plan's batched stream memory
operations, the raw NCCL calls on addresses, the copy-engine copies, the flags' lowering, the direct launch),
so a one-GPU machine checks each change to that path. Two ranks: tests/gpu/test_gemm_rs_gpu.py,
test_ag_gemm_gpu.py, test_graphs_gpu.py. Run: `pytest -m gpu tests/gpu/test_ops_one_gpu.py`."""
import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from gpu_checks import poison_allocator, rel_error
from overlap_tp import OverlapConfig, ag_gemm, gemm_ar, gemm_rs
from overlap_tp.ops.tile_rule import DEFAULT_TILE

pytestmark = pytest.mark.gpu

CASES = [   # (op, config)
    ("rs", OverlapConfig(method="signal", transport="nccl", groups=4)),
    ("rs", OverlapConfig(method="signal", transport="nccl", schedule="tile_exact", groups=3)),
    ("rs", OverlapConfig(method="signal", transport="p2p", comm_sms=0)),
    ("rs", OverlapConfig(method="decompose", transport="nccl", chunks=3)),
    ("ar", OverlapConfig(method="signal", transport="nccl", groups=4)),
    ("ar", OverlapConfig(method="decompose", transport="nccl", chunks=2)),
    ("ag", OverlapConfig(method="signal", transport="p2p", comm_sms=0, groups=4)),
    ("ag", OverlapConfig(method="signal", transport="nccl", comm_sms=16, groups=2)),
    ("ag", OverlapConfig(method="decompose", transport="nccl", chunks=2)),
]
SHAPES = [(4096, 4096, 2048), (1000, 1408, 1024)]   # (M, N, K); the second: no dimension a multiple of the tile


def _call(op, a, w, bias, config):
    run = {"rs": gemm_rs, "ar": gemm_ar, "ag": ag_gemm}[op]
    return run(a, w, dist.group.WORLD, bias=bias, config=config)


def _check(rank, world):
    poison_allocator()
    gen = torch.Generator(device="cuda").manual_seed(5)

    def operands(m, n, k):
        return (torch.randn(m, k, device="cuda", generator=gen).bfloat16(),
                (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).bfloat16(),
                torch.randn(n, device="cuda", generator=gen).bfloat16())

    for m, n, k in SHAPES:
        for op, config in CASES:
            block_m, block_n = (config.block_m or DEFAULT_TILE["block_m"]), (config.block_n or DEFAULT_TILE["block_n"])
            if config.schedule == "tile_exact" and (m % block_m or n % block_n):
                continue
            for call in range(3):   # the plan's first call and later ones (every word back where it started)
                a, w, bias = operands(m, n, k)
                got = _call(op, a, w, bias, config)
                want = torch.addmm(bias.float(), a.float(), w.float().t())
                assert not got.isnan().any(), (op, config, call)
                assert rel_error(got, want) < 1e-2, (op, config, call, rel_error(got, want))
            # captured, replayed with fresh inputs copied into the static buffers
            a_static, w_static, bias_static = operands(m, n, k)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out_static = _call(op, a_static, w_static, bias_static, config)
            for replay in range(5):
                a, w, bias = operands(m, n, k)
                a_static.copy_(a)
                w_static.copy_(w)
                bias_static.copy_(bias)
                graph.replay()
                want = torch.addmm(bias.float(), a.float(), w.float().t())
                assert rel_error(out_static, want) < 1e-2, (op, config, "replay", replay)
            del graph
            torch.cuda.synchronize()


def test_every_dense_op_at_t1_matches_torch_eager_and_replayed():
    run_distributed(1, _check, backend="nccl")
