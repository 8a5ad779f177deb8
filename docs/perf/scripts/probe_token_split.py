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
#   pulls        the pulls alone; gemm A: half A's GEMM (+ attention) alone, on rows already in place
# The buffer is half-major (rows ordered half, rank, row), so each half's gathered rows are one [t * m/2, k] block and
# one GEMM, as a layer's half-batch GEMM would be. Each variant is checked (every row pulled, eager and replayed) and
# timed eager and as a CUDA graph replay (median of --reps, slowest rank). If staggered is not below split by about
# min(pulls / 2, gemm A), the queue or the graph serialises the halves, and the split would have to be built otherwise
# (split-phase ops, another stream order).
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
if ARGS.m % (2 * t):
    raise SystemExit(f"--m {ARGS.m}: must split into 2 halves of t = {t} equal shards")
mh, k = ARGS.m // (2 * t), ARGS.k              # rows of one rank's half shard
n = ARGS.n or 6144 // t
row_bytes = k * 2
buf = symm_mem.empty(2 * t * mh, k, dtype=torch.bfloat16, device="cuda")   # block (h, p): rank p's rows of half h
handle = symm_mem.rendezvous(buf, group)
within = buf.data_ptr() - handle.buffer_ptrs[rank]                         # the same on every rank (as p2p.py)
sources = [handle.buffer_ptrs[p] + within for p in range(t)]               # every rank's buffer, mapped here
torch.manual_seed(rank)
buf.normal_()                                   # our own blocks: values of this rank's own
w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
w2 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 if ARGS.attn else None
out = torch.empty(2 * t * mh, n, device="cuda", dtype=torch.bfloat16)
out2 = torch.empty_like(out) if ARGS.attn else None
side = torch.cuda.Stream()
HALF_ROWS = t * mh


def block(h, p):
    """Rows of rank p's shard of half h."""
    return slice((h * t + p) * mh, (h * t + p + 1) * mh)


def pull(stream, h):
    """Every peer's rows of half h into the same rows of our buffer (copy engines, the peers in ring order)."""
    for p in ring_peers(rank, t):
        offset = (h * t + p) * mh * row_bytes
        memops.copy(stream.cuda_stream, buf.data_ptr() + offset, sources[p] + offset, mh * row_bytes)


def compute(rows):
    """The GEMM over the gathered rows `rows` (+ the attention stand-in), on the current stream."""
    torch.mm(buf[rows], w.t(), out=out[rows])
    if w2 is not None:
        torch.mm(buf[rows], w2.t(), out=out2[rows])


HALVES = (slice(0, HALF_ROWS), slice(HALF_ROWS, 2 * HALF_ROWS))
ALL = slice(0, 2 * HALF_ROWS)


def sequential():
    current = torch.cuda.current_stream()
    side.wait_stream(current)
    pull(side, 0)
    pull(side, 1)
    current.wait_stream(side)
    compute(ALL)


def split():
    current = torch.cuda.current_stream()
    for h in (0, 1):
        side.wait_stream(current)   # half B's pulls wait for half A's GEMM: one half after the other
        pull(side, h)
        current.wait_stream(side)
        compute(HALVES[h])


def staggered():
    current = torch.cuda.current_stream()
    side.wait_stream(current)
    pulled = []
    for h in (0, 1):
        pull(side, h)
        event = torch.cuda.Event()
        event.record(side)
        pulled.append(event)
    for h, event in enumerate(pulled):
        current.wait_event(event)
        compute(HALVES[h])
    current.wait_stream(side)   # the side stream joins before anything that follows (as CommEngine.join)


def pulls():
    current = torch.cuda.current_stream()
    side.wait_stream(current)
    pull(side, 0)
    pull(side, 1)
    current.wait_stream(side)


VARIANTS = {"sequential": sequential, "split": split, "staggered": staggered, "nocomm": lambda: compute(ALL),
            "pulls": pulls, "gemm A": lambda: compute(HALVES[0])}
PULLING = ("sequential", "split", "staggered", "pulls")


def captured(fn):
    """fn captured in a CUDA graph (after a warm-up outside the capture): its replay."""
    g = torch.cuda.CUDAGraph()
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        fn()
    torch.cuda.current_stream().wait_stream(warm)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        fn()
    return g.replay


# every rank's own blocks, to check the pulled ones against
reference = [torch.empty_like(buf) for _ in range(t)]
dist.all_gather(reference, buf, group=group)


def check(name, run):
    """After run(), every peer's blocks in our buffer hold that peer's own rows (zeroed first, so a missing pull shows)."""
    for h in (0, 1):
        for p in range(t):
            if p != rank:
                buf[block(h, p)].zero_()
    torch.cuda.synchronize()
    dist.barrier(group)
    run()
    torch.cuda.synchronize()
    for h in (0, 1):
        for p in range(t):
            assert torch.equal(buf[block(h, p)], reference[p][block(h, p)]), f"{name}: rank {p}'s rows of half {h}"
    dist.barrier(group)


def timed(run):
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


if rank == 0:
    print(f"t = {t}, gathered [{2 * t * mh}, {k}] in two halves, GEMM N {n}"
          f"{' + attention stand-in' if w2 is not None else ''}, "
          f"CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', 'unset')}, {ARGS.reps} reps")
for graph in (False, True):
    times = {}
    for name, fn in VARIANTS.items():
        run = captured(fn) if graph else fn
        if name in PULLING:
            check(name + (" (replayed)" if graph else ""), run)
        times[name] = timed(run)
    if rank == 0:
        hideable = min(times["pulls"] / 2, times["gemm A"])
        print(("graph  " if graph else "eager  ") + "  ".join(f"{name} {ms:.3f}" for name, ms in times.items())
              + f" ms | split - staggered {times['split'] - times['staggered']:.3f} ms of at most {hideable:.3f}"
              f" | staggered / nocomm {times['staggered'] / times['nocomm']:.3f}", flush=True)
dist.destroy_process_group()
