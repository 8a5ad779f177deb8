"""OverlapMoELayer on all GPUs here with NCCL (t = gpu_world()), bf16, against Megatron's MoELayer (alltoall dispatcher) built from
the same seed (run on the device: `pytest -m gpu tests/gpu/test_moe_layer_gpu.py`).

Mixtral-8x7B-like layer (hidden 4096, expert FFN 14336, SwiGLU, 8 experts, top-2, aux loss), EP = 2, 8192
tokens per rank, routing forced identically for both layers (overlap_tp.bench.moe_layer.force_routing):
uniform, Zipf(s = 1.2) over the experts, and every token to rank 0's experts (rank 1 receives none).
- `signal` and `off`: forward output, input grad, router grad and every expert's fc1 / fc2 weight grad agree
  with Megatron's (relative error 1e-2 / 2e-2 in bf16); a smaller layer does the same with the whole MoE
  layer recomputed (recompute_modules 'moe');
- 200 back-to-back forward + backward steps of `signal` with the routing changing every step (uniform,
  Zipf, one rank receiving nothing) finish without a hang (watchdog 120 s); every step's output and input
  grad agree with `off` run on the same inputs and routing (1e-2), a step that repeats an earlier step's
  input and routing reproduces its bits, and the grads accumulated over the 200 steps agree with off's (2e-2);
- with static sizes (capacity factor, padded to capacity) forward + backward captured in a CUDA graph and
  replayed 50 times with fresh inputs: every replay as the eager step on the same input, a late peer included.
"""
import os

import pytest
import torch

from distributed import run_distributed
from gpu_checks import gpu_world, rel_error

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from overlap_tp import OverlapConfig  # noqa: E402

pytestmark = pytest.mark.gpu

TOKENS = 8192
ROUTINGS = ("uniform", "zipf", "rank0_only")
METHODS = {"signal": OverlapConfig(method="signal", comm_sms=16, groups="auto"), "off": OverlapConfig(method="off")}


def _setup(world):
    from megatron.core import parallel_state
    os.environ["OVERLAP_TP_WATCHDOG_S"] = "120"
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=world)
    return parallel_state


def _step(layer, x, g):
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out, _ = layer(x)
    out.backward(g)
    return out.detach(), x.grad


def _grads(layer):
    """Megatron's parameter names -> grads; OverlapGroupedMLP's stacked grads split per expert."""
    out = {}
    for name, param in layer.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        if name in ("experts.weight1", "experts.weight2"):
            linear = "linear_fc1" if name.endswith("1") else "linear_fc2"
            out.update({f"experts.local_experts.{e}.{linear}.weight": grad[e] for e in range(grad.shape[0])})
        else:
            out[name] = grad
    return out


def _close(got, ref, what, tol):
    assert got.shape == ref.shape, (what, tuple(got.shape), tuple(ref.shape))
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    if float(ref.float().norm()) == 0:   # an expert that received no token
        assert not got.any(), f"{what}: expected zeros"
        return
    err = rel_error(got, ref.float())
    assert err < tol, f"{what}: relative error {err:.3g} against the reference"


def _check_parity(rank, world, routing, tokens, overrides):
    from overlap_tp.bench.moe_layer import build_layer, force_routing, moe_config, routing_offsets
    from overlap_tp.megatron.moe_layer import set_moe_overlap_config
    ps = _setup(world)
    config = moe_config(world, **overrides)
    offsets = routing_offsets(tokens, config.num_moe_experts, world, routing, rank)
    gen = torch.Generator(device="cuda").manual_seed(5 + rank)
    x = torch.randn(tokens, 1, config.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
    g = torch.randn(tokens, 1, config.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
    ref = build_layer(False, config)
    force_routing(ref, offsets)
    out_ref, dx_ref = _step(ref, x, g)
    grads_ref = _grads(ref)
    del ref
    for method, overlap_config in METHODS.items():
        ours = build_layer(True, config)
        set_moe_overlap_config(ours, overlap_config)
        force_routing(ours, offsets)
        if routing == "rank0_only":
            counts = ours.token_counts(ours.router(x)[1])
            assert counts[:, config.num_moe_experts // world:].sum() == 0, counts
        out, dx = _step(ours, x, g)
        what = f"{routing} {method} rank {rank}"
        _close(out, out_ref, what + " output (reference: Megatron's MoELayer)", 1e-2)
        _close(dx, dx_ref, what + " input grad (reference: Megatron's MoELayer)", 1e-2)
        grads = _grads(ours)
        assert grads.keys() == grads_ref.keys()
        for name, grad in grads.items():
            _close(grad, grads_ref[name], f"{what} {name} grad", 2e-2)
        del ours
    ps.destroy_model_parallel()


@pytest.mark.parametrize("routing", ROUTINGS)
def test_matches_megatrons_moe_layer(routing):
    run_distributed(gpu_world(), _check_parity, routing, TOKENS, {}, backend="nccl")


def test_matches_megatron_with_the_moe_layer_recomputed():
    run_distributed(gpu_world(), _check_parity, "zipf", 2048, dict(hidden=1024, ffn=2048, recompute_granularity="selective",
                                                          recompute_modules=["moe"]), backend="nccl")


def _check_back_to_back(rank, world):
    """200 steps of `signal` and, on the same inputs and routing, of `off` (the same layer class and weights:
    build_layer's seed), the routing and the inputs cycling with period 12. Every step's output and input
    grad match off's (1e-2, different GEMM kernels); a step repeating an earlier one's input and routing
    gives that step's bits exactly (the same kernels on the same data: state left by earlier steps, such
    as counters, flags or buffers, must not leak in); the grads accumulated over the 200 steps match off's
    (2e-2)."""
    from overlap_tp.bench.moe_layer import build_layer, force_routing, moe_config, routing_offsets
    from overlap_tp.megatron.moe_layer import set_moe_overlap_config
    ps = _setup(world)
    config = moe_config(world)
    routings = [routing_offsets(TOKENS, config.num_moe_experts, world, routing, rank, seed=seed)
                for seed, routing in enumerate(ROUTINGS + ("zipf",))]
    layers = {}
    for method in ("signal", "off"):
        layers[method] = build_layer(True, config)
        set_moe_overlap_config(layers[method], METHODS[method])
        force_routing(layers[method], *routings)
    gen = torch.Generator(device="cuda").manual_seed(11 + rank)
    sets = [(torch.randn(TOKENS, 1, config.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen),
             torch.randn(TOKENS, 1, config.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen))
            for _ in range(3)]
    period = len(sets) * len(routings)   # force_routing cycles its offsets once per forward
    first = {}
    for step in range(200):
        x, g = sets[step % len(sets)]
        results = {}
        for method, layer in layers.items():
            xi = x.detach().clone().requires_grad_(True)
            out, _ = layer(xi)
            out.backward(g)
            results[method] = (out.detach(), xi.grad)
        out, dx = results["signal"]
        what = f"step {step} rank {rank}"
        _close(out, results["off"][0], what + " output (reference: off)", 1e-2)
        _close(dx, results["off"][1], what + " input grad (reference: off)", 1e-2)
        phase = step % period
        if phase in first:
            assert torch.equal(out, first[phase][0]), f"{what}: output differs from step {phase}'s (same input)"
            assert torch.equal(dx, first[phase][1]), f"{what}: input grad differs from step {phase}'s (same input)"
        else:
            first[phase] = (out.clone(), dx.clone())
    torch.cuda.synchronize()
    grads, grads_off = _grads(layers["signal"]), _grads(layers["off"])
    assert grads.keys() == grads_off.keys()
    for name, grad in grads.items():
        _close(grad, grads_off[name], f"rank {rank} {name} grad accumulated over 200 steps", 2e-2)
    ps.destroy_model_parallel()


def test_200_back_to_back_steps():
    run_distributed(gpu_world(), _check_back_to_back, backend="nccl")


def _check_captured(rank, world):
    """With static sizes (capacity factor 1.0, padded to capacity) the layer's forward + backward is captured
    with torch.cuda.graph and replayed 50 times with fresh inputs copied into the static ones: every replay's
    output, input grad and parameter grads equal the eager step's on the same input (1e-2; the same kernels
    and plans, so normally bit for bit), with rank 1 held back on the GPU before some replays (a late peer)."""
    from overlap_tp.bench.moe_layer import build_layer, force_routing, moe_config, routing_offsets
    from overlap_tp.megatron.moe_layer import set_moe_overlap_config
    from overlap_tp.tune.timing import CapturedCalls
    ps = _setup(world)
    tokens = 2048
    config = moe_config(world, hidden=1024, ffn=2048, moe_expert_capacity_factor=1.0,
                        moe_pad_expert_input_to_capacity=True)
    layer = build_layer(True, config)
    set_moe_overlap_config(layer, METHODS["signal"])
    force_routing(layer, routing_offsets(tokens, config.num_moe_experts, world, "zipf", rank))
    gen = torch.Generator(device="cuda").manual_seed(21 + rank)
    sets = [(torch.randn(tokens, 1, config.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen),
             torch.randn(tokens, 1, config.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen))
            for _ in range(3)]
    eager = []
    for x, g in sets:   # also builds every plan the capture needs
        out, dx = _step(layer, x, g)
        eager.append((out, dx, {k: v.clone() for k, v in _grads(layer).items()}))
    static_x = sets[0][0].clone().requires_grad_(True)
    static_g = sets[0][1].clone()

    def step(x, g):   # grads set to None first: the captured backward allocates them, replays overwrite them
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out, _ = layer(x)
        out.backward(g)
        return out

    captured = CapturedCalls(step, [(static_x, static_g)], warmup=2)
    static_out = captured.outputs[0]
    for replay in range(50):
        i = replay % len(sets)
        with torch.no_grad():
            static_x.copy_(sets[i][0])
            static_g.copy_(sets[i][1])
        if rank == 1 and replay % 10 == 3:
            torch.cuda._sleep(100_000_000)
        captured.graph.replay()
        out, dx, grads = eager[i]
        what = f"replay {replay} rank {rank}"
        _close(static_out, out, what + " output", 1e-2)
        _close(static_x.grad, dx, what + " input grad", 1e-2)
        for name, grad in _grads(layer).items():
            _close(grad, grads[name], f"{what} {name} grad", 1e-2)
    torch.cuda.synchronize()
    ps.destroy_model_parallel()


def test_captured_with_static_sizes_replays_like_eager():
    run_distributed(gpu_world(), _check_captured, backend="nccl")
