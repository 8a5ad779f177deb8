# Would a TMA-store epilogue cut what storing into the peer costs? Session 23 (probe_remote_epilogue.py, two H100s):
# the signaled kernel's remote stores (masked st.global of each tile into the peer's buffer, both ranks at once) cost
# 58-114 us over its local stores at the 8B layer's four GEMM+ReduceScatter shapes, cuBLAS's epilogue 38-85 us. Here
# the plain persistent TMA GEMM of probe_gemm_variants.py (no tile table, no signal; W row-major [N, K] for every
# shape) with each of its epilogues: masked st.global as ours ("flat.st"), one TMA store of the tile ("flat.tma"), two
# TMA stores of half tiles ("flat.tma2"; and with 4 stages), into local memory and into the peer's (a peer-mapped
# symmetric buffer), against cuBLAS into both; t = 2, both ranks storing into each other at once, graph replays, the
# slowest rank's median (us). A variant that fails (a TMA descriptor over peer memory, a compile) prints why.
# Prediction: the TMA stores' remote cost about cuBLAS's (bulk asynchronous stores keep the next tile's loads going),
# the pointer stores' about the signaled kernel's; if so, the signaled kernel's epilogue as TMA stores (its tiles stop
# at region boundaries; its release needs the bulk stores' completion first) saves ~7-30 us per ReduceScatter.
#   torchrun --nproc-per-node 2 docs/perf/scripts/probe_remote_stores.py
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed import _symmetric_memory as symm_mem

from overlap_tp.tune.timing import graph_timed

rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)   # before the import below, which initialises CUDA (the SM count)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_gemm_variants import VARIANTS, variant_call  # noqa: E402
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
group, t = dist.group.WORLD, dist.get_world_size()
assert t == 2, "t = 2: each rank stores into the other"
peer = 1 - rank
M, N, REPS = 8192, 4096, 30
SHAPES = {"proj": 2048, "qkv dgrad": 3072, "fc2": 7168, "fc1 dgrad": 14336}   # K per rank
NAMES = ("flat.st", "flat.tma", "flat.tma2", "flat.tma2.s4")
buf = symm_mem.empty(M, N, dtype=torch.bfloat16, device="cuda")
handle = symm_mem.rendezvous(buf, group)
remote = handle.get_buffer(peer, (M, N), torch.bfloat16)   # the peer's buffer, mapped here
local = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")

for name, k in SHAPES.items():
    torch.manual_seed(1000 + k + rank)
    a = torch.randn(M, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    want = a.float() @ w.float().t()
    calls = {"cuBLAS local": lambda: torch.mm(a, w.t(), out=local),
             "cuBLAS remote": lambda: torch.mm(a, w.t(), out=remote)}
    for variant in NAMES:
        for where, dst in (("local", local), ("remote", remote)):
            label = f"{variant} {where}"
            try:
                call = variant_call(VARIANTS[variant], a, w, dst)
                dst.fill_(float("nan"))
                torch.cuda.synchronize()
                dist.barrier(group)
                call()
                torch.cuda.synchronize()
                dist.barrier(group)
                # what landed: ours locally; in the remote case each rank's product in its peer's buffer
                sums = torch.stack([want.double().sum(), buf.double().sum(),
                                    (local.float() - want).norm().double() / want.norm().double()])
                gathered = [torch.empty_like(sums) for _ in range(t)]
                dist.all_gather(gathered, sums, group=group)
                if where == "local":
                    ok = all(float(g[2]) < 1e-2 for g in gathered)
                else:
                    ok = all(abs(float(gathered[1 - r][1]) - float(gathered[r][0])) <= 1e-2 * abs(float(gathered[r][0]))
                             + 1.0 for r in range(t))
                if not ok:   # decided from every rank's figures, so every rank skips it alike
                    raise AssertionError(f"{where} stores: the product did not land where it should")
            except Exception as e:   # reported, not fatal
                if rank == 0:
                    print(f"{name} {label}: failed ({type(e).__name__}: {str(e).splitlines()[0][:160]})", flush=True)
                continue
            calls[label] = call
    row = {label: graph_timed(call, [()], REPS, group) * 1e3 for label, call in calls.items()}
    if rank == 0:
        print(f"{name} (K/t {k}): " + "; ".join(f"{label} {us:.1f} us" for label, us in row.items()), flush=True)
        print(f"{name} remote - local (us): " + "; ".join(
            f"{v} {row[v + ' remote'] - row[v + ' local']:.1f}" for v in ("cuBLAS",) + NAMES
            if v + " remote" in row and v + " local" in row), flush=True)
