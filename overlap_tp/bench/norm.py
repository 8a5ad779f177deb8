"""Fused bias-dropout-add + RMSNorm benchmark, one GPU:

    python -m overlap_tp.bench norm --out OUT_DIR

Per (rows = M/t, hidden), bf16, the Llama path (no bias, no dropout) unless the variant says otherwise:
  fwd fused            the fused forward on a standard input: the plain fused add-RMSNorm Triton kernel
                       (the reorder code is compiled out when no map is given)
  fwd fused, map       the same kernel reading the tile-exact layout (128 x 256 tiles, random slot order)
  fwd fused, map+bias+dropout 0.1   Philox mask regenerated in the kernel
  fwd eager            torch: x + residual, then torch.nn.functional.rms_norm
  fwd eager, undo map  torch: TileOrder.undo(x) + residual, then rms_norm (the reorder done unfused)
  bwd fused / map      the one-pass backward (dy standard / tile-ordered), dx = d_residual aliased; its
                       partial rows summed by a second kernel launched with PDL (Hopper)
  bwd fused, no PDL    the same with the partial sum launched after the backward ends
  --sweep              also the forward at each num_warps in FWD_WARPS and the backward at each
                       (programs per SM, num_warps) in BWD_GRID, to set the launchers' defaults
  bwd eager / undo map autograd of the eager forward (after undoing dy's map)
  per-group rows       the forward split into --groups row groups behind an emulated collective, see below
GB/s counts each input read once and each output written once; "% copy" divides it by the bandwidth of
a device-to-device copy (src -> dst, read + write, 512 MiB each way) measured in the same run; "% same-size
copy" by that of a copy moving the row's own byte count (what a kernel of this size can reach). Times ("us") are GPU-only
medians over --reps calls, inputs rotated over --input-sets sets, L2 flushed before each call, every
launch queued behind a sleep kernel (`median_ms`), so no launch gap is counted; "host us" is the host's
time to enqueue one call. Every variant's result is checked (bf16 tolerance against float64, or
bitwise) before it is timed.

Per-group emulation (DESIGN.md item 3): the collective is a spin kernel (torch.cuda._sleep: one thread,
no memory traffic) per group, sized as the group's output bytes / --comm-gbps, on a high-priority comm
stream; each group records an event. "norm after all" launches one norm behind the last event; "per
group, comm stream" launches each group's norm on the comm stream behind its collective (it then
delays the next group's collective); "per group, third stream" launches it on a third stream behind the
group's event. "hidden %" = the share of the full norm's time that left the critical path.
"""
import argparse
import functools
import statistics
import sys
import time

import torch
from overlap_tp.tune import report
from overlap_tp.tune.timing import sleep_cycles_per_ms
from overlap_tp.kernels.fused_add_rmsnorm import (
    TileOrder, backward_grid, dropout_keep_mask, dropout_seed, empty_forward_outputs, launch_backward, launch_forward,
    reference_add_rmsnorm)

EPS = 1e-5
DROPOUT = 0.1
FWD_WARPS = (2, 4, 8, 16, 32)
BWD_GRID = [(per_sm, warps) for per_sm in (1, 2, 4, 8) for warps in (4, 8, 16, 32)]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m overlap_tp.bench norm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="2048,4096,8192", help="comma list of M/t (rows one rank normalizes)")
    p.add_argument("--hidden", default="4096,8192", help="comma list of hidden sizes")
    p.add_argument("--block", default="128x256", help="BM x BN of the tile-exact map")
    p.add_argument("--groups", type=int, default=4, help="row groups of the per-group variant")
    p.add_argument("--comm-gbps", type=float, default=200.0,
                   help="emulated collective: output bytes per second (DEVICE.md: NCCL RS ~185-220 GB/s bus)")
    p.add_argument("--input-sets", type=int, default=3)
    p.add_argument("--reps", type=int, default=30, help="timed calls per variant (median)")
    p.add_argument("--sweep", action="store_true", help="also time the launch-parameter grid (FWD_WARPS, BWD_GRID)")
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--name", default="fused_add_rmsnorm")
    return p.parse_args(argv)


def median_ms(calls, reps):
    """(GPU ms, host ms) medians of the calls, taken in turn (one per input set).

    A sleep kernel holds the GPU while the host enqueues all `reps` calls, each behind an L2 flush and
    between two events, so the events time the kernels alone. (triton.testing.do_bench launches each call
    behind its L2 flush; a call whose host side takes longer than the flush, like the backward's launch plus
    partial sum, then also times the launch gap.) The sleep is
    doubled and the reps redone while the host's enqueue reaches 80% of it."""
    for call in calls:  # compile and warm up
        call()
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    sleep_ms = 10.0
    while True:
        host = []
        torch.cuda.synchronize()
        torch.cuda._sleep(int(sleep_ms * sleep_cycles_per_ms()))
        t_enqueue = time.perf_counter()
        for i in range(reps):
            flush.zero_()
            starts[i].record()
            t0 = time.perf_counter()
            calls[i % len(calls)]()
            host.append(time.perf_counter() - t0)
            ends[i].record()
        enqueue_ms = (time.perf_counter() - t_enqueue) * 1e3
        torch.cuda.synchronize()
        if enqueue_ms < 0.8 * sleep_ms:
            break
        sleep_ms *= 2
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)), 1e3 * statistics.median(host)


@functools.cache
def copy_gbps(reps, nbytes=2**30):
    """GB/s (read + write) of a device-to-device copy moving `nbytes` in all (half read, half written);
    the default, 512 MiB each way, is the device's bandwidth, the denominator of "% copy"."""
    src = torch.randn(nbytes // 4, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms, _ = median_ms([lambda: dst.copy_(src)], reps)
    return 2 * src.numel() * src.element_size() / ms / 1e6


def check(got, want, what, exact=False):
    if exact:
        ok = torch.equal(got, want)
    else:
        ok = torch.allclose(got.double(), want.double(), rtol=2e-2, atol=2e-2 * want.abs().mean().item())
    if not ok:
        raise AssertionError(f"{what}: result does not match the reference")


def random_order(rows, hidden, block_m, block_n):
    tiles = (rows // block_m) * (hidden // block_n)
    slot_of = torch.randperm(tiles, device="cuda").to(torch.int32).reshape(rows // block_m, hidden // block_n)
    return TileOrder(block_m, block_n, slot_of)


def eager_forward(x, residual, weight):
    s = x + residual
    return torch.nn.functional.rms_norm(s, (s.shape[-1],), weight, EPS), s


def bench_shape(rows, hidden, args, copy):
    """Rows of the report for one (rows, hidden)."""
    block_m, block_n = (int(v) for v in args.block.split("x"))
    order = random_order(rows, hidden, block_m, block_n)
    sets = []
    for _ in range(args.input_sets):
        x, dy = (torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        sets.append(dict(x=x, x_ordered=order.apply(x), residual=4 * torch.randn_like(x), dy=dy,
                         dy_ordered=order.apply(dy), d_residual=torch.randn_like(x)))
    weight = (1 + 0.1 * torch.randn(hidden, device="cuda")).bfloat16()
    bias = (0.1 * torch.randn(hidden, device="cuda")).bfloat16()
    out = empty_forward_outputs(sets[0]["x"], sets[0]["residual"], torch.bfloat16)
    d_residual = torch.empty_like(sets[0]["x"])
    seed = dropout_seed("cuda")
    matrix_bytes = rows * hidden * 2
    fwd_bytes = 4 * matrix_bytes + 2 * hidden + 4 * rows  # x, residual in; y, residual out

    def bwd_bytes(programs_per_sm=None, num_warps=None):
        """dy, s, d_residual in; ds out; weight, rstd; the fp32 partial rows written and summed."""
        programs = backward_grid(rows, hidden, torch.device("cuda", 0), programs_per_sm, num_warps)[0]
        return 4 * matrix_bytes + 2 * hidden + 4 * rows + 2 * 4 * programs * hidden
    results = []

    def add(variant, timing, nbytes, fused=None, eager=None):
        """One report row; timing, fused, eager: (GPU ms, host ms) from median_ms."""
        ms, host_ms = timing
        results.append(dict(rows=rows, hidden=hidden, variant=variant, us=ms * 1e3, host_us=host_ms * 1e3,
                            gbps=nbytes / ms / 1e6, pct_copy=100 * nbytes / ms / 1e6 / copy,
                            pct_copy_same=100 * nbytes / ms / 1e6 / copy_gbps(args.reps, nbytes),
                            vs_fused_pct=None if fused is None else 100 * (ms / fused[0] - 1),
                            speedup_vs_eager=None if eager is None else eager[0] / ms))

    def forward(s, ordered=False, with_bias=False, p=0.0, target=out, row_lo=0, row_hi=None, num_warps=None):
        launch_forward(s["x_ordered"] if ordered else s["x"], s["residual"], weight, bias if with_bias else None,
                       target, eps=EPS, dropout_p=p, seed=seed, x_order=order if ordered else None,
                       row_lo=row_lo, row_hi=row_hi, num_warps=num_warps)

    def backward(s, ordered=False, programs_per_sm=None, num_warps=None, pdl=None):
        return launch_backward(s["dy_ordered"] if ordered else s["dy"], s["d_residual"], out.residual_out, out.rstd,
                               weight, d_residual, None, dy_order=order if ordered else None,
                               programs_per_sm=programs_per_sm, num_warps=num_warps, pdl=pdl)

    def eager_backward(s, ordered=False):
        """A call backpropagating through one kept eager graph (after undoing dy's map)."""
        x, residual, w = (t.detach().requires_grad_() for t in (s["x"], s["residual"], weight))
        y, summed = eager_forward(x, residual, w)

        def call():
            dy = order.undo(s["dy_ordered"]) if ordered else s["dy"]
            return torch.autograd.grad([y, summed], [x, residual, w], [dy, s["d_residual"]], retain_graph=True)
        return call

    # Correctness first, against float64.
    s0 = sets[0]
    y_ref, s_ref = reference_add_rmsnorm(s0["x"], s0["residual"], weight, eps=EPS)
    for ordered, warps in [(False, None), (True, None)] + ([(False, w) for w in FWD_WARPS] if args.sweep else []):
        for t in (out.y, out.residual_out):
            t.fill_(float("nan"))
        forward(s0, ordered, num_warps=warps)
        check(out.y, y_ref, f"fwd ordered={ordered} warps={warps} y")
        check(out.residual_out, s_ref, f"fwd ordered={ordered} warps={warps} residual")
    check(eager_forward(s0["x"], s0["residual"], weight)[0], y_ref, "eager fwd")
    forward(s0, True, True, DROPOUT)
    keep = dropout_keep_mask(seed, rows, hidden, DROPOUT)
    y_drop, s_drop = reference_add_rmsnorm(s0["x"], s0["residual"], weight, bias, eps=EPS, keep=keep,
                                           dropout_p=DROPOUT)
    check(out.y, y_drop, "fwd dropout y")
    check(out.residual_out, s_drop, "fwd dropout residual")

    forward(s0)
    leaves = [t.double().requires_grad_() for t in (s0["x"], s0["residual"], weight)]
    y64, s64 = reference_add_rmsnorm(*leaves, eps=EPS)
    torch.autograd.backward([y64, s64], [s0["dy"].double(), s0["d_residual"].double()])
    for ordered, per_sm, warps in [(False, None, None), (True, None, None)] + (
            [(False, per_sm, warps) for per_sm, warps in BWD_GRID] if args.sweep else []):
        d_residual.fill_(float("nan"))
        d_weight, _ = backward(s0, ordered, per_sm, warps)
        what = f"bwd ordered={ordered} programs/SM={per_sm} warps={warps}"
        check(d_residual, leaves[1].grad, f"{what} d_residual")
        check(d_weight, leaves[2].grad, f"{what} d_weight")
        if per_sm is None and not ordered:
            check(backward(s0, pdl=False)[0], d_weight, "bwd without PDL: d_weight bitwise", exact=True)
    check(eager_backward(s0)()[1], leaves[1].grad, "eager bwd d_residual")

    # Timings.
    def timed(make_call):
        return median_ms([make_call(s) for s in sets], args.reps)

    fused = timed(lambda s: lambda: forward(s))
    fused_map = timed(lambda s: lambda: forward(s, True))
    eager = timed(lambda s: lambda: eager_forward(s["x"], s["residual"], weight))
    eager_undo = timed(lambda s: lambda: eager_forward(order.undo(s["x_ordered"]), s["residual"], weight))
    add("fwd fused", fused, fwd_bytes, eager=eager)
    add("fwd fused, map", fused_map, fwd_bytes, fused, eager_undo)
    add("fwd fused, map+bias+dropout", timed(lambda s: lambda: forward(s, True, True, DROPOUT)),
        fwd_bytes + 2 * hidden, fused)
    add("fwd eager", eager, fwd_bytes, fused)
    add("fwd eager, undo map", eager_undo, fwd_bytes, fused)
    for warps in FWD_WARPS if args.sweep else ():
        add(f"fwd fused, {warps} warps", timed(lambda s: lambda: forward(s, num_warps=warps)), fwd_bytes, fused)

    forward(s0)
    fused_bwd = timed(lambda s: lambda: backward(s))
    eager_bwd = timed(eager_backward)
    eager_bwd_undo = timed(lambda s: eager_backward(s, True))
    add("bwd fused", fused_bwd, bwd_bytes(), eager=eager_bwd)
    add("bwd fused, map", timed(lambda s: lambda: backward(s, True)), bwd_bytes(), fused_bwd, eager_bwd_undo)
    add("bwd fused, no PDL", timed(lambda s: lambda: backward(s, pdl=False)), bwd_bytes(), fused_bwd)
    for per_sm, warps in BWD_GRID if args.sweep else ():
        add(f"bwd fused, {per_sm} programs/SM, {warps} warps",
            timed(lambda s: lambda: backward(s, programs_per_sm=per_sm, num_warps=warps)),
            bwd_bytes(per_sm, warps), fused_bwd)
    add("bwd eager", eager_bwd, bwd_bytes(), fused_bwd)
    add("bwd eager, undo map", eager_bwd_undo, bwd_bytes(), fused_bwd)

    results.extend(bench_per_group(rows, args, sets, forward, fused_map))
    return results


def bench_per_group(rows, args, sets, forward, norm_ms):
    """The forward split into row groups that become ready one by one behind an emulated collective."""
    groups = args.groups
    bounds = [rows * g // groups for g in range(groups + 1)]
    hidden = sets[0]["x"].shape[1]
    group_us = rows // groups * hidden * 2 / (args.comm_gbps * 1e3)
    cycles = int(group_us * sleep_cycles_per_ms() / 1e3)
    main = torch.cuda.current_stream()
    comm, third = torch.cuda.Stream(priority=-1), torch.cuda.Stream()
    events = [torch.cuda.Event() for _ in range(groups)]
    full = empty_forward_outputs(sets[0]["x"], sets[0]["residual"], torch.bfloat16)
    grouped = empty_forward_outputs(sets[0]["x"], sets[0]["residual"], torch.bfloat16)

    def collective(then=None):
        comm.wait_stream(main)
        with torch.cuda.stream(comm):
            for g in range(groups):
                torch.cuda._sleep(cycles)
                events[g].record()
                if then is not None:
                    then(g)

    def comm_alone(s):
        collective()
        main.wait_stream(comm)

    def after_all(s):
        collective()
        main.wait_stream(comm)
        forward(s, True, target=full)

    def on_comm_stream(s):
        collective(lambda g: forward(s, True, target=grouped, row_lo=bounds[g], row_hi=bounds[g + 1]))
        main.wait_stream(comm)

    def on_third_stream(s):
        def norm(g):
            third.wait_event(events[g])
            with torch.cuda.stream(third):
                forward(s, True, target=grouped, row_lo=bounds[g], row_hi=bounds[g + 1])
        collective(norm)
        main.wait_stream(third)
        main.wait_stream(comm)

    s0 = sets[0]
    after_all(s0)
    for variant in (on_comm_stream, on_third_stream):
        for t in grouped:
            t.fill_(float("nan"))
        variant(s0)
        for got, want in zip(grouped, full):
            check(got, want, f"per-group {variant.__name__}", exact=True)

    timings = {fn.__name__: median_ms([lambda s=s, fn=fn: fn(s) for s in sets], args.reps)[0]
               for fn in (comm_alone, after_all, on_comm_stream, on_third_stream)}
    labels = {"comm_alone": "comm alone (emulated)", "after_all": "norm after all groups",
              "on_comm_stream": "per group, comm stream", "on_third_stream": "per group, third stream"}
    rows_out = []
    for name, ms in timings.items():
        hidden_pct = None if name == "comm_alone" else 100 * (timings["after_all"] - ms) / norm_ms[0]
        rows_out.append(dict(rows=rows, hidden=hidden, variant=f"{groups} groups: {labels[name]}", us=ms * 1e3,
                             hidden_pct=hidden_pct))
    return rows_out


COLUMNS = [
    ("rows", "rows (M/t)", "{}"),
    ("hidden", "hidden", "{}"),
    ("variant", "variant", "{}"),
    ("us", "us", "{:.1f}"),
    ("host_us", "host us", "{:.0f}"),
    ("gbps", "GB/s", "{:.0f}"),
    ("pct_copy", "% copy", "{:.1f}"),
    ("pct_copy_same", "% same-size copy", "{:.1f}"),
    ("vs_fused_pct", "vs fused (same direction) %", "{:+.1f}"),
    ("speedup_vs_eager", "x eager", "{:.2f}"),
    ("hidden_pct", "norm hidden %", "{:.0f}"),
]


def main(argv):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("norm benchmark: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    copy = copy_gbps(args.reps)
    rows = []
    for m in (int(v) for v in args.rows.split(",")):
        for n in (int(v) for v in args.hidden.split(",")):
            shape_rows = bench_shape(m, n, args, copy)
            rows.extend(shape_rows)
            for r in shape_rows:
                print(" | ".join(fmt.format(r[k]) if r.get(k) is not None else "-" for k, _, fmt in COLUMNS),
                      flush=True)
    notes = (f"Device-to-device copy bandwidth in this run: {copy:.0f} GB/s (read + write). Targets: fused "
             f"forward >= 80% of it; the map's overhead <= 3%. Tile-exact map: {args.block} tiles in a random "
             f"order. Per-group: {args.groups} groups, collective emulated at {args.comm_gbps:.0f} GB/s of "
             "output.\n\n" + __doc__.split("\n\n", 1)[1])
    report.write(args.out, args.name, "Fused bias-dropout-add + RMSNorm (one GPU, bf16)", rows, COLUMNS, notes)
    return 0
