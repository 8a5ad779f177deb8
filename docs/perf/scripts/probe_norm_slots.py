# What leaving a p2p reduce-scatter's sum to the norm kernel saves on ONE GPU (the GPU side only): at t = 2 shards of
# the BENCHMARKS.md shapes, the slot sum (kernels/sum_slots.py) then the norm kernel, against the norm kernel reading
# the t slots itself. Forward: linear_proj / fc2 -> fused bda + norm (x_slots, session 11); backward: linear_qkv /
# fc1 dgrad -> the norm's backward (dy_slots, session 18). Both variants captured in CUDA graphs, timed by replay in
# interleaved rounds; bits checked equal first.
#   python3 docs/perf/scripts/probe_norm_slots.py [--rounds 7]
import statistics, sys
import torch
from overlap_tp.kernels.fused_add_rmsnorm import (dropout_seed, empty_forward_outputs, launch_backward, launch_forward)
from overlap_tp.kernels.sum_slots import SumSlots
from overlap_tp.tune.timing import CapturedCalls

ROUNDS = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 7
dev = torch.device("cuda")
print(f"device: {torch.cuda.get_device_name()}; rounds {ROUNDS}; us per call, median over rounds (each round: the "
      f"median of 20 replays of 4 calls)")
for name, rows, hidden, t in (("l8b", 4096, 4096, 2), ("l70b", 4096, 8192, 2), ("l8b t4", 2048, 4096, 4)):
    gen = torch.Generator(device="cuda").manual_seed(rows + hidden)
    slots = torch.randn(t, rows, hidden, device=dev, generator=gen).bfloat16()
    residual = torch.randn(rows, hidden, device=dev, generator=gen).bfloat16()
    weight = (1 + 0.5 * torch.randn(hidden, device=dev, generator=gen)).bfloat16()
    bias = torch.randn(hidden, device=dev, generator=gen).bfloat16()
    seed = dropout_seed("cuda")
    total = torch.empty(rows, hidden, dtype=torch.bfloat16, device=dev)
    sum_slots = SumSlots(t, total.numel())
    fwd = dict(eps=1e-5, dropout_p=0.1, seed=seed)
    out = empty_forward_outputs(total, residual, torch.bfloat16)
    d_res = torch.randn(rows, hidden, device=dev, generator=gen).bfloat16()
    ds = torch.empty_like(residual)
    dx = torch.empty_like(residual)

    def fwd_summed():
        sum_slots(slots.view(t, -1), total)
        launch_forward(total, residual, weight, bias, out, **fwd)

    def fwd_slots():
        launch_forward(total, residual, weight, bias, out, x_slots=slots, **fwd)

    def bwd_summed():
        sum_slots(slots.view(t, -1), total)
        launch_backward(total, d_res, out.residual_out, out.rstd, weight, ds, dx, dropout_p=0.1, seed=seed,
                        bias_grad=True)

    def bwd_slots():
        launch_backward(total, d_res, out.residual_out, out.rstd, weight, ds, dx, dropout_p=0.1, seed=seed,
                        bias_grad=True, dy_slots=slots)

    for label, summed, fused in (("forward", fwd_summed, fwd_slots), ("backward", bwd_summed, bwd_slots)):
        summed()
        want = [v.clone() for v in ((out.y, out.residual_out, out.rstd) if label == "forward" else (ds, dx))]
        total.fill_(float("nan"))
        fused()
        got = (out.y, out.residual_out, out.rstd) if label == "forward" else (ds, dx)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), (name, label)
        graphs = [CapturedCalls(lambda fn=fn: fn(), [()] * 4) for fn in (summed, fused)]
        rounds = [[], []]
        for _ in range(ROUNDS):
            for times, graph in zip(rounds, graphs):
                times.append(statistics.median(graph.samples(80, None)) * 1e3)
        a, b = (statistics.median(r) for r in rounds)
        saved = [x - y for x, y in zip(*rounds)]
        print(f"{name:7s} rows {rows} hidden {hidden} t {t} {label:8s}: sum then norm {a:7.1f} us, norm on the slots "
              f"{b:7.1f} us, saved {a - b:6.1f} us (per round {min(saved):.1f}..{max(saved):.1f})", flush=True)
