# How fast the copy engines pull a peer's rows, and whether splitting a pull over several streams helps (session 20).
# The p2p AllGather (ops/p2p.py GatherBuffer) pulls each chunk of the peers' rows with one cuMemcpyAsync on one comm
# stream. At the 8B qkv shape (32 MB per peer shard) session 20 measured AllGather+GEMM over p2p at 0.308 ms
# (signaled GEMM) / 0.337 ms (cuBLAS) against the GEMM alone's 0.276: the pull (~0.17-0.28 ms at one copy engine's
# 113-160 GB/s, shared/DEVICE.md) outlasts the local rows' GEMM (0.138 ms), so the last chunk's GEMM waits for it.
# NVLink (NV18) carries ~450 GB/s per direction: if copies on several streams run on several copy engines at once,
# a chunk split across k streams arrives up to k times sooner, and the AllGather's exposed tail shrinks with it.
# Both ranks pull from each other at the same time (as in the AllGather), for k = 1, 2, 4, 8 streams and sizes 4-64 MB,
# alone and beside a GEMM on the default stream (8192 x 4096 x 4096: the SMs busy, as in the op).
#   torchrun --nproc-per-node 2 docs/perf/scripts/probe_ce_pulls.py
import os
import statistics

import torch
import torch.distributed as dist
from torch.distributed import _symmetric_memory as symm_mem

from overlap_tp.ops import memops

rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
group, peer = dist.group.WORLD, 1 - rank
MAX_MB = 64
buf = symm_mem.empty(MAX_MB << 19, dtype=torch.bfloat16, device="cuda")   # MAX_MB MiB of bf16
handle = symm_mem.rendezvous(buf, group)
buf.fill_(rank + 1)
peer_buf = handle.get_buffer(peer, buf.shape, buf.dtype)
dst = torch.empty_like(buf)
streams = [torch.cuda.Stream() for _ in range(8)]
a = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
REPS = 20


def pull(nbytes, k):
    """nbytes of the peer's buffer into dst, split into k equal copies on k streams; ms on the GPU (events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    current = torch.cuda.current_stream()
    start.record(current)
    part = nbytes // k
    for i, s in enumerate(streams[:k]):
        s.wait_stream(current)
        memops.copy(s.cuda_stream, dst.data_ptr() + i * part, peer_buf.data_ptr() + i * part, part)
    for s in streams[:k]:
        current.wait_stream(s)
    end.record(current)
    return start, end


def timed(nbytes, k, with_gemm):
    samples = []
    for _ in range(REPS):
        torch.cuda.synchronize()
        dist.barrier(group)
        if with_gemm:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(4):
                    torch.mm(a, w)
        start, end = pull(nbytes, k)
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


for with_gemm in (False, True):
    for mb in (4, 16, 32, 64):
        nbytes = mb << 20
        row = []
        for k in (1, 2, 4, 8):
            ms = timed(nbytes, k, with_gemm)
            t = torch.tensor([ms], device="cuda")
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            row.append(f"k={k}: {float(t):.3f} ms ({nbytes / float(t) / 1e6:.0f} GB/s)")
        if rank == 0:
            print(f"pull {mb:2d} MB {'beside a GEMM' if with_gemm else 'alone       '}: " + ", ".join(row), flush=True)
torch.cuda.synchronize()
assert bool((dst[: (MAX_MB << 19)] == peer + 1).all()), "the pulled bytes are not the peer's"
if rank == 0:
    print("pulled bytes checked: the peer's", flush=True)
dist.barrier(group)
dist.destroy_process_group()
