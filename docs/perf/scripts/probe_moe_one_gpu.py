# The expert ops on ONE GPU (EP = 1; session 12 had no 2-GPU machine), issue 25 item 1:
# 1. the grouped GEMM alone, per-rank shapes of Mixtral-like experts at EP 2 (4 local experts of 8, top-2, T tokens
#    per rank -> ~2T rows): per-expert cuBLAS (the `off` path), torch._grouped_mm (one grouped cuBLAS call), and
#    the grouped signaled Triton GEMM (the `signal` path's kernel over the dispatch plan's tiles, every SM);
# 2. host time of one MoE forward + backward (a2a_gemm, gemm_a2a, method signal) with a NEW routing, queued behind
#    a 40 ms sleep kernel: a step that synchronizes the host shows as >= 40 ms.
#   torchrun --nproc-per-node 1 docs/perf/scripts/probe_moe_one_gpu.py [--host-only]
import statistics, sys, time
import torch, torch.distributed as dist
from overlap_tp import OverlapConfig, a2a_gemm, gemm_a2a
from overlap_tp.bench.moe import routing_counts
from overlap_tp.ops.common import gemm_programs
from overlap_tp.ops.expert import expert_mm
from overlap_tp.ops.moe_tile_plan import dispatch_plan, layout
from overlap_tp.kernels.signaled_gemm import SignaledGemm
from overlap_tp.tune.timing import sleep_cycles_per_ms

torch.cuda.set_device(0)
dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
dev = torch.device("cuda", 0)
HIDDEN, FFN, EXPERTS = 4096, 14336, 4


def event_ms(fn, reps=20, rounds=3):
    """median over rounds of (mean ms per call of `reps` back-to-back calls)."""
    fn(); torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record(); torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / reps)
    return statistics.median(out)


GEMMS = [] if "--host-only" in sys.argv else [(t, r) for t in (8192, 16384) for r in ("uniform", "zipf")]
print("| gemm | routing.tokens | rows | per-expert cuBLAS ms | torch._grouped_mm ms | signaled ms | cuBLAS/signaled | grouped_mm/signaled | config |")
print("|---|---|---|---|---|---|---|---|---|")
for tokens, routing in GEMMS:
    counts = routing_counts(tokens, EXPERTS, 1, routing)
    lay = layout(counts, 0)
    per_expert = counts[0].tolist()
    offs = torch.tensor(per_expert, device=dev).cumsum(0).to(torch.int32)
    for name, k, n in (("fc1", HIDDEN, 2 * FFN), ("fc2", FFN, HIDDEN)):
        a = torch.randn(lay.rows, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(EXPERTS, n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
        out = torch.empty(lay.rows, n, device=dev, dtype=torch.bfloat16)
        cublas = event_ms(lambda: expert_mm(a, w, lay.segments, (out,)))
        ref = out.clone()
        try:
            grouped = event_ms(lambda: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs))
        except (RuntimeError, AttributeError) as error:
            grouped = float("nan"); print(f"_grouped_mm: {str(error)[:100]}")
        for config in (OverlapConfig(method="signal", comm_sms=0),
                       OverlapConfig(method="signal", comm_sms=0, num_stages=3),
                       OverlapConfig(method="signal", comm_sms=0, block_n=128)):
            plan = dispatch_plan(layout(counts, 0), n, config.block_m, config.block_n, 1)
            gemm = SignaledGemm(plan.tiles.to(dev), gemm_programs(dev, config), config)
            out.fill_(float("nan"))
            gemm(a, w, out)
            err = float((out.float() - ref.float()).norm() / ref.float().norm())
            signaled = event_ms(lambda: gemm(a, w, out))
            label = f"{config.block_m}x{config.block_n}x{config.block_k}/{config.num_stages}/{config.num_warps}"
            print(f"| {name} | {routing}.t{tokens} | {lay.rows} | {cublas:.3f} | {grouped:.3f} | {signaled:.3f} | "
                  f"{cublas / signaled:.3f} | {grouped / signaled:.3f} | {label} err {err:.1e} |", flush=True)

# 2. host time of a step with a new routing, behind a 40 ms sleep
signal = OverlapConfig(method="signal")
w1 = (torch.randn(EXPERTS, 2 * 1024, 1024, device=dev) / 32).bfloat16().requires_grad_()
w2 = (torch.randn(EXPERTS, 1024, 1024, device=dev) / 32).bfloat16().requires_grad_()
cycles = sleep_cycles_per_ms()


def step(counts):
    x = torch.randn(int(counts.sum()), 1024, device=dev).bfloat16().requires_grad_()
    y = a2a_gemm(x, counts, w1, config=signal)
    z = gemm_a2a(y[:, :1024].contiguous(), counts, w2, config=signal)
    z.float().square().mean().backward()


for label, seeds in (("new routing every step", range(1, 9)), ("the same routing", [0] * 8)):
    step(routing_counts(4096, EXPERTS, 1, "zipf", seed=0))
    host = []
    for seed in seeds:
        counts = routing_counts(4096, EXPERTS, 1, "zipf", seed=seed)
        torch.cuda.synchronize()
        torch.cuda._sleep(int(40 * cycles))
        t0 = time.perf_counter()
        step(counts)
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    print(f"MoE fwd+bwd host ms behind a 40 ms sleep, {label}: median {statistics.median(host):.2f}, "
          f"max {max(host):.2f} (>= 40: the step synchronized)", flush=True)
dist.destroy_process_group()
