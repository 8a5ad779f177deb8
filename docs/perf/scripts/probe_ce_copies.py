# How fast an AllGather's rows move between t GPUs, by what engine: the copy engines (cuMemcpyAsync through the driver,
# as ops/p2p.py GatherBuffer does: pulls from the peers' symmetric buffers, serial in ring order or one stream per peer;
# and pushes into them), torch's `copy_` of a peer-mapped view (what PyTorch's async-TP issues: whether the driver runs
# it on the copy engines or as an SM kernel is the question, eager and inside a CUDA graph). Sessions 22-23 also timed
# the SM pull kernel alone here (K programs, BLOCK elements per step: 180-300 GB/s per rank); since session 34 that
# kernel does the call's handshakes too (kernels/peer_copy.py SignaledPull) and is measured in its op
# (probe_op_timeline.py, `bench ops`).
# Each eager and captured in a CUDA graph (replayed), alone and beside a GEMM on another stream.
# Session 22 (commit 62cc94e, then without the copy_ / SM / graph modes) measured the copy engines at 210-270 GB/s per
# rank at t = 4 however driven (docs/perf/s22/ce_copies.txt) while async-TP's AllGather+GEMM at l8b.qkv (48 MB per
# rank) ran in 0.218 ms: above that ceiling if its copies are SM kernels.
# Every rank copies at the same time; a row is the slowest rank's median over REPS; GB/s counts the bytes each rank
# receives. Each mode's copy is checked once (every peer region holds its owner's rows) before it is timed.
#   torchrun --nproc-per-node T docs/perf/scripts/probe_ce_copies.py
import os
import statistics

import torch
import torch.distributed as dist
from torch.distributed import _symmetric_memory as symm_mem

from overlap_tp.ops import memops


rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
group, t = dist.group.WORLD, dist.get_world_size()
peers = [(rank + i) % t for i in range(1, t)]   # ring order
SHARD_MB = (16, 32)                              # per rank's shard (l8b.qkv at t = 4: 16 MB, at t = 2: 32 MB)
REPS = 20
elems = max(SHARD_MB) << 19                      # bf16 elements of the largest shard
buf = symm_mem.empty(t * elems, dtype=torch.bfloat16, device="cuda")   # region p: rank p's shard
handle = symm_mem.rendezvous(buf, group)
views = [handle.get_buffer(p, buf.shape, buf.dtype) for p in range(t)]   # every rank's buffer, mapped here
bases = [v.data_ptr() for v in views]
streams = [torch.cuda.Stream() for _ in range(max(1, t - 1))]
a = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)


def region(p, owner, n):
    """Region `owner` of rank p's buffer, first n elements (a tensor on this device)."""
    return views[p][owner * elems:owner * elems + n]


def issue(mode, n):
    """Every peer's shard into our buffer (pulls) or ours into every peer's (push), n elements each."""
    current = torch.cuda.current_stream()
    nbytes = 2 * n
    per_peer = mode.endswith("per-peer") or mode.endswith("2 streams")
    used = streams[:len(peers)] if mode.endswith("per-peer") else streams[:2] if mode.endswith("2 streams") \
        else streams[:1]
    for s in used:
        s.wait_stream(current)
    for i, p in enumerate(peers):
        stream = used[i % len(used)] if per_peer else used[0]
        if mode.startswith("copy_ pull"):   # async-TP's copy: a peer-mapped view into ours
            with torch.cuda.stream(stream):
                region(rank, p, n).copy_(region(p, p, n))
        elif mode.startswith("CE pull"):
            memops.copy(stream.cuda_stream, bases[rank] + p * elems * 2, bases[p] + p * elems * 2, nbytes)
        else:                               # CE push: our region into region `rank` of peer p's buffer
            memops.copy(stream.cuda_stream, bases[p] + rank * elems * 2, bases[rank] + rank * elems * 2, nbytes)
    for s in used:
        current.wait_stream(s)


def modes():
    out = ["CE pull", "CE push", "copy_ pull"]
    if t > 2:
        out += ["CE pull per-peer", "copy_ pull 2 streams"]
    return out


def reset():
    """Our peers' regions zeroed, our own region holds rank + 1 (its owner's value), on every rank."""
    torch.cuda.synchronize()
    dist.barrier(group)
    for p in range(t):
        buf[p * elems:(p + 1) * elems].fill_(rank + 1 if p == rank else 0)
    torch.cuda.synchronize()
    dist.barrier(group)


def check(mode, n):
    torch.cuda.synchronize()
    dist.barrier(group)
    for p in peers:
        got = buf[p * elems:p * elems + n]
        assert bool((got == p + 1).all()), f"rank {rank}, {mode}: region {p} does not hold rank {p}'s shard"


side = torch.cuda.Stream()


def timed(mode, n, beside, graph):
    run = (lambda: issue(mode, n))
    if graph:
        g = torch.cuda.CUDAGraph()
        capture_stream = torch.cuda.Stream()
        capture_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(capture_stream):
            issue(mode, n)   # warm-up (a Triton compile) outside the capture
        torch.cuda.current_stream().wait_stream(capture_stream)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            issue(mode, n)
        run = g.replay
    samples = []
    for _ in range(REPS):
        torch.cuda.synchronize()
        dist.barrier(group)
        side.wait_stream(torch.cuda.current_stream())
        if beside == "GEMM":
            with torch.cuda.stream(side):
                for _ in range(4):
                    torch.mm(a, w)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end))
    ms = torch.tensor([statistics.median(samples)], device="cuda")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
    return float(ms)


for mode in modes():   # every mode moves the right rows (eager, then replayed from a graph)
    for graph in (False, True):
        reset()
        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                issue(mode, elems)
            reset()
            g.replay()
        else:
            issue(mode, elems)
        check(f"{mode}{' (graph)' if graph else ''}", elems)
if rank == 0:
    print("checked: every mode, eager and replayed, moves every peer's shard into place", flush=True)
for beside in ("nothing", "GEMM"):
    for mb in SHARD_MB:
        n = mb << 19
        for graph in (False, True):
            row = []
            for mode in modes():
                ms = timed(mode, n, beside, graph)
                row.append(f"{mode} {ms:.3f} ms ({(t - 1) * 2 * n / ms / 1e6:.0f} GB/s)")
            if rank == 0:
                print(f"t={t} shard {mb:2d} MB beside {beside} {'graph' if graph else 'eager'}: " + "; ".join(row),
                      flush=True)
