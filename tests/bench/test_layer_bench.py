"""CPU (gloo, 2 processes) coverage of the layer benchmark's plumbing and of the GPU checks' logic:

- overlap_tp.bench.reference_spec: the Megatron reference spec differs from get_gpt_layer_local_spec only
  in the documented slots; a TransformerLayer built from it runs sequence-parallel on the CPU
  (megatron_sp_on_cpu) and matches our spec's layer; count_collectives sees exactly Megatron's 10
  collectives of one forward + backward; under no_tp_communication it sees none, the shapes stay, and
  every patched module global is restored afterwards;
- overlap_tp.bench.layer at the tiny size (`--tiny`): every configuration runs, is checked, timed and
  reported (JSON + Markdown);
- tests/gpu/test_layers_gpu.py and tests/gpu/test_gpt_parity_gpu.py: their check functions at tiny sizes
  (the GPU runs use the same functions with NCCL and the real shapes).
"""
import gzip
import json
import os
import warnings

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from distributed import run_distributed  # noqa: E402

H, FFN, SEQ = 64, 128, 16


def _quiet():
    warnings.filterwarnings("ignore")


def _same(a, b):
    """Spec entries from two calls of Megatron's spec builder (megatron-core 0.19 builds the MLP entry as a
    functools.partial, which compares by identity)."""
    import functools
    if isinstance(a, functools.partial) and isinstance(b, functools.partial):
        return a.func == b.func and a.args == b.args and a.keywords == b.keywords
    return a == b


def test_reference_spec_is_megatrons_local_spec_with_our_norms_and_attention():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.torch_norm import L2Norm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from overlap_tp.megatron.attention import core_attention_module
    from overlap_tp.bench.reference_spec import get_gpt_layer_megatron_reference_spec, gpt_block_spec
    from overlap_tp.megatron.layer_spec import OverlapQKRMSNorm
    from overlap_tp.megatron.norm import OverlapRMSNorm

    local = get_gpt_layer_local_spec(normalization="RMSNorm")
    ref = get_gpt_layer_megatron_reference_spec()
    assert ref.module is TransformerLayer
    sub, attn = ref.submodules, ref.submodules.self_attention.submodules
    assert sub.input_layernorm is OverlapRMSNorm and sub.pre_mlp_layernorm is OverlapRMSNorm
    assert attn.core_attention is core_attention_module()
    assert attn.linear_qkv is ColumnParallelLinear and attn.linear_proj is RowParallelLinear
    assert attn.q_layernorm is IdentityOp and attn.k_layernorm is IdentityOp
    # everything not swapped is Megatron's own object
    for name in ("self_attn_bda", "mlp", "mlp_bda", "sharded_state_dict_keys_map", "cross_attention"):
        assert _same(getattr(sub, name), getattr(local.submodules, name)), name
    assert ref.submodules.self_attention.module is local.submodules.self_attention.module
    # Megatron's own spec object is not modified
    assert local.submodules.input_layernorm is not OverlapRMSNorm
    assert get_gpt_layer_local_spec(normalization="RMSNorm").submodules.self_attention.submodules.core_attention \
        is local.submodules.self_attention.submodules.core_attention
    qk = get_gpt_layer_megatron_reference_spec(qk_layernorm=True).submodules.self_attention.submodules
    assert qk.q_layernorm is OverlapQKRMSNorm and qk.k_layernorm is OverlapQKRMSNorm
    l2 = get_gpt_layer_megatron_reference_spec(qk_l2_norm=True).submodules.self_attention.submodules
    assert l2.q_layernorm is L2Norm
    block = gpt_block_spec(ref, 3)
    assert isinstance(block, TransformerBlockSubmodules) and block.layer_norm is OverlapRMSNorm
    assert len(block.layer_specs) == 3 and len({id(s) for s in block.layer_specs}) == 3


def test_local_collectives_are_shape_equivalent():
    from overlap_tp.bench.reference_spec import local_all_gather, local_reduce_scatter

    class Group:
        def __init__(self, rank, size):
            self._rank, self._size = rank, size

        def rank(self):
            return self._rank

        def size(self):
            return self._size

    shard = torch.arange(6.0).view(2, 3)
    out = torch.empty(6, 3)
    assert local_all_gather(out, shard, Group(1, 3)) is None
    assert torch.equal(out, torch.cat([shard] * 3))
    full = torch.arange(12.0).view(4, 3)
    part = torch.empty(2, 3)
    handle = local_reduce_scatter(part, full, Group(1, 2), async_op=True)
    assert handle.wait() and torch.equal(part, full[2:])


def _layer_config(world):
    from megatron.core.transformer.transformer_config import TransformerConfig
    return TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, num_query_groups=2,
                             ffn_hidden_size=FFN, use_cpu_initialization=True, params_dtype=torch.bfloat16, bf16=True,
                             normalization="RMSNorm", tensor_model_parallel_size=world, sequence_parallel=True,
                             hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False, gated_linear_unit=True,
                             activation_func=torch.nn.functional.silu)


def _check_reference_and_counterfactual(rank, world):
    _quiet()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import layers as mlayers
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.spec_utils import build_module
    from overlap_tp import OverlapConfig
    from overlap_tp.bench.reference_spec import (count_collectives, get_gpt_layer_megatron_reference_spec,
                                                 megatron_sp_on_cpu, no_tp_communication)
    from overlap_tp.megatron.layer_spec import get_gpt_layer_overlap_spec
    from overlap_tp.megatron.layers import set_overlap_config
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(SEQ // world, 1, H, generator=gen).to(torch.bfloat16)
    g = torch.randn(SEQ // world, 1, H, generator=gen).to(torch.bfloat16)
    originals = {(m, n): getattr(m, n) for m, n in ((mlayers, "dist_all_gather_func"),
                                                    (mlayers, "dist_reduce_scatter_func"),
                                                    (mappings, "dist_all_gather_func"),
                                                    (mappings, "dist_reduce_scatter_func"), (mappings, "_reduce"),
                                                    (torch.distributed, "all_gather_into_tensor"))}
    current_device = torch.cuda.current_device

    def run(layer):
        xi = x.clone().requires_grad_(True)
        out, _ = layer(xi, attention_mask=None)
        out.backward(g)
        return out, xi.grad

    with megatron_sp_on_cpu():
        results = {}
        for kind, spec in (("megatron", get_gpt_layer_megatron_reference_spec()),
                           ("ours", get_gpt_layer_overlap_spec())):
            torch.manual_seed(5)
            layer = build_module(spec, config=_layer_config(world), layer_number=1)
            if kind == "ours":
                set_overlap_config(layer, OverlapConfig(method="off"))
            with count_collectives() as counts:
                results[kind] = run(layer)
            if kind == "megatron":
                # qkv, fc1: all-gather forward, all-gather + reduce-scatter backward (layers' globals);
                # proj, fc2: reduce-scatter forward, all-gather backward (mappings' globals)
                assert counts == {"layers.dist_all_gather_func": 4, "layers.dist_reduce_scatter_func": 2,
                                  "mappings.dist_reduce_scatter_func": 2, "mappings.dist_all_gather_func": 2}, counts
                reference = layer
                with count_collectives() as counts, no_tp_communication():
                    out, dx = run(layer)
                assert counts == {}, counts
                assert out.shape == results[kind][0].shape and dx.shape == results[kind][1].shape
                assert torch.isfinite(out.float()).all() and torch.isfinite(dx.float()).all()
        for (n, p), (_, q) in zip(reference.named_parameters(), layer.named_parameters()):
            assert torch.equal(p, q), n
        for a, b in zip(results["ours"], results["megatron"]):
            err = float((a.float() - b.float()).norm() / b.float().norm())
            assert err < 2e-2, err
    for (module, name), value in originals.items():
        assert getattr(module, name) is value, f"{module.__name__}.{name} not restored"
    assert torch.cuda.current_device is current_device
    # a -split configuration's layer: ours built with the token split (its numerics: tests/megatron/test_layers.py)
    from overlap_tp.bench import layer as bench_layer
    config = bench_layer.layer_config("tiny", world, "cpu")
    assert bench_layer.build_layer("ours", config, torch.device("cpu"), token_split=True).token_split
    assert not bench_layer.build_layer("ours", config, torch.device("cpu")).token_split
    ps.destroy_model_parallel()


def test_reference_layer_and_counterfactual():
    run_distributed(2, _check_reference_and_counterfactual)


def _run_bench(rank, world, out_dir):
    _quiet()
    from overlap_tp.bench import layer
    args = layer.parse_args(["--tiny", "--out", out_dir, "--reps", "2", "--warmup", "1",
                             "--profile", os.path.join(out_dir, "profile"), "--profile-steps", "1"])
    rows = layer.run(args, command="test_layer_bench")
    assert [r["config"] for r in rows] == layer.CPU_CONFIGS.split(",")
    for row in rows:
        assert "error" not in row, row
        assert row["ms"] > 0 and len(row["round_ms"]) == args.rounds == 2, row
        if row["config"] != "megatron":   # the ratio's range over the interleaved rounds
            low, high = (float(v) for v in row["rounds_vs_megatron"].split("-"))
            assert 0 < low <= high, row
    by = {r["config"]: r for r in rows}
    assert by["nocomm"]["collectives"] == 0 and by["megatron"]["collectives"] == 10
    for name in ("off", "signal", "decompose"):
        assert by[name]["check_err"] <= args.check_tol and by[name]["same_init"] is True, by[name]


def test_layer_bench_tiny(tmp_path):
    run_distributed(2, _run_bench, str(tmp_path))
    data = json.loads((tmp_path / "layer.json").read_text())
    assert {"environment", "rows", "settings", "summary"} <= set(data)
    assert data["summary"]["tiny"]["best_ours"] in ("off", "signal", "decompose")
    assert "signal_vs_megatron" in data["summary"]["tiny"] and "signal_vs_nocomm" in data["summary"]["tiny"]
    markdown = (tmp_path / "layer.md").read_text()
    assert "| tiny | nocomm |" in markdown and "test_layer_bench" in markdown
    from overlap_tp.bench import layer
    for config in layer.CPU_CONFIGS.split(","):
        for rank in range(2):
            with gzip.open(tmp_path / "profile" / f"tiny_{config}_rank{rank}.json.gz", "rt") as f:
                trace = json.load(f)
            assert any(e.get("name", "").startswith("aten::mm") for e in trace["traceEvents"]), config


def test_bench_cli_arguments():
    from overlap_tp.ops.resolve import fill_defaults
    from overlap_tp.bench import layer
    assert layer.parse_args([]).configs == layer.DEFAULT_CONFIGS
    assert layer.parse_args(["--tiny"]).device == "cpu"
    for bad in (["--configs", "signal,megatron"], ["--configs", "megatron,bogus"], ["--models", "l9b"],
                ["--rounds", "0"], ["--reps", "2", "--rounds", "3"]):
        with pytest.raises(SystemExit):
            layer.parse_args(bad)
    from overlap_tp.bench.__main__ import SUBCOMMANDS
    assert SUBCOMMANDS["layer"] == "overlap_tp.bench.layer"
    # the p2p transports under both GEMMs; GEMM+AllReduce stays on NCCL (it has no p2p transport)
    configs = layer.configurations("cuda")
    for name, method in (("signal-p2p", "signal"), ("decompose-p2p", "decompose")):
        spec, ops, counterfactual = configs[name]
        assert spec == "ours" and not counterfactual
        assert all((ops[op].method, ops[op].transport, ops[op].comm_sms) == (method, "p2p", 0)
                   for op in ("ag_gemm", "gemm_rs")), name
        assert ops["gemm_ar"].transport == "nccl"
    spec, ops, _ = configs["mixed-p2p"]   # the signaled GEMM behind the AllGather, cuBLAS's regions for the RS
    assert [(ops[op].method, ops[op].transport) for op in ("ag_gemm", "gemm_rs")] == [("signal", "p2p"),
                                                                                       ("decompose", "p2p")]
    _, ops, _ = configs["signal-p2p-lanes2"]   # signal-p2p with the AllGathers' pulls over two streams
    rs_lanes = fill_defaults(ops["gemm_rs"], "gemm_rs", "cuda", 2).copy_lanes   # unset: the resolver's 1
    assert (ops["ag_gemm"].copy_lanes, rs_lanes) == (2, 1) and ops["ag_gemm"].transport == "p2p"
    assert "decompose-p2p" in layer.DEFAULT_CONFIGS.split(",")
    assert layer.parse_args(["--configs", "megatron,decompose-p2p,mixed-p2p"]).configs == "megatron,decompose-p2p,mixed-p2p"


def test_layer_gpu_checks_on_cpu():
    """tests/gpu/test_layers_gpu.py's checks at tiny shapes: same-seed weights, outputs and grads of our
    linears against Megatron's with SP on and off, methods off / decompose / signal, fused main_grad."""
    import test_layers_gpu
    test_layers_gpu.run_on_cpu(test_layers_gpu.CPU_SHAPES[2:])


def test_gpt_parity_checks_on_cpu():
    """tests/gpu/test_gpt_parity_gpu.py's check at the tiniest size: three GPTModels, a few training steps,
    the dist_checkpointing cross-load both ways."""
    import test_gpt_parity_gpu
    test_gpt_parity_gpu.run_on_cpu(test_gpt_parity_gpu.CI_SIZES)


def test_graphs_needs_cuda(capsys):
    from overlap_tp.bench.layer import parse_args
    assert parse_args(["--graphs"]).graphs
    with pytest.raises(SystemExit):
        parse_args(["--graphs", "--tiny"])
    assert "--graphs needs --device cuda" in capsys.readouterr().err


def test_layer_bench_split_configurations_need_an_even_micro_batch_and_our_layer(capsys):
    """The -split configurations (their layer is built in test_reference_layer_and_counterfactual): an odd
    micro-batch, or a split of a layer that is not ours, is refused."""
    from overlap_tp.bench import layer
    for argv, message in ((["--tiny", "--configs", "megatron,off-split"], "must be even"),
                          (["--tiny", "--micro-batch", "2", "--configs", "megatron,nocomm-split"], "unknown configs")):
        with pytest.raises(SystemExit):
            layer.parse_args(argv)
        assert message in capsys.readouterr().err


def _run_fp8_bench(rank, world, out_dir):
    _quiet()
    from overlap_tp.bench import layer
    args = layer.parse_args(["--tiny", "--out", out_dir, "--reps", "2", "--warmup", "1",
                             "--configs", "megatron,off,off-fp8,signal-fp8", "--fp8", "hybrid/tensorwise"])
    by = {r["config"]: r for r in layer.run(args, command="test_layer_bench fp8")}
    for name in ("off", "off-fp8", "signal-fp8"):
        assert "error" not in by[name] and by[name]["same_init"] is True, by[name]
    # the -fp8 layers ran FP8: further from megatron's bf16 layer than bf16's off, within the FP8 tolerance
    for name in ("off-fp8", "signal-fp8"):
        assert by["off"]["check_err"] * 4 < by[name]["check_err"] <= args.fp8_check_tol, (by["off"], by[name])


def test_layer_bench_fp8_configurations(tmp_path, capsys):
    run_distributed(2, _run_fp8_bench, str(tmp_path))
    data = json.loads((tmp_path / "layer.json").read_text())
    assert data["settings"]["fp8"] == "hybrid/tensorwise"
    from overlap_tp.bench import layer
    for argv, message in ((["--tiny", "--configs", "megatron,megatron-fp8"], "unknown configs"),
                          (["--tiny", "--fp8", "e5m2/tensorwise"], "FORMAT/RECIPE"),
                          (["--tiny", "--fp8", "e4m3/delayed"], "FORMAT/RECIPE")):
        with pytest.raises(SystemExit):
            layer.parse_args(argv)
        assert message in capsys.readouterr().err
    assert layer.parse_args(["--tiny", "--micro-batch", "2", "--configs", "megatron,signal-fp8-split"])
