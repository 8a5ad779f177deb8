"""overlap_tp with Transformer Engine installed, on one GPU (skipped where TE or CUDA is absent; the device builds TE
with benchmarks/device/te_build.sh and runs these through benchmarks/device/te_checks.sh or the whole GPU suite with
TE on PYTHONPATH):

- our layer spec with TE present (TEDotProductAttention as core attention, TENorm as the q/k norms: what
  get_gpt_layer_overlap_spec takes from TE with transformer_impl="transformer_engine"), at t = 2 as two processes
  sharing the GPU (peers_on_one_gpu.py: the p2p transports over CUDA IPC, the group gloo), forward and backward,
  against Megatron's own TE layer (get_gpt_layer_with_transformer_engine_spec: TE's fused RMSNorm+Linear, TE's
  linears and attention) at t = 1 with the same weights: this rank's rows of the output and of the input grad,
  this rank's shard of every parameter grad (the norms' summed over the ranks, as Megatron's finalize_model_grads
  does), each within bf16 tolerance;
- the FP8 boundary: our FP8 linears with TE present give the same bits inside Megatron's FP8 context (TE's
  fp8_autocast) as outside it: TE quantizes nothing of the layer, our linears quantize once;
- `--tp-comm-overlap` with `--overlap-tp` is one clear error with TE importable, and Megatron accepts the
  Transformer Engine baseline's flags (recipes' OVERLAP=te-ub) with it (CHECK=1, no GPU needed by the check);
- the smoke recipe's first steps at TP 1 with OVERLAP=te: Megatron's TE layers through overlap_tp's launcher, for
  real (at TP 1 nothing is overlapped: the TE code paths of the launcher and the recipe are what runs).
"""
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from gpu_checks import rel_error

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
T = 2
SIZES = dict(hidden=1024, heads=8, groups=4, ffn=2816, seq=2048)
TOL = 3e-2   # max relative error (norm-wise) of each tensor: bf16 rounding and a different reduction order (t = 1, 2)


def _require_te():
    from overlap_tp.bench.te_baselines import te_problem
    problem = te_problem()
    if problem:
        pytest.skip(problem)


def _config(tp):
    from megatron.core.transformer.transformer_config import TransformerConfig
    return TransformerConfig(
        num_layers=1, hidden_size=SIZES["hidden"], num_attention_heads=SIZES["heads"],
        num_query_groups=SIZES["groups"], kv_channels=SIZES["hidden"] // SIZES["heads"],
        ffn_hidden_size=SIZES["ffn"], normalization="RMSNorm", layernorm_epsilon=1e-5, qk_layernorm=True,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, params_dtype=torch.bfloat16, bf16=True,
        init_method_std=0.02, tensor_model_parallel_size=tp, sequence_parallel=tp > 1)


def _seed(seed):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def _shard(name, full, rank, t):
    """Rank `rank`'s part of the t = 1 tensor `full` of parameter `name` at TP t (Megatron's sharding)."""
    if name.endswith("linear_fc1.weight"):   # [gate; up]: each half split over the ranks, a rank's parts stacked
        return torch.cat([half.chunk(t)[rank] for half in full.chunk(2)])
    if name.endswith("linear_qkv.weight"):   # rows grouped by query group: contiguous blocks of groups
        return full.chunk(t)[rank]
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):   # row-parallel: the input columns
        return full.chunk(t, dim=1)[rank]
    return full   # the norms: every rank holds them whole


def _step(layer, x, g):
    """Output, input grad and {parameter name: grad} of one forward + backward."""
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out, _ = layer(hidden_states=x, attention_mask=None)
    out.backward(g)
    return out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def _te_spec_layer_at_t1(ps):
    """Megatron's TE layer at TP 1 (each rank its own TP group; both compute the same): its weights (the norm weights
    drawn around 1, so that a misplaced one shows), the full input and output grad, and its step, keyed by the
    names of overlap_tp's spec (te_baselines.reference_name)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.spec_utils import build_module
    from overlap_tp.bench.te_baselines import reference_name
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    _seed(1234)
    layer = build_module(get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True), config=_config(1),
                         layer_number=1).cuda()
    gen = torch.Generator(device="cuda").manual_seed(99)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, device="cuda", generator=gen))
    x, g = (torch.randn(SIZES["seq"], 1, SIZES["hidden"], device="cuda", generator=gen).bfloat16() for _ in range(2))
    out, dx, grads = _step(layer, x, g)
    weights = {reference_name(n): p.detach().clone() for n, p in layer.named_parameters()}
    grads = {reference_name(n): grad.clone() for n, grad in grads.items()}
    del layer
    ps.destroy_model_parallel()
    return weights, x, g, out.clone(), dx.clone(), grads


def _check_our_spec_against_te_spec(rank, world):
    warnings.filterwarnings("ignore")
    from peers_on_one_gpu import install
    torch.cuda.set_device(0)
    install()
    from megatron.core import parallel_state as ps
    from megatron.core.extensions.transformer_engine import TEDotProductAttention, TENorm
    from megatron.core.transformer.spec_utils import build_module
    from overlap_tp.megatron.layer_spec import get_gpt_layer_overlap_spec
    from overlap_tp.megatron.layers import set_overlap_config
    from test_layers_gpu import _p2p_configs, _settings

    weights, x, g, out_ref, dx_ref, grads_ref = _te_spec_layer_at_t1(ps)

    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    _seed(4321)
    spec = get_gpt_layer_overlap_spec(qk_layernorm=True, transformer_impl="transformer_engine", settings=_settings())
    layer = build_module(spec, config=_config(world), layer_number=1).cuda()
    attention = layer.self_attention
    assert isinstance(attention.core_attention, TEDotProductAttention), type(attention.core_attention)
    assert isinstance(attention.q_layernorm, TENorm) and isinstance(attention.k_layernorm, TENorm)
    assert set_overlap_config(layer, _p2p_configs("signal")) == 4
    params = dict(layer.named_parameters())
    assert sorted(params) == sorted(weights), sorted(set(params) ^ set(weights))
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(_shard(name, weights[name], rank, world))
    rows = SIZES["seq"] // world
    mine = slice(rank * rows, (rank + 1) * rows)
    out, dx, grads = _step(layer, x[mine], g[mine])

    group = ps.get_tensor_model_parallel_group()
    errors = {"output": rel_error(out, out_ref[mine].float()), "input grad": rel_error(dx, dx_ref[mine].float())}
    for name, grad in grads.items():
        if not getattr(params[name], "tensor_model_parallel", False):   # a norm: this rank's partial sum
            summed = grad.float().cpu()
            dist.all_reduce(summed, group=group)
            grad = summed.cuda()
        errors[name] = rel_error(grad, _shard(name, grads_ref[name], rank, world).float())
    worst = max(errors, key=errors.get)
    print(f"rank {rank}: ours at t = {world} against Megatron's TE layer at t = 1: worst {worst} "
          f"{errors[worst]:.2e}", flush=True)
    assert errors[worst] <= TOL, {k: f"{v:.2e}" for k, v in errors.items()}
    torch.cuda.synchronize()
    ps.destroy_model_parallel()


def test_our_spec_with_te_at_t2_matches_megatrons_te_layer_at_t1():
    _require_te()
    run_distributed(T, _check_our_spec_against_te_spec, backend="gloo")


def _recipe(name, *extra, **env):
    environ = dict(os.environ, PYTHON=sys.executable, WANDB_PROJECT="", **env)
    return subprocess.run(["bash", os.path.join(ROOT, "recipes", f"{name}.sh"), *extra], env=environ, cwd=ROOT,
                          capture_output=True, text=True, timeout=240)


def _check_fp8_boundary(rank, world):
    """Our FP8 linears with TE present: inside the FP8 context Megatron opens around each layer (fp8_utils.
    get_fp8_context: TE's fp8_autocast with the config's recipe), a step is bit for bit the same step outside it, so
    TE quantizes nothing of the layer (its core attention stays bf16 without fp8_dot_product_attention; its norms do
    not quantize) and our linears quantize their inputs once; and the layer does run FP8 (not the bf16 layer's bits)."""
    warnings.filterwarnings("ignore")
    from peers_on_one_gpu import install
    torch.cuda.set_device(0)
    install()
    import dataclasses
    from megatron.core import parallel_state as ps
    from megatron.core.fp8_utils import get_fp8_context
    from megatron.core.transformer.spec_utils import build_module
    from overlap_tp.megatron.layer_spec import get_gpt_layer_overlap_spec
    from overlap_tp.megatron.layers import set_overlap_config
    from test_layers_gpu import _p2p_configs, _settings
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    spec = get_gpt_layer_overlap_spec(qk_layernorm=True, transformer_impl="transformer_engine", settings=_settings())
    layers = {}
    for name, extra in (("fp8", dict(fp8="e4m3", fp8_recipe="tensorwise")), ("bf16", {})):
        _seed(4321)
        config = dataclasses.replace(_config(world), **extra)
        layers[name] = build_module(spec, config=config, layer_number=1).cuda()
        assert set_overlap_config(layers[name], _p2p_configs("signal")) == 4
    gen = torch.Generator(device="cuda").manual_seed(5 + rank)
    rows = SIZES["seq"] // world
    x, g = (torch.randn(rows, 1, SIZES["hidden"], device="cuda", generator=gen).bfloat16() for _ in range(2))
    outside = _step(layers["fp8"], x, g)
    with get_fp8_context(layers["fp8"].config):
        inside = _step(layers["fp8"], x, g)
    assert torch.equal(inside[0], outside[0]) and torch.equal(inside[1], outside[1])
    assert all(torch.equal(inside[2][n], outside[2][n]) for n in outside[2]), "TE changed a gradient"
    bf16 = _step(layers["bf16"], x, g)
    assert not torch.equal(outside[0], bf16[0]), "the FP8 layer gave the bf16 layer's bits"
    assert rel_error(outside[0], bf16[0].float()) < 0.1
    torch.cuda.synchronize()
    ps.destroy_model_parallel()


def test_fp8_linears_with_te_quantize_once_inside_megatrons_fp8_context():
    _require_te()
    run_distributed(T, _check_fp8_boundary, backend="gloo")


def test_tp_comm_overlap_with_overlap_tp_is_an_error_with_te_installed():
    _require_te()
    both = _recipe("smoke", "--tp-comm-overlap", CHECK="1", OVERLAP="signal")
    assert both.returncode == 2 and both.stdout == "", (both.stdout, both.stderr[-2000:])
    assert both.stderr.startswith("overlap-tp-pretrain: --overlap-tp signal with --tp-comm-overlap: both overlap the "
                                  "same TP communication"), both.stderr[-2000:]
    te_ub = _recipe("smoke", CHECK="1", OVERLAP="te-ub")
    assert (te_ub.returncode, te_ub.stdout) == (0, "ok (world size 2)\n"), te_ub.stderr[-2000:]


def test_smoke_recipe_first_steps_at_tp1_on_megatrons_te_layers(tmp_path):
    """OVERLAP=te TP=1: Megatron's TE spec, TE's gradient-accumulation and RoPE fusions, through the launcher."""
    _require_te()
    out_dir = tmp_path / "smoke-te"
    run = _recipe("smoke", OVERLAP="te", TP="1", TRAIN_ITERS="3", LOG_INTERVAL="1", GRAPHS="none",
                  OUT_DIR=str(out_dir))
    log = (out_dir / "train.log").read_text() if (out_dir / "train.log").exists() else ""
    assert run.returncode == 0, (run.stderr[-2000:], log[-3000:])
    assert re.search(r"transformer_impl \.+ transformer_engine", log), log[-3000:]
    losses = [float(v) for v in re.findall(r"lm loss: ([0-9.Ee+-]+)", log)]
    assert re.search(r"iteration\s+3/\s+3 \|", log) and len(losses) >= 3, log[-3000:]
    assert all(0 < loss < 20 for loss in losses), losses
