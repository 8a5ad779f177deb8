# Does a token split overlap one half's AllGather with the other half's compute, on Megatron's one hardware queue
# (CUDA_DEVICE_MAX_CONNECTIONS=1) and inside a CUDA graph? The question docs/fused_block.md (Token split) leaves open
# before building the split into the layer (issue 22). Written in session 30; not yet run.
#
# The AllGather+GEMM of linear_qkv, in plain parts: the copy-engine pulls of ops/p2p.py's GatherBuffer (cuMemcpyAsync
# from the peers' symmetric buffers, ring order, on a side stream) and a cuBLAS GEMM over the gathered rows, with an
# optional stand-in for the attention after it (a second GEMM of the same size, --attn). The peers' rows are written
# once and never change, so no signal is needed: every timed run starts behind a barrier.
#   sequential   pulls of every row, then GEMM (+ attention)                          (Megatron's order)
#   split        per half h: pulls(h), then GEMM(h) (+ attention(h)), one half after the other
#   staggered    the pulls of both halves issued first on the side stream (half A's, then half B's); GEMM(A) waits
#                for A's pulls only, so B's pulls can run beside GEMM(A) (+ attention(A)); then GEMM(B)
#   nocomm       the GEMM (+ attention) over the gathered rows, no pulls (the floor)
# Each is timed eager and as a CUDA graph replay (median of --reps, slowest rank). If staggered is not below split by
# about min(half's pulls, GEMM(A) [+ attention(A)]), the queue or the graph serialises the halves and the split would
# have to be built otherwise (split-phase ops, another stream order).
#   CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nproc-per-node T docs/perf/scripts/probe_token_split.py [--attn]
#       [--m 8192] [--k 4096] [--n N] [--reps 30]        (N default: linear_qkv's 6144 / T at the 8B shapes)
import argparse
import os
import statistics

import torch
import torch.distributed as dist
from torch.distributed import _symmetric_memory as symm_mem

from overlap_tp.ops import memops
from overlap_tp.ops.tile_plan import ring_peers

parser = argparse.ArgumentParser()
parser.add_argument("--m", type=int, default=8192, help="rows gathered (the sequence), all ranks together")
parser.add_argument("--k", type=int, default=4096)
parser.add_argument("--n", type=int, default=0, help="the GEMM's output columns per rank (0: 6144 / t)")
parser.add_argument("--attn", action="store_true", help="a second GEMM per half after the first (attention's place)")
parser.add_argument("--reps", type=int, default=30)
ARGS = parser.parse_args()

rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
group, t = dist.group.WORLD, dist.get_world_size()
m, k = ARGS.m // t, ARGS.k                     # this rank's shard: m rows
n = ARGS.n or 6144 // t
row_bytes = k * 2
buf = symm_mem.empty(t * m, k, dtype=torch.bfloat16, device="cuda")   # rows [p*m, (p+1)*m): rank p's shard
handle = symm_mem.rendezvous(buf, group)
bases = [handle.get_buffer(p, buf.shape, buf.dtype).data_ptr() for p in range(t)]
buf.normal_()
w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
w2 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 if ARGS.attn else None
out = torch.empty(t * m, n, device="cuda", dtype=torch.bfloat16)
out2 = torch.empty(t * m, n, device="cuda", dtype=torch.bfloat16)
side = torch.cuda.Stream()
HALVES = ((0, m // 2), (m // 2, m))             # each rank's shard rows in two halves (the batch halves' rows)


def pull(stream, lo, hi):
    """Rows [lo, hi) of every peer's shard into the same rows of its region in our buffer (copy engines)."""
    for p in ring_peers(rank, t):
        offset = (p * m + lo) * row_bytes
        memops.copy(stream.cuda_stream, bases[rank] + offset, bases[p] + offset, (hi - lo) * row_bytes)


def rows(lo, hi):
    """Rows [lo, hi) of every rank's region: one half of the gathered input, as t row blocks."""
    return [slice(p * m + lo, p * m + hi) for p in range(t)]


def compute(lo, hi):
    """The GEMM over one half's gathered rows (+ the attention stand-in), on the current stream."""
    for r in rows(lo, hi):
        torch.mm(buf[r], w.t(), out=out[r])
        if w2 is not None:
            torch.mm(buf[r], w2.t(), out=out2[r])


def sequential():
    current = torch.cuda.current_stream()
    side.wait_stream(current)
    pull(side, 0, m)
    current.wait_stream(side)
    compute(0, m)


def split():
    current = torch.cuda.current_stream()
    for lo, hi in HALVES:
        side.wait_stream(current)
        pull(side, lo, hi)
        current.wait_stream(side)
        compute(lo, hi)


def staggered():
    current = torch.cuda.current_stream()
    side.wait_stream(current)
    pulled = []
    for lo, hi in HALVES:
        pull(side, lo, hi)
        event = torch.cuda.Event()
        event.record(side)
        pulled.append(event)
    for (lo, hi), event in zip(HALVES, pulled):
        current.wait_event(event)
        compute(lo, hi)
    current.wait_stream(side)   # the side stream joins before anything that follows (as CommEngine.join)


def nocomm():
    compute(0, m)


def timed(fn, graph):
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        warm = torch.cuda.Stream()
        warm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warm):
            fn()
        torch.cuda.current_stream().wait_stream(warm)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    samples = []
    for _ in range(ARGS.reps):
        torch.cuda.synchronize()
        dist.barrier(group)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end))
    ms = torch.tensor([statistics.median(samples)], device="cuda")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
    return float(ms)


# the pulls move the right rows: every region holds its owner's shard after each variant
reference = [torch.empty(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(t)]
dist.all_gather(reference, buf[rank * m:(rank + 1) * m].contiguous(), group=group)
VARIANTS = {"sequential": sequential, "split": split, "staggered": staggered, "nocomm": nocomm}
for name, fn in VARIANTS.items():
    if name == "nocomm":
        continue
    for p in range(t):
        if p != rank:
            buf[p * m:(p + 1) * m].zero_()
    torch.cuda.synchronize()
    dist.barrier(group)
    fn()
    torch.cuda.synchronize()
    assert all(torch.equal(buf[p * m:(p + 1) * m], reference[p]) for p in range(t)), f"{name}: wrong rows"
    dist.barrier(group)

if rank == 0:
    print(f"t = {t}, gathered [{t * m}, {k}], GEMM N {n}{' + attention stand-in' if w2 is not None else ''}, "
          f"CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', 'unset')}, {ARGS.reps} reps")
for graph in (False, True):
    times = {name: timed(fn, graph) for name, fn in VARIANTS.items()}
    if rank == 0:
        print(("graph  " if graph else "eager  ") + "  ".join(f"{name} {ms:.3f} ms" for name, ms in times.items())
              + f"  | staggered / split {times['staggered'] / times['split']:.3f}"
              f"  staggered / nocomm {times['staggered'] / times['nocomm']:.3f}", flush=True)
dist.destroy_process_group()
