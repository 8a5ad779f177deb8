"""overlap_tp.megatron.layers / layer_spec / attention under gloo (2 and 4 CPU processes).

- Without sequence parallelism our linears are compared with Megatron's own ColumnParallelLinear /
  RowParallelLinear (which run on the CPU there) built from the same seed: weights, TP attributes,
  sharded_state_dict, outputs, input / weight / bias grads.
- Sequence-parallel paths (Megatron's need CUDA) and gradient_accumulation_fusion (Megatron's needs
  apex) are compared with a dense single-process fp64 computation.
- A TransformerLayer from get_gpt_layer_overlap_spec runs forward/backward with and without SP, against
  the same layer built with Megatron's linears.
Each test spawns its processes once and checks many cases inside (process start-up dominates).
"""
import os
import warnings

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core==0.16.1)")

from distributed import run_distributed  # noqa: E402
from overlap_tp import OverlapConfig  # noqa: E402

H, FFN, SEQ, BATCH = 32, 64, 8, 2   # SEQ divisible by 4 ranks
OFF = OverlapConfig(method="off")


def _quiet():
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _init_megatron(world):
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    return ps


def _config(world, *, sp=False, fusion=False, dtype=torch.bfloat16, **extra):
    from megatron.core.transformer.transformer_config import TransformerConfig
    return TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, use_cpu_initialization=True,
                             params_dtype=dtype, bf16=dtype == torch.bfloat16, tensor_model_parallel_size=world,
                             sequence_parallel=sp, gradient_accumulation_fusion=fusion, **extra)


def _init(std=0.05):
    return lambda w: torch.nn.init.normal_(w, std=std)


def rel_error(got, ref):
    ref = ref.double()
    return float((got.double() - ref).norm() / max(ref.norm(), 1e-12))


def _close(got, ref, what, tol=1e-2):
    assert got.shape == ref.shape, (what, tuple(got.shape), tuple(ref.shape))
    err = rel_error(got, ref)
    assert err < tol, f"{what}: relative error {err:.3g}"


def _build(kind, ours, world, config, *, in_size, out_size, bias=True, skip_bias_add=False, **kw):
    """Megatron's linear of `kind`, or ours (with every op kind 'off' unless the layer's own config or `settings`
    say otherwise: never 'auto' by accident)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from overlap_tp.megatron.layers import OverlapColumnParallelLinear, OverlapRowParallelLinear
    from overlap_tp.megatron.settings import OverlapSettings
    torch.manual_seed(1234)
    if ours:
        kw.setdefault("settings", OverlapSettings().with_configs(OFF))
    if kind == "column":
        cls = OverlapColumnParallelLinear if ours else ColumnParallelLinear
        kw.setdefault("gather_output", False)
    else:
        cls = OverlapRowParallelLinear if ours else RowParallelLinear
        kw.setdefault("input_is_parallel", True)
    return cls(in_size, out_size, config=config, init_method=_init(), bias=bias, skip_bias_add=skip_bias_add,
               tp_comm_buffer_name="fc", **kw)


def _full_weights(layer, kind, group):
    """The full (unsharded) weight and bias of a layer, gathered from the ranks."""
    import torch.distributed as dist
    t = dist.get_world_size(group)
    dim = 0 if kind == "column" else 1
    parts = [torch.empty_like(layer.weight) for _ in range(t)]
    dist.all_gather(parts, layer.weight.detach().contiguous(), group=group)
    w = torch.cat(parts, dim=dim)
    b = None
    if layer.bias is not None:
        if kind == "column":
            parts = [torch.empty_like(layer.bias) for _ in range(t)]
            dist.all_gather(parts, layer.bias.detach().contiguous(), group=group)
            b = torch.cat(parts)
        else:
            b = layer.bias.detach()
    return w, b


def _dense(kind, sp, rank, t, w, b, x_full, g_full):
    """fp64 reference for rank `rank`: (its input, its upstream grad, output, dx, dw, db)."""
    w, x, g = w.double(), x_full.double(), g_full.double()
    s = x.shape[0]
    rows = slice(rank * s // t, (rank + 1) * s // t)
    if kind == "column":
        n = w.shape[0]
        cols = slice(rank * n // t, (rank + 1) * n // t)
        out = x @ w[cols].t() + (b.double()[cols] if b is not None else 0)
        dx = g[..., cols] @ w[cols] if not sp else (g @ w)[rows]
        dx_full_sum = g @ w            # non-SP: the all-reduced dgrad, the same on every rank
        dw = g[..., cols].reshape(-1, n // t).t() @ x.reshape(-1, x.shape[-1])
        db = g[..., cols].reshape(-1, n // t).sum(0)
        x_in = x_full[rows] if sp else x_full
        g_in = g_full[..., cols]
        return x_in, g_in, out, (dx if sp else dx_full_sum), dw, db
    k = w.shape[1]
    cols = slice(rank * k // t, (rank + 1) * k // t)
    out = x @ w.t() + (b.double() if b is not None else 0)
    g_in = g_full[rows] if sp else g_full
    dx = (g @ w)[..., cols]
    dw = g.reshape(-1, g.shape[-1]).t() @ x[..., cols].reshape(-1, k // t)
    db = (g[rows] if sp else g).reshape(-1, g.shape[-1]).sum(0)
    return x_full[..., cols], g_in, (out[rows] if sp else out), dx, dw, db


def _run(layer, x, g):
    x = x.detach().clone().requires_grad_(True)
    out, out_bias = layer(x)
    out.backward(g)
    return out, out_bias, x.grad


def _attrs(p):
    names = ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce", "sequence_parallel")
    return {n: getattr(p, n, "<unset>") for n in names}


def _sharded_summary(sd):
    out = {}
    for key, value in sd.items():
        out[key] = (type(value).__name__, getattr(value, "key", None), getattr(value, "local_shape", None),
                    getattr(value, "global_shape", None), getattr(value, "global_offset", None),
                    getattr(value, "axis_fragmentations", None), getattr(value, "replica_id", None))
    return out


# ---------------------------------------------------------------------------------------------------
# Linears
# ---------------------------------------------------------------------------------------------------

def _check_linears(rank, world):
    _quiet()
    ps = _init_megatron(world)
    group = ps.get_tensor_model_parallel_group()
    metadata = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    gen = torch.Generator().manual_seed(7)
    shapes = {"column": (H, FFN), "row": (FFN, H)}

    for kind in ("column", "row"):
        in_size, out_size = shapes[kind]
        x_full = torch.randn(SEQ, BATCH, in_size, generator=gen).to(torch.bfloat16)
        g_full = torch.randn(SEQ, BATCH, out_size, generator=gen).to(torch.bfloat16)

        # --- structure vs Megatron (with and without SP): init, attributes, sharded state dict
        for sp in (False, True):
            cfg = _config(world, sp=sp)
            ours = _build(kind, True, world, cfg, in_size=in_size, out_size=out_size)
            ref = _build(kind, False, world, cfg, in_size=in_size, out_size=out_size)
            assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
            for (name, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
                assert p.shape == q.shape and p.dtype == q.dtype, (kind, name)
                assert torch.equal(p, q), f"{kind}.{name}: init differs from Megatron's"
                assert _attrs(p) == _attrs(q), (kind, sp, name, _attrs(p), _attrs(q))
            assert ours.sequence_parallel == ref.sequence_parallel
            assert _sharded_summary(ours.sharded_state_dict("l.", metadata=metadata)) == \
                _sharded_summary(ref.sharded_state_dict("l.", metadata=metadata)), (kind, sp)
            assert set(ours.state_dict()) == set(ref.state_dict())

        # --- non-SP numerics vs Megatron and the dense reference, every skip_bias_add / bias setting
        cfg = _config(world)
        for bias, skip in ((True, False), (True, True), (False, False)):
            ours = _build(kind, True, world, cfg, in_size=in_size, out_size=out_size, bias=bias, skip_bias_add=skip)
            ref = _build(kind, False, world, cfg, in_size=in_size, out_size=out_size, bias=bias, skip_bias_add=skip)
            w, b = _full_weights(ours, kind, group)
            x_in, g_in, out_ref, dx_ref, dw_ref, db_ref = _dense(kind, False, rank, world, w, b, x_full, g_full)
            if skip and b is not None:   # the caller adds the bias: the dense output has none
                out_ref = out_ref - (b.double().chunk(world)[rank] if kind == "column" else b.double())
            out, ob, dx = _run(ours, x_in, g_in)
            out_m, ob_m, dx_m = _run(ref, x_in, g_in)
            what = f"{kind} bias={bias} skip={skip} world={world}"
            assert (ob is None) == (ob_m is None) and (ob is None or ob is ours.bias), what
            _close(out, out_m, what + " out vs megatron", 1e-2)
            _close(out, out_ref, what + " out vs dense")
            _close(dx, dx_m, what + " dgrad vs megatron")
            _close(dx, dx_ref, what + " dgrad vs dense")
            _close(ours.weight.grad, ref.weight.grad, what + " wgrad vs megatron")
            _close(ours.weight.grad, dw_ref, what + " wgrad vs dense")
            if bias and not skip:
                _close(ours.bias.grad, ref.bias.grad, what + " bias grad vs megatron")
                _close(ours.bias.grad, db_ref, what + " bias grad vs dense")
            elif bias:   # the caller adds the returned bias: no grad reaches it here, as in Megatron
                assert ours.bias.grad is None and ref.bias.grad is None

        # --- SP numerics vs the dense reference (Megatron's SP path needs CUDA)
        cfg = _config(world, sp=True)
        ours = _build(kind, True, world, cfg, in_size=in_size, out_size=out_size)
        w, b = _full_weights(ours, kind, group)
        x_in, g_in, out_ref, dx_ref, dw_ref, db_ref = _dense(kind, True, rank, world, w, b, x_full, g_full)
        out, _, dx = _run(ours, x_in, g_in)
        what = f"{kind} SP world={world}"
        _close(out, out_ref, what + " out")
        _close(dx, dx_ref, what + " dgrad")
        _close(ours.weight.grad, dw_ref, what + " wgrad")
        _close(ours.bias.grad, db_ref, what + " bias grad (this rank's rows)")

        # --- overlap methods through the layer's own overlap_config (decompose runs on the CPU)
        ours.overlap_config = {"gemm_rs": OverlapConfig(method="decompose", chunks=2)}
        ours.zero_grad()
        out2, _, dx2 = _run(ours, x_in, g_in)
        _close(out2, out_ref, what + " decompose out")
        _close(dx2, dx_ref, what + " decompose dgrad")
        _close(ours.weight.grad, dw_ref, what + " decompose wgrad")

        # --- gradient_accumulation_fusion: wgrad into fp32 main_grad, DDP's dummy-grad contract
        for sp in (False, True):
            cfg = _config(world, sp=sp, fusion=True)
            ours = _build(kind, True, world, cfg, in_size=in_size, out_size=out_size)
            w, b = _full_weights(ours, kind, group)
            x_in, g_in, _, _, dw_ref, _ = _dense(kind, sp, rank, world, w, b, x_full, g_full)
            what = f"{kind} fusion sp={sp}"
            for ddp, zero_out in ((False, False), (True, False), (True, True)):
                weight = ours.weight
                weight.main_grad = torch.full(weight.shape, 0.25, dtype=torch.float32)
                for attr in ("grad_added_to_main_grad", "zero_out_wgrad"):
                    if hasattr(weight, attr):
                        delattr(weight, attr)
                if ddp:
                    weight.grad_added_to_main_grad = False
                if zero_out:
                    weight.zero_out_wgrad = True
                weight.grad = None
                _run(ours, x_in, g_in)
                _run(ours, x_in, g_in)           # two micro-batches accumulate
                _close(weight.main_grad - 0.25, 2 * dw_ref, what + f" main_grad ddp={ddp}")
                assert weight.main_grad.dtype == torch.float32
                if not ddp:
                    assert weight.grad is None, what
                else:
                    assert weight.grad_added_to_main_grad is True
                    assert weight.grad is not None and weight.grad.shape == weight.shape
                    if zero_out:
                        assert torch.count_nonzero(weight.grad) == 0

    # --- column gather_output and row input_is_parallel=False (non-SP; Megatron's versions need CUDA)
    cfg = _config(world)
    x = torch.randn(SEQ, BATCH, H, generator=gen).to(torch.bfloat16)
    g = torch.randn(SEQ, BATCH, FFN, generator=gen).to(torch.bfloat16)
    ours = _build("column", True, world, cfg, in_size=H, out_size=FFN, gather_output=True)
    w, b = _full_weights(ours, "column", group)
    _, _, _, dx_ref, dw_ref, _ = _dense("column", False, rank, world, w, b, x, g)
    out, _, dx = _run(ours, x, g)
    _close(out, x.double() @ w.double().t() + b.double(), "gather_output out")
    _close(dx, dx_ref, "gather_output dgrad")
    _close(ours.weight.grad, dw_ref, "gather_output wgrad")
    x = torch.randn(SEQ, BATCH, FFN, generator=gen).to(torch.bfloat16)
    g = torch.randn(SEQ, BATCH, H, generator=gen).to(torch.bfloat16)
    ours = _build("row", True, world, cfg, in_size=FFN, out_size=H, input_is_parallel=False)
    w, b = _full_weights(ours, "row", group)
    _, _, out_ref, _, dw_ref, _ = _dense("row", False, rank, world, w, b, x, g)
    out, _, dx = _run(ours, x, g)
    _close(out, out_ref, "input_is_parallel=False out")
    _close(dx, g.double() @ w.double(), "input_is_parallel=False dgrad")
    _close(ours.weight.grad, dw_ref, "input_is_parallel=False wgrad")

    # --- frozen weight: no wgrad, dgrad still right
    ours = _build("column", True, world, _config(world, sp=True), in_size=H, out_size=FFN)
    ours.weight.requires_grad_(False)
    w, b = _full_weights(ours, "column", group)
    g = torch.randn(SEQ, BATCH, FFN, generator=gen).to(torch.bfloat16)
    x_in, g_in, _, dx_ref, _, db_ref = _dense("column", True, rank, world, w, b, x_full_h(gen), g)
    out, _, dx = _run(ours, x_in, g_in)
    _close(dx, dx_ref, "frozen weight dgrad")
    assert ours.weight.grad is None
    _close(ours.bias.grad, db_ref, "frozen weight bias grad")
    ps.destroy_model_parallel()


def x_full_h(gen):
    return torch.randn(SEQ, BATCH, H, generator=gen).to(torch.bfloat16)


@pytest.mark.parametrize("world", [2, 4])
def test_linears_match_megatron_and_dense(world):
    run_distributed(world, _check_linears)


# ---------------------------------------------------------------------------------------------------
# TransformerLayer from the spec
# ---------------------------------------------------------------------------------------------------

def _layer_config(world, sp):
    from megatron.core.transformer.transformer_config import TransformerConfig
    return TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, num_query_groups=2,
                             ffn_hidden_size=FFN, use_cpu_initialization=True, params_dtype=torch.bfloat16,
                             bf16=True, normalization="RMSNorm", tensor_model_parallel_size=world,
                             sequence_parallel=sp, hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=True,
                             qk_layernorm=True, gated_linear_unit=True, init_method_std=0.05)


def _megatron_linears_spec(spec):
    """The same layer spec with Megatron's TransformerLayer (separate bda and pre-MLP norm) and its
    ColumnParallelLinear / RowParallelLinear."""
    import copy
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_layer import TransformerLayer
    spec = copy.deepcopy(spec)
    spec.module, spec.params = TransformerLayer, {}   # Megatron's layer takes no settings or chain
    attn = spec.submodules.self_attention.submodules
    attn.linear_qkv, attn.linear_proj = ColumnParallelLinear, RowParallelLinear
    mlp = spec.submodules.mlp.submodules
    mlp.linear_fc1, mlp.linear_fc2 = ColumnParallelLinear, RowParallelLinear
    return spec


def _check_transformer_layer(rank, world):
    _quiet()
    ps = _init_megatron(world)
    from megatron.core.transformer.spec_utils import build_module
    from overlap_tp.megatron.layer_spec import get_gpt_layer_overlap_spec
    from overlap_tp.megatron.layers import OverlapColumnParallelLinear, OverlapRowParallelLinear, set_overlap_config
    from overlap_tp.megatron.norm import OverlapRMSNorm
    spec = get_gpt_layer_overlap_spec(qk_layernorm=True)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(SEQ, BATCH, H, generator=gen).to(torch.bfloat16)
    g = torch.randn(SEQ, BATCH, H, generator=gen).to(torch.bfloat16)
    rows = slice(rank * SEQ // world, (rank + 1) * SEQ // world)

    def run(layer_spec, sp):
        torch.manual_seed(99)
        layer = build_module(layer_spec, config=_layer_config(world, sp), layer_number=1)
        set_overlap_config(layer, OFF)
        xi = (x[rows] if sp else x).clone().requires_grad_(True)
        out, _ = layer(xi, attention_mask=None)
        out.backward(g[rows] if sp else g)
        grads = {n: p.grad for n, p in layer.named_parameters()}
        return layer, out, xi.grad, grads

    ref_layer, out_ref, dx_ref, grads_ref = run(_megatron_linears_spec(spec), False)
    for sp in (False, True):
        layer, out, dx, grads = run(spec, sp)
        assert isinstance(layer.self_attention.linear_qkv, OverlapColumnParallelLinear)
        assert isinstance(layer.mlp.linear_fc2, OverlapRowParallelLinear)
        assert isinstance(layer.input_layernorm, OverlapRMSNorm) and isinstance(layer.pre_mlp_layernorm, OverlapRMSNorm)
        assert layer.self_attention.linear_proj.sequence_parallel == sp
        assert layer.fused_attn_norm, "the fused bda + pre-MLP norm path should run"
        for (n, p), (_, q) in zip(layer.named_parameters(), ref_layer.named_parameters()):
            assert torch.equal(p, q), f"{n}: weights differ from the Megatron-linears layer"
        what = f"TransformerLayer sp={sp} world={world}"
        _close(out, out_ref[rows] if sp else out_ref, what + " out", 2e-2)
        _close(dx, dx_ref[rows] if sp else dx_ref, what + " dgrad", 3e-2)
        params = dict(layer.named_parameters())
        for n, grad in grads.items():
            assert grad is not None, (what, n)
            if (sp and getattr(params[n], "sequence_parallel", False)) or "q_layernorm" in n or "k_layernorm" in n:
                # per-rank partial sums, all-reduced over TP by Megatron's finalize_model_grads
                # (param.sequence_parallel with SP; q/k layernorm by name); the reference's too
                grad = grad.float()
                torch.distributed.all_reduce(grad, group=ps.get_tensor_model_parallel_group())
                ref = grads_ref[n].float()   # non-SP reference: full sums, except q/k layernorm (per head)
                if "q_layernorm" in n or "k_layernorm" in n:
                    torch.distributed.all_reduce(ref, group=ps.get_tensor_model_parallel_group())
                _close(grad, ref, f"{what} grad {n} (TP-summed)", 3e-2)
                continue
            _close(grad, grads_ref[n], f"{what} grad {n}", 3e-2)

    # layers.fused_norms false: Megatron's TransformerLayer around the same linears and norms, the same
    # numbers within bf16 rounding (separate bias-dropout-add and norm kernels, summed reduce-scatters)
    from megatron.core.transformer.transformer_layer import TransformerLayer
    for sp in (False, True):
        layer, out, dx, grads = run(get_gpt_layer_overlap_spec(qk_layernorm=True, fused_norms=False), sp)
        assert type(layer) is TransformerLayer and isinstance(layer.mlp.linear_fc2, OverlapRowParallelLinear)
        what = f"unfused TransformerLayer sp={sp} world={world}"
        _close(out, out_ref[rows] if sp else out_ref, what + " out", 2e-2)
        _close(dx, dx_ref[rows] if sp else dx_ref, what + " dgrad", 3e-2)

    # Without an OverlapRMSNorm to fuse into, the layer is Megatron's and says why.
    from megatron.core.transformer.identity_op import IdentityOp
    import copy
    plain = copy.deepcopy(spec)
    plain.submodules.pre_mlp_layernorm = IdentityOp
    with pytest.warns(UserWarning, match="pre_mlp_layernorm is IdentityOp"):
        layer = build_module(plain, config=_layer_config(world, False), layer_number=1)
    assert not layer.fused_attn_norm
    ps.destroy_model_parallel()


def test_transformer_layer_from_spec():
    run_distributed(2, _check_transformer_layer)


def _sp_layer_case(world, seed):
    """Megatron at TP `world`, overlap_tp's layer spec (qk layernorm) and a bf16 input and output grad [s/t, b, h] of a
    sequence-parallel layer."""
    ps = _init_megatron(world)
    from overlap_tp.megatron.layer_spec import get_gpt_layer_overlap_spec
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(SEQ // world, BATCH, H, generator=gen).to(torch.bfloat16)
    g = torch.randn(SEQ // world, BATCH, H, generator=gen).to(torch.bfloat16)
    return ps, get_gpt_layer_overlap_spec(qk_layernorm=True), x, g


def _spec_with(**switches):
    """overlap_tp's layer spec (qk layernorm) whose modules are built with these OverlapSettings switches."""
    from overlap_tp.megatron.layer_spec import get_gpt_layer_overlap_spec
    from overlap_tp.megatron.settings import OverlapSettings
    return get_gpt_layer_overlap_spec(qk_layernorm=True, settings=OverlapSettings(**switches))


class _FakeDeferredSum:
    """The p2p transport's DeferredSum on the CPU: slots (out, 0), whose sum is the real reduce-scatter output."""

    def __init__(self, out, consumed):
        self.slots, self.out, self.done, self.consumed = torch.stack([out, torch.zeros_like(out)]), out, False, consumed

    def consume(self, kernel):
        assert not self.done
        kernel(self.slots)
        self.done = True
        self.consumed.append(self.slots.shape)

    def __call__(self):
        assert not self.done
        self.done = True
        return self.out

    def into(self, out):
        out.copy_(self())
        self.consumed.append(self.slots.shape)
        return out


def _deferring(real_gemm_rs, consumed):
    """gemm_rs as the p2p transport runs it where a consumer sums the output (async_op: a Pending carrying a
    DeferredSum), faked on gloo: the real result as slots (out, 0); `consumed` records each consumption."""
    from overlap_tp.ops.plan_base import Pending

    def deferring_gemm_rs(*args, async_op=False, **kwargs):
        result = real_gemm_rs(*args, async_op=async_op, **kwargs)
        if not async_op:
            return result
        deferred = _FakeDeferredSum(result.wait(), consumed)
        return Pending(deferred, deferred_sum=deferred)
    return deferring_gemm_rs


def _check_deferred_proj_sum(rank, world):
    """linear_proj's reduce-scatter sum left to the fused bda + norm kernel, and the column-parallel dgrads' sums left
    to the norms' backward kernels (what the p2p transport does on GPUs, faked here on gloo): the layer's output,
    input grad and every parameter grad are bit for bit those of the summed path; an attention block whose bda is not
    the fused one gets an error, not the unwritten output."""
    _quiet()
    ps, spec, x, g = _sp_layer_case(world, 4)
    from megatron.core.transformer.spec_utils import build_module
    from overlap_tp.megatron import layers
    from overlap_tp.megatron import linear_functions as functions
    real_gemm_rs, consumed = functions.gemm_rs, []
    deferring_gemm_rs = _deferring(real_gemm_rs, consumed)

    def run(fake, bda=None):
        torch.manual_seed(99)
        layer = build_module(spec, config=_layer_config(world, True), layer_number=1)
        layers.set_overlap_config(layer, OFF)
        if bda is not None:
            layer.self_attn_bda = bda
        functions.gemm_rs = deferring_gemm_rs if fake else real_gemm_rs
        try:
            xi = x.clone().requires_grad_(True)
            out, _ = layer(xi, attention_mask=None)
            out.backward(g)
        finally:
            functions.gemm_rs = real_gemm_rs
        return [out, xi.grad] + [p.grad for _, p in layer.named_parameters()]

    want = run(False)
    got = run(True)
    # the forward's proj, then in the backward fc1's and qkv's dgrads (left to the pre-MLP and the input norm)
    assert consumed == [torch.Size([2, SEQ // world * BATCH, H])] * 3, consumed
    for a, b in zip(got, want):
        assert torch.equal(a, b)

    def plain_bda(training, fused):
        return lambda x_with_bias, residual, prob: x_with_bias[0] + residual
    with pytest.raises(RuntimeError, match="reached something other than the fused"):
        run(True, bda=plain_bda)
    ps.destroy_model_parallel()


def test_deferred_proj_sum_is_summed_by_the_fused_norm():
    run_distributed(2, _check_deferred_proj_sum)


def _check_mlp_boundary(rank, world):
    """Two layers in a row (one config, layer numbers 1 and 2: linked when built): from the first step the first
    layer's mlp bda runs the second layer's input norm in the fused kernel and hands the rows over (the second
    layer's norm is not run again), with fc2's p2p sum left to that kernel too (faked on gloo as in
    _check_deferred_proj_sum). Outputs, input grad and every parameter grad: within bf16 rounding of the unlinked
    path (Megatron's bda rounds x + bias, then the sum; the kernel rounds once), bit for bit between the deferred
    and the summed fc2, and bit for bit between the first and the second step on the same input (a process's first
    step runs the same kernels as every later one: what a resumed run needs to match the uninterrupted one)."""
    _quiet()
    ps, spec, x, g = _sp_layer_case(world, 5)
    from megatron.core.transformer.spec_utils import build_module
    from overlap_tp.megatron import layers, norm as norm_module
    from overlap_tp.megatron import linear_functions as functions
    real_gemm_rs, real_rmsnorm, consumed, norms = functions.gemm_rs, norm_module.rmsnorm, [], []
    deferring_gemm_rs = _deferring(real_gemm_rs, consumed)

    def counted_rmsnorm(x, weight, **kwargs):
        norms.append(weight)
        return real_rmsnorm(x, weight, **kwargs)

    def run(link, fake, steps=2):
        torch.manual_seed(99)
        config = _layer_config(world, True)
        first = build_module(spec, config=config, layer_number=1)
        second = build_module(spec, config=config, layer_number=2)
        for layer in (first, second):
            layers.set_overlap_config(layer, OFF)
        first.fused_mlp_boundary = link
        functions.gemm_rs, norm_module.rmsnorm = (deferring_gemm_rs if fake else real_gemm_rs), counted_rmsnorm
        results = []
        try:
            for _ in range(steps):
                consumed.clear()
                norms.clear()
                for p in list(first.parameters()) + list(second.parameters()):
                    p.grad = None
                xi = x.clone().requires_grad_(True)
                out, _ = second(hidden_states=first(hidden_states=xi, attention_mask=None)[0], attention_mask=None)
                out.backward(g)
                # the second layer's input norm, run on its own (unlinked) or handed over (linked), in every step
                assert len([w for w in norms if w is second.input_layernorm.weight]) == (0 if link else 1)
                results.append([out, xi.grad] + [p.grad for p in list(first.parameters()) + list(second.parameters())])
        finally:
            functions.gemm_rs, norm_module.rmsnorm = real_gemm_rs, real_rmsnorm
        assert first.next_input_norm is second.input_layernorm     # linked when built ...
        assert (first.linked_next_norm() is second.input_layernorm) == link   # ... and used unless turned off
        assert len(list(first.parameters())) == len(list(second.parameters()))   # no parameter of the other's
        assert second.next_input_norm is None                 # nothing built after it
        for step in results[1:]:                              # the same input, no update: the same kernels
            for a, b in zip(step, results[0]):
                assert torch.equal(a, b)
        return results[-1]

    unlinked = run(False, False)
    linked = run(True, False)
    for a, b in zip(linked, unlinked):
        _close(a.float(), b.float(), "linked vs unlinked", 2e-2)
    deferred = run(True, True)
    rows = torch.Size([2, SEQ // world * BATCH, H])
    # forward: the first's proj and fc2, the second's proj; backward: each layer's fc1 and qkv dgrads, left to the
    # pre-MLP and input norms (the second's input norm is the first's fused mlp bda: the handover's backward)
    assert consumed == [rows] * 7, consumed
    for a, b in zip(deferred, linked):
        assert torch.equal(a, b)
    ps.destroy_model_parallel()


def test_mlp_boundary_hands_the_next_norm_over_and_sums_fc2_in_the_kernel():
    run_distributed(2, _check_mlp_boundary)


class _FakeOwnGather:
    """ops.ag_gemm.OwnGather on gloo (its symmetric buffer is CUDA-only): a CPU buffer [t * m, k] whose region this
    rank's norm writes into (claim), filled with the peers' rows by an all-gather, then the GEMM as AgGemm's `off`
    runs it (so the result is bit for bit the shared path's); the reference check of GatherBuffer.claim included."""
    built, gemms = [], []

    def __init__(self, group, m, k, dtype, device, instance=0):
        import torch.distributed as dist
        self.group, self.m, self.k, self.dtype, self.device = group, m, k, dtype, device
        self.instance = instance
        self.t, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.buf = torch.empty(self.t * m, k, dtype=dtype, device=device)
        self.unreferenced = torch._C._storage_Use_Count(self.buf.untyped_storage()._cdata)
        self.claimed = None
        _FakeOwnGather.built.append(self)

    @staticmethod
    def supports(config, device):
        return True

    def fits(self, m, k, dtype, device):
        return (m, k, dtype, device) == (self.m, self.k, self.dtype, self.device)

    def claim(self):
        if self.claimed is None:
            assert torch._C._storage_Use_Count(self.buf.untyped_storage()._cdata) == self.unreferenced, \
                "claimed while the previous gathered input is still referenced"
            self.claimed = "eager"
        return self.buf.narrow(0, self.rank * self.m, self.m)

    def holds(self, x):
        return (self.claimed is not None and x.data_ptr() == self.buf[self.rank * self.m].data_ptr()
                and x.shape == (self.m, self.k))

    def ag_gemm(self, a_shard, w, bias, config):
        import torch.distributed as dist
        assert self.holds(a_shard)
        self.claimed = None
        parts = [torch.empty_like(a_shard) for _ in range(self.t)]
        dist.all_gather(parts, a_shard.contiguous(), group=self.group)
        for p in range(self.t):
            if p != self.rank:
                self.buf[p * self.m:(p + 1) * self.m].copy_(parts[p])
        out = torch.mm(self.buf, w.t())
        if bias is not None:
            out += bias
        _FakeOwnGather.gemms.append(w.shape)
        return out, self.buf.detach()


def _check_gather_in_place(rank, world):
    """OverlapSettings.gather_in_place (faked OwnGather on gloo): two linked layers' four norms (the first layer's input
    norm, each fused attention bda, the first layer's fused MLP bda for the second's input norm) write straight into
    linear_qkv's and linear_fc1's own buffers, whose forwards then gather through them, and whose backwards read the
    gathered inputs kept there (no re-gather); outputs, input grad and every parameter grad bit for bit those of the
    layers without it, over two steps. With activation recomputation it stays off, and says so."""
    _quiet()
    ps, spec, x, g = _sp_layer_case(world, 6)
    from megatron.core.transformer.spec_utils import build_module
    from overlap_tp.megatron import layers
    from overlap_tp.megatron import linear_functions as functions
    real_own, real_gather_rows, regathers = layers.OwnGather, functions.gather_rows, []

    def counted_gather_rows(*args, **kwargs):
        regathers.append(args[0].shape)
        return real_gather_rows(*args, **kwargs)

    def run(in_place, steps=2):
        torch.manual_seed(99)
        layers.OwnGather, functions.gather_rows = _FakeOwnGather, counted_gather_rows
        _FakeOwnGather.built.clear()
        try:
            config = _layer_config(world, True)
            in_place_spec = _spec_with(gather_in_place=in_place)
            first = build_module(in_place_spec, config=config, layer_number=1)
            second = build_module(in_place_spec, config=config, layer_number=2)
            results = []
            for _ in range(steps):
                regathers.clear()
                _FakeOwnGather.gemms.clear()
                for p in list(first.parameters()) + list(second.parameters()):
                    p.grad = None
                xi = x.clone().requires_grad_(True)
                out, _ = second(hidden_states=first(hidden_states=xi, attention_mask=None)[0], attention_mask=None)
                out.backward(g)
                results.append([out, xi.grad] + [p.grad for p in list(first.parameters()) + list(second.parameters())])
                # qkv and fc1 of both layers: gathered in place, never re-gathered; else re-gathered in the backward
                assert len(_FakeOwnGather.gemms) == (4 if in_place else 0), _FakeOwnGather.gemms
                assert len(regathers) == (0 if in_place else 4), regathers
            assert len(_FakeOwnGather.built) == (4 if in_place else 0)   # one buffer per linear, kept across steps
            for linear in (first.self_attention.linear_qkv, first.mlp.linear_fc1, second.self_attention.linear_qkv,
                           second.mlp.linear_fc1):
                assert linear.gather_in_place == in_place
        finally:
            layers.OwnGather, functions.gather_rows = real_own, real_gather_rows
        return results

    want = run(False)
    got = run(True)
    for step_got, step_want in zip(got, want):
        for a, b in zip(step_got, step_want):
            assert torch.equal(a, b)

    # activation recomputation: off, with a warning naming it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer = build_module(_spec_with(gather_in_place=True), config=_layer_config(world, True).__class__(
            **{**_layer_config(world, True).__dict__, "recompute_granularity": "full", "recompute_method": "uniform",
               "recompute_num_layers": 1}), layer_number=1)
    assert not layer.self_attention.linear_qkv.gather_in_place and layer.input_layernorm.output_for is None
    assert any("gather-in-place is off because activations are recomputed" in str(w.message) for w in caught)
    ps.destroy_model_parallel()


def test_norms_write_into_the_gathered_buffers_and_the_backward_reads_them_in_place():
    run_distributed(2, _check_gather_in_place)


def _check_token_split(rank, world):
    """OverlapSettings.token_split (the p2p sums faked on gloo as in _check_deferred_proj_sum, gathering in place as in
    _check_gather_in_place): two linked layers run the micro-batch of 2 as two halves of one sequence, interleaved (the
    forward's ReduceScatters proj A, proj B, fc2 A, fc2 B, each half on its own plans: instance 0 / 1), the second layer
    taking the first's halves and their handed-over norms as they are. Outputs, input grad and every parameter grad
    within bf16 rounding of the unsplit layers (the weight gradients are summed over two halves), bit for bit from one
    step to the next. An odd micro-batch runs whole, and says so; a layer whose activations are recomputed does not
    split, and says so."""
    _quiet()
    ps, spec, x, g = _sp_layer_case(world, 9)
    from megatron.core.transformer.spec_utils import build_module
    from overlap_tp.megatron import layers, norm as norm_module
    from overlap_tp.megatron import linear_functions as functions
    real_gemm_rs, real_own, real_rmsnorm, consumed, calls, norms = (functions.gemm_rs, layers.OwnGather,
                                                                    norm_module.rmsnorm, [], [], [])
    deferring = _deferring(real_gemm_rs, consumed)

    def recorded_gemm_rs(a, w, *args, instance=0, **kwargs):
        calls.append((tuple(w.shape), instance))
        return deferring(a, w, *args, instance=instance, **kwargs)

    def counted_rmsnorm(x, weight, **kwargs):
        norms.append(weight)
        return real_rmsnorm(x, weight, **kwargs)

    def run(split, steps=2, xs=x, gs=g):
        torch.manual_seed(99)
        functions.gemm_rs, layers.OwnGather, norm_module.rmsnorm = recorded_gemm_rs, _FakeOwnGather, counted_rmsnorm
        _FakeOwnGather.built.clear()
        try:
            config = _layer_config(world, True)
            split_spec = _spec_with(gather_in_place=True, token_split=split)
            built = [build_module(split_spec, config=config, layer_number=n) for n in (1, 2)]
            assert [layer.token_split for layer in built] == [split] * 2
            params = [p for layer in built for p in layer.parameters()]
            results = []
            for _ in range(steps):
                consumed.clear()
                calls.clear()
                norms.clear()
                for p in params:
                    p.grad = None
                xi = xs.clone().requires_grad_(True)
                out, _ = built[1](hidden_states=built[0](hidden_states=xi, attention_mask=None)[0],
                                  attention_mask=None)
                out.backward(gs)
                results.append([out, xi.grad] + [p.grad for p in params])
                # the second layer's input norm is the first's fused mlp bda, handed over (per half when split)
                assert not [w for w in norms if w is built[1].input_layernorm.weight]
            # one gathered buffer per (linear, half), kept across steps
            halves = split and xs.shape[1] % 2 == 0
            assert sorted(own.instance for own in _FakeOwnGather.built) == ([0] * 4 + [1] * 4 if halves else [0] * 4)
        finally:
            functions.gemm_rs, layers.OwnGather, norm_module.rmsnorm = real_gemm_rs, real_own, real_rmsnorm
        for step in results[1:]:
            for a, b in zip(step, results[0]):
                assert torch.equal(a, b)
        return results[-1], built

    want, _ = run(False, steps=1)
    got, built = run(True)
    for i, (a, b) in enumerate(zip(got, want)):
        _close(a.float(), b.float(), f"split vs whole, tensor {i}", 2e-2)
    proj, fc2 = (tuple(built[0].self_attention.linear_proj.weight.shape), tuple(built[0].mlp.linear_fc2.weight.shape))
    assert calls[:8] == [(proj, 0), (proj, 1), (fc2, 0), (fc2, 1)] * 2, calls[:8]
    # the backward: fc1's and qkv's dgrads of both halves, B's before A's (autograd's reverse of the forward)
    assert [instance for _, instance in calls[8:]] == [1, 0] * 4, calls[8:]
    # as in _check_mlp_boundary's 7 (the forward's proj x 2 and first fc2, the backward's fc1 and qkv x 2), per half,
    # and the second layer's fc2 (unlinked: summed into its output before Megatron's bda, after the other half's MLP)
    assert consumed == [torch.Size([2, SEQ // world * BATCH // 2, H])] * 16, consumed

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(True, steps=1, xs=x[:, :1].contiguous(), gs=g[:, :1].contiguous())
    assert any("the micro-batch has 1 sequences" in str(w.message) for w in caught)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer = build_module(_spec_with(token_split=True), config=_layer_config(world, True).__class__(
            **{**_layer_config(world, True).__dict__, "recompute_granularity": "full", "recompute_method": "uniform",
               "recompute_num_layers": 1}), layer_number=1)
    assert not layer.token_split
    assert any("token-split is off because activations are recomputed" in str(w.message) for w in caught)
    ps.destroy_model_parallel()


def test_token_split_interleaves_two_halves_on_their_own_plans():
    run_distributed(2, _check_token_split)


def _check_defer_wgrad(rank, world):
    """OverlapSettings.defer_wgrad with gathering in place (faked OwnGather on gloo; proj's dgrad AllGather on the signaled
    op in the Triton interpreter, so AgGemm.start/finish run): each layer's linear_fc1 backward leaves its wgrad,
    which linear_proj's backward runs between its AllGather's start and its GEMM and returns through fc1's weight;
    outputs, input grad and every parameter grad bit for bit those of the same layers without it, over two steps,
    with and without an fp32 main_grad added to as Megatron's DDP hook adds a returned grad. Without gathering in place
    nothing is deferred; a deferred wgrad that no backward took is an error at proj's next forward."""
    _quiet()
    ps, spec, x, g = _sp_layer_case(world, 8)
    from megatron.core.transformer.spec_utils import build_module
    from problems import SMALL_TILES
    from overlap_tp.megatron import layers
    from overlap_tp.megatron import linear_functions as functions
    real_own, real_around, events = layers.OwnGather, functions._ag_gemm_around, []

    def around(dz, wt, args, between):
        events.append("gather started")
        out = real_around(dz, wt, args, lambda: (events.append("between"), between())[1])
        events.append("gemm done")
        return out

    signal = {"ag_gemm": OverlapConfig(method="signal", groups=1, **SMALL_TILES), "gemm_rs": OFF, "gemm_ar": OFF}

    def run(defer, main_grad, in_place=True, steps=2):
        torch.manual_seed(99)
        layers.OwnGather, functions._ag_gemm_around = _FakeOwnGather, around
        try:
            config = _layer_config(world, True)
            defer_spec = _spec_with(gather_in_place=in_place, defer_wgrad=defer)
            built = [build_module(defer_spec, config=config, layer_number=n) for n in (1, 2)]
            for layer in built:
                layers.set_overlap_config(layer, signal)
                shared = layer.mlp.linear_fc1.wgrad_handoff
                assert (shared is not None) == (defer and in_place)
                assert shared is layer.self_attention.linear_proj.wgrad_handoff
            params = [p for layer in built for p in layer.parameters()]
            for p in params:
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32) if main_grad else None
            results = []
            for _ in range(steps):
                events.clear()
                for p in params:
                    p.grad = None
                    if main_grad:
                        p.main_grad.zero_()   # as Megatron zeroes its grad buffers every iteration
                xi = x.clone().requires_grad_(True)
                out, _ = built[1](hidden_states=built[0](hidden_states=xi, attention_mask=None)[0],
                                  attention_mask=None)
                out.backward(g)
                grads = [p.main_grad.clone() if main_grad else p.grad for p in params]
                if main_grad:   # what Megatron's DDP hook does with a returned grad, for the undeferred path
                    grads = [m + p.grad.float() if p.grad is not None else m for m, p in zip(grads, params)]
                results.append([out, xi.grad] + grads)
                want = ["gather started", "between", "gemm done"] * 2 if defer and in_place else []
                assert events == want, events
                for layer in built:
                    assert layer.mlp.linear_fc1.wgrad_handoff is None or layer.mlp.linear_fc1.wgrad_handoff.pending is None
        finally:
            layers.OwnGather, functions._ag_gemm_around = real_own, real_around
        return results, built

    for main_grad, steps in ((False, 2), (True, 1)):   # two steps: the handoff, flags and buffers used again
        want, _ = run(False, main_grad, steps=steps)
        got, built = run(True, main_grad, steps=steps)
        for step, (step_got, step_want) in enumerate(zip(got, want)):
            for i, (a, b) in enumerate(zip(step_got, step_want)):
                assert (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b)), \
                    (main_grad, step, i)
    run(True, False, in_place=False, steps=1)   # no own buffer: nothing deferred (the events check)

    # a wgrad left and never taken: proj's next forward says so
    handoff = built[0].mlp.linear_fc1.wgrad_handoff
    handoff.pending = lambda: None
    with pytest.raises(RuntimeError, match="deferred weight gradient was never run"):
        layers.OwnGather = _FakeOwnGather
        try:
            built[0](hidden_states=x.clone().requires_grad_(True), attention_mask=None)
        finally:
            layers.OwnGather = real_own
    ps.destroy_model_parallel()


def test_fc1_wgrad_runs_inside_proj_backward_bit_for_bit():
    run_distributed(2, _check_defer_wgrad)


def _check_links_when_built(rank, world):
    """The MLP boundary's link is made when the layers are built, between consecutive layers of one block only: the
    same config object and the next layer number (Megatron's TransformerBlock), never across configs (another
    model) or over a gap in the numbers (the next virtual pipeline chunk)."""
    _quiet()
    ps = _init_megatron(world)
    from megatron.core.transformer.spec_utils import build_module
    from overlap_tp.megatron.layer_spec import get_gpt_layer_overlap_spec
    spec = get_gpt_layer_overlap_spec(qk_layernorm=True)
    config, other = _layer_config(world, True), _layer_config(world, True)
    built = [build_module(spec, config=c, layer_number=n) for c, n in ((config, 1), (config, 2), (other, 3),
                                                                          (other, 5), (other, 6))]
    links = [layer.next_input_norm for layer in built]
    assert links[0] is built[1].input_layernorm
    assert links[1] is None and links[2] is None                # another config; a gap in the numbers
    assert links[3] is built[4].input_layernorm and links[4] is None
    # an MTP layer built next with the next number is not linked (megatron-core >= 0.19 passes is_mtp_layer; set here)
    mtp = build_module(spec, config=other, layer_number=7)
    assert built[4].next_input_norm is mtp.input_layernorm      # as a decoder layer it would be
    built[4].next_input_norm, mtp.is_mtp_layer = None, True
    mtp.chain.link(built[4])                                     # built[4] the last one built again
    mtp._link_to_previous_built()
    assert built[4].next_input_norm is None
    # the chain is the block spec's: layers of another spec do not link; specs sharing a chain (a block of dense and
    # MoE layer specs) do
    from overlap_tp.megatron.transformer_layer import LayerChain
    first = build_module(get_gpt_layer_overlap_spec(qk_layernorm=True), config=config, layer_number=3)
    second = build_module(get_gpt_layer_overlap_spec(qk_layernorm=True), config=config, layer_number=4)
    assert first.next_input_norm is None
    chain = LayerChain()
    first = build_module(get_gpt_layer_overlap_spec(qk_layernorm=True, chain=chain), config=config, layer_number=3)
    second = build_module(get_gpt_layer_overlap_spec(qk_layernorm=True, chain=chain), config=config, layer_number=4)
    assert first.next_input_norm is second.input_layernorm
    import copy
    spec = get_gpt_layer_overlap_spec(qk_layernorm=True)
    first, second = (build_module(copy.deepcopy(spec), config=config, layer_number=n) for n in (3, 4))
    assert first.next_input_norm is second.input_layernorm      # a copied spec keeps its chain (gpt_block_spec)
    ps.destroy_model_parallel()


def test_layers_link_when_built_consecutively_in_one_block():
    run_distributed(2, _check_links_when_built)


def test_no_mlp_boundary_under_per_layer_graphs():
    from types import SimpleNamespace
    from overlap_tp.megatron.transformer_layer import captured_per_layer
    assert not captured_per_layer(SimpleNamespace(cuda_graph_impl="none"))
    assert not captured_per_layer(SimpleNamespace(cuda_graph_impl="full_iteration"))
    assert not captured_per_layer(SimpleNamespace(cuda_graph_impl="local", cuda_graph_scope=["full_iteration"]))
    assert captured_per_layer(SimpleNamespace(cuda_graph_impl="local", cuda_graph_scope=[]))
    assert captured_per_layer(SimpleNamespace(cuda_graph_impl="local", cuda_graph_scope=["attn"]))
    assert captured_per_layer(SimpleNamespace(cuda_graph_impl="transformer_engine"))
    assert captured_per_layer(SimpleNamespace(cuda_graph_impl="none", enable_cuda_graph=True))


# ---------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------

def _check_errors(rank, world):
    _quiet()
    ps = _init_megatron(world)
    from overlap_tp.megatron.attention import SDPAttention
    from megatron.core.transformer.enums import AttnMaskType

    def build(kind="column", cfg=None, **kw):
        return _build(kind, True, world, cfg or _config(world), in_size=H, out_size=FFN if kind == "column" else H,
                      **kw)

    def config_with(**attrs):
        cfg = _config(world)
        for k, v in attrs.items():
            setattr(cfg, k, v)
        return cfg

    cases = [
        (lambda: build(cfg=config_with(fp8="e4m3")), NotImplementedError, "--fp8-recipe tensorwise or blockwise"),
        (lambda: build(cfg=config_with(fp8="e4m3", fp8_recipe="tensorwise")), NotImplementedError,
         "sequence parallelism"),
        (lambda: build("row", cfg=config_with(fp8="hybrid", fp8_recipe="blockwise")), NotImplementedError,
         "sequence parallelism"),
        (lambda: build(cfg=config_with(fp4="nvfp4")), NotImplementedError, "fp4"),
        (lambda: build(cfg=config_with(delay_wgrad_compute=True)), NotImplementedError, "delay_wgrad_compute"),
        (lambda: build(cfg=_config(world, dtype=torch.float32)), ValueError, "bf16 or fp16"),
        (lambda: build(cfg=_config(world, sp=True), gather_output=True), ValueError, "gather_output"),
        (lambda: build(is_expert=True), NotImplementedError, "MoE"),
        (lambda: build("row", input_is_parallel=False, cfg=_config(world, sp=True)), RuntimeError,
         "input_is_parallel"),
        (lambda: build()(torch.randn(SEQ, BATCH, H + 1).bfloat16()), ValueError, "expected input"),
        (lambda: build("row", cfg=_config(world, sp=True))(torch.randn(SEQ + 1, BATCH, H // world).bfloat16()),
         ValueError, "not divisible"),
        (lambda: build(cfg=_config(world, fusion=True))(torch.randn(SEQ, BATCH, H).bfloat16()), RuntimeError,
         "main_grad"),
        (lambda: build(overlap_config="off"), TypeError, "overlap_config"),
        (lambda: build(overlap_config={"gemm_xx": OFF}), ValueError, "unknown op kinds"),
        (lambda: SDPAttention(config_with(context_parallel_size=2), 1, AttnMaskType.causal, "self"),
         NotImplementedError, "context_parallel_size"),
    ]
    for fn, error, match in cases:
        with pytest.raises(error, match=match):
            fn()
    layer = build()
    with pytest.raises(TypeError):
        layer.overlap_config = 3
    layer.config.delay_wgrad_compute = True
    with pytest.raises(NotImplementedError, match="delay_wgrad_compute"):
        layer.backward_dw()
    ps.destroy_model_parallel()


def test_bad_settings_raise():
    run_distributed(2, _check_errors)


def test_spec_and_provider():
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from overlap_tp.megatron.attention import SDPAttention
    from overlap_tp.megatron.layer_spec import OverlapSpecProvider, get_gpt_layer_overlap_spec
    from overlap_tp.megatron.layers import OverlapColumnParallelLinear, OverlapRowParallelLinear
    from overlap_tp.megatron.norm import OverlapRMSNorm
    from overlap_tp.megatron.transformer_layer import OverlapTransformerLayer
    spec = get_gpt_layer_overlap_spec()
    assert issubclass(spec.module, TransformerLayer) and spec.module is OverlapTransformerLayer
    sub = spec.submodules
    assert sub.input_layernorm is OverlapRMSNorm and sub.pre_mlp_layernorm is OverlapRMSNorm
    assert sub.self_attention.submodules.linear_qkv is OverlapColumnParallelLinear
    assert sub.self_attention.submodules.linear_proj is OverlapRowParallelLinear
    assert sub.mlp.submodules.linear_fc1 is OverlapColumnParallelLinear
    assert sub.mlp.submodules.linear_fc2 is OverlapRowParallelLinear
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        assert sub.self_attention.submodules.core_attention is SDPAttention
    provider = OverlapSpecProvider()
    assert provider.fuse_layernorm_and_linear() is False and provider.column_parallel_layer_norm_linear() is None
    get_gpt_layer_overlap_spec(moe_grouped_gemm=True, normalization="RMSNorm", config=None, vp_stage=None)
    for bad in (dict(normalization="LayerNorm"), dict(multi_latent_attention=True, qk_l2_norm=True),
                dict(fp8="hybrid", num_experts=8)):
        with pytest.raises(NotImplementedError):
            get_gpt_layer_overlap_spec(**bad)
    with pytest.raises(NotImplementedError, match="MoE"):
        provider.grouped_mlp_modules(True, False)
    with pytest.raises(NotImplementedError, match="RMSNorm"):
        provider.layer_norm(rms_norm=False)


def test_auto_gathers_in_place_where_the_tuner_picks_a_p2p_gather(monkeypatch):
    """--overlap-tp auto, gathering in place: a column-parallel layer asks the tuner for its AllGather's
    config at the gathered shape (as its ag_gemm call will) and gathers in place only where that is signal or
    decompose on p2p; on CPU tensors auto runs off and the tuner is not asked; a fixed config asks nothing."""
    from types import SimpleNamespace
    from overlap_tp.megatron import layers
    from overlap_tp.megatron.settings import OverlapSettings
    from overlap_tp.ops import resolve as resolver
    asked, picks = [], []
    monkeypatch.setattr(resolver, "resolve_auto", lambda op, m, n, k, dtype, device, group, base:
                        asked.append((op, m, n, k, base.method)) or picks[-1])
    def new_linear():
        return SimpleNamespace(overlap_config=OverlapConfig(method="auto"), settings=OverlapSettings(), tp_group=None,
                               _in_place_resolved=None,
                               output_size_per_partition=768, input_size=1024)
    in_place_config = layers.OverlapColumnParallelLinear._in_place_config
    cuda = torch.device("cuda")   # a device object only: nothing is allocated
    for pick, in_place in ((OverlapConfig(method="signal", transport="p2p"), True),
                           (OverlapConfig(method="decompose", transport="p2p"), True),
                           (OverlapConfig(method="signal", transport="nccl"), False),
                           (OverlapConfig(method="off"), False)):
        picks.append(pick)
        linear = new_linear()
        resolved = resolver.fill_defaults(pick, "ag_gemm", cuda, 1)   # the tuner's pick, its unset fields filled
        assert in_place_config(linear, 2048, torch.bfloat16, cuda) == (resolved if in_place else None), pick
        # the next forward of the same shape asks nothing: the answer is kept
        assert in_place_config(linear, 2048, torch.bfloat16, cuda) == (resolved if in_place else None), pick
    assert asked == [("ag_gemm", 2048, 768, 1024, "auto")] * 4   # no TP group here: t = 1, the gathered rows = m
    assert in_place_config(linear, 4096, torch.bfloat16, cuda) is None and asked[-1][1] == 4096   # a new shape asks
    asked.clear()
    assert in_place_config(linear, 2048, torch.bfloat16, torch.device("cpu")) is None and asked == []
    linear.overlap_config = {"ag_gemm": OverlapConfig(method="decompose", transport="p2p")}
    assert in_place_config(linear, 2048, torch.bfloat16, cuda) == resolver.fill_defaults(
        linear.overlap_config["ag_gemm"], "ag_gemm", cuda, 1) and asked == []
