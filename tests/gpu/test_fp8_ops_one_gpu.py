"""The dense ops with FP8 operands on ONE GPU (Hopper: FP8 wgmma).

- The p2p FP8 strategies at t = 2: two processes share the GPU, their buffers peer-mapped through CUDA IPC
  (peers_on_one_gpu.py, as test_p2p_one_gpu.py; the group is gloo): ag_gemm (AgGemmSignaledP2PFp8: the shard's rows
  and scales staged, the peers' scales pulled with the first chunk, the GEMM's tiles behind the ready flags),
  gemm_rs (GemmRSOverP2PFp8, epilogue stores and rs_transfer 'copy') and gemm_ar (GemmAROverP2PFp8), both scalings,
  eager with fresh operands every call against the float64 product of the dequantized operands, ag_gemm's gathered
  input bit for bit every rank's rows and scales; then captured in one CUDA graph and replayed with fresh operands
  (one rank late before some replays), each replay bit for bit the eager calls on the same operands.
- The NCCL and off FP8 strategies at t = 1 (a one-rank NCCL group, as test_ops_one_gpu.py): the raw communicator's
  byte broadcasts of the rows and the scales' broadcast, torch's scaled GEMM (_scaled_mm tensorwise, scaled_mm
  blockwise where cuBLAS has it).
One shape, no dimension a tile multiple (M/t = 520, N = 1408 = 5.5 tiles of 256, K = 384 = 3 x 128). Tolerance per
element (test_fp8_gpu.py's, per rounding): 2**-8 per bf16 rounding of each partial (with the bias where an epilogue
adds it) and of the result, plus 2**-9 sum_k |a_ik| |w_jk| for the accumulation (Hopper's FP8 wgmma accumulates
with fewer bits than fp32 between promotions). Run: `pytest -m gpu tests/gpu/test_fp8_ops_one_gpu.py` (about a
minute: the processes' start and the FP8 kernels' compiles)."""
import os

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from overlap_tp import OverlapConfig, ag_gemm, gemm_ar, gemm_rs
from overlap_tp.kernels import fp8_quant as Q
from overlap_tp.ops import ag_gemm as ag, gemm_rs as rs
from overlap_tp.ops.plan_base import cached_plan, operand_plan_args

pytestmark = pytest.mark.gpu

T = 2
M, N, K = 1040, 1408, 384   # M: the gathered rows (ag_gemm) or the rows reduced (gemm_rs, gemm_ar); K: one rank's
RECIPES = {"tensorwise": (Q.quantize_tensorwise_reference, Q.quantize_tensorwise_reference),
           "blockwise": (Q.quantize_1x128_reference, Q.quantize_128x128_reference)}
AG = OverlapConfig(method="signal", transport="p2p", comm_sms=0, groups=3)
RS = OverlapConfig(method="signal", transport="p2p", comm_sms=0, rs_transfer="epilogue")
RS_COPY = OverlapConfig(method="signal", transport="p2p", comm_sms=0, rs_transfer="copy", groups=2)


def _needs_fp8():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FP8 wgmma needs compute capability 9.0 (Hopper) or newer")


def _data(seed, rows, n, k):
    """bf16 x[rows, k] (rows of different magnitudes), w[n, k], bias[n], on the GPU, from `seed`."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k, device="cuda", generator=g) * torch.exp(torch.randn(rows, 1, device="cuda", generator=g))
    w = torch.randn(n, k, device="cuda", generator=g) / k ** 0.5
    return x.bfloat16(), w.bfloat16(), torch.randn(n, device="cuda", generator=g).bfloat16()


def _ag_problem(seed, recipe, world):
    """Every rank's shard of x [M, K] quantized on its own, w quantized, the bias; the reference terms."""
    qa, qw = RECIPES[recipe]
    x, w, bias = _data(seed, M, N, K)
    shards = [qa(s.contiguous()) for s in x.chunk(world)]
    w8 = qw(w)
    da, dw = torch.cat([Q.dequantize_reference(s) for s in shards]), Q.dequantize_reference(w8)
    product = da @ dw.t()
    return shards, w8, bias, product + bias.double(), [product], da.abs() @ dw.abs().t()


def _rs_problem(seed, recipe, world):
    """Every rank's a[M, K] and w[N, K] (its K shard) quantized on its own, the shared bias; the reference terms."""
    qa, qw = RECIPES[recipe]
    a8, w8, partials, s = [], [], [], 0
    for r in range(world):
        x, w, bias = _data(seed * 31 + r, M, N, K)
        a8.append(qa(x))
        w8.append(qw(w))
        da, dw = Q.dequantize_reference(a8[-1]), Q.dequantize_reference(w8[-1])
        partials.append(da @ dw.t())
        s = s + da.abs() @ dw.abs().t()
    bias = _data(seed, 1, N, 16)[2]
    return a8, w8, bias, sum(partials) + bias.double(), partials, s


def _assert_close(got, ref, partials, s, what):
    assert not got.isnan().any(), (what, "an output element was never written")
    bound = 2 ** -8 * (ref.abs() + sum(p.abs() for p in partials) + (ref - sum(partials)).abs()) + 2 ** -9 * s
    err = (got.double() - ref).abs()
    assert (err <= bound).all(), (what, int((err > bound).sum()), float((err - bound).max()))


def _rows(rank, world):
    return slice(rank * M // world, (rank + 1) * M // world)


def _on_one_gpu(rank, world, check):
    from peers_on_one_gpu import install
    os.environ.setdefault("OVERLAP_TP_WATCHDOG_S", "120")
    torch.cuda.set_device(0)
    install()
    check(rank, world)


def _check_p2p(rank, world):
    group, rows = dist.group.WORLD, _rows(rank, world)
    for recipe in RECIPES:
        for call in range(3):   # the plans' first call and later ones, fresh operands (and scales) each time
            shards, w8, bias, ref, partials, s = _ag_problem(10 * call, recipe, world)
            out, gathered = ag_gemm(shards[rank], w8, group, bias=bias, config=AG, return_gathered=True)
            _assert_close(out, ref, partials, s, ("ag_gemm", recipe, call))
            assert torch.equal(gathered.q.view(torch.uint8), torch.cat([x.q for x in shards]).view(torch.uint8))
            stack = torch.cat if recipe == "tensorwise" else torch.stack
            assert torch.equal(gathered.ds, stack([x.ds for x in shards])), ("gathered scales", recipe, call)
            del gathered   # the plan's buffer: its next call is refused while this is held
            a8, w8, bias, ref, partials, s = _rs_problem(10 * call, recipe, world)
            for config in (RS, RS_COPY):
                got = gemm_rs(a8[rank], w8[rank], group, bias=bias, config=config)
                _assert_close(got, ref[rows], [p[rows] for p in partials], s[rows], ("gemm_rs", recipe, config, call))
            _assert_close(gemm_ar(a8[rank], w8[rank], group, bias=bias, config=RS), ref, partials, s,
                          ("gemm_ar", recipe, call))
        torch.cuda.synchronize()
        dist.barrier()
    _check_replays(rank, world)


def _check_replays(rank, world):
    """gemm_rs and ag_gemm (blockwise and tensorwise) captured in one graph; each replay, with fresh operands copied
    into the captured ScaledFp8s, gives the bits of the eager calls on the same operands."""
    group = dist.group.WORLD
    rs_as, rs_ws, rs_bias, *_ = _rs_problem(99, "blockwise", world)
    rs_a, rs_w = rs_as[rank], rs_ws[rank]
    ag_shards, ag_w, ag_bias, *_ = _ag_problem(99, "tensorwise", world)
    ag_a = ag_shards[rank]

    def calls():
        return (gemm_rs(rs_a, rs_w, group, bias=rs_bias, config=RS_COPY),
                ag_gemm(ag_a, ag_w, group, bias=ag_bias, config=AG))
    for _ in range(2):   # the plans built and every kernel compiled before the capture
        calls()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = calls()
    rows = _rows(rank, world)
    for replay in range(1, 5):
        a8, w8, _, _, rs_partials, rs_s = _rs_problem(100 + replay, "blockwise", world)
        shards, wg, _, _, ag_partials, ag_s = _ag_problem(100 + replay, "tensorwise", world)
        for static, fresh in ((rs_a, a8[rank]), (rs_w, w8[rank]), (ag_a, shards[rank]), (ag_w, wg)):
            static.q.copy_(fresh.q)
            static.ds.copy_(fresh.ds)
        if rank == 1 and replay % 2:
            torch.cuda._sleep(200_000_000)   # a late peer (about 0.1 s on the GPU before its replay)
        graph.replay()
        torch.cuda.synchronize()
        replayed = [out.clone() for out in captured]
        rs_ref = sum(rs_partials) + rs_bias.double()   # the captured bias
        _assert_close(replayed[0], rs_ref[rows], [p[rows] for p in rs_partials], rs_s[rows], ("rs replay", replay))
        _assert_close(replayed[1], ag_partials[0] + ag_bias.double(), ag_partials, ag_s, ("ag replay", replay))
        for got, eager in zip(replayed, calls()):
            assert torch.equal(got, eager), ("replay against eager", replay)
        torch.cuda.synchronize()
        dist.barrier()
    del graph
    torch.cuda.synchronize()
    dist.barrier()


def test_fp8_p2p_strategies_at_t2_on_one_gpu():
    _needs_fp8()
    run_distributed(T, _on_one_gpu, _check_p2p, backend="gloo")


def _check_nccl_and_off(rank, world):
    group = dist.group.WORLD
    cases = [(OverlapConfig(method="off"), ag.AgGemmOffFp8, rs.GemmRSOffFp8),
             (OverlapConfig(method="signal", transport="nccl", comm_sms=16, groups=3), ag.AgGemmSignaledNcclFp8,
              rs.GemmRSSignaledNcclFp8)]
    for recipe in RECIPES:
        for config, ag_strategy, rs_strategy in cases:
            for call in range(2):
                shards, w8, bias, ref, partials, s = _ag_problem(call, recipe, 1)
                out, gathered = ag_gemm(shards[0], w8, group, bias=bias, config=config, return_gathered=True)
                _assert_close(out, ref, partials, s, ("ag_gemm", recipe, config, call))
                assert torch.equal(gathered.q.view(torch.uint8), shards[0].q.view(torch.uint8))
                assert torch.equal(gathered.ds.view(-1), shards[0].ds.view(-1))
                a8s, w8s, bias, ref, partials, s = _rs_problem(call, recipe, 1)
                _assert_close(gemm_rs(a8s[0], w8s[0], group, bias=bias, config=config), ref, partials, s,
                              ("gemm_rs", recipe, config, call))
            assert type(ag.ag_gemm_plan(shards[0], w8, group, config)) is ag_strategy
            m, n, k, dtype, device, fp8 = operand_plan_args(a8s[0], w8s[0])
            assert type(cached_plan(rs.GemmRS, group, m, n, k, dtype, device, config, fp8=fp8)) is rs_strategy
    torch.cuda.synchronize()


def test_fp8_nccl_and_off_strategies_at_t1():
    """A one-rank NCCL group: the raw communicator's calls on the FP8 rows (as bytes) and the scales, and torch's
    scaled GEMM of the off strategies, against the reference."""
    _needs_fp8()
    run_distributed(1, _check_nccl_and_off, backend="nccl")
