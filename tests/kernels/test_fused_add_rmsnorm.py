"""Fused bias + dropout + residual add + RMSNorm (kernels/fused_add_rmsnorm.py, overlap_tp/megatron/norm.py) against
a float64 torch reference, in the Triton CPU interpreter (small shapes; tests/gpu/ has the real sizes)."""
import types

import pytest
import torch

from overlap_tp.kernels.fused_add_rmsnorm import (
    ForwardOutputs, FusedAddRMSNormFunction, TileOrder, _sum_partials_kernel, check_forward, dropout_keep_mask,
    dropout_seed, empty_forward_outputs, launch_forward, reference_add_rmsnorm)
from deferred_sums import DeferringConsumer, FakeDeferredSum
from overlap_tp.megatron.norm import OverlapRMSNorm, fused_add_rmsnorm, rmsnorm

# The interpreter turns the backward kernel's runtime loop bound (a 1-element array) into an int; numpy
# < 2.3 (pinned for that reason) warns about it.

TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def random_order(rows, cols, block_m, block_n, generator=None):
    tiles = (rows // block_m) * (cols // block_n)
    slot_of = torch.randperm(tiles, generator=generator).to(torch.int32).reshape(rows // block_m, cols // block_n)
    return TileOrder(block_m, block_n, slot_of)


def assert_close(actual, expected, dtype, summed_rows=1):
    """The dtype's tolerance; a column sum over `summed_rows` rows is ~sqrt(rows) large: atol grows with it."""
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol * summed_rows ** 0.5)


# ---------------------------------------------------------------------------------------------------
# TileOrder
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("block_m, block_n", [(16, 32), (8, 4), (1, 64), (32, 16)])
def test_tile_order_undo_follows_the_element_formula(block_m, block_n):
    rows, cols = 2 * block_m * 2, 3 * block_n
    order = random_order(rows, cols, block_m, block_n, torch.Generator().manual_seed(block_m * block_n))
    buf = torch.randn(rows * cols)
    standard = order.undo(buf)
    r = torch.arange(rows)[:, None]
    c = torch.arange(cols)[None, :]
    where = order.slot_of.long()[r // block_m, c // block_n] * block_m * block_n + (r % block_m) * block_n + c % block_n
    assert torch.equal(standard, buf[where])
    assert torch.equal(order.apply(standard), buf)
    assert order.shape == (rows, cols)


@pytest.mark.parametrize("block_m, block_n, slot_of, message", [
    (16, 32, torch.tensor([[0, 1], [1, 3]], dtype=torch.int32), "permutation"),
    (16, 32, torch.tensor([[0, 1], [2, 4]], dtype=torch.int32), "permutation"),
    (16, 32, torch.arange(4).reshape(2, 2), "int32"),
    (16, 32, torch.arange(4, dtype=torch.int32), "2-D"),
    (16, 32, torch.arange(4, dtype=torch.int32).reshape(2, 2).t(), "contiguous"),
    (16, 48, torch.arange(4, dtype=torch.int32).reshape(2, 2), "power of two"),
    (16, 2, torch.arange(4, dtype=torch.int32).reshape(2, 2), "power of two"),
    (0, 32, torch.arange(4, dtype=torch.int32).reshape(2, 2), "block_m"),
])
def test_tile_order_rejects_bad_maps(block_m, block_n, slot_of, message):
    with pytest.raises(ValueError, match=message):
        TileOrder(block_m, block_n, slot_of)


# ---------------------------------------------------------------------------------------------------
# Forward and backward against the float64 reference
# ---------------------------------------------------------------------------------------------------

# name: (x dtype, residual dtype, fp32_residual, bias, zero-centered gamma, dropout p, x order, grad order)
CASES = {
    "fp32": (torch.float32, torch.float32, False, False, False, 0.0, None, None),
    "fp32-bias-zero-centered-orders": (torch.float32, torch.float32, False, True, True, 0.0, (16, 32), (8, 64)),
    "bf16-fp32-residual-orders": (torch.bfloat16, torch.float32, True, True, False, 0.0, (8, 16), (16, 32)),
    "bf16-bf16-residual-x-order": (torch.bfloat16, torch.bfloat16, False, False, True, 0.0, (16, 128), None),
    "fp16-fp32-residual-in-fp16-out": (torch.float16, torch.float32, False, True, False, 0.0, None, (4, 4)),
    "bf16-dropout": (torch.bfloat16, torch.bfloat16, False, True, False, 0.25, None, None),
    "fp32-dropout-orders-fp32-residual": (torch.float32, torch.float32, True, True, True, 0.5, (16, 32), (16, 32)),
}


def make_inputs(x_dtype, residual_dtype, bias, x_order, shape=(16, 2, 128), seed=0):
    """residual [s, b, h]; x in the standard layout or as the tile-ordered flat buffer."""
    gen = torch.Generator().manual_seed(seed)
    hidden = shape[-1]
    residual = torch.randn(shape, generator=gen).to(residual_dtype)
    x_standard = torch.randn(shape, generator=gen).to(x_dtype)
    x = x_order.apply(x_standard.reshape(-1, hidden)) if x_order is not None else x_standard
    weight = (1 + 0.5 * torch.randn(hidden, generator=gen)).to(x_dtype)
    b = (0.5 * torch.randn(hidden, generator=gen)).to(x_dtype) if bias else None
    return x, residual, weight, b


# (16, 2, 128): 32 rows, 8 per backward program; (11, 2, 96): 22 rows, programs of 6, 6, 6 and 4 rows (the
# prefetch of the row after a program's last is masked off), 96 columns (masked within a block row).
@pytest.mark.parametrize("shape", [(16, 2, 128), (11, 2, 96)], ids=["even", "uneven"])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_gradients_match_float64_reference(case, shape):
    x_dtype, residual_dtype, fp32_residual, bias, zero_centered, p, x_blocks, grad_blocks = CASES[case]
    if shape[-1] == 96:  # tiles that divide 22 x 96
        x_blocks, grad_blocks = (x_blocks and (2, 32)), (grad_blocks and (2, 32))
    rows, hidden = shape[0] * shape[1], shape[-1]
    x_order = random_order(rows, hidden, *x_blocks) if x_blocks else None
    grad_order = random_order(rows, hidden, *grad_blocks) if grad_blocks else None
    inputs = make_inputs(x_dtype, residual_dtype, bias, x_order, shape)
    leaves = [None if t is None else t.clone().requires_grad_() for t in inputs]
    x, residual, weight, b = leaves

    torch.manual_seed(1234)
    y, carried = fused_add_rmsnorm(x, residual, weight, b, eps=1e-5, zero_centered_gamma=zero_centered,
                                   dropout_p=p, fp32_residual=fp32_residual, x_order=x_order, grad_order=grad_order)
    torch.manual_seed(1234)
    keep = dropout_keep_mask(dropout_seed("cpu"), rows, hidden, p) if p else None

    ref_leaves = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    y_ref, carried_ref = reference_add_rmsnorm(*ref_leaves, eps=1e-5, zero_centered_gamma=zero_centered, keep=keep,
                                               dropout_p=p, x_order=x_order)
    assert y.dtype == x_dtype and y.shape == shape
    assert carried.dtype == (torch.float32 if fp32_residual else x_dtype) and carried.shape == shape
    assert_close(carried, carried_ref, x_dtype)
    assert_close(y, y_ref, x_dtype)

    gen = torch.Generator().manual_seed(7)
    dy_standard = torch.randn(shape, generator=gen).to(x_dtype)
    d_carried = torch.randn(shape, generator=gen).to(carried.dtype)
    dy = grad_order.apply(dy_standard.reshape(rows, hidden)).view(shape) if grad_order else dy_standard
    torch.autograd.backward([y, carried], [dy, d_carried])
    torch.autograd.backward([y_ref, carried_ref], [dy_standard.double(), d_carried.double()])
    for name, leaf, ref in zip(("x", "residual", "weight", "bias"), leaves, ref_leaves):
        if leaf is None:
            continue
        assert leaf.grad.dtype == leaf.dtype and leaf.grad.shape == leaf.shape, name
        assert_close(leaf.grad, ref.grad, x_dtype, summed_rows=1 if name in ("x", "residual") else rows)


def test_dropout_mask_is_reproducible_has_rate_p_and_ignores_the_layout():
    rows, hidden, p = 64, 64, 0.3
    torch.manual_seed(5)
    keep = dropout_keep_mask(dropout_seed("cpu"), rows, hidden, p)
    torch.manual_seed(5)
    assert torch.equal(keep, dropout_keep_mask(dropout_seed("cpu"), rows, hidden, p))
    assert abs((~keep).float().mean().item() - p) < 0.03
    assert not torch.equal(keep, dropout_keep_mask(dropout_seed("cpu"), rows, hidden, p))
    assert not torch.equal(keep[0], keep[1])

    # The mask is a function of (seed, row, column): the same with the input tile-ordered (another tile width).
    x_order = random_order(rows, hidden, 16, 4)
    x, residual, weight, _ = make_inputs(torch.float32, torch.float32, False, None, (rows, hidden))
    outs = []
    for order, x_in in ((None, x), (x_order, x_order.apply(x))):
        torch.manual_seed(9)
        outs.append(fused_add_rmsnorm(x_in, residual, weight, dropout_p=p, x_order=order)[1])
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], x + residual)


def test_row_ranges_write_exactly_their_rows_and_compose_to_the_full_launch():
    rows, hidden, p = 32, 128, 0.1
    x_order = random_order(rows, hidden, 8, 32)
    x, residual, weight, b = make_inputs(torch.bfloat16, torch.float32, True, x_order, (rows, hidden))
    seed = dropout_seed("cpu")
    options = dict(eps=1e-6, zero_centered_gamma=True, dropout_p=p, seed=seed, x_order=x_order)

    def poisoned():
        out = empty_forward_outputs(x, residual, torch.float32)
        return ForwardOutputs(*(t.fill_(float("nan")) for t in out))

    full = poisoned()
    launch_forward(x, residual, weight, b, full, **options)
    grouped = poisoned()
    for lo, hi in ((0, 8), (8, 24)):
        launch_forward(x, residual, weight, b, grouped, row_lo=lo, row_hi=hi, **options)
        assert grouped.rstd[:hi].isfinite().all() and grouped.rstd[hi:].isnan().all()
        assert grouped.y[hi:].isnan().all() and grouped.residual_out[hi:].isnan().all()
    launch_forward(x, residual, weight, b, grouped, row_lo=24, row_hi=rows, **options)
    for got, want in zip(grouped, full):
        assert torch.equal(got, want)
    assert full.y.isfinite().all()


def test_post_layernorm_residual_and_unused_outputs_backpropagate():
    shape = (8, 2, 64)
    x, residual, weight, b = make_inputs(torch.float32, torch.float32, True, None, shape)
    gen = torch.Generator().manual_seed(3)
    dy, d_carried = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    ref = [t.double().requires_grad_() for t in (x, residual, weight, b)]
    y_ref, _ = reference_add_rmsnorm(*ref)
    torch.autograd.backward([y_ref], [dy.double() + d_carried.double()])

    leaves = [t.clone().requires_grad_() for t in (x, residual, weight, b)]
    y, carried = fused_add_rmsnorm(*leaves, residual_post_norm=True)
    assert carried is y
    torch.autograd.backward([y, carried], [dy, d_carried])
    for leaf, r in zip(leaves, ref):
        assert_close(leaf.grad, r.grad, torch.float32)

    # Only the residual used (no gradient reaches the normalized output): dx = d_residual = d_carried.
    leaves = [t.clone().requires_grad_() for t in (x, residual, weight, b)]
    _, carried = fused_add_rmsnorm(*leaves)
    carried.backward(d_carried)
    assert torch.equal(leaves[0].grad, d_carried) and torch.equal(leaves[1].grad, d_carried)
    assert torch.equal(leaves[2].grad, torch.zeros_like(weight))


# ---------------------------------------------------------------------------------------------------
# Module
# ---------------------------------------------------------------------------------------------------

def megatron_config(**overrides):
    options = dict(normalization="RMSNorm", layernorm_zero_centered_gamma=False, sequence_parallel=True,
                   hidden_dropout=0.0, fp32_residual_connection=False,
                   apply_residual_connection_post_layernorm=False, params_dtype=torch.float32)
    options.update(overrides)
    return types.SimpleNamespace(**options)


@pytest.mark.parametrize("zero_centered", [False, True])
def test_module_plain_norm_matches_reference(zero_centered):
    norm = OverlapRMSNorm(megatron_config(layernorm_zero_centered_gamma=zero_centered), 96, eps=1e-6)
    assert norm.weight.sequence_parallel is True
    assert torch.equal(norm.weight, torch.full((96,), 0.0 if zero_centered else 1.0))
    with torch.no_grad():
        norm.weight.add_(0.3 * torch.randn(96))
    x = torch.randn(6, 3, 96, requires_grad=True)
    y = norm(x)
    x_ref, w_ref = x.detach().double().requires_grad_(), norm.weight.detach().double().requires_grad_()
    y_ref, _ = reference_add_rmsnorm(x_ref, None, w_ref, eps=1e-6, zero_centered_gamma=zero_centered)
    assert_close(y, y_ref, torch.float32)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy.double())
    assert_close(x.grad, x_ref.grad, torch.float32)
    assert_close(norm.weight.grad, w_ref.grad, torch.float32)
    assert_close(rmsnorm(x.detach(), norm.weight.detach(), eps=1e-6, zero_centered_gamma=zero_centered),
                 y_ref, torch.float32)


def test_module_fused_path_follows_megatron_options():
    config = megatron_config(hidden_dropout=0.5, fp32_residual_connection=True)
    norm = OverlapRMSNorm(config, 64).to(torch.bfloat16)
    x, residual, _, b = make_inputs(torch.bfloat16, torch.float32, True, None, (8, 2, 64))
    norm.eval()
    y_eval, carried_eval = norm.add_and_norm(x, residual, b)
    assert carried_eval.dtype == torch.float32
    y_ref, carried_ref = reference_add_rmsnorm(x, residual, norm.weight.detach(), b)
    assert_close(carried_eval, carried_ref, torch.bfloat16)
    assert_close(y_eval, y_ref, torch.bfloat16)

    norm.train()
    torch.manual_seed(0)
    y_train, carried_train = norm.add_and_norm(x, residual, b)
    torch.manual_seed(0)
    keep = dropout_keep_mask(dropout_seed("cpu"), 16, 64, 0.5)
    _, carried_ref = reference_add_rmsnorm(x, residual, norm.weight.detach(), b, keep=keep, dropout_p=0.5)
    assert_close(carried_train, carried_ref, torch.bfloat16)
    assert not torch.equal(carried_train, carried_eval)

    post_norm = OverlapRMSNorm(megatron_config(apply_residual_connection_post_layernorm=True), 64)
    y, carried = post_norm.add_and_norm(x.float(), residual)
    assert carried is y


def test_module_refuses_layernorm():
    with pytest.raises(ValueError, match="RMSNorm"):
        OverlapRMSNorm(megatron_config(normalization="LayerNorm"), 64)


# ---------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------

def _bad_inputs():
    rows, hidden = 32, 64
    x, residual, weight, b = make_inputs(torch.float32, torch.float32, True, None, (rows, hidden))
    order = random_order(rows, hidden, 16, 32)
    return {
        "shape": (dict(x=x[:16], residual=residual, weight=weight), "does not match"),
        "hidden": (dict(x=x[:, :32].contiguous(), residual=residual[:, :32].contiguous(), weight=weight),
                   "hidden size"),
        "weight-2d": (dict(x=x, residual=residual, weight=weight.view(8, 8)), "1-D"),
        "int-x": (dict(x=x.int(), residual=residual, weight=weight), "dtype"),
        "residual-dtype": (dict(x=x.bfloat16(), residual=residual, weight=weight.bfloat16(),
                                residual_dtype=torch.float16),
                           "residual_dtype"),
        "non-contiguous": (dict(x=x.t().contiguous().t(), residual=residual, weight=weight), "contiguous"),
        "device": (dict(x=x, residual=residual.to("meta"), weight=weight), "meta"),
        "bias-shape": (dict(x=x, residual=residual, weight=weight, bias=b[:32]), "bias"),
        "dropout": (dict(x=x, residual=residual, weight=weight, dropout_p=1.5), "dropout"),
        "order-shape": (dict(x=x, residual=residual, weight=weight, x_order=random_order(16, hidden, 16, 32)),
                        "x_order describes a 16 x 64"),
        "order-type": (dict(x=x, residual=residual, weight=weight, x_order=order.slot_of), "TileOrder"),
        "grad-order": (dict(x=x, residual=residual, weight=weight, grad_order=random_order(16, hidden, 16, 32)),
                       "grad_order"),
        "plain-with-bias": (dict(x=x, residual=None, weight=weight, bias=b), "need a residual"),
    }


@pytest.mark.parametrize("name", list(_bad_inputs()))
def test_bad_inputs_raise_value_error(name):
    kwargs, message = _bad_inputs()[name]
    args = dict(x=None, residual=None, weight=None, bias=None, eps=1e-5, zero_centered_gamma=False, dropout_p=0.0,
                residual_dtype=torch.float32, x_order=None, grad_order=None)  # the Function's argument order
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        if args["residual"] is None:
            check_forward(args["x"], None, args["weight"], args["bias"])
        else:
            FusedAddRMSNormFunction.apply(*args.values())


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        rmsnorm(torch.randn(4, 8), torch.ones(8))


def test_partial_rows_are_summed_in_blocks_with_masked_edges():
    """The backward's second kernel: [K, programs, N] partial rows summed over programs, here in blocks of 2 of
    5 programs (the last block half masked) and 32-column strips of 40 columns (the last one masked)."""
    partials = torch.randn(2, 5, 40, generator=torch.Generator().manual_seed(2))
    sums = torch.full((2, 40), float("nan"))
    _sum_partials_kernel[(2, 2)](partials, sums, 5, 40, BLOCK_P=2, BLOCK_N=32, PDL=False)
    torch.testing.assert_close(sums, partials.double().sum(1).float(), rtol=1e-6, atol=1e-6)


def test_zero_rows_give_empty_outputs_and_zero_weight_grad():
    """An empty sequence: no kernel reads a row (the backward's first-row load would be out of bounds)."""
    x, residual = (torch.randn(0, 2, 64).requires_grad_() for _ in range(2))
    weight = torch.ones(64, requires_grad=True)
    y, carried = fused_add_rmsnorm(x, residual, weight, None, eps=1e-5)
    assert y.shape == carried.shape == (0, 2, 64)
    (y.sum() + carried.sum()).backward()
    assert x.grad.shape == residual.grad.shape == (0, 2, 64)
    assert torch.equal(weight.grad, torch.zeros(64))


# ---------------------------------------------------------------------------------------------------
# x as the unsummed slots of a p2p reduce-scatter (x_slots / x_sum)
# ---------------------------------------------------------------------------------------------------

def _slots(t, shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn((t,) + shape, generator=gen) * 2).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, shape", [(2, (16, 2, 128)), (3, (11, 2, 96)), (1, (4, 1, 64))])
def test_the_kernel_sums_slots_like_the_slot_sum_then_the_norm(dtype, t, shape):
    """launch_forward(x_slots=...) gives the bits of kernels/sum_slots.py's sum followed by the norm on it (the
    same rounding of the sum to x's dtype, in whatever mode the kernels run), with bias and dropout."""
    from overlap_tp.kernels.sum_slots import SumSlots
    slots = _slots(t, shape, dtype, seed=t * 7 + shape[0])
    _, residual, weight, b = make_inputs(dtype, torch.float32, True, None, shape)
    x = torch.empty(shape, dtype=dtype)
    SumSlots(t, x.numel())(slots.view(t, -1), x)
    options = dict(eps=1e-6, dropout_p=0.1, seed=dropout_seed("cpu"))
    want = empty_forward_outputs(x, residual, torch.float32)
    launch_forward(x, residual, weight, b, want, **options)
    got = empty_forward_outputs(x, residual, torch.float32)
    placeholder = torch.full(shape, float("nan"), dtype=dtype)   # never read
    launch_forward(placeholder, residual, weight, b, got, x_slots=slots, **options)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_x_sum_runs_the_kernel_through_its_consumer_and_backpropagates_to_x():
    shape, t = (8, 2, 64), 2
    from overlap_tp.kernels.sum_slots import SumSlots
    slots = _slots(t, shape, torch.bfloat16, seed=5)
    x_summed = torch.empty(shape, dtype=torch.bfloat16)   # rounded as the fused kernel rounds it, in either mode
    SumSlots(t, x_summed.numel())(slots.view(t, -1), x_summed)
    _, residual, weight, b = make_inputs(torch.bfloat16, torch.bfloat16, True, None, shape)
    gen = torch.Generator().manual_seed(9)
    dy = torch.randn(shape, generator=gen).to(torch.bfloat16)
    d_res = torch.randn(shape, generator=gen).to(torch.bfloat16)

    def run(x, x_sum):
        leaves = [x.clone().requires_grad_(), residual.clone().requires_grad_(), weight.clone().requires_grad_(),
                  b.clone().requires_grad_()]
        y, carried = fused_add_rmsnorm(*leaves, x_sum=x_sum)
        torch.autograd.backward([y, carried], [dy, d_res])
        return (y, carried) + tuple(leaf.grad for leaf in leaves)

    want = run(x_summed, None)
    deferred = FakeDeferredSum(slots)
    got = run(torch.full(shape, float("nan"), dtype=torch.bfloat16), deferred)
    assert deferred.calls == 1
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_x_sum_refuses_bad_slots_and_an_x_order():
    shape = (4, 1, 64)
    x = torch.zeros(shape, dtype=torch.bfloat16)
    _, residual, weight, _ = make_inputs(torch.bfloat16, torch.bfloat16, False, None, shape)
    with pytest.raises(ValueError, match="not a contiguous stack"):
        fused_add_rmsnorm(x, residual, weight, x_sum=FakeDeferredSum(torch.zeros(2, 3, 64, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match="not a contiguous stack"):
        fused_add_rmsnorm(x, residual, weight, x_sum=FakeDeferredSum(torch.zeros(2, 4, 64, dtype=torch.float16)))
    with pytest.raises(ValueError, match="no x_order"):
        order = random_order(4, 64, 2, 32)
        fused_add_rmsnorm(x.view(4, 64), residual.view(4, 64), weight, x_order=order,
                          x_sum=FakeDeferredSum(torch.zeros(2, 4, 64, dtype=torch.bfloat16)))


# ---------------------------------------------------------------------------------------------------
# dy as the unsummed slots of the next layer's p2p dgrad reduce-scatter (dy_slots / DeferredGrad)
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, shape", [(2, (16, 2, 128)), (3, (11, 2, 96)), (4, (6, 2, 64)), (1, (4, 1, 64)),
                                      (5, (3, 1, 64))])   # t = 2-4: each slot prefetched; 1 and 5: summed at once
@pytest.mark.parametrize("fused", [True, False], ids=["fused_add_rmsnorm", "rmsnorm"])
def test_the_backward_kernel_sums_the_deferred_dgrad_slots_like_the_slot_sum(dtype, t, shape, fused):
    """The norm's backward with its output's gradient left as slots (the consumer's DeferredGrad) gives the bits of
    kernels/sum_slots.py's sum followed by the backward on it: every input and parameter gradient, bias and dropout."""
    from overlap_tp.kernels.fused_add_rmsnorm import accept_deferred_grad
    from overlap_tp.kernels.sum_slots import SumSlots
    slots = _slots(t, shape, dtype, seed=t * 5 + shape[0])
    summed = torch.empty(shape, dtype=dtype)
    SumSlots(t, summed.numel())(slots.view(t, -1), summed)
    x, residual, weight, b = make_inputs(dtype, dtype, True, None, shape)
    d_res = _slots(1, shape, dtype, seed=3)[0]

    def run(defer):
        torch.manual_seed(1)
        leaves = [x.clone().requires_grad_(), residual.clone().requires_grad_(), weight.clone().requires_grad_(),
                  b.clone().requires_grad_()]
        if fused:
            y, carried = fused_add_rmsnorm(*leaves, dropout_p=0.1)
        else:
            y, carried = rmsnorm(leaves[0], leaves[2]), None
        link = accept_deferred_grad(y) if defer else None
        assert (link is not None) == defer
        out = DeferringConsumer.apply(y, link, slots, summed)
        torch.autograd.backward([out] + ([carried] if fused else []), [torch.zeros_like(out)] + ([d_res] if fused else []))
        return [leaf.grad for leaf in leaves if leaf.grad is not None]

    want, got = run(False), run(True)
    assert len(got) == len(want) == (4 if fused else 2)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_a_deferred_dgrad_that_meets_a_second_consumer_is_an_error_not_a_read():
    """y feeding the deferring linear and something else: autograd adds the two gradients into a new tensor, so the
    norm's backward finds another tensor than the placeholder and refuses it. A second linear asking for the link
    gets none, and the first then sums (shared)."""
    from overlap_tp.kernels.fused_add_rmsnorm import accept_deferred_grad
    shape = (4, 1, 64)
    x, _, weight, _ = make_inputs(torch.float32, torch.float32, False, None, shape)
    slots = _slots(2, shape, torch.float32, seed=2)
    for second_first in (False, True):   # either gradient may reach the norm first (the other is added to it)
        y = rmsnorm(x.clone().requires_grad_(), weight)
        link = accept_deferred_grad(y)
        out = DeferringConsumer.apply(y, link, slots, slots.sum(0))
        other = (y * 3).exp()   # a dense gradient of y's shape
        with pytest.raises(RuntimeError, match="another tensor"):
            torch.autograd.backward([other, out] if second_first else [out, other],
                                    [torch.ones_like(other), torch.ones_like(out)])
    y = rmsnorm(x.clone().requires_grad_(), weight)
    first, second = accept_deferred_grad(y), accept_deferred_grad(y)
    assert first is not None and second is None and first.shared
    assert accept_deferred_grad(x) is None   # not a norm's output


@pytest.mark.parametrize("shape", [(8, 2, 64), (5, 1, 96)])
def test_y_out_takes_the_normalized_rows_in_place(shape):
    """y_out (a column-parallel layer's region of its own gathered buffer): the normalized rows land there, bit for
    bit what a new tensor gets, nothing else of the buffer is written, and the gradients are unchanged; plain and
    fused norms alike."""
    _, residual, weight, b = make_inputs(torch.bfloat16, torch.bfloat16, True, None, shape)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(shape, generator=gen).to(torch.bfloat16)
    dy = torch.randn(shape, generator=gen).to(torch.bfloat16)
    rows = shape[0] * shape[1]

    def run(norm, into):
        leaves = [x.clone().requires_grad_(), residual.clone().requires_grad_(), weight.clone().requires_grad_(),
                  b.clone().requires_grad_()]
        buffer = torch.full((3 * rows, shape[-1]), float("nan"), dtype=torch.bfloat16)
        region = buffer.narrow(0, rows, rows).view(shape) if into else None
        if norm == "fused":
            y, _ = fused_add_rmsnorm(*leaves, y_out=region)
            used = leaves
        else:
            y = rmsnorm(leaves[0], leaves[2], y_out=region)
            used = [leaves[0], leaves[2]]
        y.backward(dy)
        if into:
            assert y.data_ptr() == region.data_ptr()
            assert buffer[:rows].isnan().all() and buffer[2 * rows:].isnan().all()   # only the region written
        return (y.detach().clone(),) + tuple(leaf.grad for leaf in used)

    for norm in ("fused", "plain"):
        for got, want in zip(run(norm, True), run(norm, False)):
            assert torch.equal(got, want), norm


def test_y_out_of_the_wrong_shape_dtype_or_layout_is_refused():
    shape = (4, 2, 64)
    x, residual, weight, _ = make_inputs(torch.bfloat16, torch.bfloat16, False, None, shape)
    for bad in (torch.empty(4, 64, dtype=torch.bfloat16), torch.empty(shape, dtype=torch.float32),
                torch.empty(2, 4, 64, dtype=torch.bfloat16).transpose(0, 1)):
        with pytest.raises(ValueError, match="y_out must be"):
            fused_add_rmsnorm(x, residual, weight, y_out=bad)
        with pytest.raises(ValueError, match="y_out must be"):
            rmsnorm(x, weight, y_out=bad)
