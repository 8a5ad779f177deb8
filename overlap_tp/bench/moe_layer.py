"""MoE layer benchmark: OverlapMoELayer against Megatron's MoELayer (alltoall dispatcher), forward + backward,
Mixtral-8x7B-like (hidden 4096, expert FFN 14336, SwiGLU, 8 experts, top-2, aux loss), EP = the number of
processes, 8192 and 16384 tokens per rank, uniform and Zipf(1.2) routing.

    torchrun --nproc-per-node 2 -m overlap_tp.bench moe_layer --out OUT_DIR

One process per GPU; every variant runs in the same process on the same inputs, weights and routing:
  megatron   Megatron's MoELayer: router, permute, all_to_all, SequentialMLP experts (TEGroupedMLP with
             --transformer-impl transformer_engine where Transformer Engine imports), all_to_all, unpermute
  off        OverlapMoELayer, method 'off': the all-to-all then the per-expert cuBLAS GEMMs, sequentially
  signal     OverlapMoELayer, method 'signal' (the default config): a2a_gemm / gemm_a2a overlapped
  (--methods adds decompose or auto: auto's trial calls run untimed before its timing, `auto chose` says
  which method it kept)
A step is forward + backward of the layer (input grad included), timed as the median of --reps steps (CUDA
events, inputs rotated over 3 sets), the slowest rank's; the steps of all variants are interleaved in --rounds
rounds (each round times every variant in turn) and "S m per round" is the range of the ratio over the rounds.
Routing is forced the same way for every variant: the router's logits get a per-token offset
scale * (log p + Gumbel), so each token's top-k are k distinct experts drawn from p (uniform, Zipf(1.2) over
the experts, or rank 0's experts only); the router still computes its logits, probabilities and aux loss.
Every variant's output is checked against Megatron's first.
"""
import argparse
import collections
import contextlib
import dataclasses
import os
import re
import time

import torch
import torch.distributed as dist

from overlap_tp.ops.config import OverlapConfig
from overlap_tp.ops.resolve import resolve
from overlap_tp.tune import report
from overlap_tp.bench.moe import ZIPF_S
from overlap_tp.bench.ops import agree
from overlap_tp.tune.timing import slowest_median, timed_samples

INPUT_SETS = 3
ROUTINGS = ("uniform", "zipf", "rank0_only")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m overlap_tp.bench moe_layer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="8192,16384", help="tokens per rank (before top-k)")
    p.add_argument("--routing", default="uniform,zipf", help="comma list of " + ",".join(ROUTINGS))
    p.add_argument("--methods", default="signal,off",
                   help="OverlapMoELayer methods to time (signal, off, decompose, auto; signal-p2p / decompose-p2p: "
                        "the method with the expert ops on the p2p transport, expert.transport p2p in --overlap-tp-config; a "
                        "suffix "
                        ".gN / .smN sets groups / comm_sms, e.g. signal.g4.sm8)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336, help="expert FFN size (fc1 is 2 x ffn: SwiGLU)")
    p.add_argument("--experts", type=int, default=8, help="global experts E (EP = the number of processes)")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--transformer-impl", default="local", choices=("local", "transformer_engine"),
                   help="Megatron's MoE module: local (SequentialMLP) or TE's (TEGroupedMLP) where TE imports")
    p.add_argument("--routings", type=int, default=1,
                   help="routings cycled step by step (each drawn with its own seed): 1 = the same every step; "
                        "training's routing changes every step, which rebuilds the expert ops' plans")
    p.add_argument("--reps", type=int, default=20, help="timed steps per variant, spread over --rounds")
    p.add_argument("--rounds", type=int, default=5,
                   help="interleaved rounds: each round times every variant in turn (reps / rounds steps each)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="also profile 3 steps of every variant (torch.profiler): per variant and shape, a table of "
                        "the kernels by GPU time (DIR/<shape>_<variant>.txt), the trace (.json) and the GPU-busy "
                        "time per step")
    p.add_argument("--out", default="runs/bench", help="folder for the JSON + Markdown report (rank 0)")
    p.add_argument("--name", default="moe_layer", help="report file name (without extension)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.reps < args.rounds:
        p.error(f"--rounds {args.rounds} with --reps {args.reps}: need 1 <= rounds <= reps")
    return args


def moe_config(ep, hidden=4096, ffn=14336, experts=8, top_k=2, transformer_impl="local", **overrides):
    """The TransformerConfig of a Mixtral-like MoE layer at EP = ep, expert TP = 1, bf16."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    values = dict(num_layers=1, hidden_size=hidden, num_attention_heads=32, ffn_hidden_size=ffn,
                  num_moe_experts=experts, moe_router_topk=top_k, moe_token_dispatcher_type="alltoall",
                  expert_model_parallel_size=ep, params_dtype=torch.bfloat16, bf16=True, gated_linear_unit=True,
                  activation_func=torch.nn.functional.silu, bias_activation_fusion=True, add_bias_linear=False,
                  moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, init_method_std=0.02,
                  transformer_impl=transformer_impl)
    values.update(overrides)
    return TransformerConfig(**values)


def build_layer(ours, config, seed=1234):
    """OverlapMoELayer (get_moe_overlap_module_spec) or the MoE module Megatron's own spec builds for
    `config`; from the same seed both come out with equal weights."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    from overlap_tp.megatron.layer_spec import get_moe_overlap_module_spec
    from overlap_tp.megatron_patches.apply import megatron_moe_spec
    spec = get_moe_overlap_module_spec() if ours else megatron_moe_spec(config)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    layer = build_module(spec, config=config) if isinstance(spec, ModuleSpec) else spec(config=config)
    layer.set_layer_number(1)
    return layer.cuda()


def routing_offsets(tokens, experts, ep, routing, rank, scale=20.0, seed=0):
    """[tokens, E] logit offsets scale * (log p + Gumbel): a token's top-k are k distinct experts drawn from
    p (Gumbel-top-k); each rank draws its own."""
    ranks = torch.arange(1, experts + 1, dtype=torch.float64)
    p = {"uniform": torch.ones(experts, dtype=torch.float64), "zipf": ranks ** -ZIPF_S,
         "rank0_only": (ranks <= experts // ep).double()}[routing]
    g = torch.Generator().manual_seed(seed + rank)
    gumbel = -torch.log(-torch.log(torch.rand(tokens, experts, generator=g, dtype=torch.float64).clamp_min(1e-12)))
    return (scale * (p.clamp_min(1e-12).log() + gumbel)).float()


def force_routing(layer, *offsets):
    """Add offsets [tokens, E] to the layer's router logits, the next of `offsets` (cycled) at every call;
    the router still runs and gets its grads."""
    gating = layer.router.gating
    offsets = [o.to(torch.cuda.current_device()) for o in offsets]
    calls = [0]

    def gating_with_offsets(x):
        logits = gating(x)
        offset = offsets[calls[0] % len(offsets)]
        calls[0] += 1
        return logits + offset.view(logits.shape).to(logits.dtype)

    layer.router.gating = gating_with_offsets
    return calls   # calls[0] = 0 restarts the cycle


VARIANT_FIELDS = {"g": "groups", "sm": "comm_sms"}   # a --methods entry's changes (variant_config)


def variant_config(name: str):
    """The expert ops' config of a --methods entry: a method, or signal-p2p / decompose-p2p (the method on the p2p
    transport, whose GEMMs get every SM: comm_sms 0, as the resolver sets on p2p); then optional
    '.'-separated changes to sweep: gN (groups=N), smN (comm_sms=N), e.g. signal.g4.sm8."""
    base, *changes = name.split(".")
    if base in ("signal-p2p", "decompose-p2p"):
        config = OverlapConfig(method=base.split("-")[0], transport="p2p", comm_sms=0)
    else:
        config = OverlapConfig(method=base)
    for change in changes:
        match = re.fullmatch(r"(g|sm)(\d+)", change)
        if match is None:
            raise ValueError(f"--methods {name}: '{change}' is not gN (groups) or smN (comm_sms)")
        config = dataclasses.replace(config, **{VARIANT_FIELDS[match[1]]: int(match[2])})
    return resolve(config, "a2a_gemm", device="cuda")   # the expert ops' defaults for the fields not named


def bench_shape(tokens, routing, args, group):
    from overlap_tp.megatron.moe_layer import set_moe_overlap_config
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    config = moe_config(ep, args.hidden, args.ffn, args.experts, args.top_k, args.transformer_impl)
    offsets = [routing_offsets(tokens, args.experts, ep, routing, rank, seed=1000 * k) for k in range(args.routings)]
    variants = {"megatron": build_layer(False, config)}
    for method in args.methods.split(","):
        variants[method] = build_layer(True, config)
        set_moe_overlap_config(variants[method], variant_config(method))
    cycles = {name: force_routing(layer, *offsets) for name, layer in variants.items()}
    sets = [(torch.randn(tokens, 1, args.hidden, device="cuda", dtype=torch.bfloat16).requires_grad_(True),
             torch.randn(tokens, 1, args.hidden, device="cuda", dtype=torch.bfloat16)) for _ in range(INPUT_SETS)]

    ours = variants[args.methods.split(",")[0]]
    counts = ours.token_counts(ours.router(sets[0][0])[1])   # the first routing's
    for calls in cycles.values():   # every variant's checked call below under that first routing
        calls[0] = 0
    local = args.experts // ep
    received = [int(counts[:, r * local:(r + 1) * local].sum()) for r in range(ep)]
    row = {"shape": f"{routing}.t{tokens}", "tokens": tokens, "routing": routing, "H": args.hidden, "F": args.ffn,
           "E": args.experts, "ep": ep, "rows_max": max(received),
           "imbalance": max(received) * ep / max(1, sum(received)),
           "megatron_experts": type(variants["megatron"].experts).__name__}

    def step(layer):
        def run(x, g):
            layer.zero_grad(set_to_none=True)
            x.grad = None
            out, _ = layer(x)
            out.backward(g)
            return out
        return run

    reference = step(variants["megatron"])(*sets[0]).detach()
    for name, layer in variants.items():
        if name != "megatron":
            agree(step(layer)(*sets[0]), reference, f"moe_layer {name} {row['shape']}")
        trial = getattr(getattr(layer, "experts", None), "_trial", None)
        calls = 0
        while trial is not None and trial.chosen is None:   # method auto: its trial calls, untimed
            step(layer)(*sets[calls % len(sets)])
            calls += 1
        if trial is not None:
            row["auto_chose"] = trial.chosen
    # every routing once per variant, untimed, before the rounds: a routing's first step can compile a new kernel
    # specialization (Triton specializes integer arguments on == 1 and divisibility by 16, a bounded set per op that
    # training pays once), which would dominate a round it fell into; its cost is reported apart
    # (first_<variant>: ms per step of this pass, the slowest rank's; compiles_<variant>: the Triton kernels this
    # rank compiled in it, by name; mallocs_<variant>: the caching allocator's device allocations in it, the other
    # first-time cost of larger routings), not mixed into the timed medians
    for name, layer in variants.items():
        cycles[name][0] = 0
        torch.cuda.synchronize()
        mallocs = torch.cuda.memory_stats().get("num_device_alloc", 0)
        start = time.perf_counter()
        with triton_compiles() as compiled:
            for k in range(args.routings):
                step(layer)(*sets[k % len(sets)])
            torch.cuda.synchronize()
        elapsed = torch.tensor([(time.perf_counter() - start) * 1e3 / args.routings], device="cuda")
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        row[f"first_{name}"] = elapsed.item()
        row[f"compiles_{name}"] = ", ".join(f"{kernel} x{n}" for kernel, n in sorted(compiled.items())) or "none"
        row[f"mallocs_{name}"] = torch.cuda.memory_stats().get("num_device_alloc", 0) - mallocs
    # every variant's steps spread over interleaved rounds (each round times every variant in turn), so a drift of
    # the machine during the run moves all of them alike; the per-round ratios give the comparison's noise. Each
    # variant's round starts at the same routing, so within a round every variant runs the same routings.
    samples = {name: [] for name in variants}
    round_ms = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, layer in variants.items():
            cycles[name][0] = 0
            got = timed_samples(step(layer), sets, max(1, -(-args.reps // args.rounds)), group, warmup=2)
            samples[name] += got
            round_ms[name].append(slowest_median(got, group))
    for name in variants:
        row[name] = slowest_median(samples[name], group)
    if args.profile:
        for name, layer in variants.items():
            row[f"busy_{name}"] = profile_steps(step(layer), sets, os.path.join(args.profile, f"{row['shape']}_{name}"))
    for method in args.methods.split(","):
        row[f"S_{method}"] = row["megatron"] / row[method]
        ratios = [a / b for a, b in zip(round_ms["megatron"], round_ms[method])]
        row[f"S_{method}_rounds"] = f"{min(ratios):.2f}-{max(ratios):.2f}"
    if "signal" in row and "off" in row:
        row["signal_vs_off"] = row["off"] / row["signal"]
    return row


@contextlib.contextmanager
def triton_compiles():
    """{kernel name: compiles} of the Triton kernels this process compiles inside the block (Triton's
    knobs.runtime.jit_post_compile_hook, which runs once per new specialization; a kernel found in Triton's disk
    cache counts too: it is still a new specialization in this process). Empty where Triton has no such hook."""
    counts = collections.Counter()
    try:
        from triton import knobs
        runtime = knobs.runtime
        previous = runtime.jit_post_compile_hook
    except (ImportError, AttributeError):
        yield counts
        return

    def hook(*args, **kwargs):
        fn = kwargs.get("fn")
        counts[getattr(fn, "name", None) or str(fn)] += 1
        if previous is not None:
            previous(*args, **kwargs)

    runtime.jit_post_compile_hook = hook
    try:
        yield counts
    finally:
        runtime.jit_post_compile_hook = previous


def profile_steps(run, sets, path, steps=3):
    """GPU time per step (ms: the kernels' and copies' time summed over the profiled steps / steps), with the
    kernel table by GPU time written to `path`.txt and the trace to `path`.json (torch.profiler over `steps`
    steps after one unprofiled, Python functions recorded, so the trace shows where the GPU waited for the host and
    what the host did meanwhile). The profiled steps are not the timed ones."""
    from torch.profiler import ProfilerActivity, profile
    run(*sets[0])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        for i in range(steps):
            run(*sets[i % len(sets)])
        torch.cuda.synchronize()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    prof.export_chrome_trace(path + ".json")
    events = prof.key_averages()
    busy_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    with open(path + ".txt", "w") as f:
        f.write(events.table(sort_by="self_device_time_total", row_limit=30))
    return busy_us / steps / 1e3


def columns(methods, profiled=False):
    cols = [("shape", "routing.tokens", "{}"), ("rows_max", "rows max", "{}"), ("imbalance", "imbalance", "{:.2f}"),
            ("megatron", "Megatron MoELayer", "{:.3f}")]
    cols += [(m, f"ours {m}", "{:.3f}") for m in methods] + [(f"S_{m}", f"S {m}", "{:.2f}") for m in methods]
    cols += [(f"S_{m}_rounds", f"S {m} per round", "{}") for m in methods]
    cols += [(f"first_{m}", f"first pass {m}", "{:.1f}") for m in ["megatron"] + list(methods)]
    cols += [(f"compiles_{m}", f"first pass compiles {m}", "{}") for m in methods]
    cols += [(f"mallocs_{m}", f"first pass mallocs {m}", "{}") for m in ["megatron"] + list(methods)]
    if "signal" in methods and "off" in methods:
        cols.append(("signal_vs_off", "off / signal", "{:.2f}"))
    if "auto" in methods:
        cols.append(("auto_chose", "auto chose", "{}"))
    if profiled:
        cols += [(f"busy_{m}", f"GPU busy {m}", "{:.3f}") for m in ["megatron"] + list(methods)]
    return cols


def main(argv):
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("run under torchrun: torchrun --nproc-per-node 2 -m overlap_tp.bench moe_layer ...")
        return 2
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    from megatron.core import parallel_state
    ep = dist.get_world_size()
    if args.experts % ep:
        raise SystemExit(f"--experts {args.experts} is not a multiple of EP = {ep}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=ep)
    group = parallel_state.get_expert_model_parallel_group()
    rows = []
    for tokens in map(int, args.tokens.split(",")):
        for routing in args.routing.split(","):
            row = bench_shape(tokens, routing, args, group)
            rows.append(row)
            torch.cuda.empty_cache()
            if dist.get_rank() == 0:
                print(" ".join(f"{key}={row[key]:.3f}" if isinstance(row[key], float) else f"{key}={row[key]}"
                               for key in row), flush=True)
    if dist.get_rank() == 0:
        methods = args.methods.split(",")
        notes = (f"Times in ms per forward + backward of one MoE layer (median of steps, slowest rank; the variants "
                 f"interleaved in {args.rounds} rounds, S m per round: the ratio's range over them). S m = "
                 f"Megatron / ours with method m. Megatron's experts: {rows[0]['megatron_experts']}. rows max / "
                 f"imbalance: the most rows one rank's experts receive and its ratio to the mean. GPU busy (with "
                 f"--profile): kernel and copy time per step, summed over streams (wall time minus it: the GPU idle or "
                 f"waiting on the host). first pass m: ms per step of one untimed pass over every routing before "
                 f"the timed rounds (kernel compiles of new specializations included; first pass compiles m: the "
                 f"Triton kernels rank 0 compiled in it; first pass mallocs m: rank 0's caching-allocator device "
                 f"allocations in it). EP = 1: no all-to-all, the times are the paths' own costs.")
        command = f"torchrun --nproc-per-node {ep} -m overlap_tp.bench moe_layer " + " ".join(argv)
        if args.routings > 1:
            notes += f" {args.routings} routings cycled step by step (new expert plans every step, as in training)."
        report.write(args.out, args.name, f"MoE layer forward + backward, EP = {ep}", rows,
                     columns(methods, bool(args.profile)), notes, command=command)
        print(report.markdown_table(rows, columns(methods, bool(args.profile))))
        print(notes)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0
