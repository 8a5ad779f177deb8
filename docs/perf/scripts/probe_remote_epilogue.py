# What storing a GEMM's output into a peer's memory costs, by the epilogue that stores it: the signaled Triton GEMM
# (kernels/signaled_gemm.py: tl.store of each tile, blocking in the persistent loop) against cuBLAS (torch.mm with
# out= a peer-mapped view: cuBLAS's own epilogue), each into local memory and into the peer's, at t = 2 with both
# ranks storing into each other at once (as the p2p ReduceScatter does), and the p2p ReduceScatter ops themselves
# (gemm_rs signal and decompose over p2p, which store half of the tiles remotely); and the copy engines pushing C into
# the peer (the alternative: local stores, then copy-engine pushes per group of tiles).
# Why (session 22, docs/perf/s22/README.md): in llama3-8b's training step the signaled GEMM+ReduceScatters ran
# 6-18% above Megatron's cuBLAS GEMMs (proj 207 vs 183 us, qkv dgrad 371 vs 314), the AllGathers 2-4%; session 20
# saw the signaled kernel 0.43 ms above the GEMM alone at l70b.fc2 where cuBLAS's regions paid 0.11. This says how
# much of it is the remote stores, and whether cuBLAS's epilogue pays it: the next step is asynchronous (TMA)
# epilogue stores if the signaled kernel's remote stores are the cost.
# Shapes: the 8B layer's four GEMM+ReduceScatters at t = 2, s 8192 (A [8192, K/t], C [8192, 4096]).
#   torchrun --nproc-per-node 2 docs/perf/scripts/probe_remote_epilogue.py
import os

import torch
import torch.distributed as dist
from torch.distributed import _symmetric_memory as symm_mem

from overlap_tp import OverlapConfig, gemm_rs
from overlap_tp.kernels.signaled_gemm import signaled_gemm
from overlap_tp.ops import memops
from overlap_tp.ops.common import gemm_programs
from overlap_tp.ops.reduction import device_plan
from overlap_tp.tune.timing import graph_timed

rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
group, t = dist.group.WORLD, dist.get_world_size()
assert t == 2, "t = 2: each rank stores into the other"
peer = 1 - rank
M, N = 8192, 4096
SHAPES = {   # name: (K per rank, weight layout: "nk" = W [N, K] row-major, "kn" = the transposed view of [K, N])
    "proj": (2048, "nk"), "qkv dgrad": (3072, "kn"), "fc2": (7168, "nk"), "fc1 dgrad": (14336, "kn"),
}
REPS = 30
buf = symm_mem.empty(M, N, dtype=torch.bfloat16, device="cuda")
handle = symm_mem.rendezvous(buf, group)
remote = handle.get_buffer(peer, (M, N), torch.bfloat16)   # the peer's buffer, mapped here
local = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
config = OverlapConfig(method="signal", comm_sms=0)
plan = device_plan("row_slice", M, N, 1, config, 2, torch.device("cuda"))   # one region, one group: every tile
programs = gemm_programs(torch.device("cuda"), config)


def signaled(a, w, dst):
    signaled_gemm(a, w, dst, plan.tiles, None, programs, config)


results = {}
for name, (k, layout) in SHAPES.items():
    torch.manual_seed(1000 + k + rank)
    a = torch.randn(M, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    if layout == "kn":
        w = torch.randn(k, N, device="cuda", dtype=torch.bfloat16).div_(k ** 0.5).t()   # weight.t() of a [K, N]
    # the stores land where they should: our signaled product locally and in the peer's buffer, the peer's in ours
    signaled(a, w, local)
    signaled(a, w, remote)
    torch.cuda.synchronize()
    dist.barrier(group)
    ref = a.float() @ w.float().t()
    err = float((local.float() - ref).norm() / ref.norm())
    assert err < 1e-2, (name, err)
    sums = torch.stack([local.double().sum(), buf.double().sum()])   # ours; what the peer stored into ours
    gathered = [torch.empty_like(sums) for _ in range(t)]
    dist.all_gather(gathered, sums, group=group)
    assert float(gathered[rank][1]) == float(gathered[peer][0]), (name, "the peer's stores into our buffer")
    dist.barrier(group)
    row = {}
    row["cuBLAS local"] = graph_timed(lambda: torch.mm(a, w.t(), out=local), [()], REPS, group)
    row["cuBLAS remote"] = graph_timed(lambda: torch.mm(a, w.t(), out=remote), [()], REPS, group)
    row["signaled local"] = graph_timed(lambda: signaled(a, w, local), [()], REPS, group)
    row["signaled remote"] = graph_timed(lambda: signaled(a, w, remote), [()], REPS, group)
    # the alternative to remote stores: local stores, then the copy engines push the peer's rows (half of C at t = 2;
    # timed here for all of C, both ranks pushing at once)
    row["CE push of C"] = graph_timed(lambda: memops.copy(torch.cuda.current_stream().cuda_stream, remote.data_ptr(),
                                                          local.data_ptr(), M * N * 2), [()], REPS, group)
    for method in ("signal", "decompose"):   # the ops: half the tiles remote, then the slot sum
        op_config = OverlapConfig(method=method, transport="p2p", comm_sms=0)
        gemm_rs(a, w, group, config=op_config)
        row[f"gemm_rs {method}-p2p"] = graph_timed(lambda: gemm_rs(a, w, group, config=op_config), [()], REPS, group)
    results[name] = row
    if rank == 0:
        print(f"{name} (K/t {k}, {layout}): " + "; ".join(f"{key} {ms * 1e3:.1f} us" for key, ms in row.items()),
              flush=True)
if rank == 0:
    print("remote - local (us): " + "; ".join(
        f"{name}: cuBLAS {1e3 * (r['cuBLAS remote'] - r['cuBLAS local']):.1f}, signaled "
        f"{1e3 * (r['signaled remote'] - r['signaled local']):.1f}" for name, r in results.items()), flush=True)
