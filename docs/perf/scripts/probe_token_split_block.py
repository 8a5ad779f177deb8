# How much of the attention block's communication can a token split hide at t ranks, in plain parts, before it is built
# into the layer (issue 22; docs/fused_block.md, Token split)? Written in session 31, after probe_token_split.py showed
# that one half's copy-engine pulls run beside the other half's GEMM inside a CUDA graph on one hardware queue. Not yet
# run (run_s32_3.sh).
#
# The block of one 8B layer (hidden 4096, 32 heads / 8 KV groups of 128, s 8192) for a micro-batch of two sequences,
# split by sequence (Domino's way: each half is a whole sequence, so causal attention stays exact). Per half h, on
# rank r, which owns rows [r*s/t, (r+1)*s/t) of each sequence:
#   norm(h)       RMSNorm of our rows (torch's), into a scratch buffer
#   pulls(h)      the peers' rows of half h into our gathered buffer (copy engines, ring order; ops/p2p.py's pulls)
#   qkv(h)        cuBLAS over the gathered [s, 4096] rows -> [s, 6144 / t]
#   attn(h)       causal attention on a fused backend (flash, cuDNN or efficient: printed), 32 / t query heads over
#                 8 / t KV heads
#   proj(h)       cuBLAS -> this rank's partial sums [s, 4096], written locally
#   pushes(h)     each peer's rows of that partial into the peer's slot for us (copy engines: a ReduceScatter whose
#                 transfer leaves the SMs free, which docs/fused_block.md says a split needs)
#   sum(h)        our own rows + the t - 1 slots + the residual (torch). A proxy for the consumer: it waits for our
#                 own pushes only, not for the peers' into our slots (no flags), so rank skew does not show
# Variants, each eager and as a CUDA graph replay (median of --reps, slowest rank):
#   sequential    per half: norm, pulls, qkv, attn, proj, pushes, sum; every transfer waited for where it is issued
#   staggered     both norms, both halves' pulls issued ahead; half A's qkv waits for A's pulls only; A's pushes run
#                 beside half B's qkv / attn / proj; then both sums (B's pushes are the only exposed tail; in a whole
#                 layer the MLP of half A would follow instead)
#   nocomm        the same compute, no transfers (the floor)
#   pulls, pushes both halves' transfers alone
# The transfers move fixed data: the peers' rows sit in their buffers from the start (the norms write a scratch
# buffer), so no flag is needed and the peers' norms are not waited for; every timed run starts behind a barrier, and
# all ranks run the same schedule. After a run, eager and replayed, the pulled rows and the pushed slots are checked,
# and the partial sums against the first eager run's (qkv, attention output and partial sums zeroed before each checked
# run, so a transfer that ran before its producer, or a GEMM that read rows not yet pulled, shows).
#   CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nproc-per-node T docs/perf/scripts/probe_token_split_block.py
#       [--s 8192] [--reps 20]
import argparse
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import _symmetric_memory as symm_mem
from torch.nn.attention import SDPBackend, sdpa_kernel

from overlap_tp.ops import memops
from overlap_tp.ops.tile_plan import ring_peers

parser = argparse.ArgumentParser()
parser.add_argument("--s", type=int, default=8192, help="tokens per sequence (each half is one sequence)")
parser.add_argument("--reps", type=int, default=30)
ARGS = parser.parse_args()
HIDDEN, HEADS, GROUPS, HEAD_DIM = 4096, 32, 8, 128

rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
group, t = dist.group.WORLD, dist.get_world_size()
s = ARGS.s
if s % t or HEADS % t or GROUPS % t:
    raise SystemExit(f"s {s}, {HEADS} heads and {GROUPS} KV groups must split over t = {t}")
rows, hq, hkv = s // t, HEADS // t, GROUPS // t        # our rows per sequence; query and KV heads per rank
row_bytes = HIDDEN * 2
bf16 = dict(device="cuda", dtype=torch.bfloat16)

# symmetric buffers, block (h, p) = rows of rank p for half h: the gathered input, and the ReduceScatter's slots
# (block (h, p) of rank r's slots: rank p's partial sums of rank r's rows)
gathered = symm_mem.empty(2 * s, HIDDEN, **bf16)
slots = symm_mem.empty(2 * s, HIDDEN, **bf16)
peer_addresses = {}
for name, buf in (("gathered", gathered), ("slots", slots)):
    handle = symm_mem.rendezvous(buf, group)
    within = buf.data_ptr() - handle.buffer_ptrs[rank]
    peer_addresses[name] = [handle.buffer_ptrs[p] + within for p in range(t)]


def block(h, p):
    return slice(h * s + p * rows, h * s + (p + 1) * rows)


torch.manual_seed(rank)
gathered.normal_()
x = torch.randn(2, rows, HIDDEN, **bf16)                     # our rows of both sequences (the residual)
norm_w = torch.ones(HIDDEN, **bf16)
normed = torch.empty_like(x)
w_qkv = torch.randn((hq + 2 * hkv) * HEAD_DIM, HIDDEN, **bf16) / HIDDEN ** 0.5
w_proj = torch.randn(HIDDEN, hq * HEAD_DIM, **bf16) / (hq * HEAD_DIM) ** 0.5
qkv = torch.empty(2, s, (hq + 2 * hkv) * HEAD_DIM, **bf16)
ctx = torch.empty(2, s, hq * HEAD_DIM, **bf16)
partial = torch.empty(2, s, HIDDEN, **bf16)
out = torch.empty(2, rows, HIDDEN, **bf16)
pull_stream, push_stream = torch.cuda.Stream(), torch.cuda.Stream()


def norm(h):
    normed[h] = F.rms_norm(x[h], (HIDDEN,), norm_w, 1e-5)


def pulls(h):
    for p in ring_peers(rank, t):
        offset = block(h, p).start * row_bytes
        memops.copy(pull_stream.cuda_stream, gathered.data_ptr() + offset, peer_addresses["gathered"][p] + offset,
                    rows * row_bytes)


FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]   # never math
GQA_NATIVE = [True]   # False: the KV heads repeated for each query head first (a fused backend without GQA)


def attention(h):
    """qkv(h) and causal attention over it, into ctx[h] ([s, hq * 128], the heads side by side)."""
    torch.mm(gathered[h * s:(h + 1) * s], w_qkv.t(), out=qkv[h])
    q, k, v = qkv[h].split([hq * HEAD_DIM, hkv * HEAD_DIM, hkv * HEAD_DIM], dim=1)
    q, k, v = [y.view(s, -1, HEAD_DIM).transpose(0, 1).unsqueeze(0) for y in (q, k, v)]   # [1, heads, s, 128]
    if not GQA_NATIVE[0]:
        k, v = (y.repeat_interleave(hq // hkv, dim=1) for y in (k, v))
    with sdpa_kernel(FUSED):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=GQA_NATIVE[0])
    ctx[h].view(s, hq, HEAD_DIM).copy_(o[0].transpose(0, 1))


try:
    attention(0)
except RuntimeError as error:   # no fused backend takes enable_gqa here
    GQA_NATIVE[0] = False
    attention(0)
    if rank == 0:
        print(f"attention: KV heads repeated per query head (a fused backend with enable_gqa raised: "
              f"{str(error).splitlines()[0][:120]})", flush=True)
if rank == 0:   # which fused backend torch's order picks for these shapes
    q0 = torch.empty(1, hq, s, HEAD_DIM, **bf16)
    kv0 = torch.empty(1, hkv if GQA_NATIVE[0] else hq, s, HEAD_DIM, **bf16)
    with sdpa_kernel(FUSED):
        choice = torch._fused_sdp_choice(q0, kv0, kv0, is_causal=True, enable_gqa=GQA_NATIVE[0])
    names = {int(backend): name for name, backend in SDPBackend.__members__.items()}
    print(f"attention: {names.get(choice, choice)}", flush=True)
    del q0, kv0


def proj(h):
    torch.mm(ctx[h], w_proj.t(), out=partial[h])


def pushes(h):
    """Each peer's rows of our partial sums into that peer's slot for us (block (h, rank) of its slots)."""
    for p in ring_peers(rank, t):
        memops.copy(push_stream.cuda_stream, peer_addresses["slots"][p] + block(h, rank).start * row_bytes,
                    partial[h, p * rows:(p + 1) * rows].data_ptr(), rows * row_bytes)


def reduce(h):
    total = partial[h, rank * rows:(rank + 1) * rows] + x[h]
    for p in range(t):
        if p != rank:
            total += slots[block(h, p)]
    out[h] = total


def fork(stream):
    stream.wait_stream(torch.cuda.current_stream())


def mark(stream):
    event = torch.cuda.Event()
    event.record(stream)
    return event


def sequential(comm=True):
    current = torch.cuda.current_stream()
    for h in (0, 1):
        norm(h)
        if comm:
            fork(pull_stream)
            pulls(h)
            current.wait_stream(pull_stream)
        attention(h)
        proj(h)
        if comm:
            fork(push_stream)
            pushes(h)
            current.wait_stream(push_stream)
        reduce(h)


def staggered():
    current = torch.cuda.current_stream()
    pulled = []
    for h in (0, 1):
        norm(h)
        fork(pull_stream)
        pulls(h)
        pulled.append(mark(pull_stream))
    pushed = []
    for h in (0, 1):
        current.wait_event(pulled[h])
        attention(h)
        proj(h)
        fork(push_stream)
        pushes(h)
        pushed.append(mark(push_stream))
    for h in (0, 1):
        current.wait_event(pushed[h])
        reduce(h)
    current.wait_stream(pull_stream)   # both side streams join before anything that follows
    current.wait_stream(push_stream)


def transfers(which):
    def run():
        current = torch.cuda.current_stream()
        stream = pull_stream if which is pulls else push_stream
        fork(stream)
        which(0)
        which(1)
        current.wait_stream(stream)
    return run


VARIANTS = {"sequential": sequential, "staggered": staggered, "nocomm": lambda: sequential(comm=False),
            "pulls": transfers(pulls), "pushes": transfers(pushes)}
MOVING = ("sequential", "staggered")


def captured(fn):
    """fn captured in a CUDA graph (after a warm-up outside the capture): its replay."""
    g = torch.cuda.CUDAGraph()
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        fn()
    torch.cuda.current_stream().wait_stream(warm)
    torch.cuda.synchronize()
    dist.barrier(group)   # the warm-up's pushes have landed in every peer before anything is zeroed for a check
    with torch.cuda.graph(g):
        fn()
    return g.replay


own_rows = [torch.empty_like(gathered) for _ in range(t)]
dist.all_gather(own_rows, gathered, group=group)   # every rank's gathered buffer as it starts: its own blocks' rows


reference_partial = []   # the first checked run's partial sums (eager sequential)


def check(name, run):
    """After run(), the peers' rows of both halves are in our gathered buffer, each peer's partial sums of our rows
    are in our slots, and our partial sums are the first run's (all zeroed first, so a missing transfer, a push before
    its proj or a qkv over rows not yet pulled shows)."""
    for h in (0, 1):
        for p in ring_peers(rank, t):
            gathered[block(h, p)].zero_()
            slots[block(h, p)].zero_()
    for buf in (qkv, ctx, partial):
        buf.zero_()
    torch.cuda.synchronize()
    dist.barrier(group)
    run()
    torch.cuda.synchronize()
    dist.barrier(group)
    if not reference_partial:
        reference_partial.append(partial.clone())
    assert torch.allclose(partial, reference_partial[0], rtol=1e-2, atol=1e-2), f"{name}: partial sums differ"
    partials = [torch.empty_like(partial) for _ in range(t)]
    dist.all_gather(partials, partial, group=group)
    for h in (0, 1):
        for p in ring_peers(rank, t):
            assert torch.equal(gathered[block(h, p)], own_rows[p][block(h, p)]), f"{name}: rank {p}'s rows, half {h}"
            assert torch.equal(slots[block(h, p)], partials[p][h, rank * rows:(rank + 1) * rows]), \
                f"{name}: rank {p}'s partial sums of our rows, half {h}"
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
    print(f"t = {t}, the 8B attention block for two sequences of {s} (one per half), "
          f"CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', 'unset')}, {ARGS.reps} reps")
for graph in (False, True):
    times = {}
    for name, fn in VARIANTS.items():
        run = captured(fn) if graph else fn
        run()   # one untimed run (a graph's first replay uploads it)
        if name in MOVING:
            check(name + (" (replayed)" if graph else ""), run)
        times[name] = timed(run)
    if rank == 0:
        exposed = {name: times[name] - times["nocomm"] for name in MOVING}
        print(("graph  " if graph else "eager  ") + "  ".join(f"{name} {ms:.3f}" for name, ms in times.items())
              + " ms | over nocomm: " + ", ".join(f"{name} {ms:.3f}" for name, ms in exposed.items())
              + (f" ms | staggered hid {1 - exposed['staggered'] / exposed['sequential']:.0%} of the sequential"
                 f" order's exposed transfers" if exposed["sequential"] > 0 else " ms"), flush=True)
dist.destroy_process_group()
