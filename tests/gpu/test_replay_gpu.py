"""Eager calls replayed from CUDA graphs (ops/replay.py) on all GPUs here (t = gpu_world()): gemm_rs, gemm_ar and
ag_gemm on the p2p transports, each plan against a twin plan of the same config that issues every call eagerly.

Checked with a few input buffers reused in turn (the addresses recur, as a training step's do) and fresh random data
written into them before every call:
- every call of the replaying plan equals its twin's bit for bit, across the first sighting (eager), the capture and
  the replays; graphs exist afterwards, one per address set;
- a rank that replays next to a peer that issues eagerly (one protocol on the device words);
- gemm_rs / gemm_ar: an async_op call (eager) between replayed ones; ag_gemm: the gathered input returned by a
  replay, and a replay while the previous gathered input is still referenced is the eager path's RuntimeError; a
  layer's own gathered buffer (OwnGather) whose region the producer claimed and wrote (the stage waits for nothing and
  copies nothing), or claimed and then handed another tensor (the stage copies it).
"""
import os

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from gpu_checks import gpu_world, poison_allocator
from overlap_tp import OverlapConfig
from overlap_tp.ops import replay
from overlap_tp.ops.ag_gemm import AgGemm, OwnGather
from overlap_tp.ops.gemm_ar import GemmAR
from overlap_tp.ops.gemm_rs import GemmRS

pytestmark = pytest.mark.gpu

RS_CONFIGS = {
    "p2p": OverlapConfig(method="signal", comm_sms=16, transport="p2p"),
    "p2p/copy": OverlapConfig(method="signal", comm_sms=16, transport="p2p", rs_transfer="copy"),
    "cublas-p2p": OverlapConfig(method="decompose", transport="p2p"),
}
AG_CONFIGS = {
    "p2p": OverlapConfig(method="signal", transport="p2p", comm_sms=0),
    "p2p/sm16": OverlapConfig(method="signal", transport="p2p", comm_sms=16),
    "p2p/lanes2": OverlapConfig(method="signal", transport="p2p", comm_sms=0, copy_lanes=2),
}
BUFFERS, ROUNDS = 3, 4


def twins(cls, world, m, n, k, config):
    """(a plan that replays, its twin that issues eagerly), built in the same order on every rank."""
    os.environ.pop(replay.ENV, None)
    replaying = cls(dist.group.WORLD, m, n, k, torch.bfloat16, "cuda", config)
    os.environ[replay.ENV] = "0"
    eager = cls(dist.group.WORLD, m, n, k, torch.bfloat16, "cuda", config)
    os.environ.pop(replay.ENV)
    return replaying, eager


def fill(tensors, seed):
    torch.manual_seed(seed)
    for x in tensors:
        x.copy_(torch.randn_like(x, dtype=torch.float32) / x.shape[-1] ** 0.25)


def _check_reductions(rank, world, cls, replays_here):
    poison_allocator()
    m, n, k = 1024 * world, 2048, 1024
    for name, config in RS_CONFIGS.items():   # gemm_ar's p2p transport is gemm_rs's with a gather after it
        plan, twin = twins(cls, world, m, n, k, config)
        graphs = plan.p2p.graphs
        assert graphs is not None and twin.p2p.graphs is None, name
        if not replays_here(rank):
            plan.p2p.graphs = None   # this rank issues eagerly beside a peer that replays
        inputs = [(torch.empty(m, k, dtype=torch.bfloat16, device="cuda"),
                   torch.empty(n, k, dtype=torch.bfloat16, device="cuda"),
                   torch.empty(n, dtype=torch.bfloat16, device="cuda")) for _ in range(BUFFERS)]
        outs = []   # some outputs kept, so that the outputs' addresses vary (the key has out's)
        for call in range(ROUNDS * BUFFERS):
            a, w, bias = inputs[call % BUFFERS]
            fill((a, w, bias), 100 * call + rank)
            bias_or_none = bias if call % 2 else None
            if call == 7:   # an eager async call in between
                got = plan(a, w, bias_or_none, async_op=True).wait()
            else:
                got = plan(a, w, bias_or_none)
            want = twin(a, w, bias_or_none)
            assert torch.equal(got, want), (name, call)
            if call % 3 == 0:
                outs.append(got)
        torch.cuda.synchronize()
        if replays_here(rank):
            assert len(graphs.graphs) >= 1, name   # captured, and so launched


def _check_ag_gemm(rank, world, replays_here):
    poison_allocator()
    m, n, k = 1024, 3072, 1024
    for name, config in AG_CONFIGS.items():
        plan, twin = twins(AgGemm, world, m, n, k, config)
        graphs = plan.graphs
        if not replays_here(rank):
            plan.graphs = None   # this rank issues eagerly beside a peer that replays
        inputs = [(torch.empty(m, k, dtype=torch.bfloat16, device="cuda"),
                   torch.empty(n, k, dtype=torch.bfloat16, device="cuda"),
                   torch.empty(n, dtype=torch.bfloat16, device="cuda")) for _ in range(BUFFERS)]
        for call in range(ROUNDS * BUFFERS):
            a, w, bias = inputs[call % BUFFERS]
            fill((a, w, bias), 100 * call + rank)
            bias_or_none = bias if call % 2 else None
            got, gathered = plan(a, w, bias_or_none, return_gathered=True)
            gathered_now = gathered.clone()
            del gathered
            want, want_gathered = twin(a, w, bias_or_none, return_gathered=True)
            assert torch.equal(got, want), (name, call)
            assert torch.equal(gathered_now, want_gathered), (name, call)
            del want_gathered
        if replays_here(rank):
            assert len(graphs.graphs) >= 1, name   # captured, and so launched
        # a call with the previous gathered input still referenced: the eager stage's error, raised before anything is
        # issued, replayed or not
        a, w, _ = inputs[0]
        _, held = plan(a, w, return_gathered=True)
        with pytest.raises(RuntimeError, match="still referenced"):
            plan(a, w)
        del held
        torch.cuda.synchronize()
        dist.barrier()


def _check_own_gather(rank, world, replays_here):
    poison_allocator()
    m, n, k = 1024, 3072, 1024
    config = AG_CONFIGS["p2p"]
    _, twin = twins(AgGemm, world, m, n, k, config)
    own = OwnGather(dist.group.WORLD, m, k, torch.bfloat16, torch.device("cuda", rank))
    inputs = [(torch.empty(m, k, dtype=torch.bfloat16, device="cuda"),
               torch.empty(n, k, dtype=torch.bfloat16, device="cuda")) for _ in range(BUFFERS)]
    for call in range(ROUNDS * BUFFERS):
        a, w = inputs[call % BUFFERS]
        fill((a, w), 100 * call + rank)
        region = own.claim()
        if call % 4 == 3:   # claimed, then handed another tensor: the stage copies it
            shard = a
        else:               # the producer writes the shard in place: nothing staged
            region.copy_(a)
            shard = region
        if call == 0 and not replays_here(rank):   # this rank's plan issues eagerly beside a peer that replays
            os.environ[replay.ENV] = "0"
        got, gathered = own.ag_gemm(shard, w, None, config)
        os.environ.pop(replay.ENV, None)
        gathered_now = gathered.clone()
        del gathered, region, shard
        want, want_gathered = twin(a, w, return_gathered=True)
        assert torch.equal(got, want), call
        assert torch.equal(gathered_now, want_gathered), call
        del want_gathered
    plan = next(iter(own._plans.values()))
    if replays_here(rank):
        assert len(plan.graphs.graphs) >= 1
    else:
        assert plan.graphs is None
    torch.cuda.synchronize()
    dist.barrier()


@pytest.mark.parametrize("who", ["every rank", "rank 0 only"])
def test_own_gather_replays_equal_eager_calls(who):
    run_distributed(gpu_world(), _check_own_gather, _replays_here(who), backend="nccl")


@pytest.mark.parametrize("who", ["every rank", "rank 0 only"])
def test_gemm_rs_replays_equal_eager_calls(who):
    run_distributed(gpu_world(), _check_reductions, GemmRS, _replays_here(who), backend="nccl")


@pytest.mark.parametrize("who", ["every rank", "rank 0 only"])
def test_gemm_ar_replays_equal_eager_calls(who):
    run_distributed(gpu_world(), _check_reductions, GemmAR, _replays_here(who), backend="nccl")


@pytest.mark.parametrize("who", ["every rank", "rank 0 only"])
def test_ag_gemm_replays_equal_eager_calls(who):
    run_distributed(gpu_world(), _check_ag_gemm, _replays_here(who), backend="nccl")


def _replays_here(who):
    return _every_rank if who == "every rank" else _rank_0


def _every_rank(rank):
    return True


def _rank_0(rank):
    return rank == 0
