"""Fused bias + dropout + residual add + RMSNorm on the GPU at training sizes (bf16), against float64.

Run: `pytest -m gpu tests/gpu/test_fused_add_rmsnorm_gpu.py` on one GPU."""
import pytest
import torch

from overlap_tp.kernels.fused_add_rmsnorm import (
    ForwardOutputs, TileOrder, dropout_keep_mask, dropout_seed, empty_forward_outputs, launch_backward,
    launch_forward, reference_add_rmsnorm)
from deferred_sums import DeferringConsumer, FakeDeferredSum
from overlap_tp.megatron.norm import fused_add_rmsnorm

pytestmark = pytest.mark.gpu

HIDDEN = (4096, 8192)
ROWS = (2048, 4096, 8192)  # M / t: the rows one rank normalizes
BF16_TOL = 2e-2
BLOCK_M, BLOCK_N = 128, 256  # the GEMM+RS tile of the tile-exact schedule


def random_order(rows, hidden, generator):
    tiles = (rows // BLOCK_M) * (hidden // BLOCK_N)
    slot_of = torch.randperm(tiles, generator=generator, device="cuda").to(torch.int32)
    return TileOrder(BLOCK_M, BLOCK_N, slot_of.reshape(rows // BLOCK_M, hidden // BLOCK_N))


def inputs(rows, hidden, seed, residual_dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, hidden, device="cuda", generator=gen).bfloat16()
    residual = (4 * torch.randn(rows, hidden, device="cuda", generator=gen)).to(residual_dtype)
    weight = (1 + 0.5 * torch.randn(hidden, device="cuda", generator=gen)).bfloat16()
    bias = (0.5 * torch.randn(hidden, device="cuda", generator=gen)).bfloat16()
    return x, residual, weight, bias, gen


def poisoned(t):
    return t.fill_(float("nan"))


def assert_bf16_close(actual, expected, summed_rows=1):
    """bf16 tolerance; a column sum over `summed_rows` rows is ~sqrt(rows) large: atol grows with it."""
    torch.testing.assert_close(actual.double(), expected, rtol=BF16_TOL, atol=BF16_TOL * summed_rows ** 0.5)


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("ordered", [False, True], ids=["standard", "tile-ordered"])
def test_forward_and_backward_kernels_into_poisoned_outputs(rows, hidden, ordered):
    """Zero-centered gamma, bias, dropout 0.1 (fixed seed), fp32 residual: every output written, every
    value within bf16 tolerance of float64; the same result twice (deterministic), with the partial sum
    launched by PDL behind the backward and launched after it."""
    x_std, residual, weight, bias, gen = inputs(rows, hidden, seed=rows + hidden + ordered,
                                                residual_dtype=torch.float32)
    x_order = random_order(rows, hidden, gen) if ordered else None
    dy_order = random_order(rows, hidden, gen) if ordered else None
    x = x_order.apply(x_std) if ordered else x_std
    p, eps = 0.1, 1e-5
    seed = dropout_seed("cuda")
    options = dict(zero_centered_gamma=True, dropout_p=p, seed=seed)

    out = ForwardOutputs(*(poisoned(t) for t in empty_forward_outputs(x, residual, torch.float32)))
    launch_forward(x, residual, weight, bias, out, eps=eps, x_order=x_order, **options)
    keep = dropout_keep_mask(seed, rows, hidden, p)
    assert abs((~keep).float().mean().item() - p) < 0.01
    ref = [t.double().requires_grad_() for t in (x_std, residual, weight, bias)]
    y_ref, s_ref = reference_add_rmsnorm(*ref, eps=eps, zero_centered_gamma=True, keep=keep, dropout_p=p)
    assert_bf16_close(out.residual_out, s_ref)
    assert_bf16_close(out.y, y_ref)
    torch.testing.assert_close(out.rstd.double(), s_ref.pow(2).mean(-1).add(eps).rsqrt(), rtol=1e-3, atol=0)

    dy_std = torch.randn(rows, hidden, device="cuda", generator=gen).bfloat16()
    d_residual_out = torch.randn(rows, hidden, device="cuda", generator=gen)
    dy = dy_order.apply(dy_std) if ordered else dy_std
    backward_options = dict(dy_order=dy_order, dx_order=x_order, bias_grad=True, **options)
    grads = []
    for pdl in (None, False):
        ds, dx = poisoned(torch.empty_like(residual)), poisoned(torch.empty_like(x))
        d_weight, d_bias = launch_backward(dy, d_residual_out, out.residual_out, out.rstd, weight, ds, dx, pdl=pdl,
                                           **backward_options)
        grads.append((ds, dx, d_weight, d_bias))
    for first, second in zip(*grads):
        assert torch.equal(first, second)

    torch.autograd.backward([y_ref, s_ref], [dy_std.double(), d_residual_out.double()])
    ds, dx, d_weight, d_bias = grads[0]
    assert_bf16_close(ds, ref[1].grad)
    assert_bf16_close(x_order.undo(dx) if ordered else dx, ref[0].grad)
    assert_bf16_close(d_weight, ref[2].grad, summed_rows=rows)
    assert_bf16_close(d_bias, ref[3].grad, summed_rows=rows)


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("rows", ROWS)
def test_autograd_bf16_residual_without_dropout(rows, hidden):
    """The Llama path (no bias, no dropout, bf16 residual) through autograd, y's gradient tile-ordered."""
    x, residual, weight, _, gen = inputs(rows, hidden, seed=7 * rows + hidden)
    grad_order = random_order(rows, hidden, gen)
    leaves = [t.clone().requires_grad_() for t in (x, residual, weight)]
    y, carried = fused_add_rmsnorm(*leaves, eps=1e-6, grad_order=grad_order)
    ref = [t.double().requires_grad_() for t in (x, residual, weight)]
    y_ref, s_ref = reference_add_rmsnorm(*ref, eps=1e-6)
    assert_bf16_close(carried, s_ref)
    assert_bf16_close(y, y_ref)

    dy = torch.randn(rows, hidden, device="cuda", generator=gen).bfloat16()
    d_carried = torch.randn(rows, hidden, device="cuda", generator=gen).bfloat16()
    torch.autograd.backward([y, carried], [grad_order.apply(dy).view(rows, hidden), d_carried])
    torch.autograd.backward([y_ref, s_ref], [dy.double(), d_carried.double()])
    assert_bf16_close(leaves[0].grad, ref[0].grad)
    assert_bf16_close(leaves[1].grad, ref[1].grad)
    assert_bf16_close(leaves[2].grad, ref[2].grad, summed_rows=rows)


@pytest.mark.parametrize("hidden", HIDDEN)
def test_per_group_launches_on_a_side_stream_match_one_launch(hidden):
    """Groups of rows normalized on a second stream behind per-group events equal one full launch."""
    rows, groups = 8192, 4
    x_std, residual, weight, _, gen = inputs(rows, hidden, seed=hidden)
    x_order = random_order(rows, hidden, gen)
    x = x_order.apply(x_std)
    full = empty_forward_outputs(x, residual, torch.bfloat16)
    launch_forward(x, residual, weight, None, full, eps=1e-5, x_order=x_order)

    grouped = ForwardOutputs(*(poisoned(t) for t in empty_forward_outputs(x, residual, torch.bfloat16)))
    side = torch.cuda.Stream()
    bounds = [rows * g // groups for g in range(groups + 1)]
    for lo, hi in zip(bounds, bounds[1:]):
        ready = torch.cuda.Event()
        ready.record()
        with torch.cuda.stream(side):
            side.wait_event(ready)
            launch_forward(x, residual, weight, None, grouped, eps=1e-5, x_order=x_order, row_lo=lo, row_hi=hi)
    torch.cuda.current_stream().wait_stream(side)
    for got, want in zip(grouped, full):
        assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------------
# x as the unsummed slots of a p2p reduce-scatter: the compiled kernels, one GPU (the slots written here
# stand in for the peers' stores; tests/gpu/test_layers_gpu.py runs the whole path at t = 2)
# ---------------------------------------------------------------------------------------------------

def stacked_slots(t, rows, hidden, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (3 * torch.randn(t, rows, hidden, device="cuda", generator=gen)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t, rows, hidden", [(2, 4096, 4096), (2, 4096, 8192), (4, 2048, 4096), (3, 37, 4104),
                                             (2, 1, 8)])
def test_sum_slots_compiled_is_bitwise_the_fp32_sum_rounded_once(dtype, t, rows, hidden):
    """The compiled kernel rounds to nearest even, as torch's fp32 -> bf16 / fp16 cast: bit for bit the
    reference (the interpreter truncates, so tests/kernels only checks within one ulp)."""
    from overlap_tp.kernels.sum_slots import SumSlots, reference_sum_slots
    slots = stacked_slots(t, rows, hidden, dtype, seed=t * rows + hidden)
    out = poisoned(torch.empty(rows, hidden, dtype=dtype, device="cuda"))
    op = SumSlots(t, rows * hidden)
    for _ in range(2):   # the first call compiles through the JIT, the second launches the kept kernel
        op(slots.view(t, -1), out)
        assert torch.equal(out, reference_sum_slots(slots))
        poisoned(out)


@pytest.mark.parametrize("t, rows, hidden", [(2, 4096, 4096), (2, 4096, 8192), (4, 1024, 8192), (2, 37, 4096)])
@pytest.mark.parametrize("residual_dtype, dropout_p", [(torch.bfloat16, 0.0), (torch.float32, 0.1)])
def test_x_slots_forward_is_bitwise_the_slot_sum_then_the_kernel(t, rows, hidden, residual_dtype, dropout_p):
    """launch_forward(x_slots=...) writes the bits of SumSlots followed by launch_forward on the sum (what
    linear_proj's p2p sum in the fused bda must equal), at training sizes, with bias, dropout and both
    residual dtypes."""
    from overlap_tp.kernels.sum_slots import SumSlots
    slots = stacked_slots(t, rows, hidden, torch.bfloat16, seed=rows + hidden + t)
    _, residual, weight, bias, _ = inputs(rows, hidden, seed=hidden + t, residual_dtype=residual_dtype)
    x = torch.empty(rows, hidden, dtype=torch.bfloat16, device="cuda")
    SumSlots(t, x.numel())(slots.view(t, -1), x)
    options = dict(eps=1e-5, dropout_p=dropout_p, seed=dropout_seed("cuda"))
    want = empty_forward_outputs(x, residual, residual_dtype)
    launch_forward(x, residual, weight, bias, want, **options)
    got = ForwardOutputs(*(poisoned(t_) for t_ in empty_forward_outputs(x, residual, residual_dtype)))
    launch_forward(poisoned(torch.empty_like(x)), residual, weight, bias, got, x_slots=slots, **options)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("rows, hidden", [(4096, 4096), (2048, 8192)])
def test_x_sum_through_autograd_is_bitwise_the_summed_input(rows, hidden):
    """fused_add_rmsnorm(x_sum=...) forward and every gradient equal the path fed with the summed x."""
    from overlap_tp.kernels.sum_slots import SumSlots
    slots = stacked_slots(2, rows, hidden, torch.bfloat16, seed=rows)
    _, residual, weight, bias, gen = inputs(rows, hidden, seed=hidden)
    x_summed = torch.empty(rows, hidden, dtype=torch.bfloat16, device="cuda")
    SumSlots(2, x_summed.numel())(slots.view(2, -1), x_summed)
    dy = torch.randn(rows, hidden, device="cuda", generator=gen).bfloat16()
    d_res = torch.randn(rows, hidden, device="cuda", generator=gen).bfloat16()

    def run(x, x_sum):
        leaves = [t.clone().requires_grad_() for t in (x, residual, weight, bias)]
        y, carried = fused_add_rmsnorm(*leaves, eps=1e-5, x_sum=x_sum)
        torch.autograd.backward([y, carried], [dy, d_res])
        return (y, carried) + tuple(leaf.grad for leaf in leaves)

    want = run(x_summed, None)
    deferred = FakeDeferredSum(slots)
    got = run(poisoned(torch.empty_like(x_summed)), deferred)
    assert deferred.calls == 1
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("t, rows, hidden", [(2, 4096, 4096), (2, 2048, 8192), (3, 1000, 4096), (4, 37, 4096),
                                             (8, 512, 4096)])
@pytest.mark.parametrize("fused", [True, False], ids=["fused_add_rmsnorm", "rmsnorm"])
def test_deferred_dgrad_slots_backward_is_bitwise_the_summed_gradient(t, rows, hidden, fused):
    """The norms' backward kernels with their output gradient left as slots (DeferredGrad, the compiled dy_slots
    path: round to nearest even) give every gradient of the path fed with SumSlots' sum, bit for bit."""
    from overlap_tp.kernels.fused_add_rmsnorm import accept_deferred_grad
    from overlap_tp.kernels.sum_slots import SumSlots
    from overlap_tp.megatron.norm import rmsnorm
    slots = stacked_slots(t, rows, hidden, torch.bfloat16, seed=rows + t)
    summed = torch.empty(rows, hidden, dtype=torch.bfloat16, device="cuda")
    SumSlots(t, summed.numel())(slots.view(t, -1), summed)
    x, residual, weight, bias, gen = inputs(rows, hidden, seed=hidden + t)
    d_res = torch.randn(rows, hidden, device="cuda", generator=gen).bfloat16()

    def run(defer):
        torch.manual_seed(3)
        leaves = [v.clone().requires_grad_() for v in (x, residual, weight, bias)]
        if fused:
            y, carried = fused_add_rmsnorm(*leaves, eps=1e-5, dropout_p=0.1)
        else:
            y, carried = rmsnorm(leaves[0], leaves[2], eps=1e-5), None
        link = accept_deferred_grad(y) if defer else None
        out = DeferringConsumer.apply(y, link, slots, summed)
        torch.autograd.backward([out] + ([carried] if fused else []),
                                [torch.zeros_like(out)] + ([d_res] if fused else []))
        return [leaf.grad for leaf in leaves if leaf.grad is not None]

    want, got = run(False), run(True)
    assert len(got) == len(want) == (4 if fused else 2)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
