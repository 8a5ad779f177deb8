# Does a token split pay on top of our signaled ops (issue 22; docs/fused_block.md, Token split)? Written in session 32
# after probe_token_split_block.py (plain parts: cuBLAS, copy-engine pulls and pushes) showed at t = 4 under a graph
# that staggering two sequences hides 54% of the block's transfers when nothing else overlaps them. Our layer already
# overlaps each transfer with its own GEMM (the signaled AllGather+GEMM's pulls, the GEMM+ReduceScatter's epilogue
# stores), so the question for building the split into the layer is what staggering adds to that.
#
# The 8B attention block (hidden 4096, 32 heads / 8 KV groups of 128, s 8192) for a micro-batch of two sequences, one
# per half, on rank r (rows [r*s/t, (r+1)*s/t) of each sequence), with the ops the recipes run at TP >= 4:
#   norm(h)     RMSNorm of our rows of sequence h (torch's) into a scratch shard
#   qkv(h)      the signaled AllGather+GEMM, copy-engine pulls (method signal, transport p2p, comm_sms 0), one plan per
#               half with a gathered buffer of its own (AgGemm(..., gather=OwnGather(...).buffer))
#   attn(h)     causal attention (a fused backend, printed)
#   proj(h)     the signaled GEMM+ReduceScatter, epilogue stores into the owners (signal, p2p), summed at once
#   add(h)      + the residual (torch)
# Variants, eager and as a CUDA graph replay (median of --reps, slowest rank):
#   sequential  per half: norm, qkv (the plan's call), attn, proj, add: the order our layer runs two halves in today
#   staggered   both norms and both halves' AllGathers started (AgGemm.start: stage, pulls issued), then per half:
#               qkv's GEMM (AgGemm.finish), attn, proj, add: half B's pulls run beside half A's compute
#   nocomm      the same compute with no communication: cuBLAS over the whole gathered rows, attention, cuBLAS over the
#               local rows' share (torch.mm of [s, 4096 / t] x [4096 / t, 4096]); the floor
# Checks: staggered's outputs bit for bit sequential's (the same plans and kernels), eager and replayed.
#   CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nproc-per-node T docs/perf/scripts/probe_token_split_ours.py
#       [--s 8192] [--reps 30]
import argparse
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from overlap_tp import OverlapConfig, gemm_rs
from overlap_tp.ops.ag_gemm import AgGemm, OwnGather

parser = argparse.ArgumentParser()
parser.add_argument("--s", type=int, default=8192, help="tokens per sequence (each half is one sequence)")
parser.add_argument("--reps", type=int, default=30)
ARGS = parser.parse_args()
HIDDEN, HEADS, GROUPS, HEAD_DIM = 4096, 32, 8, 128

rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
device = torch.device("cuda", rank)
dist.init_process_group("nccl", device_id=device)
group, t = dist.group.WORLD, dist.get_world_size()
s = ARGS.s
if s % t or HEADS % t or GROUPS % t:
    raise SystemExit(f"s {s}, {HEADS} heads and {GROUPS} KV groups must split over t = {t}")
rows, hq, hkv = s // t, HEADS // t, GROUPS // t
bf16 = dict(device=device, dtype=torch.bfloat16)
AG = OverlapConfig(method="signal", transport="p2p", comm_sms=0)
RS = OverlapConfig(method="signal", transport="p2p", comm_sms=0)
QKV_N = (hq + 2 * hkv) * HEAD_DIM

torch.manual_seed(rank)
x = torch.randn(2, rows, HIDDEN, **bf16)                 # our rows of both sequences (the residual)
norm_w = torch.ones(HIDDEN, **bf16)
normed = torch.empty_like(x)
torch.manual_seed(100 + rank)                             # each rank its own shard of the weights
w_qkv = torch.randn(QKV_N, HIDDEN, **bf16) / HIDDEN ** 0.5
w_proj = torch.randn(HIDDEN, hq * HEAD_DIM, **bf16) / (hq * HEAD_DIM) ** 0.5
plans = [AgGemm(group, rows, QKV_N, HIDDEN, torch.bfloat16, device, AG,
                gather=OwnGather(group, rows, HIDDEN, torch.bfloat16, device).buffer) for _ in range(2)]
gathered_nocomm = torch.randn(2, s, HIDDEN, **bf16)       # nocomm's stand-in for the gathered rows
FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]   # never math
GQA_NATIVE = [True]


def norm(h):
    normed[h] = F.rms_norm(x[h], (HIDDEN,), norm_w, 1e-5)


def attention(qkv):
    """Causal attention over one sequence's qkv [s, QKV_N]: the context [s, hq * 128]."""
    q, k, v = qkv.split([hq * HEAD_DIM, hkv * HEAD_DIM, hkv * HEAD_DIM], dim=1)
    q, k, v = [y.view(s, -1, HEAD_DIM).transpose(0, 1).unsqueeze(0) for y in (q, k, v)]
    if not GQA_NATIVE[0]:
        k, v = (y.repeat_interleave(hq // hkv, dim=1) for y in (k, v))
    with sdpa_kernel(FUSED):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=GQA_NATIVE[0])
    return o[0].transpose(0, 1).reshape(s, hq * HEAD_DIM)


probe_qkv = torch.randn(s, QKV_N, **bf16)
try:
    attention(probe_qkv)
except RuntimeError as error:   # no fused backend takes enable_gqa here
    GQA_NATIVE[0] = False
    attention(probe_qkv)
    if rank == 0:
        print(f"attention: KV heads repeated per query head ({str(error).splitlines()[0][:120]})", flush=True)
if rank == 0:
    q0 = torch.empty(1, hq, s, HEAD_DIM, **bf16)
    kv0 = torch.empty(1, hkv if GQA_NATIVE[0] else hq, s, HEAD_DIM, **bf16)
    with sdpa_kernel(FUSED):
        choice = torch._fused_sdp_choice(q0, kv0, kv0, is_causal=True, enable_gqa=GQA_NATIVE[0])
    names = {int(backend): name for name, backend in SDPBackend.__members__.items()}
    print(f"attention: {names.get(choice, choice)}", flush=True)
    del q0, kv0


def tail(h, qkv):
    """attn, proj (GEMM+ReduceScatter), add: our rows of sequence h's block output."""
    return gemm_rs(attention(qkv), w_proj, group, config=RS) + x[h]


def sequential():
    outs = []
    for h in (0, 1):
        norm(h)
        outs.append(tail(h, plans[h](normed[h], w_qkv)))
    return outs


def staggered():
    started = []
    for h in (0, 1):
        norm(h)
        started.append(plans[h].start(normed[h]))
    return [tail(h, plans[h].finish(started[h], w_qkv)) for h in (0, 1)]


def nocomm():
    outs = []
    for h in (0, 1):
        norm(h)
        ctx = attention(gathered_nocomm[h] @ w_qkv.t())
        outs.append((ctx @ w_proj.t())[rank * rows:(rank + 1) * rows] + x[h])
    return outs


VARIANTS = {"sequential": sequential, "staggered": staggered, "nocomm": nocomm}


def captured(fn):
    """fn captured in a CUDA graph after an eager warm-up on a side stream: (replay, the static outputs)."""
    g = torch.cuda.CUDAGraph()
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        fn()
    torch.cuda.current_stream().wait_stream(warm)
    torch.cuda.synchronize()
    dist.barrier(group)
    with torch.cuda.graph(g):
        outs = fn()
    return g.replay, outs


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
    ms = torch.tensor([statistics.median(samples)], device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
    return float(ms)


if rank == 0:
    print(f"t = {t}, the 8B attention block for two sequences of {s} (one per half) through our signaled ops "
          f"(ag {AG.method}/{AG.transport}, rs {RS.method}/{RS.transport}), "
          f"CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', 'unset')}, {ARGS.reps} reps")
reference = [o.clone() for o in sequential()]
torch.cuda.synchronize()
for graph in (False, True):
    times = {}
    for name, fn in VARIANTS.items():
        if graph:
            run, outs = captured(fn)
            run()
        else:
            run = fn
            outs = fn()
        torch.cuda.synchronize()
        if name != "nocomm":   # the same plans and kernels: bit for bit
            for h in (0, 1):
                assert torch.equal(outs[h], reference[h]), f"{name} ({'replayed' if graph else 'eager'}), half {h}"
        del outs
        times[name] = timed(run)
    if rank == 0:
        over = {name: times[name] - times["nocomm"] for name in ("sequential", "staggered")}
        print(("graph  " if graph else "eager  ") + "  ".join(f"{name} {ms:.3f}" for name, ms in times.items())
              + " ms | over nocomm: " + ", ".join(f"{name} {ms:.3f}" for name, ms in over.items())
              + f" ms | staggered / sequential {times['staggered'] / times['sequential']:.3f}"
              + (f", hid {1 - over['staggered'] / over['sequential']:.0%} of sequential's exposed time"
                 if over["sequential"] > 0 else ""), flush=True)
dist.destroy_process_group()
