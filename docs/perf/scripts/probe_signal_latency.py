"""What one cross-GPU handshake, one small copy and one cross-stream edge cost inside a CUDA graph at t = 2: the fixed
latencies that set our small ops' time (session 34: the smoke's AllGather+GEMM takes ~55 us where its pulls move
4 MB in ~8-15 us and its GEMM runs ~13 us; its pulls start ~16 us after the stage copy and its GEMM ends ~15 us after
the last pull).

Each case is captured in one CUDA graph as N repetitions and timed by replays (CUDA events, the median of 20
replays, divided by N), both ranks replaying at once; a ping-pong's figure is a round trip (two hops).

    torchrun --nproc-per-node 2 docs/perf/scripts/probe_signal_latency.py [--reps 64]

  memop ping-pong     rank 0: write the peer's word, wait for ours, reset it (one batched stream memory operation,
                      as GatherBuffer's READY exchange); rank 1 the mirror
  kernel ping-pong    the same with two one-warp kernels per hop: a system-scope release store into the peer's word,
                      an acquire spin on ours (as the graph waits' deadline_wait_kernel)
  in-kernel ping-pong one kernel doing all N round trips: NVLink's latency floor
  cross-stream hop    a one-warp kernel on stream A, an event, a one-warp kernel on stream B, an event back: per edge
  memop write->wait   stream A writes a local word (a memop), stream B waits for it (memop), both in one graph: the
                      flag a pull raises for the GEMM's tiles is this edge
  pull 4 KB / push    one copy-engine copy from the peer's buffer (pull) or into it (push), back to back: per copy
  pull + flag         each 4 KB pull followed by a memop write of a local word (a chunk's pull and its ready flag)
  pull / push 4 MB    one copy of 4 MB (the smoke's shard: 2048 x 1024 bf16): bandwidth
"""
import argparse
import os
import statistics

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from overlap_tp.ops import memops


@triton.jit
def pingpong_kernel(local_ptr, remote_ptr, n, FIRST: tl.constexpr):
    """n round trips in one kernel: FIRST stores 1 into the peer's word i, then spins on its own word i; the other
    spins first; each resets its own word."""
    for i in range(n):
        if FIRST:
            tl.atomic_xchg(remote_ptr + i, 1, sem="release", scope="sys")
        while tl.atomic_add(local_ptr + i, 0, sem="acquire", scope="sys") != 1:
            pass
        tl.store(local_ptr + i, 0)
        if not FIRST:
            tl.atomic_xchg(remote_ptr + i, 1, sem="release", scope="sys")


@triton.jit
def signal_kernel(remote_ptr):
    tl.atomic_xchg(remote_ptr, 1, sem="release", scope="sys")


@triton.jit
def wait_kernel(local_ptr):
    while tl.atomic_add(local_ptr, 0, sem="acquire", scope="sys") != 1:
        pass
    tl.store(local_ptr, 0)


@triton.jit
def tiny_kernel(x_ptr):
    tl.store(x_ptr, tl.load(x_ptr) + 1)


def timed_graph(build, group, reps=20):
    """Capture build() in a graph, replay it reps times with both ranks in step; the median us per replay."""
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.graph(g, stream=side):
        build()
    times = []
    for _ in range(reps + 2):
        torch.cuda.synchronize()
        dist.barrier(group)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times[2:])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=64, help="repetitions N per graph")
    args = p.parse_args()
    n = args.reps
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    if dist.get_world_size(group) != 2:
        raise SystemExit("probe_signal_latency: run on 2 ranks")
    from torch.distributed import _symmetric_memory as symm
    peer = 1 - rank
    words = symm.empty(4 * n, dtype=torch.int32, device="cuda")
    words.zero_()
    data = symm.empty(4 << 20, dtype=torch.uint8, device="cuda")
    handle = symm.rendezvous(words, group)
    data_handle = symm.rendezvous(data, group)
    torch.cuda.synchronize()
    dist.barrier(group)
    local = words.data_ptr()
    remote = handle.buffer_ptrs[peer] + (local - handle.buffer_ptrs[rank])
    data_local = data.data_ptr()
    data_remote = data_handle.buffer_ptrs[peer] + (data_local - data_handle.buffer_ptrs[rank])
    scratch = torch.empty(4 << 20, dtype=torch.uint8, device="cuda")
    first = rank == 0
    results = {}

    def stream():
        return torch.cuda.current_stream().cuda_stream

    # memop ping-pong: per hop one batched driver call, as GatherBuffer's READY exchange
    pings = [memops.MemOps([("write", remote + 4 * i, 1), ("wait", local + 4 * i, 1), ("write", local + 4 * i, 0)])
             for i in range(n)]
    pongs = [memops.MemOps([("wait", local + 4 * i, 1), ("write", local + 4 * i, 0), ("write", remote + 4 * i, 1)])
             for i in range(n)]

    def memop_pingpong():
        for i in range(n):
            (pings if first else pongs)[i].issue(stream())
    results["memop ping-pong (round trip)"] = timed_graph(memop_pingpong, group) / n

    # the peer's words as a tensor for Triton (a raw pointer wrapped: symmetric memory maps it into our space)
    remote_words = handle.get_buffer(peer, (4 * n,), torch.int32)
    pingpong_kernel[(1,)](words, remote_words, 1, first, num_warps=1)   # compiled eagerly, both ranks at once
    torch.cuda.synchronize()
    dist.barrier(group)

    def kernel_pingpong():
        for i in range(n):
            if first:
                signal_kernel[(1,)](remote_words[i:], num_warps=1)
                wait_kernel[(1,)](words[i:], num_warps=1)
            else:
                wait_kernel[(1,)](words[i:], num_warps=1)
                signal_kernel[(1,)](remote_words[i:], num_warps=1)
    signal_kernel[(1,)](scratch.view(torch.int32), num_warps=1)
    torch.cuda.synchronize()
    wait_kernel[(1,)](torch.ones(1, dtype=torch.int32, device="cuda"), num_warps=1)
    torch.cuda.synchronize()
    words.zero_()
    torch.cuda.synchronize()
    dist.barrier(group)
    results["kernel ping-pong, 2 kernels per hop (round trip)"] = timed_graph(kernel_pingpong, group) / n

    def inkernel_pingpong():
        pingpong_kernel[(1,)](words, remote_words, n, first, num_warps=1)
    results["in-kernel ping-pong (round trip)"] = timed_graph(inkernel_pingpong, group) / n

    # cross-stream edges: a tiny kernel alternating between two streams through events
    other = torch.cuda.Stream()
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    tiny_kernel[(1,)](counter, num_warps=1)

    def cross_stream():
        for _ in range(n):
            tiny_kernel[(1,)](counter, num_warps=1)
            ev = torch.cuda.Event()
            ev.record()
            other.wait_event(ev)
            with torch.cuda.stream(other):
                tiny_kernel[(1,)](counter, num_warps=1)
                back = torch.cuda.Event()
                back.record()
            torch.cuda.current_stream().wait_event(back)
    one_stream = timed_graph(lambda: [tiny_kernel[(1,)](counter, num_warps=1) for _ in range(2 * n)], group) / n
    results["two tiny kernels, one stream (reference)"] = one_stream
    results["two tiny kernels over two streams, 2 edges"] = timed_graph(cross_stream, group) / n

    # a memop write on one stream, a memop wait on another (a chunk's ready flag and what waits for it)
    def memop_edge():
        for i in range(n):
            memops.write_value(stream(), local + 4 * (n + i), 1)
            ev = torch.cuda.Event()
            ev.record()   # keeps the other stream joined into the capture
            other.wait_event(ev)
            with torch.cuda.stream(other):
                memops.wait_value(torch.cuda.current_stream().cuda_stream, local + 4 * (n + i), 1)
                memops.write_value(torch.cuda.current_stream().cuda_stream, local + 4 * (n + i), 0)
                back = torch.cuda.Event()
                back.record()
            torch.cuda.current_stream().wait_event(back)
    results["memop write -> event -> memop wait+reset -> event back"] = timed_graph(memop_edge, group) / n

    for label, src, dst in (("pull", data_remote, data_local), ("push", data_local, data_remote)):
        results[f"{label} 4 KB, back to back (per copy)"] = timed_graph(
            lambda src=src, dst=dst: [memops.copy(stream(), dst + (i % 16) * 4096, src + (i % 16) * 4096, 4096)
                                      for i in range(n)], group) / n
    results["pull 4 KB + memop flag write (per pair)"] = timed_graph(
        lambda: [(memops.copy(stream(), data_local + (i % 16) * 4096, data_remote + (i % 16) * 4096, 4096),
                  memops.write_value(stream(), local + 4 * (2 * n + i), 1)) for i in range(n)], group) / n
    for label, src, dst in (("pull", data_remote, data_local), ("push", data_local, data_remote),
                            ("local", data_local, scratch.data_ptr())):
        us = timed_graph(lambda src=src, dst=dst: [memops.copy(stream(), dst, src, 4 << 20) for _ in range(8)],
                         group) / 8
        results[f"{label} 4 MB (per copy; GB/s)"] = (us, (4 << 20) / us / 1e3)

    if rank == 0:
        print(f"## signal and copy latencies inside a CUDA graph, t = 2, N = {n} ({torch.cuda.get_device_name()})")
        for label, value in results.items():
            text = f"{value[0]:8.2f} us  {value[1]:6.1f} GB/s" if isinstance(value, tuple) else f"{value:8.2f} us"
            print(f"  {label:58s} {text}", flush=True)
    dist.barrier(group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
