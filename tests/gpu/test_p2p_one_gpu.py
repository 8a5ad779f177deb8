"""The p2p transports at t = 2 on ONE GPU: two processes share it, their buffers peer-mapped through CUDA IPC
(peers_on_one_gpu.py stands in for PyTorch's symmetric memory, which refuses two ranks on one device; the group is
gloo). Everything else is the ops' own code:
- gemm_rs on the p2p transport (epilogue stores into the owner's slots, the peer signals, the slot sum) and ag_gemm
  on it (the shard's copy and the copy-engine pulls behind the peer signals, the GEMM's tiles behind the ready
  flags), eager with fresh inputs every call, and captured in a CUDA graph and replayed (one rank late before some
  replays); the same with cuBLAS's GEMMs over those transports (method decompose: the stores into the owners'
  slots by cuBLAS, the pulled chunks' GEMMs behind the caller stream's joins); a soak of randomly drawn calls of
  both (OVERLAP_TP_SOAK_CALLS, 1000) against `off`;
- the fused add + RMSNorm summing gemm_rs's slots itself, bit for bit the summed path;
- gather_rows on the copy engines (the column-parallel backward's re-gather), eager and replayed; its result and
  ag_gemm's gathered input are the shape's one buffer, refused while held;
- OverlapTransformerLayers at TP 2 (test_layers_gpu.py's deferred proj sum and MLP boundary checks), and one layer
  captured forward + backward and replayed bit for bit;
- a peer that never calls again: the waiting rank ends (watchdog, exit 70), eager and replayed;
- the expert ops on their p2p transport at EP 2 (a2a_gemm pulls, gemm_a2a pushes), with the signaled grouped GEMM
  and with cuBLAS (method decompose), forward and backward against a dense fp32 computation; OverlapMoELayer on it
  against Megatron's MoELayer, and captured with static sizes.
The two processes' contexts time-slice the GPU: these check the protocols and the bits, never speed. Two GPUs:
test_gemm_rs_gpu.py, test_ag_gemm_gpu.py, test_graphs_gpu.py, test_layers_gpu.py, test_moe_*_gpu.py.
Run: `pytest -m gpu tests/gpu/test_p2p_one_gpu.py` (about 5 minutes)."""
import dataclasses
import functools
import os
import random
import textwrap

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from gpu_checks import rel_error, replays_equal_eager, run_two_ranks
from overlap_tp import OverlapConfig, ag_gemm, gemm_rs
from overlap_tp.megatron.norm import fused_add_rmsnorm
from overlap_tp.ops.ag_gemm import gather_rows

pytestmark = pytest.mark.gpu

T = 2
RS = OverlapConfig(method="signal", transport="p2p", comm_sms=0)
AG = OverlapConfig(method="signal", transport="p2p", comm_sms=0, groups=4)
RS_CUBLAS = OverlapConfig(method="decompose", transport="p2p", comm_sms=0)
AG_CUBLAS = OverlapConfig(method="decompose", transport="p2p", comm_sms=0, chunks=2)
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


def _check_ops(rank, world, rs=RS, ag=AG):
    group = dist.group.WORLD
    for m, n, k in SHAPES:
        if m % world:
            continue
        for call in range(4):
            a, w, bias = _operands(call, m, n, k, rank)
            got = gemm_rs(a, w, group, bias=bias, config=rs)
            assert rel_error(got, _rs_reference(call, m, n, k, rank, world)) < 1e-2, ("gemm_rs", m, n, k, call)
            shards, w, bias = _ag_operands(call, m, n, k, rank, world)
            got = ag_gemm(shards[rank], w, group, bias=bias, config=ag)
            want = torch.cat(shards).float() @ w.float().t() + bias.float()
            assert rel_error(got, want) < 1e-2, ("ag_gemm", m, n, k, call)
        torch.cuda.synchronize()
        dist.barrier()


def _check_replays(rank, world, rs=RS, ag=AG):
    group = dist.group.WORLD
    m, n, k = SHAPES[0]
    a_static, w_static, bias_static = _operands(0, m, n, k, rank)
    shards, wg_static, biasg_static = _ag_operands(0, m, n, k, rank, world)
    shard_static = shards[rank].clone()
    for _ in range(2):   # the plans built, every kernel compiled, before the capture
        gemm_rs(a_static, w_static, group, bias=bias_static, config=rs)
        ag_gemm(shard_static, wg_static, group, bias=biasg_static, config=ag)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rs_out = gemm_rs(a_static, w_static, group, bias=bias_static, config=rs)
        ag_out = ag_gemm(shard_static, wg_static, group, bias=biasg_static, config=ag)
    for replay in range(1, 6):
        a, w, bias = _operands(replay, m, n, k, rank)
        shards, wg, biasg = _ag_operands(replay, m, n, k, rank, world)
        for static, fresh in ((a_static, a), (w_static, w), (bias_static, bias), (shard_static, shards[rank]),
                              (wg_static, wg), (biasg_static, biasg)):
            static.copy_(fresh)
        if rank == 1 and replay % 2:
            torch.cuda._sleep(200_000_000)   # a late peer (~0.1 s on the GPU before its replay)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_error(rs_out, _rs_reference(replay, m, n, k, rank, world)) < 1e-2, ("gemm_rs replay", replay)
        want = torch.cat(shards).float() @ wg.float().t() + biasg.float()
        assert rel_error(ag_out, want) < 1e-2, ("ag_gemm replay", replay)
    del graph
    torch.cuda.synchronize()
    dist.barrier()


def _check_norm_sums_the_slots(rank, world, rs=RS):
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

        summed = gemm_rs(a, w, group, config=rs).requires_grad_()
        res_a = residual.clone().requires_grad_()
        want, want_res = fused_add_rmsnorm(summed, res_a, weight)
        torch.autograd.backward((want, want_res), (grad, grad))

        pending = gemm_rs(a, w, group, config=rs, async_op=True)
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


def _check_gather(rank, world):
    """gather_rows on the copy engines (the column-parallel backward's re-gather): every rank's rows in rank
    order, bit for bit, eager with fresh shards every call (a GEMM queued between issue and wait), then captured
    and replayed."""
    group = dist.group.WORLD
    for m, k in ((1024, 512), (520, 264)):
        for call in range(4):
            shards = [_operands(call, m, 8, k, r)[0] for r in range(world)]
            pending = gather_rows(shards[rank], group, RS)
            busy = shards[rank] @ shards[rank].t()   # the caller's stream works while the copy engines gather
            got = pending.wait()
            assert torch.equal(got, torch.cat(shards)), ("gather", m, k, call)
            del busy
            if call == 1:   # the result is the shape's shared buffer: a call while it is held is refused, not run
                with pytest.raises(RuntimeError, match="still referenced"):
                    gather_rows(shards[rank], group, RS)
            del got
        # ag_gemm's gathered input on p2p is the same buffer (one per shard shape), refused alike while held
        shards = [_operands(7, m, 8, k, r)[0] for r in range(world)]
        w = _operands(7, 8, 16, k, 0)[1]
        out, gathered = ag_gemm(shards[rank], w, group, config=AG, return_gathered=True)
        assert torch.equal(gathered, torch.cat(shards)), ("ag_gemm gathered", m, k)
        with pytest.raises(RuntimeError, match="still referenced"):
            gather_rows(shards[rank], group, RS)
        del gathered
        # and so is the cuBLAS path's (decompose over p2p), and gather_rows with its config pulls too
        out, gathered = ag_gemm(shards[rank], w, group, config=AG_CUBLAS, return_gathered=True)
        assert torch.equal(gathered, torch.cat(shards)), ("ag_gemm cuBLAS gathered", m, k)
        with pytest.raises(RuntimeError, match="still referenced"):
            gather_rows(shards[rank], group, AG_CUBLAS)
        del gathered
        assert torch.equal(gather_rows(shards[rank], group, RS).wait(), torch.cat(shards)), ("after ag_gemm", m, k)
        # the pulls split over three streams (copy_lanes): the same rows
        lanes = dataclasses.replace(RS, copy_lanes=3)
        assert torch.equal(gather_rows(shards[rank], group, lanes).wait(), torch.cat(shards)), ("lanes", m, k)
        static = _operands(0, m, 8, k, rank)[0].clone()
        for _ in range(2):
            gather_rows(static, group, RS).wait()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = gather_rows(static, group, RS).wait()
        for replay in range(1, 5):
            shards = [_operands(100 + replay, m, 8, k, r)[0] for r in range(world)]
            static.copy_(shards[rank])
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, torch.cat(shards)), ("gather replay", m, k, replay)
        del graph
    torch.cuda.synchronize()
    dist.barrier()


def _check_layer_captured(rank, world, method="signal", in_place=False):
    """An OverlapTransformerLayer at TP 2 (SP, both sequence-parallel collectives and the backward's re-gather on
    the p2p transports: no other collective) captured forward + backward in one CUDA graph and replayed with fresh
    inputs: output, input grad and every parameter grad bit for bit the eager step's on the same input (Megatron's
    deterministic mode), one rank late before some replays (the layer replayed at t = 2). in_place: the
    layer built with OverlapSettings.gather_in_place (its norms write into qkv's and fc1's own gathered buffers)."""
    import test_layers_gpu as L
    from megatron.core.transformer.spec_utils import build_module
    from overlap_tp.megatron.layer_spec import get_gpt_layer_overlap_spec
    from overlap_tp.megatron.layers import set_overlap_config
    L._quiet()
    L._deterministic()
    ps = L._setup(world, "cuda")
    config, p2p_configs = L._sp_p2p_config(world, num_layers=1, deterministic=True, method=method)
    L._seed(79, "cuda")
    layer = build_module(get_gpt_layer_overlap_spec(settings=L._settings(gather_in_place=in_place)), config=config,
                         layer_number=1).cuda()
    assert layer.self_attention.linear_qkv.gather_in_place == in_place
    set_overlap_config(layer, p2p_configs)
    steps = list(L._fresh_steps(9 + rank, 2048 // world, config.hidden_size, 4))
    replays_equal_eager(lambda x, g: L._fwd_bwd([layer], x, g), steps, rank, late=True)
    ps.destroy_model_parallel()


SOAK_CALLS = int(os.environ.get("OVERLAP_TP_SOAK_CALLS", 1000))
SOAK_SHAPES = [(1024, 1024, 512), (2048, 4096, 1024), (2 * 520, 1000, 512), (256, 128, 64), (4096, 2048, 2048)]
SOAK_CONFIGS = {"rs": [RS, OverlapConfig(method="signal", transport="p2p", comm_sms=0, block_n=128), RS_CUBLAS],
                "ag": [AG, OverlapConfig(method="signal", transport="p2p", comm_sms=0, groups=1),
                       OverlapConfig(method="signal", transport="p2p", comm_sms=0, groups=3), AG_CUBLAS,
                       OverlapConfig(method="decompose", transport="p2p", comm_sms=0, chunks=1)]}


def _check_soak(rank, world):
    """Back-to-back calls with randomly drawn ops, shapes and p2p configs (the same draws on both ranks), each
    against the op's `off` path on the same inputs; errors read every 100 calls, so the calls run back to back."""
    group, draw = dist.group.WORLD, random.Random(2026)
    torch.manual_seed(100 + rank)
    run, off = {"rs": gemm_rs, "ag": ag_gemm}, OverlapConfig(method="off")
    pending = []
    for call in range(SOAK_CALLS):
        op = draw.choice(("rs", "ag"))
        m, n, k = draw.choice(SOAK_SHAPES)
        config = draw.choice(SOAK_CONFIGS[op])
        a = torch.randn(m // world if op == "ag" else m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        got = run[op](a, w, group, config=config)
        ref = run[op](a, w, group, config=off).float()
        pending.append(((got.float() - ref).norm() / ref.norm(), (call, op, (m, n, k), config)))
        if len(pending) == 100 or call == SOAK_CALLS - 1:
            for error, (_, what) in zip(torch.stack([e for e, _ in pending]).tolist(), pending):
                assert error < 1e-2, (what, error)
            pending = []
    torch.cuda.synchronize()
    dist.barrier()


CUBLAS = functools.partial   # the same check with cuBLAS's GEMMs over the p2p transports (method decompose)


def _check_resolved_defaults(rank, world):
    """The resolver on CUDA: OverlapConfig(method=signal / decompose) with nothing else set (what `--overlap-tp signal`
    / `decompose` build per op kind) gives ag_gemm and gemm_rs plans on the p2p transport with every SM, epilogue
    stores and row chunks at t = 2, whose results are the reference's."""
    from overlap_tp.ops.ag_gemm import AgGemm
    from overlap_tp.ops.gemm_rs import GemmRS
    group = dist.group.WORLD
    m, n, k = SHAPES[0]
    for method in ("signal", "decompose"):
        config = OverlapConfig(method=method)
        rs_plan = GemmRS(group, m, n, k, torch.bfloat16, "cuda", config)
        ag_plan = AgGemm(group, m // world, n, k, torch.bfloat16, "cuda", config)
        for plan in (rs_plan, ag_plan):
            assert (plan.method, plan.config.transport, plan.config.comm_sms) == (method, "p2p", 0), plan.describe()
            assert not plan.config.unset(), plan.config
        assert (rs_plan.config.rs_transfer, ag_plan.config.chunk_by) == ("epilogue", "rows")
        _check_ops(rank, world, rs=config, ag=config)



@pytest.mark.parametrize("check", [_check_ops, _check_replays, _check_norm_sums_the_slots, _check_gather,
                                   _check_layer_captured, _check_soak,
                                   CUBLAS(_check_ops, rs=RS_CUBLAS, ag=AG_CUBLAS),
                                   CUBLAS(_check_replays, rs=RS_CUBLAS, ag=AG_CUBLAS),
                                   CUBLAS(_check_norm_sums_the_slots, rs=RS_CUBLAS),
                                   CUBLAS(_check_layer_captured, method="decompose"),
                                   CUBLAS(_check_layer_captured, in_place=True),
                                   CUBLAS(_check_layer_captured, method="decompose", in_place=True),
                                   _check_resolved_defaults],
                         ids=["eager", "replayed_late_peer", "norm_sums_the_slots", "gather_rows", "layer_captured",
                              "soak", "cublas_eager", "cublas_replayed_late_peer", "cublas_norm_sums_the_slots",
                              "cublas_layer_captured", "layer_captured_in_place", "cublas_layer_captured_in_place",
                              "resolved_defaults"])
def test_p2p_transports_at_t2_on_one_gpu(check):
    run_distributed(T, _on_one_gpu, check, backend="gloo")


def _check_strategies(rank, world):
    """The op's class returns the plan of the strategy its config names, on the p2p transports, and that plan's calls
    equal the reference (the strategies' own choice is tested on the CPU: tests/ops/test_strategies.py)."""
    from overlap_tp.ops import ag_gemm as ag, gemm_rs as rs
    group, (m, n, k) = dist.group.WORLD, SHAPES[0]
    cases = [(rs.GemmRS, RS, rs.GemmRSOverP2P, "signal/p2p"),
             (rs.GemmRS, dataclasses.replace(RS, rs_transfer="copy"), rs.GemmRSOverP2P, "signal/p2p/copy"),
             (rs.GemmRS, RS_CUBLAS, rs.GemmRSOverP2P, "decompose/p2p"),
             (rs.GemmRS, dataclasses.replace(RS_CUBLAS, rs_transfer="copy"), rs.GemmRSOverP2P, "decompose/p2p/copy"),
             (ag.AgGemm, AG, ag.AgGemmSignaledCopyEngines, "signal/p2p"),
             (ag.AgGemm, dataclasses.replace(AG, copy_lanes=2), ag.AgGemmSignaledCopyLanes, "signal/p2p"),
             (ag.AgGemm, AG_CUBLAS, ag.AgGemmDecomposedP2P, "decompose/p2p")]
    for op, config, strategy, label in cases:
        rows = m if op is rs.GemmRS else m // world
        plan = op(group, rows, n, k, torch.bfloat16, torch.device("cuda", 0), config)
        assert type(plan) is strategy and plan.describe().endswith(f", {label})"), (plan.describe(), config)
        for call in range(2):
            if op is rs.GemmRS:
                a, w, bias = _operands(call, m, n, k, rank)
                got, want = plan(a, w, bias), _rs_reference(call, m, n, k, rank, world)
            else:
                shards, w, bias = _ag_operands(call, m, n, k, rank, world)
                got = plan(shards[rank], w, bias)
                want = torch.cat(shards).float() @ w.float().t() + bias.float()
            assert rel_error(got, want) < 1e-2, (plan.describe(), call)
        torch.cuda.synchronize()
        dist.barrier()


def test_each_p2p_strategy_is_built_by_its_op_and_matches_the_reference_at_t2_on_one_gpu():
    run_distributed(T, _on_one_gpu, _check_strategies, backend="gloo")


def _check_layer(rank, world, check):
    """A test_layers_gpu.py check of OverlapTransformerLayers with both sequence-parallel collectives on the p2p
    transports, run at TP 2 on this one GPU (its TP group is gloo: nothing but the p2p ops may communicate)."""
    torch.cuda.set_device(0)
    check(rank, world)


@pytest.mark.parametrize("method", ["signal", "decompose"])
@pytest.mark.parametrize("name", ["check_deferred_proj_sum", "check_mlp_boundary", "check_gather_in_place"])
def test_transformer_layers_on_the_p2p_transports_at_t2_on_one_gpu(name, method):
    """linear_proj's p2p sum left to the fused bda + norm, the MLP boundary across two layers (the next layer's
    norm and fc2's sum in one kernel), and the norms writing into the column-parallel layers' own gathered buffers:
    bit for bit their summed / staged paths over 20 steps (test_layers_gpu.py), with the signaled GEMMs and with
    cuBLAS's over the same transports."""
    import test_layers_gpu
    check = functools.partial(getattr(test_layers_gpu, name), method=method)
    run_distributed(T, _on_one_gpu, functools.partial(_check_layer, check=check), backend="gloo")


_PEER_NEVER_CALLS = textwrap.dedent("""
    import os, time
    import torch
    import torch.distributed as dist
    from peers_on_one_gpu import install
    from overlap_tp import OverlapConfig, gemm_rs
    rank, captured = int(os.environ["RANK"]), os.environ["CAPTURED"] == "1"
    torch.cuda.set_device(0)
    install()
    dist.init_process_group("gloo")
    config = OverlapConfig(method="signal", transport="p2p", comm_sms=0)
    torch.manual_seed(rank)
    a = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16) / 32
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):        # builds the plan, compiles the kernels, on both ranks
        for _ in range(3):
            gemm_rs(a, w, config=config)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if captured:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gemm_rs(a, w, config=config)
        torch.cuda.synchronize()
    dist.barrier()
    if rank == 1:                        # alive, but never calls again: rank 0's wait for its signal never passes
        time.sleep(90)
        os._exit(0)
    print(f"CALL AT {time.time()}", flush=True)
    if captured:
        graph.replay()
    else:
        gemm_rs(a, w, config=config)
    torch.cuda.synchronize()
    print("NOT REACHED", flush=True)
    os._exit(0)
""")


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "replayed"])
def test_a_peer_that_never_calls_ends_the_waiting_rank(captured):
    """gemm_rs on the p2p transport at t = 2 (one GPU); after three calls together only rank 0 calls again (eagerly,
    or by replaying a captured call). Its wait for rank 1's signal must end the process within OVERLAP_TP_WATCHDOG_S
    (5 s) and the poll, exit code 70, with a message naming the op and the transport (and, replayed, the signal),
    instead of hanging (docs/reliability.md; the replayed case is test_graphs_gpu.py's two-GPU test)."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, OVERLAP_TP_WATCHDOG_S="5", CAPTURED=str(int(captured)),
               PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    returncode, out, err, ended = run_two_ranks(_PEER_NEVER_CALLS, env)
    assert "CALL AT" in out, err[-3000:]
    called = float(out.split("CALL AT ")[1].split()[0])
    assert returncode == 70, err[-3000:]
    op = "gemm_rs(M=2048, N=1024, K=1024, t=2, signal/p2p)"
    if captured:
        assert f"overlap_tp watchdog: {op} waited 5 s for rank 1's" in err and "in a CUDA graph replay" in err, \
            err[-3000:]
    else:
        assert f"overlap_tp watchdog: {op} did not complete within 5 s" in err, err[-3000:]
    assert "NOT REACHED" not in out
    assert ended - called < 20, ended - called


# ---------------------------------------------------------------------------------------------------
# The expert ops on the p2p transport (a2a_gemm pulls, gemm_a2a pushes) at EP 2
# ---------------------------------------------------------------------------------------------------

EXPERTS, HIDDEN, FFN = 2, 1024, 1408   # local experts per rank; FFN not a multiple of the 256-wide tile
EXPERT_P2P = OverlapConfig(method="signal", transport="p2p", comm_sms=0, groups=2)
EXPERT_CUBLAS_P2P = OverlapConfig(method="decompose", transport="p2p", comm_sms=0, groups=2)


def _expert_counts(world, seed):
    """Routings with a hot expert, a rank that sends nothing and a rank that receives nothing, and growing ones
    (the op's buffers must be rebuilt larger, on both ranks at the same call)."""
    g = torch.Generator().manual_seed(seed)
    E = world * EXPERTS
    uniform = torch.randint(100, 400, (world, E), generator=g)
    hot = torch.randint(0, 50, (world, E), generator=g)
    hot[:, 0] = 1500
    empty = torch.randint(0, 300, (world, E), generator=g)
    empty[world - 1] = 0
    empty[:, :EXPERTS] = 0
    bigger = torch.randint(800, 1200, (world, E), generator=g)
    return [uniform, hot, empty, uniform, bigger]


def _expert_reference(counts, xs, w1, hs, w2, gys, gzs):
    """fp32 y, z per rank and the grads of x, w1, h, w2 (every rank's data: one dense computation)."""
    ep, E = counts.shape
    starts = torch.cumsum(counts, 1) - counts
    route = [[(s, int(starts[s, r * EXPERTS + l]) + i, r * EXPERTS + l) for s in range(ep) for l in range(EXPERTS)
              for i in range(int(counts[s, r * EXPERTS + l]))] for r in range(ep)]
    tokens = counts.sum(1).tolist()
    offsets = [sum(tokens[:s]) for s in range(ep)]
    x32, h32 = [[t.float().requires_grad_() for t in ts] for ts in (xs, hs)]
    w1_32, w2_32 = w1.float().requires_grad_(), w2.float().requires_grad_()
    every_x = torch.cat(x32)
    rows = [torch.tensor([offsets[s] + i for s, i, _ in route[r]], dtype=torch.long, device="cuda") for r in range(ep)]
    experts = [torch.tensor([e for _, _, e in route[r]], dtype=torch.long, device="cuda") for r in range(ep)]

    def per_expert(inp, w, expert):   # row j: inp[j] @ w[expert[j]].T, one matmul per expert (no [R, N, K] gather)
        out = torch.zeros(inp.shape[0], w.shape[1], device="cuda")
        for e in expert.unique().tolist():
            index = (expert == e).nonzero().flatten()
            out = out.index_add(0, index, inp[index] @ w[e].t())
        return out
    ys = [per_expert(every_x[rows[r]], w1_32, experts[r]) for r in range(ep)]
    outs = [per_expert(h32[r], w2_32, experts[r]) for r in range(ep)]
    zs = torch.zeros(sum(tokens), HIDDEN, device="cuda").index_add(0, torch.cat(rows), torch.cat(outs)).split(tokens)
    loss = sum((y * gy.float()).sum() for y, gy in zip(ys, gys)) + sum((z * gz.float()).sum() for z, gz in zip(zs, gzs))
    loss.backward()

    def grad(t):   # a rank's input that reaches no output (it routed or received nothing) has no grad: zeros
        return torch.zeros_like(t) if t.grad is None else t.grad
    return dict(y=ys, z=zs, dx=[grad(x) for x in x32], dw1=grad(w1_32), dh=[grad(h) for h in h32], dw2=grad(w2_32))


def _check_expert_ops(rank, world, config=EXPERT_P2P):
    from overlap_tp import a2a_gemm, gemm_a2a
    group = dist.group.WORLD
    mine = slice(rank * EXPERTS, (rank + 1) * EXPERTS)
    for m, counts in enumerate(_expert_counts(world, 7)):
        gen = torch.Generator(device="cuda").manual_seed(31 + m)

        def rand(*shape, scale=1.0):
            return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()
        tokens = counts.sum(1).tolist()
        received = [int(counts[:, r * EXPERTS:(r + 1) * EXPERTS].sum()) for r in range(world)]
        xs, gzs = [rand(t, HIDDEN) for t in tokens], [rand(t, HIDDEN) for t in tokens]
        hs, gys = [rand(r, FFN) for r in received], [rand(r, FFN) for r in received]
        w1 = rand(world * EXPERTS, FFN, HIDDEN, scale=HIDDEN ** -0.5)
        w2 = rand(world * EXPERTS, HIDDEN, FFN, scale=FFN ** -0.5)
        ref = _expert_reference(counts, xs, w1, hs, w2, gys, gzs)
        x, w = xs[rank].clone().requires_grad_(), w1[mine].contiguous().requires_grad_()
        y = a2a_gemm(x, counts, w, group, config=config)
        y.backward(gys[rank])   # the backward's mirrored op: gemm_a2a's push
        h, v = hs[rank].clone().requires_grad_(), w2[mine].contiguous().requires_grad_()
        z = gemm_a2a(h, counts, v, group, config=config)
        z.backward(gzs[rank])   # the backward's mirrored op: a2a_gemm's pull
        for name, got, want in (("y", y, ref["y"][rank]), ("dx", x.grad, ref["dx"][rank]),
                                ("dw1", w.grad, ref["dw1"][mine]), ("z", z, ref["z"][rank]),
                                ("dh", h.grad, ref["dh"][rank]), ("dw2", v.grad, ref["dw2"][mine])):
            assert not got.isnan().any(), (m, name)
            if float(want.norm()) == 0:   # nothing routed there (an expert or a rank with no rows): exact zeros
                assert not got.any(), (m, name)
            else:
                assert rel_error(got, want) < 1e-2, (m, name, rel_error(got, want))
    torch.cuda.synchronize()
    dist.barrier()


@pytest.mark.parametrize("config", [EXPERT_P2P, EXPERT_CUBLAS_P2P], ids=["signal", "cublas"])
def test_expert_ops_on_the_p2p_transport_at_ep2_on_one_gpu(config):
    """a2a_gemm (copy-engine pulls) and gemm_a2a (copy-engine pushes) at EP 2, forward and backward, over five
    routings (a hot expert, a rank that sends nothing and one that receives nothing, one that needs larger
    buffers) against one dense fp32 computation of every rank's data; the grouped signaled GEMM and cuBLAS."""
    run_distributed(T, _on_one_gpu, functools.partial(_check_expert_ops, config=config), backend="gloo")


def _check_moe_layer_captured(rank, world):
    import test_moe_layer_gpu as moe_tests
    moe_tests.METHODS["signal"] = EXPERT_P2P   # this process's "signal" layer runs the expert ops on p2p
    moe_tests._check_captured(rank, world)


def test_moe_layer_on_the_p2p_transport_captured_at_ep2_on_one_gpu():
    """test_moe_layer_gpu.py's captured check at EP 2 with the expert ops on p2p: OverlapMoELayer (static sizes:
    capacity factor 1.0, padded) forward + backward in one CUDA graph, 50 replays with fresh inputs equal to the
    eager steps, one rank late before some replays."""
    run_distributed(T, _on_one_gpu, _check_moe_layer_captured, backend="gloo")


def _check_moe_layer_parity(rank, world, routing, config=EXPERT_P2P):
    import test_moe_layer_gpu as moe_tests
    moe_tests.METHODS.clear()
    moe_tests.METHODS["signal"] = config   # only ours on p2p against Megatron's MoELayer (its all-to-all on gloo)
    moe_tests._check_parity(rank, world, routing, 4096, {})


@pytest.mark.parametrize("routing, config", [("uniform", EXPERT_P2P), ("zipf", EXPERT_P2P), ("rank0_only", EXPERT_P2P),
                                             ("zipf", EXPERT_CUBLAS_P2P)],
                         ids=["uniform", "zipf", "rank0_only", "zipf_cublas"])
def test_moe_layer_on_the_p2p_transport_matches_megatrons_at_ep2_on_one_gpu(routing, config):
    """test_moe_layer_gpu.py's parity check at EP 2 with the expert ops on p2p: output, input grad and every
    parameter grad against Megatron's MoELayer (whose all-to-all runs on the gloo group here); the signaled grouped
    GEMM on three routings, cuBLAS (method decompose) on one."""
    run_distributed(T, _on_one_gpu, functools.partial(_check_moe_layer_parity, routing=routing, config=config),
                    backend="gloo")
