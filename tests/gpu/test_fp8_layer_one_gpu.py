"""The FP8 linears (overlap_tp.megatron.fp8_linear) at t = 2 on ONE GPU over the p2p transport (two processes sharing
it, as test_p2p_one_gpu.py): an MLP's column- and row-parallel pair (fc1 -> fc2, sequence parallel), both recipes
(tensorwise, blockwise) and both formats (e4m3, hybrid), with method signal on p2p; the weight gradients in bf16
under e4m3 and in FP8 (OverlapSettings.fp8_wgrad) under hybrid:
- forward, input gradient and weight gradients against the float64 reference of the same FP8 operands (the reference
  quantizers, bit-equal to the kernels; each rank's shard with its own scales; the wgrad's operands quantized along
  the tokens), relative error below 2**-7 (the kernels' fp32 accumulation order and the bf16 rounding of outputs and
  partial sums);
- against the bf16 layers on the same weights and inputs: the FP8 rounding of operands, relative error below 2**-3
  for e4m3 operands (3 mantissa bits: 2**-4 relative per element, partly averaged over K) and 2**-2 for e5m2 gradients;
- the pair captured forward + backward in one CUDA graph and replayed with fresh inputs, bit for bit the eager step,
  one rank late before some replays; with the weights changed in place between replays (the graph quantizes them
  inside, so a replay reads the current weights).
- two linked TransformerLayers in FP8: the norms writing the FP8 rows that linear_qkv and linear_fc1 read (norm.py)
  give bit for bit what the linears quantizing their inputs give, eager and replayed.
Run: `pytest -m gpu tests/gpu/test_fp8_layer_one_gpu.py` (about a minute)."""
import functools
import os

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from gpu_checks import replays_equal_eager
from overlap_tp import OverlapConfig

pytestmark = pytest.mark.gpu

T = 2
H, FFN, ROWS = 1024, 2048, 2048   # ROWS: the gathered tokens (seq x batch)
P2P = OverlapConfig(method="signal", transport="p2p", comm_sms=0)


def _on_one_gpu(rank, world, check):
    from peers_on_one_gpu import install
    os.environ.setdefault("OVERLAP_TP_WATCHDOG_S", "120")
    torch.cuda.set_device(0)
    install()
    check(rank, world)


def _dq(x, fmt, scaling):
    from overlap_tp.kernels import fp8_quant as Q
    reference = {"tensorwise": Q.quantize_tensorwise_reference, "1x128": Q.quantize_1x128_reference,
                 "128x128": Q.quantize_128x128_reference}[scaling]
    return Q.dequantize_reference(reference(x, fmt))


def _dq_t(x, fmt, scaling):
    """x.T quantized along x's rows (the wgrad's K-major operand), dequantized in float64."""
    return _dq(x.t().contiguous(), fmt, scaling)


def _rel(got, ref):
    return float((got.double() - ref.double()).norm() / ref.double().norm())


def _pair(world, fmt, recipe, settings):
    """fc1 (column, H -> FFN) and fc2 (row, FFN -> H) of one TransformerConfig (fp8 = fmt / recipe, or bf16 where
    fmt is None), on the GPU, from one seed: the same weights whatever the format."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig
    from overlap_tp.megatron.layers import OverlapColumnParallelLinear, OverlapRowParallelLinear
    extra = {"fp8": fmt, "fp8_recipe": recipe} if fmt else {}
    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=8, params_dtype=torch.bfloat16,
                               bf16=True, tensor_model_parallel_size=world, sequence_parallel=True, **extra)
    torch.manual_seed(5)
    model_parallel_cuda_manual_seed(5)
    init = lambda w: torch.nn.init.normal_(w, std=0.02)   # noqa: E731
    fc1 = OverlapColumnParallelLinear(H, FFN, config=config, init_method=init, bias=False, gather_output=False,
                                      settings=settings)
    fc2 = OverlapRowParallelLinear(FFN, H, config=config, init_method=init, bias=False, input_is_parallel=True,
                                   skip_bias_add=False, settings=settings)
    return fc1.cuda(), fc2.cuda()


def _step(fc1, fc2, x, g):
    """fc2(fc1(x)) and its backward with g: [output, fc1's input (saved), fc1's output, x grad, fc1 wgrad, fc2 wgrad,
    fc2's input grad]."""
    for p in (fc1.weight, fc2.weight):
        p.grad = None
    xi = x.clone().requires_grad_(True)
    h, _ = fc1(xi)
    h.retain_grad()
    out, _ = fc2(h)
    out.backward(g)
    # detached: a kept output would keep its autograd graph, whose parameters' AccumulateGrad nodes remember this
    # eager step's stream, and a later captured backward would sync with it
    return [out.detach(), h.detach(), xi.grad, fc1.weight.grad, fc2.weight.grad, h.grad]


def _check_pair(rank, world, fmt, recipe):
    import warnings
    from megatron.core import parallel_state as ps
    from overlap_tp.megatron.fp8_linear import Fp8Recipe
    from overlap_tp.megatron.settings import OverlapSettings
    warnings.filterwarnings("ignore")
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    group = ps.get_tensor_model_parallel_group()
    fp8_wgrad = fmt == "hybrid"
    settings = OverlapSettings(fp8_wgrad=fp8_wgrad).with_configs(P2P)
    fp8 = Fp8Recipe(fmt, recipe, fp8_wgrad)
    act, wsc, gfmt = fp8.row_scaling, "128x128" if recipe == "blockwise" else "tensorwise", fp8.grad_format
    fc1, fc2 = _pair(world, fmt, recipe, settings)
    b1, b2 = _pair(world, None, None, settings)
    assert torch.equal(fc1.weight, b1.weight) and torch.equal(fc2.weight, b2.weight)
    m = ROWS // world

    def gathered(x):
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return parts

    gen = torch.Generator(device="cuda").manual_seed(40 + rank)
    for call in range(3):   # fresh data each call
        x = torch.randn(m, 1, H, device="cuda", dtype=torch.bfloat16, generator=gen)
        g = torch.randn(m, 1, H, device="cuda", dtype=torch.bfloat16, generator=gen)
        out, h, dx, dw1, dw2, dh = _step(fc1, fc2, x, g)
        what = f"{fmt} {recipe} call {call} rank {rank}"
        # reference of the same FP8 operands (float64)
        xs, w1s, w2s = gathered(x.view(m, H)), gathered(fc1.weight.detach()), gathered(fc2.weight.detach())
        x8 = torch.cat([_dq(s, "e4m3", act) for s in xs])
        h_ref = x8 @ _dq(fc1.weight.detach(), "e4m3", wsc).t()
        assert _rel(h.view(ROWS, -1), h_ref) < 2 ** -7, (what, "fc1 out")
        hs = gathered(h.view(ROWS, -1))
        z_ref = sum(_dq(hs[r], "e4m3", act) @ _dq(w2s[r], "e4m3", wsc).t() for r in range(world))
        assert _rel(out.view(m, H), z_ref[rank * m:(rank + 1) * m]) < 2 ** -7, (what, "fc2 out")
        gs = gathered(g.view(m, H))
        g8 = torch.cat([_dq(s, gfmt, act) for s in gs])
        assert _rel(dh.view(ROWS, -1), g8 @ _dq(fc2.weight.detach(), "e4m3", wsc)) < 2 ** -7, (what, "fc2 dgrad")
        wfmt, hh = fp8.wgrad_grad_format, h.view(ROWS, -1)
        dw2_ref = (_dq_t(g8.to(torch.bfloat16), wfmt, act) @ _dq_t(hh, "e4m3", act).t() if fp8_wgrad
                   else g8.to(torch.bfloat16).double().t() @ hh.double())
        assert _rel(dw2, dw2_ref) < 2 ** -7, (what, "fc2 wgrad")
        dhs = gathered(dh.view(ROWS, -1))
        dx_ref = sum(_dq(dhs[r], gfmt, act) @ _dq(w1s[r], "e4m3", wsc) for r in range(world))
        assert _rel(dx.view(m, H), dx_ref[rank * m:(rank + 1) * m]) < 2 ** -7, (what, "fc1 dgrad")
        dd, xx = dh.view(ROWS, -1), torch.cat(xs)
        dw1_ref = (_dq_t(dd, wfmt, act) @ _dq_t(xx, "e4m3", act).t() if fp8_wgrad
                   else dd.double().t() @ xx.double())
        assert _rel(dw1, dw1_ref) < 2 ** -7, (what, "fc1 wgrad")
        # against the bf16 layers: the FP8 rounding only
        bf = _step(b1, b2, x, g)
        loose = 2 ** -3 if gfmt == "e4m3" else 2 ** -2
        assert _rel(out, bf[0]) < 2 ** -3, (what, "out vs bf16", _rel(out, bf[0]))
        for j, name in ((2, "x grad"), (3, "fc1 wgrad"), (4, "fc2 wgrad")):
            assert _rel([out, h, dx, dw1, dw2][j], bf[j]) < loose, (what, name + " vs bf16")

    # captured forward + backward, replayed with fresh inputs and changed weights: bit for bit the eager step
    steps = [(torch.randn(m, 1, H, device="cuda", dtype=torch.bfloat16, generator=gen),
              torch.randn(m, 1, H, device="cuda", dtype=torch.bfloat16, generator=gen)) for _ in range(3)]
    weights = [(fc1.weight.detach().clone() * (1 + 0.1 * i), fc2.weight.detach().clone() * (1 - 0.1 * i))
               for i in range(3)]

    def load(i):
        with torch.no_grad():
            fc1.weight.copy_(weights[i][0])
            fc2.weight.copy_(weights[i][1])

    replays_equal_eager(lambda x, g: _step(fc1, fc2, x, g), steps, rank, replays=6, before=load, late=True,
                        what=f"{fmt} {recipe} ")
    ps.destroy_model_parallel()


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_fp8_mlp_pair_on_the_p2p_transport_at_t2_on_one_gpu(fmt, recipe):
    run_distributed(T, _on_one_gpu, functools.partial(_check_pair, fmt=fmt, recipe=recipe), backend="gloo")


def _check_norms_fp8(rank, world, fmt, recipe):
    """Two linked overlap TransformerLayers in FP8 (test_layers_gpu.py's small Llama-like layer, p2p signal,
    deterministic attention): with the norms writing the FP8 rows linear_qkv and linear_fc1 read (norm.py's
    fp8_output, the default) against the same pair with it off (each linear quantizing its input): outputs, input
    grad and every parameter grad bit for bit over fresh steps; then the pair captured forward + backward and
    replayed, bit for bit its eager steps."""
    import test_layers_gpu as L
    from megatron.core.transformer.transformer_config import TransformerConfig
    L._quiet()
    L._deterministic()
    ps = L._setup(world, "cuda")
    dims = L.LAYER_SIZES["small"]
    config = TransformerConfig(num_layers=2, hidden_size=dims["hidden"], num_attention_heads=dims["heads"],
                               num_query_groups=dims["groups"], ffn_hidden_size=dims["ffn"],
                               params_dtype=torch.bfloat16, bf16=True, normalization="RMSNorm",
                               tensor_model_parallel_size=world, sequence_parallel=True, hidden_dropout=0.0,
                               attention_dropout=0.0, add_bias_linear=False, gated_linear_unit=True,
                               init_method_std=0.02, deterministic_mode=True, fp8=fmt, fp8_recipe=recipe)
    configs = L._p2p_configs("signal")
    fused, unfused = L._linked_pair(config, configs, 78), L._linked_pair(config, configs, 78)
    for layer in unfused:
        assert layer.input_layernorm.fp8_output is not None and layer.pre_mlp_layernorm.fp8_output is not None
        layer.input_layernorm.fp8_output = layer.pre_mlp_layernorm.fp8_output = None

    def step(pair, x, g):
        return [t.detach() for t in L._fwd_bwd(pair, x, g)]

    steps = list(L._fresh_steps(6 + rank, 4096 // world, dims["hidden"], 3))
    for i, (x, g) in enumerate(steps):
        for j, (a, b) in enumerate(zip(step(fused, x, g), step(unfused, x, g))):
            assert torch.isfinite(a.float()).all() and torch.equal(a, b), \
                f"{fmt} {recipe} step {i} rank {rank}: tensor {j} differs from the linears quantizing themselves"
    replays_equal_eager(lambda x, g: step(fused, x, g), steps, rank, replays=4, what=f"{fmt} {recipe} ")
    ps.destroy_model_parallel()


@pytest.mark.parametrize("fmt, recipe", [("e4m3", "tensorwise"), ("hybrid", "blockwise")])
def test_norms_write_the_fp8_rows_of_qkv_and_fc1_at_t2_on_one_gpu(fmt, recipe):
    run_distributed(T, _on_one_gpu, functools.partial(_check_norms_fp8, fmt=fmt, recipe=recipe), backend="gloo")
