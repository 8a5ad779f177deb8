# Where the p2p AllGather+GEMM's time goes at t = 4 (issue 21): when each chunk's pulls land and when the GEMM ends,
# eager, by CUDA events: one on the caller's stream before the call, one on the comm stream as each chunk's ready flag
# is raised (the flag's write, wrapped), one after the call. Session 23 (four H100s, graphs): at l8b.qkv the pulls
# alone take 0.193 ms and the GEMM 0.135, async-TP ends 0.03 ms after its copies, ours 0.10 after (0.297 against
# 0.225). If the chunks land on time and the end trails the last one by more than a tile, the GEMM's tail is the gap
# (narrower tiles or more chunks shrink it: the variants below); if the chunks land late, the copies slow beside the
# GEMM. Per shape and config, the slowest rank's medians over REPS calls (ms from the call's start): each chunk's
# landing, the end, the end minus the last landing; and the GEMM alone (every chunk landed before it starts: the same
# plan's kernel with its flags raised).
# Prediction (a model of the plan: 132 programs striding over its tile table, each tile GEMM-alone x 132 / tiles long,
# chunk c landing at (c + 1) / C of the pulls' 0.193 / 0.358 / 0.201 ms): l8b.qkv ends at 0.239 ms with the default
# tile, 8 groups or the narrow tile alone, 0.216 with both; l70b.qkv 0.453 and l8b.fc1 0.664 in every config. Session
# 23 measured 0.297, 0.594, 0.683 (graphs): where the probe's landings or end leave the model is the cost to find.
#   torchrun --nproc-per-node 4 docs/perf/scripts/probe_ag_tail.py
import dataclasses
import os
import statistics

import torch
import torch.distributed as dist

from overlap_tp import OverlapConfig
from overlap_tp.ops import ag_gemm as ag_module
from overlap_tp.ops.ag_gemm import AgGemm
from overlap_tp.tune.shapes import AG_SHAPES, at_tp

rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
group, t = dist.group.WORLD, dist.get_world_size()
M, REPS = 8192, 20
BASE = OverlapConfig(method="signal", transport="p2p", comm_sms=0)
CONFIGS = {
    "default": BASE,
    "groups 8": dataclasses.replace(BASE, groups=8),
    "narrow tile": dataclasses.replace(BASE, block_n=128, num_stages=4, num_warps=4, tile_by_shape=False),
    "narrow, groups 8": dataclasses.replace(BASE, block_n=128, num_stages=4, num_warps=4, tile_by_shape=False,
                                            groups=8),
}
write_value = ag_module.memops.write_value   # the flag raise's driver call (the wrapper below records after it)


def slowest(x: float) -> float:
    v = torch.tensor([x], device="cuda")
    dist.all_reduce(v, op=dist.ReduceOp.MAX, group=group)
    return float(v)


for name in ("l8b.qkv", "l70b.qkv", "l8b.fc1"):
    k, n = at_tp("ag", *AG_SHAPES[name], t)
    m = M // t
    torch.manual_seed(rank)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    for label, config in CONFIGS.items():
        try:
            plan = AgGemm(group, m, n, k, torch.bfloat16, torch.device("cuda"), config)
        except ValueError as e:   # a config this shape cannot run: the same on every rank
            if rank == 0:
                print(f"t={t} {name} {label}: not built ({e})", flush=True)
            continue
        flags = {address: i for i, address in enumerate(plan.ready.addresses)}
        comm_stream = torch.cuda.ExternalStream(plan.engine.raw)
        landed = [torch.cuda.Event(enable_timing=True) for _ in flags]

        def recorded(stream, address, value):
            write_value(stream, address, value)
            if address in flags and value:
                landed[flags[address]].record(comm_stream)

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        rows = []
        ag_module.memops.write_value = recorded
        try:
            for rep in range(REPS + 3):
                torch.cuda.synchronize()
                dist.barrier(group)
                start.record()
                out = plan(a, w)
                end.record()
                torch.cuda.synchronize()
                if rep >= 3:
                    rows.append([start.elapsed_time(e) for e in landed] + [start.elapsed_time(end)])
                del out
        finally:
            ag_module.memops.write_value = write_value
        # the GEMM alone: the plan's kernel over the gathered buffer with every flag raised
        gathered = plan(a, w, return_gathered=True)[1].clone()
        out = torch.empty(M, n, device="cuda", dtype=torch.bfloat16)
        plan.flags.fill_(1)
        alone = []
        for rep in range(REPS + 3):
            torch.cuda.synchronize()
            start.record()
            plan.gemm(gathered, w, out, None)
            end.record()
            torch.cuda.synchronize()
            if rep >= 3:
                alone.append(start.elapsed_time(end))
        plan.flags.zero_()
        medians = [slowest(statistics.median(col)) for col in zip(*rows)]
        gemm_alone = slowest(statistics.median(alone))
        *chunks, finish = medians
        if rank == 0:
            print(f"t={t} {name} (m {m}, n {n}, k {k}) {label}: chunks landed at "
                  + ", ".join(f"{c:.3f}" for c in chunks) + f" ms; end {finish:.3f}; end - last {finish - chunks[-1]:.3f};"
                  f" GEMM alone {gemm_alone:.3f}", flush=True)
        del plan, gathered
