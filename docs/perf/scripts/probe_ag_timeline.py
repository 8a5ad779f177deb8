"""Where our AllGather+GEMM's time goes against PyTorch's async-TP at one shape: each captured in a CUDA graph,
one replay profiled, rank 0's GPU events printed in start order (kernels and copies: start and end in us from the
replay's first event, stream, name).

    torchrun --nproc-per-node 4 docs/perf/scripts/probe_ag_timeline.py --m 8192 --k 4096 --n 1536

Session 33: on l8b.qkv at t = 4 ours (signal, copy-engine pulls) takes ~0.31 ms under graphs, async-TP 0.22, the pulls
alone ~0.19 and cuBLAS 0.134; finer chunks are slower (g8 0.37). The timeline shows when the pulls start and end
against the GEMM kernel and what follows the last one. A staged call's critical path, as read from the code: the
shard's stage copy (behind the peers' PULLED of the previous call), the READY exchange, the pulls (0.18-0.22 ms for
48 MB beside a GEMM, docs/perf/s22/ce_copies.txt), then one tile-time of the last chunk's tiles."""
import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist

from overlap_tp import OverlapConfig, ag_gemm
from overlap_tp.tune.timing import CapturedCalls


def timeline(fn, sets, group, label):
    captured = CapturedCalls(fn, sets, warmup=3)
    for _ in range(3):
        captured.graph.replay()
    torch.cuda.synchronize()
    dist.barrier(group)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        captured.graph.replay()
        torch.cuda.synchronize()
    times = captured.samples(30, group)
    if dist.get_rank() != 0:
        return
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    events = [e for e in json.load(open(path))["traceEvents"]
              if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    events.sort(key=lambda e: e["ts"])
    t0 = events[0]["ts"] if events else 0
    span = max(e["ts"] + e["dur"] for e in events) - t0 if events else 0
    print(f"## {label}: replay median {sorted(times)[len(times) // 2] * 1e3:.1f} us; profiled span {span:.1f} us, "
          f"{len(events)} events", flush=True)
    for e in events:
        print(f"  {e['ts'] - t0:7.1f} -> {e['ts'] + e['dur'] - t0:7.1f} us  stream {e['args'].get('stream', '?'):>3}  "
              f"{e['name'][:70]}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=8192)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=1536)
    args = p.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    t = dist.get_world_size(group)
    from torch.distributed import _symmetric_memory as symm
    symm.enable_symm_mem_for_group(group.group_name)
    torch.manual_seed(1234 + dist.get_rank())
    sets = [(torch.randn(args.m // t, args.k, device="cuda", dtype=torch.bfloat16),
             torch.randn(args.n, args.k, device="cuda", dtype=torch.bfloat16) / args.k ** 0.5)]
    ref = ag_gemm(*sets[0], group, config=OverlapConfig(method="off"))
    configs = {"ours (signal, CE pulls, groups auto)": OverlapConfig(method="signal", transport="p2p", comm_sms=0),
               # one chunk (three copies, no pipelining) and two: with the sweep's g3 / g4 / g8, the cost per chunk
               "ours g1": OverlapConfig(method="signal", transport="p2p", comm_sms=0, groups=1),
               "ours g2": OverlapConfig(method="signal", transport="p2p", comm_sms=0, groups=2),
               "ours SM pulls on 32 SMs": OverlapConfig(method="signal", transport="p2p", comm_sms=32),
               # the last chunk's tiles run one tile-time after its rows arrive: ~46 us for 128x256 at K 4096
               "ours narrow tile 128x128": OverlapConfig(method="signal", transport="p2p", comm_sms=0, block_n=128,
                                                         num_stages=4, num_warps=4),
               # and a short last chunk: its tiles fit one wave of the narrow tile (3 slices x 3 peers x 12 < 132)
               "ours narrow tile, chunks of 7 / 6 / 3 row-slices": OverlapConfig(
                   method="signal", transport="p2p", comm_sms=0, block_n=128, num_stages=4, num_warps=4,
                   groups=(7, 6, 3)),
               # one peer's rows per chunk, one copy each, as async-TP pulls (chunk_by 'peer'); cuBLAS over them
               "ours chunked by peer": OverlapConfig(method="signal", transport="p2p", comm_sms=0, chunk_by="peer"),
               "cuBLAS over peer pulls, one chunk per peer": OverlapConfig(method="decompose", transport="p2p",
                                                                           comm_sms=0, chunks=1, chunk_by="peer"),
               # async-TP pulls on two streams in turn; ours split over two copy lanes
               "ours on two copy lanes": OverlapConfig(method="signal", transport="p2p", comm_sms=0, copy_lanes=2),
               "cuBLAS over the CE pulls (decompose p2p)": OverlapConfig(method="decompose", transport="p2p",
                                                                          comm_sms=0)}

    def async_tp(a, w):
        return symm._fused_all_gather_matmul(a, [w.t()], 0, group.group_name)[1][0]
    timeline(async_tp, sets, group, "async-TP (_fused_all_gather_matmul)")   # first: the reference, whatever follows
    for label, config in configs.items():
        # every rank agrees whether this variant's output is right before any of them times it (a variant wrong on
        # one rank alone must not leave the others waiting in its capture)
        out = ag_gemm(*sets[0], group, config=config)
        right = torch.tensor([int(torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2))], device="cuda")
        dist.all_reduce(right, op=dist.ReduceOp.MIN, group=group)
        if not right.item():
            if dist.get_rank() == 0:
                print(f"## {label}: WRONG OUTPUT against method 'off' on some rank; not timed", flush=True)
            continue
        timeline(lambda a, w, c=config: ag_gemm(a, w, group, config=c), sets, group, label)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
