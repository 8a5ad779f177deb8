"""The layer benchmark's Transformer Engine baselines (te, te-ub), on the CPU where TE cannot run: the argument
handling with TE absent and with it importable (a stand-in), the userbuffers set-up against Megatron's own
(_initialize_tp_communicators run on a stand-in TE module, the two calls compared), the te-ub layer's config, the
parameter-name map, and the summary's TE entries. The layers themselves run on the GPU: tests/gpu/test_te_gpu.py
and `bench layer --configs megatron,te,te-ub` (benchmarks/device/te_checks.sh)."""
import enum
import os
import sys
import types
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from overlap_tp.bench import layer, te_baselines  # noqa: E402


@pytest.fixture
def without_te(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)   # import raises ImportError


@pytest.fixture
def with_te(monkeypatch):
    monkeypatch.setattr(te_baselines, "te_problem", lambda: None)


def test_te_configurations_need_transformer_engine(without_te, capsys):
    with pytest.raises(SystemExit):
        layer.parse_args(["--configs", "megatron,te,signal"])
    err = capsys.readouterr().err
    assert "te: Transformer Engine does not import here (ModuleNotFoundError" in err


def test_te_configurations_need_cuda(with_te, capsys):
    with pytest.raises(SystemExit):
        layer.parse_args(["--tiny", "--configs", "megatron,te-ub"])
    assert "te-ub: Transformer Engine's layer needs --device cuda" in capsys.readouterr().err


def test_te_configurations_parse_with_transformer_engine(with_te, capsys):
    args = layer.parse_args(["--configs", "megatron,te,te-ub,signal-p2p", "--graphs"])
    assert args.configs == "megatron,te,te-ub,signal-p2p" and args.graphs
    table = layer.configurations("cuda")
    assert table["te"] == ("te", None, False) and table["te-ub"] == ("te-ub", None, False)
    assert not {"te", "te-ub"} & set(layer.DEFAULT_CONFIGS.split(","))   # TE is optional: never by default
    with pytest.raises(SystemExit):   # a split is ours only
        layer.parse_args(["--micro-batch", "2", "--configs", "megatron,te-split"])
    assert "unknown configs ['te-split']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        layer.parse_args(["--help"])
    help_text = capsys.readouterr().out
    assert "te, te-ub" in help_text and "--tp-comm-overlap" in help_text and "UB_SKIPMC=1" in help_text


def _megatron_ub_call(monkeypatch, seq, micro_batch, hidden, tp):
    """The initialize_ub call of Megatron's _initialize_tp_communicators for these arguments (no
    --tp-comm-overlap-cfg, bf16), made against a stand-in TE."""
    from megatron.training import initialize
    calls = []
    base = _stand_in_te(monkeypatch, calls)
    monkeypatch.setitem(sys.modules, "yaml", types.ModuleType("yaml"))
    monkeypatch.setattr(initialize, "is_te_min_version", lambda version, *a, **k: True)
    monkeypatch.setattr(initialize, "get_args", lambda: SimpleNamespace(
        tp_comm_overlap_cfg=None, decoder_tp_comm_overlap=False, seq_length=seq, micro_batch_size=micro_batch,
        context_parallel_size=1, hidden_size=hidden, fp8=None, first_last_layers_bf16=False,
        tensor_model_parallel_size=tp, tp_comm_bootstrap_backend="nccl"))
    initialize._initialize_tp_communicators()
    return base, calls


class UserBufferQuantizationMode(enum.Enum):
    """stand-in"""
    NONE = "none"
    FP8 = "fp8"


def _stand_in_te(monkeypatch, calls):
    """transformer_engine.pytorch.module.base with initialize_ub / destroy_ub recording their calls."""
    base = types.ModuleType("transformer_engine.pytorch.module.base")
    base.UserBufferQuantizationMode = UserBufferQuantizationMode
    base.initialize_ub = lambda **kwargs: calls.append(("initialize_ub", kwargs))
    base.destroy_ub = lambda: calls.append(("destroy_ub", None))
    module = types.ModuleType("transformer_engine.pytorch.module")
    module.base = base
    pytorch = types.ModuleType("transformer_engine.pytorch")
    pytorch.module = module
    te = types.ModuleType("transformer_engine")
    te.pytorch = pytorch
    for name, value in (("transformer_engine", te), ("transformer_engine.pytorch", pytorch),
                        ("transformer_engine.pytorch.module", module),
                        ("transformer_engine.pytorch.module.base", base)):
        monkeypatch.setitem(sys.modules, name, value)
    return base


@pytest.mark.parametrize("seq, micro_batch, hidden, tp", [(8192, 1, 4096, 2), (2048, 2, 1024, 8)])
def test_userbuffers_are_initialised_as_megatron_does(monkeypatch, seq, micro_batch, hidden, tp):
    _, megatron_calls = _megatron_ub_call(monkeypatch, seq, micro_batch, hidden, tp)
    ours = []
    _stand_in_te(monkeypatch, ours)
    monkeypatch.setenv("UB_SKIPMC", "")   # restored (unset) after the test, whatever initialize_userbuffers sets
    monkeypatch.delenv("UB_SKIPMC")
    te_baselines.initialize_userbuffers(seq * micro_batch, hidden, tp)
    assert ours[0] == ("destroy_ub", None)   # one set per shape: the previous model's go first
    assert ours[1:] == megatron_calls and len(megatron_calls) == 1
    kwargs = ours[1][1]
    assert kwargs["shape"] == [seq * micro_batch, hidden] and kwargs["tp_size"] == tp
    assert kwargs["bootstrap_backend"] == "nccl" and kwargs["ub_cfgs"] == {}
    assert os.environ["UB_SKIPMC"] == "1"   # no NVLink multicast: CUDA IPC
    te_baselines.release_userbuffers()
    assert ours[-1] == ("destroy_ub", None)


def test_userbuffers_keep_a_multicast_setting_the_environment_gives(monkeypatch):
    _stand_in_te(monkeypatch, [])
    monkeypatch.setenv("UB_SKIPMC", "0")
    te_baselines.initialize_userbuffers(4096, 1024, 2)
    assert os.environ["UB_SKIPMC"] == "0"


def test_te_ub_layer_gets_tp_comm_overlap_on_a_copy_of_the_config(monkeypatch):
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import spec_utils
    built = []
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", lambda: "te spec")
    monkeypatch.setattr(spec_utils, "build_module", lambda spec, config, layer_number: built.append(
        (spec, config.tp_comm_overlap, layer_number)) or torch.nn.Module())
    config = SimpleNamespace(tp_comm_overlap=False, hidden_size=64)
    te_baselines.build_te_layer("te-ub", config)
    te_baselines.build_te_layer("te", config)
    assert built == [("te spec", True, 1), ("te spec", False, 1)]
    assert config.tp_comm_overlap is False
    with pytest.raises(ValueError, match="unknown TE layer kind 'local'"):
        te_baselines.build_te_layer("local", config)


def test_active_userbuffers_counts_the_linears_on_userbuffers():
    def linear(**flags):
        module = torch.nn.Linear(2, 2)
        for name in te_baselines.UB_LINEAR_FLAGS:
            setattr(module, name, flags.get(name, False))
        return module
    layer_ = torch.nn.Sequential(linear(ub_overlap_ag_fprop=True, ub_bulk_wgrad=True), linear(),
                                 linear(ub_overlap_rs_fprop=True), torch.nn.LayerNorm(2))
    assert te_baselines.active_userbuffers(layer_) == 2
    assert te_baselines.active_userbuffers(torch.nn.Sequential(linear(), linear())) == 0


def test_te_parameter_names_map_to_the_separate_norm_slots():
    assert te_baselines.reference_name("self_attention.linear_qkv.layer_norm_weight") == "input_layernorm.weight"
    assert te_baselines.reference_name("mlp.linear_fc1.layer_norm_weight") == "pre_mlp_layernorm.weight"
    for same in ("self_attention.linear_qkv.weight", "mlp.linear_fc2.weight", "self_attention.q_layernorm.weight"):
        assert te_baselines.reference_name(same) == same


def test_summary_keeps_the_te_layers_apart_from_ours():
    rows = [dict(model="l8b", config=c, ms=ms, vs_megatron=ms / 10.0) for c, ms in
            (("megatron", 10.0), ("te", 9.0), ("te-ub", 8.0), ("signal", 8.8), ("signal-p2p", 8.4))]
    summary, lines = layer.summarize(rows)
    entry = summary["l8b"]
    assert entry["best_ours"] == "signal-p2p"   # te-ub is faster, but it is not ours
    assert entry["te_vs_megatron"] == pytest.approx(0.9) and entry["te-ub_vs_megatron"] == pytest.approx(0.8)
    assert entry["best_vs_te-ub"] == pytest.approx(8.4 / 8.0) and entry["best_vs_te"] == pytest.approx(8.4 / 9.0)
    assert "best_vs_te-ub=1.050" in lines[0]
