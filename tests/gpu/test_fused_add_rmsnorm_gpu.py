"""Fused bias + dropout + residual add + RMSNorm on the GPU at training sizes (bf16), against float64.

Run: `pytest -m gpu tests/gpu/test_fused_add_rmsnorm_gpu.py` on one GPU."""
import pytest
import torch

from overlap_tp.kernels.fused_add_rmsnorm import (
    ForwardOutputs, TileOrder, dropout_keep_mask, dropout_seed, empty_forward_outputs, launch_backward,
    launch_forward, reference_add_rmsnorm)
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
