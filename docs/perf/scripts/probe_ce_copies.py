# How fast the copy engines move an AllGather's rows between t GPUs: pulls (our copy engine reads each peer's shard, as
# ops/p2p.py GatherBuffer does) against pushes (we write our shard into each peer's buffer, as PyTorch async-TP's
# copies do), serial on one stream (peers in ring order, as GatherBuffer) against one stream per peer, alone and beside
# a GEMM on every SM (as in the op), and beside CTAs on every SM spinning on a flag with ld.acquire in every thread (the
# signaled GEMM's wait for a chunk: whether that polling slows the copies). Session 21 at t = 4 saw the GatherBuffer's serial pulls at <= 320 GB/s each and
# 140-220 GB/s beside the GEMM (docs/perf/s21/README.md), while async-TP's AllGather+GEMM finished in 0.218 ms against
# ours 0.321 at the 8B qkv shape. Every rank copies at the same time (as in the AllGather); a row is the slowest rank's
# median over REPS; GB/s counts the bytes each rank receives. The copied bytes are checked at the end.
#   torchrun --nproc-per-node T docs/perf/scripts/probe_ce_copies.py
import os
import statistics

import torch
import torch.distributed as dist
from torch.distributed import _symmetric_memory as symm_mem

import triton

from overlap_tp.kernels.signaled_gemm import load_acquire
from overlap_tp.ops import memops


@triton.jit
def spin_kernel(flag_ptr):
    """Every thread of every program polls *flag_ptr (acquire, gpu scope) until it is 1: the signaled GEMM's wait."""
    while load_acquire(flag_ptr) < 1:
        pass

rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
group, t = dist.group.WORLD, dist.get_world_size()
peers = [(rank + i) % t for i in range(1, t)]   # ring order
SHARD_MB = (4, 16, 32)                           # per rank's shard (l8b.qkv at t = 4: 16 MB)
REPS = 20
elems = max(SHARD_MB) << 19                      # bf16 elements of the largest shard
buf = symm_mem.empty(t * elems, dtype=torch.bfloat16, device="cuda")   # region p: rank p's shard
handle = symm_mem.rendezvous(buf, group)
bases = [handle.get_buffer(p, buf.shape, buf.dtype).data_ptr() for p in range(t)]   # every rank's buffer
streams = [torch.cuda.Stream() for _ in range(max(1, t - 1))]
a = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)


def issue(nbytes, mode, per_peer):
    """Every peer's shard into our buffer (pull) or our shard into every peer's buffer (push): (src, dst) per peer,
    on one stream in ring order or one stream per peer."""
    current = torch.cuda.current_stream()
    for i, p in enumerate(peers):
        stream = streams[i] if per_peer else streams[0]
        if per_peer or i == 0:
            stream.wait_stream(current)
        if mode == "pull":   # peer p's region of its buffer -> region p of ours
            src, dst = bases[p] + p * (elems * 2), bases[rank] + p * (elems * 2)
        else:                # our region of ours -> region `rank` of peer p's buffer
            src, dst = bases[rank] + rank * (elems * 2), bases[p] + rank * (elems * 2)
        memops.copy(stream.cuda_stream, dst, src, nbytes)
    for stream in streams[:len(peers) if per_peer else 1]:
        current.wait_stream(stream)


flag = torch.zeros(1, dtype=torch.int32, device="cuda")
side = torch.cuda.Stream()
SMS = torch.cuda.get_device_properties(0).multi_processor_count


def timed(nbytes, mode, per_peer, beside):
    samples = []
    for _ in range(REPS):
        torch.cuda.synchronize()
        dist.barrier(group)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            if beside == "GEMM":
                for _ in range(4):
                    torch.mm(a, w)
            elif beside == "spinning CTAs":   # released by a stream write after the copies (no SM needed)
                flag.zero_()
                spin_kernel[(SMS,)](flag, num_warps=8)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        issue(nbytes, mode, per_peer)
        end.record()
        if beside == "spinning CTAs":
            memops.write_value(torch.cuda.current_stream().cuda_stream, flag.data_ptr(), 1)
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end))
    ms = torch.tensor([statistics.median(samples)], device="cuda")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
    return float(ms)


for p in range(t):   # region p of every buffer: rank p's shard, filled with p + 1 by its owner only
    if p == rank:
        buf[p * elems:(p + 1) * elems].fill_(rank + 1)
    else:
        buf[p * elems:(p + 1) * elems].zero_()
torch.cuda.synchronize()
dist.barrier(group)
for beside in ("nothing", "GEMM", "spinning CTAs"):
    for mb in SHARD_MB:
        nbytes = mb << 20
        row = []
        for mode in ("pull", "push"):
            for per_peer in ((False, True) if t > 2 else (False,)):
                ms = timed(nbytes, mode, per_peer, beside)
                row.append(f"{mode} {'per-peer' if per_peer else 'serial'} {ms:.3f} ms "
                           f"({(t - 1) * nbytes / ms / 1e6:.0f} GB/s)")
        if rank == 0:
            print(f"t={t} shard {mb:2d} MB beside {beside}: " + "; ".join(row), flush=True)
torch.cuda.synchronize()
dist.barrier(group)
for p in range(t):
    got = buf[p * elems:p * elems + (max(SHARD_MB) << 19)]
    assert bool((got == p + 1).all()), f"rank {rank}: region {p} does not hold rank {p}'s shard"
if rank == 0:
    print("checked: every region holds its owner's shard", flush=True)
