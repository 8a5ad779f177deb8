"""The FP8 linears (overlap_tp.megatron.fp8_linear) under gloo, 2 CPU processes, sequence parallel: forward, input
gradient and weight gradient of the column- and row-parallel layers against a float64 reference built from the
reference quantizers (kernels/fp8_quant.py, bit-equal to the kernels): the same FP8 operands, each rank's shard with
its own scales, dequantized and multiplied in float64. Both recipes (tensorwise, blockwise), both formats (e4m3, hybrid:
e5m2 gradients), the ops 'off' and 'signal', the weight gradient in bf16 and (OverlapSettings.fp8_wgrad) in FP8, its
operands quantized along the tokens. What differs from the reference is the kernels' fp32 accumulation order
and the bf16 rounding of outputs and partial sums: relative error below 2**-7 (a bf16 ulp is 2**-8 relative, a sum
of t bf16 partials adds up to t such roundings). The unit parts (recipe from Megatron's config, dequantize, the weight
cache) run in one process."""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from distributed import run_distributed  # noqa: E402
from overlap_tp import OverlapConfig  # noqa: E402
from overlap_tp.kernels import fp8_quant as Q  # noqa: E402
from overlap_tp.megatron.fp8_linear import Fp8Recipe, dequantize, quantize_rows, quantize_weight  # noqa: E402

H, FFN, SEQ, BATCH = 128, 256, 64, 2   # blockwise: every contracted and weight dimension a multiple of 128
TOL = 2 ** -7
CONFIGS = {"off": OverlapConfig(method="off"),
           "signal": OverlapConfig(method="signal", groups=2, block_m=64, block_n=64, block_k=128, num_stages=1,
                                   num_warps=4, tile_by_shape=False, comm_sms=0)}


def test_the_recipe_comes_from_megatrons_config():
    from megatron.core.enums import Fp8Recipe as MegatronRecipe
    recipe = Fp8Recipe.of(SimpleNamespace(fp8="hybrid", fp8_recipe=MegatronRecipe.blockwise))
    assert (recipe.forward_format, recipe.grad_format, recipe.row_scaling) == ("e4m3", "e5m2", "1x128")
    assert not recipe.wgrad   # bf16 unless asked, and Megatron's --no-fp8-wgrad wins
    assert Fp8Recipe.of(SimpleNamespace(fp8="e4m3", fp8_recipe="tensorwise"), wgrad=True).wgrad
    assert not Fp8Recipe.of(SimpleNamespace(fp8="e4m3", fp8_recipe="tensorwise", fp8_wgrad=False), wgrad=True).wgrad
    assert Fp8Recipe.of(SimpleNamespace(fp8=None)) is None
    with pytest.raises(ValueError, match="tensorwise or blockwise"):
        Fp8Recipe.of(SimpleNamespace(fp8="e4m3", fp8_recipe=MegatronRecipe.delayed))
    with pytest.raises(ValueError, match="e4m3 or hybrid"):
        Fp8Recipe("e5m2", "tensorwise")


def test_auto_runs_signal_for_fp8():
    from overlap_tp.megatron.fp8_linear import fp8_op_config
    assert fp8_op_config(OverlapConfig(method="auto", transport="p2p")) == OverlapConfig(method="signal",
                                                                                         transport="p2p")
    assert fp8_op_config(OverlapConfig()).method == "signal"
    assert fp8_op_config(OverlapConfig(method="off")) == OverlapConfig(method="off")


@pytest.mark.parametrize("scaling", ["tensorwise", "1x128"])
def test_dequantize_is_the_reference_rounded_once(scaling):
    gen = torch.Generator().manual_seed(3)
    shards = [torch.randn(64, 256, generator=gen).to(torch.bfloat16) * (1 + 10 * p) for p in range(2)]
    quantized = [quantize_rows(s, "e4m3", scaling) for s in shards]
    for q in quantized:
        assert torch.equal(dequantize(q, torch.bfloat16), Q.dequantize_reference(q).to(torch.bfloat16))
    gathered = Q.ScaledFp8(torch.cat([q.q for q in quantized]),
                           torch.cat([q.ds for q in quantized]) if scaling == "tensorwise"
                           else torch.stack([q.ds for q in quantized]), scaling)
    assert torch.equal(dequantize(gathered, torch.bfloat16), Q.dequantize_reference(gathered).to(torch.bfloat16))


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_the_weights_transposed_copy_dequantizes_to_the_transpose(recipe):
    w = torch.randn(256, 128, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    w8, wt8 = quantize_weight(w, Fp8Recipe("e4m3", recipe))
    assert torch.equal(Q.dequantize_reference(wt8), Q.dequantize_reference(w8).t())


def _dq(x: torch.Tensor, fmt: str, scaling: str) -> torch.Tensor:
    """x quantized by the reference quantizer, dequantized in float64."""
    reference = {"tensorwise": Q.quantize_tensorwise_reference, "1x128": Q.quantize_1x128_reference,
                 "128x128": Q.quantize_128x128_reference}[scaling]
    return Q.dequantize_reference(reference(x, fmt))


def _dq_t(x: torch.Tensor, fmt: str, scaling: str) -> torch.Tensor:
    """x.T quantized along x's rows (the wgrad's K-major operand), dequantized in float64."""
    return _dq(x.t().contiguous(), fmt, scaling)


def test_fp8_weight_grad_is_the_product_of_operands_quantized_along_the_tokens():
    import os
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from overlap_tp.megatron.fp8_linear import fp8_weight_grad
    gen = torch.Generator().manual_seed(9)
    dy = torch.randn(256, 128, generator=gen).to(torch.bfloat16)
    x = (torch.randn(256, 384, generator=gen) * 4).to(torch.bfloat16)
    for fmt, name in (("e4m3", "tensorwise"), ("hybrid", "blockwise")):
        recipe = Fp8Recipe(fmt, name)
        got = fp8_weight_grad(dy, x, recipe)
        ref = _dq_t(dy, recipe.wgrad_grad_format, recipe.row_scaling) @ _dq_t(x, "e4m3", recipe.row_scaling).t()
        assert got.dtype == torch.bfloat16 and got.shape == (128, 384)
        assert _rel(got, ref) < 2 ** -8, (fmt, name)                            # rounded to bf16 once
        assert _rel(got, dy.double().t() @ x.double()) > 2 ** -7, (fmt, name)   # and not the bf16 product
    with pytest.raises(ValueError, match="multiple of 128.*--no-fp8-wgrad"):
        fp8_weight_grad(dy[:200], x[:200], Fp8Recipe("e4m3", "blockwise"))


def _rel(got, ref):
    return float((got.double() - ref).norm() / ref.norm())


def _check(rank, world):
    import os
    import warnings
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig
    from overlap_tp.megatron.layers import OverlapColumnParallelLinear, OverlapRowParallelLinear
    from overlap_tp.megatron.settings import OverlapSettings
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    group = ps.get_tensor_model_parallel_group()

    def gathered(x):   # every rank's tensor, in rank order
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return parts

    m = SEQ * BATCH // world   # this rank's rows
    for fmt, name, fp8_wgrad in (("e4m3", "tensorwise", True), ("e4m3", "tensorwise", False),
                                 ("e4m3", "blockwise", True), ("hybrid", "tensorwise", True),
                                 ("hybrid", "blockwise", True), ("hybrid", "blockwise", False)):
        recipe = Fp8Recipe(fmt, name, fp8_wgrad)
        act, wsc, gfmt = recipe.row_scaling, "128x128" if name == "blockwise" else "tensorwise", recipe.grad_format
        config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, use_cpu_initialization=True,
                                   params_dtype=torch.bfloat16, bf16=True, tensor_model_parallel_size=world,
                                   sequence_parallel=True, fp8=fmt, fp8_recipe=name)
        for method, op_config in CONFIGS.items():
            what = f"{fmt} {name} {method} fp8_wgrad={fp8_wgrad}"
            settings = OverlapSettings(fp8_wgrad=fp8_wgrad).with_configs(op_config)
            gen = torch.Generator().manual_seed(11)
            torch.manual_seed(1234)
            init = lambda w: torch.nn.init.normal_(w, std=0.05)   # noqa: E731

            # column: [m, H] shards -> [t m, FFN/t]
            col = OverlapColumnParallelLinear(H, FFN, config=config, init_method=init, bias=True,
                                              gather_output=False, settings=settings)
            with torch.no_grad():
                col.bias.normal_(generator=gen)
            x = torch.randn(SEQ * BATCH, H, generator=gen).to(torch.bfloat16)[rank * m:(rank + 1) * m]
            dy = torch.randn(SEQ * BATCH, FFN // world, generator=gen).to(torch.bfloat16)
            x.requires_grad_(True)
            out, _ = col(x.view(m // BATCH, BATCH, H))
            out.backward(dy.view(SEQ, BATCH, -1))
            xs, ws, dys = gathered(x.detach()), gathered(col.weight.detach()), gathered(dy)
            x8 = torch.cat([_dq(s, "e4m3", act) for s in xs])
            out_ref = x8 @ _dq(col.weight.detach(), "e4m3", wsc).t() + col.bias.detach().double()
            assert _rel(out.reshape(-1, FFN // world), out_ref) < TOL, (what, "column out")
            dx_ref = sum(_dq(dys[r], gfmt, act) @ _dq(ws[r], "e4m3", wsc) for r in range(world))
            assert _rel(x.grad, dx_ref[rank * m:(rank + 1) * m]) < TOL, (what, "column dgrad")
            wfmt = recipe.wgrad_grad_format
            dw_ref = (_dq_t(dy, wfmt, act) @ _dq_t(torch.cat(xs), "e4m3", act).t() if fp8_wgrad
                      else dy.double().t() @ torch.cat(xs).double())
            assert _rel(col.weight.grad, dw_ref) < TOL, (what, "column wgrad")
            assert torch.allclose(col.bias.grad.double(), dy.double().sum(0), rtol=1e-2, atol=1e-2), what

            # row: [t m, FFN/t] -> [m, H]
            row = OverlapRowParallelLinear(FFN, H, config=config, init_method=init, bias=True,
                                           input_is_parallel=True, skip_bias_add=False, settings=settings)
            y = torch.randn(SEQ * BATCH, FFN // world, generator=gen).to(torch.bfloat16).requires_grad_(True)
            dz = torch.randn(SEQ * BATCH, H, generator=gen).to(torch.bfloat16)[rank * m:(rank + 1) * m]
            z, _ = row(y.view(SEQ, BATCH, -1))
            z.backward(dz.view(m // BATCH, BATCH, H))
            ys, ws, dzs = gathered(y.detach()), gathered(row.weight.detach()), gathered(dz)
            z_ref = sum(_dq(ys[r], "e4m3", act) @ _dq(ws[r], "e4m3", wsc).t() for r in range(world))
            z_ref = z_ref[rank * m:(rank + 1) * m] + row.bias.detach().double()
            assert _rel(z.reshape(m, H), z_ref) < TOL, (what, "row out")
            dz8 = torch.cat([_dq(s, gfmt, act) for s in dzs])
            assert _rel(y.grad, dz8 @ _dq(row.weight.detach(), "e4m3", wsc)) < TOL, (what, "row dgrad")
            dz_full = dz8.to(torch.bfloat16)   # the gathered gradient as the layer dequantizes it
            dw_ref = (_dq_t(dz_full, wfmt, act) @ _dq_t(y.detach(), "e4m3", act).t() if fp8_wgrad
                      else dz_full.double().t() @ y.detach().double())
            assert _rel(row.weight.grad, dw_ref) < TOL, (what, "row wgrad")
    ps.destroy_model_parallel()


def test_fp8_linears_forward_and_backward_at_t2():
    run_distributed(2, _check)


def _check_norms_quantize_for_the_linears(rank, world):
    """Two linked overlap layers (get_gpt_layer_overlap_spec, layer numbers 1 and 2) under each recipe: the first
    layer's input norm, both fused attention bdas and the first layer's fused MLP bda (the second layer's input norm,
    handed over) write the FP8 copies that linear_qkv and linear_fc1 read (norm.py's fp8_output), so those linears
    quantize nothing; outputs, input grad and every parameter grad bit for bit those of the same layers with the
    norms' FP8 output off (each linear quantizing its input itself)."""
    import os
    import warnings
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig
    from overlap_tp.megatron import layers
    from overlap_tp.megatron.layer_spec import get_gpt_layer_overlap_spec
    from overlap_tp.megatron.norm import Fp8Output
    from overlap_tp.megatron.settings import OverlapSettings
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    real_fp8_rows, taken = layers.fp8_rows, []

    def counted_fp8_rows(x, fmt, scaling):
        rows8 = real_fp8_rows(x, fmt, scaling)
        taken.append(rows8 is not None)
        return rows8

    gen = torch.Generator().manual_seed(3)
    hidden = 2 * H   # every K a multiple of 128 at t = 2 (linear_proj's: the heads' width over t)
    x = torch.randn(SEQ // world, BATCH, hidden, generator=gen).to(torch.bfloat16)
    g = torch.randn(SEQ // world, BATCH, hidden, generator=gen).to(torch.bfloat16)
    spec = get_gpt_layer_overlap_spec(settings=OverlapSettings().with_configs(CONFIGS["off"]))
    layers.fp8_rows = counted_fp8_rows
    try:
        for fmt, name in (("e4m3", "tensorwise"), ("hybrid", "blockwise")):
            config = TransformerConfig(
                num_layers=2, hidden_size=hidden, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=FFN,
                use_cpu_initialization=True, params_dtype=torch.bfloat16, bf16=True, normalization="RMSNorm",
                tensor_model_parallel_size=world, sequence_parallel=True, hidden_dropout=0.0, attention_dropout=0.0,
                add_bias_linear=False, gated_linear_unit=True, init_method_std=0.05, fp8=fmt, fp8_recipe=name)
            recipe = Fp8Recipe(fmt, name)

            def run(norms_quantize):
                torch.manual_seed(99)
                built = [build_module(spec, config=config, layer_number=n) for n in (1, 2)]
                for layer in built:
                    for norm in (layer.input_layernorm, layer.pre_mlp_layernorm):
                        assert norm.fp8_output == Fp8Output(recipe.forward_format, recipe.row_scaling)
                        if not norms_quantize:
                            norm.fp8_output = None
                taken.clear()
                xi = x.clone().requires_grad_(True)
                out, _ = built[1](hidden_states=built[0](hidden_states=xi, attention_mask=None)[0],
                                  attention_mask=None)
                out.backward(g)
                assert taken == [norms_quantize] * 4, (fmt, name, taken)   # qkv and fc1 of both layers
                return [out, xi.grad] + [p.grad for layer in built for p in layer.parameters()]

            for got, want in zip(run(True), run(False)):
                assert torch.equal(got, want), (fmt, name)
    finally:
        layers.fp8_rows = real_fp8_rows
    ps.destroy_model_parallel()


def test_norms_write_the_fp8_rows_their_linears_read_at_t2():
    run_distributed(2, _check_norms_quantize_for_the_linears)
