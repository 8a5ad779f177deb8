"""The p2p transports at t = 2 on ONE GPU: two processes share it, their buffers peer-mapped through CUDA IPC
(peers_on_one_gpu.py stands in for PyTorch's symmetric memory, which refuses two ranks on one device; the group is
gloo). Everything else is the ops' own code: gemm_rs on the p2p transport (epilogue stores into the owner's
slots, the peer signals, the slot sum), ag_gemm on it (the shard's copy and the copy-engine pulls behind the peer
signals, the GEMM's tiles behind the ready flags), the fused add + RMSNorm summing the slots itself, each eager
with fresh inputs every call and captured in a CUDA graph and replayed. Results against torch, or bit for bit
against the op's summed path. The two processes' contexts time-slice the GPU: these check the protocols and the
bits, never speed. Two GPUs: test_gemm_rs_gpu.py, test_ag_gemm_gpu.py, test_graphs_gpu.py.
Run: `pytest -m gpu tests/gpu/test_p2p_one_gpu.py`."""
import os

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from gpu_checks import rel_error
from overlap_tp import OverlapConfig, ag_gemm, gemm_rs
from overlap_tp.megatron.norm import fused_add_rmsnorm

pytestmark = pytest.mark.gpu

T = 2
RS = OverlapConfig(method="signal", transport="p2p", comm_sms=0)
AG = OverlapConfig(method="signal", transport="p2p", comm_sms=0, groups=4)
SHAPES = [(2048, 1024, 512), (1000, 1408, 264)]   # (M, N, K): M = the gathered rows; the second: no tile multiple


def _on_one_gpu(rank, world, check):
    from peers_on_one_gpu import install
    os.environ.setdefault("OVERLAP_TP_WATCHDOG_S", "120")
    torch.cuda.set_device(0)
    install()
    check(rank, world)


def _operands(seed, m, n, k, rank):
    """Rank r's a [m, k] and w [n, k] of GEMM call `seed`, and the bias every rank shares."""
    gen = torch.Generator(device="cuda").manual_seed(seed * 97 + rank)
    a = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).bfloat16()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return a, w, torch.randn(n, device="cuda", generator=gen).bfloat16()


def _rs_reference(seed, m, n, k, rank, world):
    """This rank's rows of sum over ranks of a_r @ w_r.T, plus the bias, in fp32."""
    total = None
    for r in range(world):
        a, w, bias = _operands(seed, m, n, k, r)
        part = a.float() @ w.float().t()
        total = part if total is None else total + part
    rows = m // world
    return (total + bias.float())[rank * rows:(rank + 1) * rows]


def _ag_operands(seed, m, n, k, rank, world):
    """Every rank's shard [m / t, k], the shared w and bias."""
    shards = [_operands(seed, m // world, n, k, r)[0] for r in range(world)]
    _, w, bias = _operands(seed, m // world, n, k, 0)
    return shards, w, bias


def _check_ops(rank, world):
    group = dist.group.WORLD
    for m, n, k in SHAPES:
        if m % world:
            continue
        for call in range(4):
            a, w, bias = _operands(call, m, n, k, rank)
            got = gemm_rs(a, w, group, bias=bias, config=RS)
            assert rel_error(got, _rs_reference(call, m, n, k, rank, world)) < 1e-2, ("gemm_rs", m, n, k, call)
            shards, w, bias = _ag_operands(call, m, n, k, rank, world)
            got = ag_gemm(shards[rank], w, group, bias=bias, config=AG)
            want = torch.cat(shards).float() @ w.float().t() + bias.float()
            assert rel_error(got, want) < 1e-2, ("ag_gemm", m, n, k, call)
        torch.cuda.synchronize()
        dist.barrier()


def _check_replays(rank, world):
    group = dist.group.WORLD
    m, n, k = SHAPES[0]
    a_static, w_static, bias_static = _operands(0, m, n, k, rank)
    shards, wg_static, biasg_static = _ag_operands(0, m, n, k, rank, world)
    shard_static = shards[rank].clone()
    for _ in range(2):   # the plans built, every kernel compiled, before the capture
        gemm_rs(a_static, w_static, group, bias=bias_static, config=RS)
        ag_gemm(shard_static, wg_static, group, bias=biasg_static, config=AG)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rs_out = gemm_rs(a_static, w_static, group, bias=bias_static, config=RS)
        ag_out = ag_gemm(shard_static, wg_static, group, bias=biasg_static, config=AG)
    for replay in range(1, 6):
        a, w, bias = _operands(replay, m, n, k, rank)
        shards, wg, biasg = _ag_operands(replay, m, n, k, rank, world)
        for static, fresh in ((a_static, a), (w_static, w), (bias_static, bias), (shard_static, shards[rank]),
                              (wg_static, wg), (biasg_static, biasg)):
            static.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_error(rs_out, _rs_reference(replay, m, n, k, rank, world)) < 1e-2, ("gemm_rs replay", replay)
        want = torch.cat(shards).float() @ wg.float().t() + biasg.float()
        assert rel_error(ag_out, want) < 1e-2, ("ag_gemm replay", replay)
    del graph
    torch.cuda.synchronize()
    dist.barrier()


def _check_norm_sums_the_slots(rank, world):
    """gemm_rs's second half left to the fused add + RMSNorm (x_sum: the kernel reads the t slots): bit for bit the
    summed output through the same norm, forward and the gradients of x and the residual."""
    group = dist.group.WORLD
    m, n, k = 2048, 1024, 512
    for call in range(3):
        a, w, _ = _operands(call, m, n, k, rank)
        gen = torch.Generator(device="cuda").manual_seed(500 + call)
        residual = torch.randn(m // world, n, device="cuda", generator=gen).bfloat16()
        weight = torch.randn(n, device="cuda", generator=gen).bfloat16()
        grad = torch.randn(m // world, n, device="cuda", generator=gen).bfloat16()

        summed = gemm_rs(a, w, group, config=RS).requires_grad_()
        res_a = residual.clone().requires_grad_()
        want, want_res = fused_add_rmsnorm(summed, res_a, weight)
        torch.autograd.backward((want, want_res), (grad, grad))

        pending = gemm_rs(a, w, group, config=RS, async_op=True)
        x = torch.empty(m // world, n, device="cuda", dtype=torch.bfloat16).requires_grad_()
        res_b = residual.clone().requires_grad_()
        got, got_res = fused_add_rmsnorm(x, res_b, weight, x_sum=pending.deferred_sum)
        torch.autograd.backward((got, got_res), (grad, grad))
        assert pending.deferred_sum.done
        for name, g, r in (("normalized", got, want), ("residual", got_res, want_res), ("x grad", x.grad, summed.grad),
                           ("residual grad", res_b.grad, res_a.grad)):
            assert torch.equal(g, r), (name, call, rel_error(g, r.float()))
    torch.cuda.synchronize()
    dist.barrier()


@pytest.mark.parametrize("check", [_check_ops, _check_replays, _check_norm_sums_the_slots],
                         ids=["eager", "replayed", "norm_sums_the_slots"])
def test_p2p_transports_at_t2_on_one_gpu(check):
    run_distributed(T, _on_one_gpu, check, backend="gloo")
