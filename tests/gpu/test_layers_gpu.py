"""OverlapColumnParallelLinear / OverlapRowParallelLinear against Megatron's own ColumnParallelLinear /
RowParallelLinear on all GPUs here (NCCL, TP = gpu_world(), bf16; run on the device: `pytest -m gpu tests/gpu`).

Shapes: the Llama-3-8B layer's four linears at s = 4096, micro-batch 1 (qkv 4096 -> 6144 and fc1
4096 -> 2 x 14336 column-parallel, proj 4096 -> 4096 and fc2 14336 -> 4096 row-parallel, no bias), plus an
odd small pair with bias (s = 520: 520/t rows per rank under SP; 1088 and 1216 are not multiples of the
tiles, but their shards stay multiples of 8 up to t = 8, which the signaled kernel's TMA needs).
Sequence parallel on and off. Megatron's layer and ours hold the same weights (ours copied from
Megatron's; `test_same_seed_same_weights` checks that the same seed already gives them) and see the same
inputs. Per case, Megatron's layer and ours are each compared with an fp32 dense computation from the
full weights and inputs (relative Frobenius error):

- outputs, input grads, weight grads, bias grads for methods off, signal (NCCL per-group collectives,
  the default config) and decompose (chunks 4), and in a second test the signal p2p transports
  (ag_gemm and gemm_rs peer-to-peer, comm_sms 0);
- pass: err(ours) <= 1.5 * err(Megatron) + 1e-3 (the bf16 noise the reference itself has; the GPU op
  tests use 1.05x for single ops; 3x on the CPU, where the signal path runs in Triton's interpreter) and
  rel(ours, Megatron) <= 1e-2;
- gradient_accumulation_fusion on (ours; wgrad accumulated into an fp32 main_grad over two
  micro-batches, DDP's grad_added_to_main_grad contract): Megatron's layers refuse the fusion without
  Apex (ColumnParallelLinear raises at construction, RowParallelLinear would fail in backward on the
  missing fused_weight_gradient_mlp_cuda), so ours is compared with Megatron's plain bf16 weight grads
  of the same two micro-batches accumulated in fp32, and with the fp32 dense sum, under the same rule.

And OverlapTransformerLayer on the p2p transports: linear_proj's sum done inside the fused bda + norm kernel is
bit for bit the summed path (20 steps); two layers with every p2p sum left to the norms' kernels (linear_proj's,
fc2's across the MLP boundary, the column-parallel dgrads') bit for bit the summed path: 20 steps at a small size,
3 steps at the 8B and 70B layer sizes (s 8192), 200 steps with a late peer.

CPU (gloo, tiny shapes, methods off / decompose / signal in Triton's interpreter):
`python tests/gpu/test_layers_gpu.py --cpu`; tests/test_layer_bench.py runs a part of it in CI.
"""
import argparse
import os
import warnings

import pytest
import torch
import torch.distributed as dist

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from distributed import run_distributed  # noqa: E402
from gpu_checks import rel_error  # noqa: E402
from overlap_tp import OverlapConfig  # noqa: E402

pytestmark = pytest.mark.gpu

# (name, kind, input size, output size, bias, sequence length)
GPU_SHAPES = [("l8b.qkv", "column", 4096, 6144, False, 4096), ("l8b.proj", "row", 4096, 4096, False, 4096),
              ("l8b.fc1", "column", 4096, 2 * 14336, False, 4096), ("l8b.fc2", "row", 14336, 4096, False, 4096),
              ("odd.column", "column", 1088, 1216, True, 520), ("odd.row", "row", 1216, 1088, True, 520)]
CPU_SHAPES = [("tiny.qkv", "column", 64, 96, False, 32), ("tiny.fc2", "row", 128, 64, False, 32),
              ("odd.column", "column", 40, 48, True, 24), ("odd.row", "row", 48, 40, True, 24)]
SMALL_TILES = dict(block_m=16, block_n=32, block_k=16)   # the Triton interpreter on the CPU

RATIO, SLACK, DIRECT = 1.5, 1e-3, 1e-2
CPU_RATIO = 3.0   # Triton's CPU interpreter rounds its dot products worse than a GPU's fp32 accumulation


P2P_METHODS = ("signal", "decompose")


def _p2p_configs(method):
    """The layers' op configs with both sequence-parallel collectives on the p2p transports under `method`."""
    p2p = OverlapConfig(method=method, transport="p2p", comm_sms=0, chunks=2)
    return {"ag_gemm": p2p, "gemm_rs": p2p, "gemm_ar": OverlapConfig(method="signal", transport="nccl")}


def methods(device_type, p2p=False):
    tiles = SMALL_TILES if device_type == "cpu" else {}
    if p2p:   # the p2p transports under the signaled GEMM and under cuBLAS (decompose)
        return {f"{method}-p2p": _p2p_configs(method) for method in P2P_METHODS}
    return {"off": OverlapConfig(method="off"), "signal": OverlapConfig(method="signal", transport="nccl", **tiles),
            "decompose": OverlapConfig(method="decompose", transport="nccl", chunks=4)}


def rel(got, ref):
    ref = ref.float()
    return float((got.float() - ref).norm() / max(float(ref.norm()), 1e-30))


def _quiet():
    warnings.filterwarnings("ignore")


def _setup(world, device_type):
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    return ps


def _settings(**switches):
    """OverlapSettings with these layer switches and every op kind 'off' (never the tuner, 'auto', by accident: each
    test sets the configs it runs)."""
    from overlap_tp.megatron.settings import OverlapSettings
    return OverlapSettings(**switches).with_configs(OverlapConfig(method="off"))


def _config(world, device_type, sp, fusion=False):
    from megatron.core.transformer.transformer_config import TransformerConfig
    # 8 heads: Megatron wants the head count divisible by TP, and the GPU tests run at t up to 8 (the linears
    # themselves do not use heads; hidden_size only names the config).
    return TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=8, params_dtype=torch.bfloat16, bf16=True,
                             tensor_model_parallel_size=world, sequence_parallel=sp,
                             gradient_accumulation_fusion=fusion, use_cpu_initialization=device_type == "cpu")


def _seed(seed, device_type):
    torch.manual_seed(seed)
    if device_type == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(seed)


def _build(kind, ours, config, in_size, out_size, bias, seed=1234):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from overlap_tp.megatron.layers import OverlapColumnParallelLinear, OverlapRowParallelLinear
    _seed(seed, "cpu" if config.use_cpu_initialization else "cuda")
    init = lambda w: torch.nn.init.normal_(w, std=0.02)  # noqa: E731
    settings = {"settings": _settings()} if ours else {}
    if kind == "column":
        cls = OverlapColumnParallelLinear if ours else ColumnParallelLinear
        return cls(in_size, out_size, config=config, init_method=init, bias=bias, gather_output=False,
                   skip_bias_add=False, **settings)
    cls = OverlapRowParallelLinear if ours else RowParallelLinear
    return cls(in_size, out_size, config=config, init_method=init, bias=bias, input_is_parallel=True,
               skip_bias_add=False, **settings)


def _gather(t, dim, group):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class Case:
    """One layer shape with SP on or off: the full inputs, this rank's slices, the fp32 dense results."""

    def __init__(self, kind, sp, w_full, b_full, seq, in_size, out_size, rank, t, device, seed):
        gen = torch.Generator(device=device).manual_seed(seed)
        self.kind, self.sp = kind, sp
        x = torch.randn(seq, 1, in_size, device=device, generator=gen).to(torch.bfloat16)
        g = torch.randn(seq, 1, out_size, device=device, generator=gen).to(torch.bfloat16)
        rows = slice(rank * seq // t, (rank + 1) * seq // t)
        w, xf, gf = w_full.float(), x.float(), g.float()
        x2, g2 = xf.reshape(seq, in_size), gf.reshape(seq, out_size)
        if kind == "column":
            n = out_size // t
            cols = slice(rank * n, (rank + 1) * n)
            self.x_in = x[rows] if sp else x
            self.g_in = g[:, :, cols]
            out = xf @ w[cols].t() + (b_full.float()[cols] if b_full is not None else 0)
            full_dx = gf @ w                      # every rank's contribution summed
            self.out_ref = out
            self.dx_ref = full_dx[rows] if sp else full_dx
            self.dw_ref = g2[:, cols].t() @ x2
            self.db_ref = g2[:, cols].sum(0)
        else:
            k = in_size // t
            cols = slice(rank * k, (rank + 1) * k)
            self.x_in = x[:, :, cols]
            self.g_in = g[rows] if sp else g
            out = xf @ w.t() + (b_full.float() if b_full is not None else 0)
            self.out_ref = out[rows] if sp else out
            self.dx_ref = (gf @ w)[:, :, cols]
            self.dw_ref = g2.t() @ x2[:, cols]
            self.db_ref = (g2[rows] if sp else g2).sum(0)


def run_layer(layer, case):
    x = case.x_in.detach().clone().requires_grad_(True)
    out, _ = layer(x)
    out.backward(case.g_in)
    return out.detach(), x.grad


def _judge(what, got, megatron, ref, failures, log):
    err_ours, err_meg, direct = rel(got, ref), rel(megatron, ref), rel(got, megatron)
    ratio = RATIO if got.is_cuda else CPU_RATIO
    ok = err_ours <= ratio * err_meg + SLACK and direct <= DIRECT
    log.append(f"{'ok  ' if ok else 'FAIL'} {what}: err ours {err_ours:.3e}, Megatron {err_meg:.3e}, "
               f"ours vs Megatron {direct:.3e}")
    if not ok:
        failures.append(log[-1])


def check_layers(rank, world, device_type, shapes, method_set, fusion=True):
    """Every shape x SP on/off x method: outputs and grads against Megatron's layer and fp32 dense."""
    _quiet()
    from overlap_tp.bench.reference_spec import megatron_sp_on_cpu
    ps = _setup(world, device_type)
    group = ps.get_tensor_model_parallel_group()
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    poison = None
    if device_type == "cuda":
        from gpu_checks import poison_allocator as poison
    failures, log = [], []
    with megatron_sp_on_cpu(device_type == "cpu"):
        for index, (name, kind, in_size, out_size, bias, seq) in enumerate(shapes):
            for sp in (True, False):
                meg = _build(kind, False, _config(world, device_type, sp), in_size, out_size, bias)
                dim = 0 if kind == "column" else 1
                w_full = _gather(meg.weight.detach(), dim, group)
                b_full = None
                if bias:
                    b_full = _gather(meg.bias.detach(), 0, group) if kind == "column" else meg.bias.detach()
                cases = [Case(kind, sp, w_full, b_full, seq, in_size, out_size, rank, world, device,
                              seed=100 * index + 10 * sp + mb) for mb in range(2)]
                m_results = []
                for case in cases:   # Megatron's plain bf16 grads of both micro-batches
                    meg.zero_grad(set_to_none=True)
                    out, dx = run_layer(meg, case)
                    m_results.append((out, dx, meg.weight.grad.clone(), meg.bias.grad.clone() if bias else None))
                case, (m_out, m_dx, m_dw, m_db) = cases[0], m_results[0]
                tag = f"{name} sp={sp}"
                for label, overlap in method_set.items():
                    ours = _build(kind, True, _config(world, device_type, sp), in_size, out_size, bias)
                    with torch.no_grad():
                        ours.weight.copy_(meg.weight)
                        if bias:
                            ours.bias.copy_(meg.bias)
                    ours.overlap_config = overlap
                    if poison is not None:
                        poison()
                    out, dx = run_layer(ours, case)
                    what = f"{tag} {label}"
                    _judge(what + " output", out, m_out, case.out_ref, failures, log)
                    _judge(what + " input grad", dx, m_dx, case.dx_ref, failures, log)
                    _judge(what + " weight grad", ours.weight.grad, m_dw, case.dw_ref, failures, log)
                    if bias:
                        _judge(what + " bias grad", ours.bias.grad, m_db, case.db_ref, failures, log)
                    del ours
                    if not fusion:
                        continue
                    # gradient_accumulation_fusion: fp32 main_grad over both micro-batches
                    fused = _build(kind, True, _config(world, device_type, sp, fusion=True), in_size, out_size, bias)
                    with torch.no_grad():
                        fused.weight.copy_(meg.weight)
                        if bias:
                            fused.bias.copy_(meg.bias)
                    fused.overlap_config = overlap
                    start = torch.randn(fused.weight.shape, device=device, dtype=torch.float32,
                                        generator=torch.Generator(device=device).manual_seed(5)) * 1e-3
                    fused.weight.main_grad = start.clone()
                    fused.weight.grad_added_to_main_grad = False      # what Megatron's DDP sets
                    for mb_case in cases:
                        run_layer(fused, mb_case)
                    got = fused.weight.main_grad - start
                    megatron_acc = m_results[0][2].float() + m_results[1][2].float()
                    ref_acc = cases[0].dw_ref + cases[1].dw_ref
                    _judge(what + " main_grad (fusion, 2 micro-batches)", got, megatron_acc, ref_acc, failures, log)
                    if fused.weight.main_grad.dtype != torch.float32 or fused.weight.grad_added_to_main_grad is not True:
                        failures.append(f"{what}: main_grad dtype {fused.weight.main_grad.dtype}, "
                                        f"grad_added_to_main_grad {fused.weight.grad_added_to_main_grad}")
                    del fused
                del meg
                if device_type == "cuda":
                    torch.cuda.empty_cache()
    if rank == 0:
        print("\n" + "\n".join(log), flush=True)
    assert not failures, "\n".join(failures)
    ps.destroy_model_parallel()


def check_same_seed_same_weights(rank, world, device_type):
    """Our layers draw their weights through Megatron's own initialisation: the same seed, the same
    weights (and the same tensor-parallel attributes)."""
    _quiet()
    ps = _setup(world, device_type)
    for kind, in_size, out_size in (("column", 256, 512), ("row", 512, 256)):
        for sp in (True, False):
            config = _config(world, device_type, sp)
            meg = _build(kind, False, config, in_size, out_size, True)
            ours = _build(kind, True, config, in_size, out_size, True)
            for (n, p), (_, q) in zip(meg.named_parameters(), ours.named_parameters()):
                assert torch.equal(p, q), f"{kind} sp={sp} {n}: the same seed gave other values"
                for attr in ("tensor_model_parallel", "partition_dim", "sequence_parallel", "allreduce"):
                    assert getattr(p, attr, None) == getattr(q, attr, None), (kind, sp, n, attr)
    ps.destroy_model_parallel()


def _gpu_world():
    from gpu_checks import gpu_world
    return gpu_world()


def test_same_seed_same_weights():
    run_distributed(_gpu_world(), check_same_seed_same_weights, "cuda", backend="nccl")


@pytest.mark.parametrize("shapes", [GPU_SHAPES[:4], GPU_SHAPES[4:]], ids=["llama3-8b.s4096", "odd"])
def test_linears_match_megatron(shapes):
    run_distributed(_gpu_world(), check_layers, "cuda", shapes, methods("cuda"), backend="nccl")


def test_linears_match_megatron_p2p():
    run_distributed(_gpu_world(), check_layers, "cuda", GPU_SHAPES, methods("cuda", p2p=True), backend="nccl")


# Llama-like layer sizes: a small one for the many-step checks, and the 8B and 70B layers (bench layer's MODELS)
LAYER_SIZES = {"small": dict(hidden=1024, heads=8, groups=4, ffn=2816),
               "l8b": dict(hidden=4096, heads=32, groups=8, ffn=14336),
               "l70b": dict(hidden=8192, heads=64, groups=8, ffn=28672)}


def _sp_p2p_config(world, num_layers, deterministic=False, method="signal", size="small"):
    """A Llama-like TransformerConfig of LAYER_SIZES[size] (SP where TP > 1, no bias, no dropout; Megatron's
    deterministic_mode if asked) and the layers' op configs with both sequence-parallel collectives on the p2p
    transports under `method` (signal: the default of --overlap-tp signal; decompose: cuBLAS)."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    dims = LAYER_SIZES[size]
    config = TransformerConfig(num_layers=num_layers, hidden_size=dims["hidden"], num_attention_heads=dims["heads"],
                               num_query_groups=dims["groups"], ffn_hidden_size=dims["ffn"],
                               params_dtype=torch.bfloat16, bf16=True, normalization="RMSNorm",
                               tensor_model_parallel_size=world, sequence_parallel=world > 1, hidden_dropout=0.0,
                               attention_dropout=0.0, add_bias_linear=False, gated_linear_unit=True,
                               init_method_std=0.02, deterministic_mode=deterministic)
    return config, _p2p_configs(method)


def _deterministic():
    """What Megatron's --deterministic-mode sets up for the process (megatron.training.determinism): cuBLAS with a
    fixed workspace (read when the handle is made) and torch's deterministic algorithms. With the config's
    deterministic_mode (SDPAttention on the math kernel), two identical steps are bit-exact, so two layer
    variants can be compared bit for bit (the flash kernel's backward differs run to run)."""
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True, warn_only=True)


def _fresh_steps(seed, seq, hidden, steps, batch=1):
    """`steps` pairs (input, output grad) of fresh bf16 random [seq, batch, hidden] tensors."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(steps):
        yield tuple(torch.randn(seq, batch, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
                    for _ in range(2))


def _linked_pair(config, p2p_configs, seed, **switches):
    """Two OverlapTransformerLayers in a row (layer numbers 1, 2; the first's MLP boundary linked to the second's
    input norm), built on the GPU from `seed` with these OverlapSettings switches (gather_in_place, ...), with the
    p2p op configs."""
    from megatron.core.transformer.spec_utils import build_module
    from overlap_tp.megatron.layer_spec import get_gpt_layer_overlap_spec
    from overlap_tp.megatron.layers import set_overlap_config
    _seed(seed, "cuda")
    spec = get_gpt_layer_overlap_spec(settings=_settings(**switches))
    pair = [build_module(spec, config=config, layer_number=n).cuda() for n in (1, 2)]
    for layer in pair:
        set_overlap_config(layer, p2p_configs)
    return pair


def _fwd_bwd(stack, x, g):
    """The layers of `stack` in a row on x, backward with g: [output, input grad, every parameter grad]."""
    for layer in stack:
        layer.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(True)
    out = xi
    for layer in stack:
        out, _ = layer(hidden_states=out, attention_mask=None)
    out.backward(g)
    return [out, xi.grad] + [p.grad for layer in stack for _, p in layer.named_parameters()]


def _count_deferred_dgrads():
    """A list that grows by one per dgrad sum left to a norm's backward (DeferredGrad.defer), for this process."""
    from overlap_tp.kernels.fused_add_rmsnorm import DeferredGrad
    calls, defer = [], DeferredGrad.defer

    def counted(self, placeholder, deferred_sum):
        calls.append(placeholder.shape)
        return defer(self, placeholder, deferred_sum)
    DeferredGrad.defer = counted
    return calls


def check_deferred_proj_sum(rank, world, method="signal"):
    """OverlapTransformerLayer (SP, p2p transports) with linear_proj's reduce-scatter sum left to the fused
    bias-dropout-add + norm kernel, and linear_qkv's and linear_fc1's dgrad sums left to the input and pre-MLP norms'
    backward kernels (the defaults), against the same layer summing first (fused_proj_sum, sum_dgrad_in_norm off):
    output, input grad and every parameter grad bit for bit, over 20 back-to-back steps with fresh inputs
    (the p2p protocol's second half run by the norms' kernels every time)."""
    _quiet()
    _deterministic()
    from megatron.core.transformer.spec_utils import build_module
    from overlap_tp.megatron.layer_spec import get_gpt_layer_overlap_spec
    from overlap_tp.megatron.layers import set_overlap_config
    ps = _setup(world, "cuda")
    config, p2p_configs = _sp_p2p_config(world, num_layers=1, deterministic=True, method=method)
    layers = []
    for fused in (True, False):
        _seed(77, "cuda")
        layer = build_module(get_gpt_layer_overlap_spec(settings=_settings()), config=config, layer_number=1).cuda()
        set_overlap_config(layer, p2p_configs)
        assert layer.fused_proj_sum, "the deferred sum should be on by default here"
        layer.fused_proj_sum = fused
        for linear in (layer.self_attention.linear_qkv, layer.mlp.linear_fc1):
            assert linear.sum_dgrad_in_norm, "the deferred dgrad sums should be on by default here"
            linear.sum_dgrad_in_norm = fused
        layers.append(layer)
    deferred = _count_deferred_dgrads()
    for step, (x, g) in enumerate(_fresh_steps(5 + rank, 4096 // world, config.hidden_size, 20)):
        deferred.clear()
        results = [_fwd_bwd([layer], x, g) for layer in layers]
        assert len(deferred) == 2, f"step {step}: {len(deferred)} dgrad sums left to the norms, expected 2"
        assert torch.isfinite(results[0][0]).all()
        for i, (a, b) in enumerate(zip(*results)):
            assert torch.equal(a, b), f"step {step} rank {rank}: tensor {i} differs from the summed path"
    torch.cuda.synchronize()
    ps.destroy_model_parallel()


@pytest.mark.parametrize("method", P2P_METHODS)
def test_transformer_layer_p2p_sum_in_the_norm_kernel_is_bitwise_the_summed_path(method):
    run_distributed(_gpu_world(), check_deferred_proj_sum, method, backend="nccl")


def check_mlp_boundary(rank, world, method="signal", size="small", seq=4096, steps=20, late_every=0,
                       variants=("fused", "summed fc2", "unlinked")):
    """Two OverlapTransformerLayers in a row (SP, p2p transports; LAYER_SIZES[size], `seq` tokens): from the first
    step the first layer's mlp bda runs the second layer's input norm and sums fc2's p2p partials in the same kernel,
    linear_proj's sum is left to the fused attention bda + pre-MLP norm, and the column-parallel dgrads' sums to the
    norms' backward kernels (the defaults; the second layer's qkv dgrad to the first layer's fused mlp bda). Against
    the linked pair summing everything first (fused_fc2_sum, fused_proj_sum, sum_dgrad_in_norm off): bit for bit over
    `steps` steps with fresh inputs; against the unlinked pair (Megatron's bda, then the norm): within bf16 rounding.
    late_every > 0: before every late_every-th step rank 1 holds its stream ~0.1 s, so rank 0's waits are real."""
    _quiet()
    _deterministic()
    ps = _setup(world, "cuda")
    config, p2p_configs = _sp_p2p_config(world, num_layers=2, deterministic=True, method=method, size=size)
    pairs = []
    for variant in variants:
        pair = _linked_pair(config, p2p_configs, 78)
        assert pair[0].fused_mlp_boundary, "the MLP boundary should be on by default here"
        pair[0].fused_fc2_sum = variant == "fused"
        pair[0].fused_mlp_boundary = variant != "unlinked"
        for layer in pair:   # the proj and dgrad sums left to the norms' kernels in the fused pair only
            if variant != "fused":
                layer.fused_proj_sum = False
            for linear in (layer.self_attention.linear_qkv, layer.mlp.linear_fc1):
                linear.sum_dgrad_in_norm = variant == "fused"
        pairs.append(pair)
    for step, (x, g) in enumerate(_fresh_steps(6 + rank, seq // world, config.hidden_size, steps)):
        if late_every and step % late_every == 0 and rank == 1:
            torch.cuda._sleep(200_000_000)   # ~0.1 s of GPU time ahead of this rank's step
        results = [_fwd_bwd(pair, x, g) for pair in pairs]
        assert torch.isfinite(results[0][0]).all()
        assert pairs[0][0].next_input_norm is pairs[0][1].input_layernorm
        for i, (a, b, *unlinked) in enumerate(zip(*results)):
            assert torch.equal(a, b), f"step {step} rank {rank}: tensor {i} differs from the summed path"
            for c in unlinked:
                assert rel_error(a, c.float()) < 2e-2, f"step {step} rank {rank}: tensor {i} vs the unlinked pair"
        del results
    torch.cuda.synchronize()
    ps.destroy_model_parallel()


@pytest.mark.parametrize("method", P2P_METHODS)
def test_mlp_boundary_next_norm_and_fc2_sum_in_one_kernel(method):
    run_distributed(_gpu_world(), check_mlp_boundary, method, backend="nccl")


@pytest.mark.parametrize("method", P2P_METHODS)
@pytest.mark.parametrize("size", ["l8b", "l70b"])
def test_fused_blocks_at_the_8b_and_70b_layer_shapes(size, method):
    """The fused block's check at training sizes: two 8B / 70B layers at s 8192 with every sum left to the norms' kernels
    (forward and backward), bit for bit the summed path, 3 steps."""
    run_distributed(_gpu_world(), check_mlp_boundary, method, size, 8192, 3, 0, ("fused", "summed"), backend="nccl")


@pytest.mark.parametrize("method", P2P_METHODS)
def test_fused_blocks_200_steps_with_a_late_peer(method):
    """200 back-to-back steps of the fused pair (no host synchronisation between them but the comparison), rank 1
    late by ~0.1 s before every 50th: no hang, every step bit for bit the summed path."""
    run_distributed(_gpu_world(), check_mlp_boundary, method, "small", 2048, 200, 50, ("fused", "summed"),
                    backend="nccl")


def test_mlp_boundary_on_one_gpu():
    """The same at TP 1 (no SP, so fc2 has no p2p sum to defer): the compiled kernel with the next layer's norm
    weight and the handover, within bf16 rounding of Megatron's bda followed by the norm."""
    run_distributed(1, check_mlp_boundary, backend="nccl")


def run_on_cpu(shapes=None, method_names=None, fusion=True):
    """The same checks under gloo on two CPU processes at tiny shapes."""
    chosen = methods("cpu")
    if method_names:
        chosen = {k: v for k, v in chosen.items() if k in method_names}
    run_distributed(2, check_same_seed_same_weights, "cpu")
    run_distributed(2, check_layers, "cpu", shapes or CPU_SHAPES, chosen, fusion)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="gloo, tiny shapes")
    cli = parser.parse_args()
    if cli.cpu:
        run_on_cpu()
    else:
        run_distributed(2, check_same_seed_same_weights, "cuda", backend="nccl")
        for label in ("default", "p2p"):
            run_distributed(2, check_layers, "cuda", GPU_SHAPES, methods("cuda", p2p=label == "p2p"), backend="nccl")


def check_gather_in_place(rank, world, method="signal", size="small", seq=4096, steps=20, late_every=0,
                          defer_wgrad=False):
    """Two OverlapTransformerLayers in a row (SP, p2p transports) built with OverlapSettings.gather_in_place: every norm
    before linear_qkv and linear_fc1 writes straight into that linear's own gathered buffer, the forward AllGathers
    stage nothing and the backward re-gathers nothing. Against the same pair without it: bit for bit (the same bits,
    written and read elsewhere) over `steps` steps with fresh inputs; late_every > 0: rank 1 holds its stream ~0.1 s
    before every late_every-th step, so the claims' waits for the peers' pulls are real.
    method "auto": a linear gathers in place exactly where the tuner picked signal or decompose on p2p for its
    AllGather (the staged pair runs the same picks: the tuner keeps one decision per shape), the others re-gather.
    defer_wgrad: the in-place pair also leaves each linear_fc1's wgrad to linear_proj's backward (OverlapSettings.defer_wgrad),
    which must run it (the handoffs empty after every step) with the same bits."""
    _quiet()
    _deterministic()
    from overlap_tp.megatron import linear_functions as functions_module
    ps = _setup(world, "cuda")
    config, p2p_configs = _sp_p2p_config(world, num_layers=2, deterministic=True, method=method, size=size)
    pairs = []
    for in_place in (True, False):
        pairs.append(_linked_pair(config, p2p_configs, 79, gather_in_place=in_place,
                                  defer_wgrad=defer_wgrad and in_place))
    real_gather_rows, regathers = functions_module.gather_rows, []

    def counted_gather_rows(*args, **kwargs):
        regathers.append(args[0].shape)
        return real_gather_rows(*args, **kwargs)
    functions_module.gather_rows = counted_gather_rows
    try:
        for step, (x, g) in enumerate(_fresh_steps(7 + rank, seq // world, config.hidden_size, steps)):
            if late_every and step % late_every == 0 and rank == 1:
                torch.cuda._sleep(200_000_000)   # ~0.1 s of GPU time ahead of this rank's step
            regathers.clear()
            got = _fwd_bwd(pairs[0], x, g)
            handoffs = [layer.mlp.linear_fc1.wgrad_handoff for layer in pairs[0]]
            assert all((h is not None) == defer_wgrad and (h is None or h.pending is None) for h in handoffs), handoffs
            owned = [linear for layer in pairs[0] for linear in (layer.self_attention.linear_qkv, layer.mlp.linear_fc1)
                     if linear._own_gathers.get(0) is not None]
            assert len(regathers) == 4 - len(owned), f"step {step}: the in-place pair re-gathered {regathers}"
            want = _fwd_bwd(pairs[1], x, g)
            assert len(regathers) == 4 - len(owned) + 4, regathers
            assert torch.isfinite(got[0]).all()
            for i, (a, b) in enumerate(zip(got, want)):
                assert torch.equal(a, b), f"step {step} rank {rank}: tensor {i} differs from the staged path"
            del got, want
    finally:
        functions_module.gather_rows = real_gather_rows
    for layer in pairs[0]:
        for linear in (layer.self_attention.linear_qkv, layer.mlp.linear_fc1):
            own = linear._in_place_config(seq // world, torch.bfloat16, torch.device("cuda")) is not None
            assert own == (linear._own_gathers.get(0) is not None) and (own or method == "auto"), \
                "a linear owns its gathered buffer exactly where its AllGather's config can gather in place"
    # the own buffers ([seq, hidden] bf16 each) in the count the training log prints (ops/symmetric.py)
    from overlap_tp.ops import symmetric
    assert symmetric.allocated().get("gathered in place", 0) == len(owned) * seq * config.hidden_size * 2, \
        symmetric.allocated()
    torch.cuda.synchronize()
    ps.destroy_model_parallel()
    return [name for layer in pairs[0]   # the linears that gathered in place, by name
            for name, linear in (("linear_qkv", layer.self_attention.linear_qkv), ("linear_fc1", layer.mlp.linear_fc1))
            if linear._own_gathers.get(0) is not None]


@pytest.mark.parametrize("method", P2P_METHODS)
def test_norms_write_into_the_gathered_buffers_bitwise(method):
    run_distributed(_gpu_world(), check_gather_in_place, method, backend="nccl")


def check_auto_gathers_in_place(rank, world):
    """check_gather_in_place under 'auto' with the tuner's answers fixed: linear_qkv's AllGather on p2p (signal, its
    pulls on 16 SMs: one kernel with the handshakes inside, a candidate the tuner measures), linear_fc1's on NCCL, so
    both branches run whatever the machine would measure (the real tuner may pick NCCL for every AllGather of the
    small pair, and then nothing gathers in place). The decisions are asked for where the
    layers ask the tuner (OverlapColumnParallelLinear._in_place_config, then the ag_gemm call) and kept per shape, as
    the tuner keeps them."""
    from overlap_tp.ops import tuner_hook as config_module
    qkv_n = _qkv_output_size("small") // world
    asked = []

    def tuner_stand_in(op, m, n, k, dtype, device, group, base):
        asked.append((op, n))
        if op == "ag_gemm":
            transport = "p2p" if n == qkv_n else "nccl"
            return OverlapConfig(method="signal", transport=transport, comm_sms=16 if transport == "p2p" else 8)
        return OverlapConfig(method="signal", transport="p2p", comm_sms=0)

    real = config_module._auto_resolver
    config_module.set_auto_resolver(tuner_stand_in)
    try:
        owned = check_gather_in_place(rank, world, "auto", "small", 4096, 5)
    finally:
        config_module.set_auto_resolver(real)
    assert owned == ["linear_qkv", "linear_qkv"], owned
    assert ("ag_gemm", qkv_n) in asked and any(op == "ag_gemm" and n != qkv_n for op, n in asked), asked


def _qkv_output_size(size):
    """linear_qkv's output columns (all ranks) at LAYER_SIZES[size]: the queries, then a key and a value per group."""
    dims = LAYER_SIZES[size]
    head = dims["hidden"] // dims["heads"]
    return dims["hidden"] + 2 * dims["groups"] * head


def test_auto_gathers_in_place_where_the_tuner_picks_p2p_bitwise():
    """--overlap-tp auto, gathering in place: in place where the tuner's config for linear_qkv's /
    linear_fc1's AllGather is signal or decompose on p2p, staged elsewhere (here: qkv in place, fc1 staged), bit for
    bit the staged pair."""
    run_distributed(_gpu_world(), check_auto_gathers_in_place, backend="nccl")


@pytest.mark.parametrize("method", P2P_METHODS)
def test_gather_in_place_at_the_8b_layer_shape_and_200_steps_with_a_late_peer(method):
    """Two 8B layers at s 8192 (3 steps), then 200 steps of the small pair with rank 1 late before every 50th."""
    run_distributed(_gpu_world(), check_gather_in_place, method, "l8b", 8192, 3, 0, backend="nccl")
    run_distributed(_gpu_world(), check_gather_in_place, method, "small", 2048, 200, 50, backend="nccl")


@pytest.mark.parametrize("method", P2P_METHODS)
def test_deferred_fc1_wgrad_bitwise(method):
    """The deferred wgrad (OverlapSettings.defer_wgrad): each fc1 wgrad run inside proj's backward (signal: between its AllGather's start and
    its GEMM; decompose: before the call), 8B layers at s 8192, 3 steps, then the small pair 20 steps with a late peer:
    bit for bit the staged pair."""
    run_distributed(_gpu_world(), check_gather_in_place, method, "l8b", 8192, 3, 0, True, backend="nccl")
    run_distributed(_gpu_world(), check_gather_in_place, method, "small", 4096, 20, 5, True, backend="nccl")


@pytest.mark.parametrize("method", P2P_METHODS)
def test_gather_in_place_at_the_70b_layer_shape(method):
    """Two 70B layers at s 8192 (2 steps): bit for bit the staged path at the 70B shapes too, which rules the layer
    out when a 70B run's loss parts from off's (a short schedule's chaos can do that on its own)."""
    run_distributed(_gpu_world(), check_gather_in_place, method, "l70b", 8192, 2, 0, backend="nccl")


def check_token_split(rank, world, method="signal", size="small", seq=4096, steps=20, late_every=0):
    """OverlapSettings.token_split on two linked layers gathering in place with the deferred wgrad (the llama3 recipes'
    settings at TP >= 4), SP on the p2p transports, a micro-batch of 2 sequences run as two interleaved halves, each on
    its own plans and buffers: against the same pair run whole, within bf16 rounding (each half's GEMMs see half the
    rows, the weight gradients sum two halves), over `steps` steps with fresh inputs; the first step run twice on the
    same input gives the same bits; late_every > 0: rank 1 holds its stream ~0.1 s before every late_every-th step
    (the halves' waits are real; no hang)."""
    _quiet()
    _deterministic()
    ps = _setup(world, "cuda")
    config, p2p_configs = _sp_p2p_config(world, num_layers=2, deterministic=True, method=method, size=size)
    pairs = []
    for split in (True, False):
        pair = _linked_pair(config, p2p_configs, 79, gather_in_place=True, defer_wgrad=True, token_split=split)
        assert all(layer.token_split == split for layer in pair)
        pairs.append(pair)
    for step, (x, g) in enumerate(_fresh_steps(11 + rank, seq // world, config.hidden_size, steps, batch=2)):
        if late_every and step % late_every == 0 and rank == 1:
            torch.cuda._sleep(200_000_000)
        got = _fwd_bwd(pairs[0], x, g)
        if step == 0:
            for i, (a, b) in enumerate(zip(got, _fwd_bwd(pairs[0], x, g))):
                assert torch.equal(a, b), f"rank {rank}: tensor {i} differs between two runs of one input"
        want = _fwd_bwd(pairs[1], x, g)
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.isfinite(a).all() and rel_error(a, b.float()) < 2e-2, \
                f"step {step} rank {rank}: tensor {i} split vs whole {rel_error(a, b.float()):.3g}"
        del got, want
    torch.cuda.synchronize()
    ps.destroy_model_parallel()


@pytest.mark.parametrize("method", P2P_METHODS)
def test_token_split_matches_the_whole_micro_batch(method):
    run_distributed(_gpu_world(), check_token_split, method, backend="nccl")


def test_token_split_at_the_8b_layer_shape_with_a_late_peer():
    """The split at the 8B layer's shapes (s 8192, micro-batch 2), 40 steps, rank 1 late before every 10th."""
    run_distributed(_gpu_world(), check_token_split, "signal", "l8b", 8192, 40, 10, backend="nccl")
