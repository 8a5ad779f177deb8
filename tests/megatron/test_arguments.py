"""overlap_tp's Megatron flags: parsing (plain argparse and, where importable, Megatron's own parser), the expert
config file, what they build for the layers (settings_from_args) and the combination checks of validate_overlap_args."""
import argparse
import json
import os
import sys
from types import SimpleNamespace

import pytest

from overlap_tp import OverlapConfig
from overlap_tp.megatron.arguments import (PEAK_TFLOPS_ENV, TUNE_CACHE_ENV, OverlapArgumentError,
                                           add_overlap_args, build_parser, tune_cache_path)
from overlap_tp.megatron.settings_from_args import settings_from_args
from overlap_tp.megatron.validation import validate_overlap_args, validate_overlap_env
from overlap_tp.megatron_patches.apply import SPEC
from overlap_tp.ops import replay
from overlap_tp.ops.resolve import fill_defaults
from overlap_tp.ops.watchdog import WATCHDOG_ENV

OPS = ("ag_gemm", "gemm_rs", "gemm_ar")
NCCL = {op: {"transport": "nccl"} for op in OPS}   # every dense op kind on NCCL (the expert config file's content)


def megatron_like(**overrides):
    """The Megatron attributes validate_overlap_args reads, as after Megatron's validate_args."""
    values = dict(overlap_tp="signal", overlap_tp_config=NCCL,
                  overlap_tp_tune_cache=None, overlap_tp_layers=False, overlap_tp_peak_tflops=None,
                  overlap_moe="off", tensor_model_parallel_size=2, sequence_parallel=True,
                  transformer_impl="local", spec=None, num_experts=None, tp_comm_overlap=False,
                  normalization="RMSNorm", fp8=None, yaml_cfg=None, multi_latent_attention=False,
                  heterogeneous_layers_config_path=None, experimental_attention_variant=None)
    values.update(overrides)
    return SimpleNamespace(**values)


def resolved(args, t=2):
    """(transport, comm_sms) per dense op kind as the ops resolve the flags' configs on a GPU of a t-rank group."""
    settings = settings_from_args(args)
    return [(c.transport, c.comm_sms) for c in (fill_defaults(settings.config(op), op, "cuda", t) for op in OPS)]


def test_defaults_leave_overlap_off():
    args = build_parser().parse_args([])
    assert args.overlap_tp == "off" and args.overlap_tp_config is None
    assert args.overlap_tp_tune_cache is None
    assert args.overlap_moe == "off" and not args.overlap_tp_layers and args.overlap_tp_stats
    assert validate_overlap_args(args, warn=None) == []
    assert settings_from_args(args).gemm_rs.method == "off" and settings_from_args(args).moe is None


def test_the_flag_alone_is_auto_and_every_flag_parses():
    parser = build_parser()
    assert parser.parse_args(["--overlap-tp"]).overlap_tp == "auto"
    assert parser.parse_args(["--overlap-moe"]).overlap_moe == "auto"
    assert parser.parse_args(["--overlap-tp", "--overlap-moe"]).overlap_moe == "auto"
    args = parser.parse_args(["--overlap-tp", "signal", "--overlap-tp-config", "/tmp/c.json",
                              "--overlap-tp-tune-cache", "/tmp/t.json", "--overlap-tp-peak-tflops", "900",
                              "--no-overlap-tp-stats"])
    assert args.overlap_tp == "signal" and args.overlap_tp_config == "/tmp/c.json"
    assert args.overlap_tp_tune_cache == "/tmp/t.json" and args.overlap_tp_peak_tflops == 900.0
    assert args.overlap_tp_stats is False


def test_help_shows_the_user_tier_first():
    text = build_parser().format_help()
    user, expert = text.index("\noverlap_tp:"), text.index("overlap_tp (expert):")
    assert user < expert and text.index("--overlap-tp [MODE]") < expert and text.index("--overlap-moe [MODE]") < expert
    assert text.index("  --overlap-tp-config") > expert


def test_tp8_signal_gets_the_measured_warning():
    given = validate_overlap_args(megatron_like(tensor_model_parallel_size=8), warn=None)
    assert any("TP 8" in g and "host-bound" in g for g in given)
    assert not any("TP 8" in g for g in validate_overlap_args(megatron_like(), warn=None))


def test_the_flags_give_the_python_apis_ops():
    """The same intent gives the same ops: --overlap-tp MODE builds OverlapConfig(method=MODE) per op kind, which the
    ops' resolver fills as it fills the Python API's."""
    for mode in ("signal", "decompose", "auto"):
        settings = settings_from_args(megatron_like(overlap_tp=mode, overlap_tp_config=None))
        assert settings.configs() == {op: OverlapConfig(method=mode) for op in OPS}


@pytest.mark.parametrize("mode, content, expected", [
    # (transport, comm_sms) of ag_gemm, gemm_rs, gemm_ar as the ops resolve them on a GPU
    ("signal", None, [("p2p", 0), ("p2p", 0), ("nccl", 16)]),
    ("signal", {"gemm_ar": {"comm_sms": 8}}, [("p2p", 0), ("p2p", 0), ("nccl", 8)]),
    ("signal", NCCL, [("nccl", 16)] * 3),
    ("signal", {op: {"transport": "p2p", "comm_sms": 0} for op in OPS}, [("p2p", 0), ("p2p", 0), ("p2p", 0)]),
    # cuBLAS over the p2p transports: decompose's ag_gemm and gemm_rs too (faster than cuBLAS chunks over NCCL on
    # every measured shape); gemm_ar has none by default and stays on NCCL
    ("decompose", None, [("p2p", 0), ("p2p", 0), ("nccl", 16)]),
    # explicit p2p: no SM beside the GEMMs unless asked; asked, ag_gemm's pulls run on those SMs
    ("signal", {"ag_gemm": {"transport": "p2p"}}, [("p2p", 0), ("p2p", 0), ("nccl", 16)]),
    ("signal", {"ag_gemm": {"transport": "p2p", "comm_sms": 16}}, [("p2p", 16), ("p2p", 0), ("nccl", 16)]),
    ("decompose", NCCL, [("nccl", 16)] * 3),
    ("auto", None, [("nccl", 16)] * 3),        # the tuner's base: it picks transports itself
])
def test_configs_per_op_kind(mode, content, expected):
    assert resolved(megatron_like(overlap_tp=mode, overlap_tp_config=content)) == expected


def test_per_op_fields_reach_their_op_kind_only():
    """chunk_by, rs_transfer, copy_lanes and the rest are per op kind in the file; the rules fill what it leaves out
    (chunk_by by peer where TP > 2 on the signaled copy-engine pulls, rs_transfer copy there too)."""
    args = megatron_like(overlap_tp_config={"ag_gemm": {"chunk_by": "rows", "copy_lanes": 2},
                                            "gemm_rs": {"rs_transfer": "epilogue"}})
    settings = settings_from_args(args)
    assert (settings.ag_gemm.chunk_by, settings.ag_gemm.copy_lanes, settings.gemm_rs.rs_transfer) == ("rows", 2,
                                                                                                    "epilogue")
    assert settings.gemm_rs.chunk_by is None and settings.gemm_ar.rs_transfer is None
    plain = settings_from_args(megatron_like(overlap_tp_config=None))
    assert fill_defaults(plain.ag_gemm, "ag_gemm", "cuda", 4).chunk_by == "peer"
    assert fill_defaults(plain.gemm_rs, "gemm_rs", "cuda", 4).rs_transfer == "copy"
    assert fill_defaults(plain.ag_gemm, "ag_gemm", "cuda", 2).chunk_by == "rows"


def test_the_config_file_reads_json_and_yaml(tmp_path):
    content = {"gemm_rs": {"transport": "p2p", "groups": [2, 2]}, "layers": {"token_split": True}}
    path = tmp_path / "overlap.json"
    path.write_text(json.dumps(content))
    settings = settings_from_args(megatron_like(overlap_tp_config=str(path)))
    assert settings.gemm_rs == OverlapConfig(method="signal", transport="p2p", groups=(2, 2))
    assert settings.token_split
    yaml = pytest.importorskip("yaml")
    path = tmp_path / "overlap.yaml"
    path.write_text(yaml.safe_dump(content))
    assert settings_from_args(megatron_like(overlap_tp_config=str(path))) == settings


@pytest.mark.parametrize("content, match", [
    ({"gemm_xx": {}}, "unknown key 'gemm_xx'"),
    ({"gemm_rs": {"transprt": "p2p"}}, "unknown key gemm_rs.transprt"),
    ({"gemm_rs": {"transport": "ib"}}, "gemm_rs: OverlapConfig.transport='ib'"),
    ({"ag_gemm": {"comm_sms": -1}}, "ag_gemm: OverlapConfig.comm_sms=-1"),
    ({"layers": {"token_split": "yes"}}, "layers.token_split='yes': expected true or false"),
    ({"layers": {"split": True}}, "unknown key layers.split"),
    ({"gemm_rs": "p2p"}, "'gemm_rs' must map field names"),
])
def test_a_bad_config_file_key_is_named(content, match):
    with pytest.raises(OverlapArgumentError, match=match):
        validate_overlap_args(megatron_like(overlap_tp_config=content), warn=None)


def test_a_config_file_that_cannot_be_read_is_named(tmp_path):
    with pytest.raises(OverlapArgumentError, match="no such file"):
        settings_from_args(megatron_like(overlap_tp_config=str(tmp_path / "missing.json")))
    bad = tmp_path / "bad.json"
    bad.write_text("{transport: p2p")
    with pytest.raises(OverlapArgumentError, match="not valid JSON"):
        settings_from_args(megatron_like(overlap_tp_config=str(bad)))


def test_bad_values_are_refused_by_the_parser(capsys):
    for argv in (["--overlap-tp", "fast"], ["--overlap-moe", "fast"], ["--overlap-tp-transport", "p2p"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)


def test_group_is_added_once_and_the_parser_returned():
    parser = argparse.ArgumentParser()
    assert add_overlap_args(parser) is parser
    assert add_overlap_args(parser) is parser  # no argparse conflict the second time
    assert any(group.title == "overlap_tp" for group in parser._action_groups)


def moe_like(**overrides):
    """An MoE run that --overlap-moe accepts: alltoall dispatcher, expert TP 1, no expert biases."""
    values = dict(overlap_tp="off", overlap_moe="signal", num_experts=8, moe_token_dispatcher_type="alltoall",
                  expert_model_parallel_size=2, expert_tensor_parallel_size=1, add_bias_linear=False)
    values.update(overrides)
    return megatron_like(**values)


def test_overlap_moe_builds_its_own_overlap_config():
    """--overlap-moe MODE: the expert ops' config, the file's 'expert' section over it; what neither sets is the
    expert ops' own defaults (2 groups, 4 SMs on NCCL; every SM on p2p), not the dense ops' 16 SMs."""
    def expert(**overrides):
        moe = settings_from_args(moe_like(**overrides)).moe
        return moe, fill_defaults(moe, "a2a_gemm", "cuda", 1)
    config, filled = expert(overlap_moe="decompose", overlap_tp_config={"expert": {"comm_sms": 4}})
    assert (config.method, filled.transport, filled.comm_sms) == ("decompose", "nccl", 4)
    config, filled = expert(overlap_tp_config=None)
    assert (config.method, filled.groups, filled.comm_sms) == ("signal", 2, 4)
    config, filled = expert(overlap_tp_config={"expert": {"comm_sms": 8}})
    assert (filled.groups, filled.comm_sms) == (2, 8)
    config, filled = expert(overlap_tp_config={"expert": {"transport": "p2p"}})
    assert (filled.transport, filled.comm_sms, filled.groups) == ("p2p", 0, 2)
    config, filled = expert(overlap_tp_config={"expert": {"transport": "p2p", "comm_sms": 4}})
    assert (filled.transport, filled.comm_sms) == ("p2p", 4)
    assert settings_from_args(moe_like(overlap_moe="off")).moe is None


def test_overlap_moe_comm_sms_0_needs_the_p2p_transport():
    """a2a_gemm's GEMM spins on flags that NCCL raises: no SM left to NCCL is refused with nccl, fine with p2p."""
    with pytest.raises(OverlapArgumentError, match="expert.transport p2p"):
        validate_overlap_args(moe_like(overlap_tp_config={"expert": {"comm_sms": 0, "transport": "nccl"}}), warn=None)
    assert validate_overlap_args(moe_like(overlap_tp_config={"expert": {"comm_sms": 0, "transport": "p2p"}}),
                                 warn=None) == []


def test_overlap_moe_decompose_runs_on_either_transport():
    """The expert ops' decompose method exchanges through NCCL or the copy engines (p2p), neither needing SMs left
    free (its matmuls are not spinning on flags)."""
    for transport in ("nccl", "p2p"):
        assert validate_overlap_args(moe_like(overlap_moe="decompose", overlap_tp_config={
            "expert": {"transport": transport, "comm_sms": 0}}), warn=None) == []


@pytest.mark.parametrize("tp", [1, 2])
def test_overlap_moe_alone_is_accepted(tp):
    args = moe_like(tensor_model_parallel_size=tp, sequence_parallel=tp > 1)
    assert validate_overlap_args(args, warn=None) == []
    assert (args.overlap_tp, args.overlap_moe) == ("off", "signal")


def test_overlap_tp_with_an_moe_model_keeps_megatrons_moe():
    """--overlap-tp on an MoE model, --overlap-moe off: accepted (apply puts Megatron's MoELayer in the MLP slot)."""
    assert validate_overlap_args(megatron_like(num_experts=8), warn=None) == []


@pytest.mark.parametrize("overrides, match", [
    ({"num_experts": None}, "--num-experts"),
    ({"moe_token_dispatcher_type": "allgather"}, "--moe-token-dispatcher-type alltoall"),
    ({"expert_tensor_parallel_size": None}, "--expert-tensor-parallel-size 1"),   # Megatron's default: TP
    ({"add_bias_linear": True}, "--disable-bias-linear"),
    ({"overlap_moe_expert_parallel_comm": True}, "Drop --overlap-moe-expert-parallel-comm"),
    ({"overlap_tp_config": {"expert": {"comm_sms": 0}}}, "expert.comm_sms >= 1"),
    ({"overlap_moe": "auto", "overlap_tp_config": {"expert": {"comm_sms": 0}}}, "expert.comm_sms >= 1"),   # tries signal
    ({"sequence_parallel": False}, "--overlap-moe signal needs --sequence-parallel"),
    ({"spec": ["my.module", "my_spec"]}, "--overlap-moe off to keep your spec"),
    ({"overlap_moe": "fast"}, "expected one of"),
])
def test_overlap_moe_conflicts_say_what_to_change(overrides, match):
    with pytest.raises(OverlapArgumentError, match=match):
        validate_overlap_args(moe_like(**overrides), warn=None)


def test_shared_expert_overlap_is_turned_off_with_a_warning_that_says_where_the_shared_experts_run():
    args = moe_like(moe_shared_expert_overlap=True, moe_shared_expert_intermediate_size=64)
    given = validate_overlap_args(args, warn=None)
    assert args.moe_shared_expert_overlap is False
    assert len(given) == 1 and "--moe-shared-expert-overlap" in given[0] and "before routing" in given[0]
    assert validate_overlap_args(moe_like(moe_shared_expert_intermediate_size=64), warn=None) == []


def test_expert_tensor_parallel_error_says_why_and_what_to_use():
    with pytest.raises(OverlapArgumentError, match="AllGather and a ReduceScatter inside them") as error:
        validate_overlap_args(moe_like(expert_tensor_parallel_size=2), warn=None)
    assert "--expert-tensor-parallel-size 1" in str(error.value) and "--overlap-moe off" in str(error.value)


def test_tp1_warns_and_runs_off():
    args = megatron_like(tensor_model_parallel_size=1, sequence_parallel=False)
    warnings = validate_overlap_args(args, warn=None)
    assert args.overlap_tp == "off"
    assert len(warnings) == 1 and "no TP communication" in warnings[0]


def test_without_sequence_parallel_explains_the_allreduce_path():
    with pytest.raises(OverlapArgumentError) as error:
        validate_overlap_args(megatron_like(sequence_parallel=False), warn=None)
    message = str(error.value)
    assert "--sequence-parallel" in message and "GEMM+AllReduce" in message and "--overlap-tp off" in message


def test_transformer_engine_gets_a_precedence_note():
    warnings = validate_overlap_args(megatron_like(transformer_impl="transformer_engine"), warn=None)
    assert len(warnings) == 1 and "precedence" in warnings[0]


@pytest.mark.parametrize("overrides, match", [
    ({"spec": ["my.module", "my_spec"]}, "Remove --spec"),
    ({"tp_comm_overlap": True}, "--tp-comm-overlap"),
    ({"normalization": "LayerNorm"}, "RMSNorm"),
    ({"fp8": "hybrid", "fp8_recipe": "delayed"}, "--fp8-recipe tensorwise or blockwise"),
    ({"fp8": "e4m3", "fp8_recipe": "mxfp8"}, "current scaling"),
    ({"overlap_tp_config": {"ag_gemm": {"comm_sms": -1}}}, ">= 0"),
    ({"overlap_tp_config": {"ag_gemm": {"copy_lanes": 0}}}, "OverlapConfig.copy_lanes=0: expected an int >= 1"),
])
def test_conflicts_say_what_to_change(overrides, match):
    with pytest.raises(OverlapArgumentError, match=match):
        validate_overlap_args(megatron_like(**overrides), warn=None)


def test_fp8_runs_signal_or_off():
    with pytest.raises(OverlapArgumentError, match="no FP8 path"):
        validate_overlap_args(megatron_like(overlap_tp="decompose", fp8="e4m3", fp8_recipe="tensorwise"), warn=None)
    notes = validate_overlap_args(megatron_like(overlap_tp="auto", fp8="hybrid", fp8_recipe="blockwise"), warn=None)
    assert any("FP8 linears run method signal" in n for n in notes), notes


def test_fp8_with_the_expert_ops_says_they_are_bf16():
    with pytest.raises(OverlapArgumentError, match="expert ops are bf16"):
        validate_overlap_args(moe_like(overlap_tp="signal", fp8="e4m3", fp8_recipe="blockwise"), warn=None)


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_fp8_current_scaling_is_accepted(fmt, recipe):
    """Megatron's own FP8 flags: the dense linears run them (overlap_tp.megatron.fp8_linear)."""
    validate_overlap_args(megatron_like(fp8=fmt, fp8_recipe=recipe), warn=None)


P2P = {op: {"transport": "p2p"} for op in ("ag_gemm", "gemm_rs")}


def layers_file(base=None, **switches):
    """An expert config file's content: `base` (per op kind) and these layer switches."""
    return {**(base if base is not None else P2P), "layers": switches}


def test_gather_in_place_and_what_it_needs():
    for base in (P2P, {}):
        for method in ("signal", "decompose"):
            validate_overlap_args(megatron_like(overlap_tp=method, overlap_tp_config=layers_file(
                base, gather_in_place=True)), warn=None)
        # auto: in place for the AllGathers the tuner puts on p2p signal or decompose, and said so
        notes = validate_overlap_args(megatron_like(overlap_tp="auto", overlap_tp_config=layers_file(
            base, gather_in_place=True)), warn=None)
        assert any("gather in place where the tuner picks signal or decompose" in n for n in notes), notes
    for overrides in ({"overlap_tp_config": layers_file(NCCL, gather_in_place=True)},
                      {"overlap_tp": "auto", "overlap_tp_config": layers_file(NCCL, gather_in_place=True)},
                      {"overlap_tp": "off", "overlap_tp_layers": True,
                       "overlap_tp_config": layers_file(gather_in_place=True)}):
        with pytest.raises(OverlapArgumentError, match="drop layers.gather_in_place"):
            validate_overlap_args(megatron_like(**overrides), warn=None)
    with pytest.raises(OverlapArgumentError, match="fused_norms false"):
        validate_overlap_args(megatron_like(overlap_tp_config=layers_file(gather_in_place=True, fused_norms=False)),
                              warn=None)


def test_gather_in_place_is_decided_for_the_run_where_the_file_is_silent():
    """On wherever the AllGather runs the p2p transport the resolver picks (signal, decompose; auto where the tuner
    picks it), quietly off where it cannot run (an nccl ag_gemm, recomputation, pipeline parallelism, Megatron's
    layer), and the deferred wgrad with it at TP >= 4 under CUDA graphs (the llama3 recipes' choices)."""
    def switches(**overrides):
        settings = settings_from_args(megatron_like(**{"overlap_tp_config": None, **overrides}))
        return settings.gather_in_place, settings.defer_wgrad
    for mode in ("signal", "decompose", "auto"):
        assert switches(overlap_tp=mode) == (True, False)
        assert switches(overlap_tp=mode, tensor_model_parallel_size=4, cuda_graph_impl="local") == (True, True)
    assert switches(tensor_model_parallel_size=4) == (True, False)          # eager: the wgrad would hide nothing
    assert switches(overlap_tp="off") == (False, False)
    assert switches(overlap_tp_config=NCCL) == (False, False)
    assert switches(recompute_granularity="full") == (False, False)
    assert switches(pipeline_model_parallel_size=2) == (False, False)
    assert switches(overlap_tp_config={"layers": {"fused_norms": False}}) == (False, False)
    assert validate_overlap_args(megatron_like(overlap_tp_config=None), warn=None) == []


def test_defer_wgrad_and_what_it_needs():
    deferred = layers_file(gather_in_place=True, defer_wgrad=True)
    validate_overlap_args(megatron_like(overlap_tp_config=deferred, cuda_graph_impl="local"), warn=None)
    with pytest.raises(OverlapArgumentError, match="Set layers.gather_in_place true"):
        validate_overlap_args(megatron_like(overlap_tp_config=layers_file(gather_in_place=False, defer_wgrad=True)),
                              warn=None)
    validate_overlap_args(megatron_like(overlap_tp_config=deferred, overlap_grad_reduce=True,
                                        cuda_graph_impl="local"), warn=None)
    # eagerly it runs (the same gradient) but hides nothing: said once; under either graph mode nothing is said
    eager = validate_overlap_args(megatron_like(cuda_graph_impl="none", overlap_tp_config=deferred), warn=None)
    assert [m for m in eager if "deferred wgrad without CUDA graphs" in m and "hides nothing" in m] == eager
    assert len(eager) == 1
    for impl in ("local", "full_iteration"):
        assert validate_overlap_args(megatron_like(cuda_graph_impl=impl, overlap_tp_config=deferred), warn=None) == []
    assert validate_overlap_args(megatron_like(cuda_graph_impl="none", overlap_tp_config=layers_file(
        gather_in_place=True)), warn=None) == []


def test_our_own_spec_is_accepted():
    assert validate_overlap_args(megatron_like(spec=list(SPEC)), warn=None) == []


def test_overlap_tp_layers_alone_is_checked_like_overlap():
    with pytest.raises(OverlapArgumentError, match="--overlap-tp-layers needs --sequence-parallel"):
        validate_overlap_args(megatron_like(overlap_tp="off", overlap_tp_layers=True, sequence_parallel=False),
                              warn=None)


def test_warnings_go_to_the_given_callback():
    seen = []
    validate_overlap_args(megatron_like(transformer_impl="transformer_engine"), warn=seen.append)
    assert len(seen) == 1


def test_inside_megatrons_parser(monkeypatch):
    arguments = pytest.importorskip(
        "megatron.training.arguments",
        reason="megatron.training is not importable (megatron-core >= 0.19 on Python >= 3.12 ships it)")
    monkeypatch.setattr(sys, "argv", ["pretrain", "--num-layers", "2", "--hidden-size", "64",
                                      "--num-attention-heads", "4", "--overlap-tp", "decompose",
                                      "--overlap-tp-config", "/tmp/overlap.json", "--sequence-parallel",
                                      "--tensor-model-parallel-size", "2"])
    args = arguments.parse_args(extra_args_provider=add_overlap_args)
    assert args.overlap_tp == "decompose" and args.overlap_tp_config == "/tmp/overlap.json" and args.sequence_parallel
    assert args.num_layers == 2


def test_env_names_are_the_readers_names():
    from overlap_tp.training import throughput
    from overlap_tp.tune import cache
    assert (PEAK_TFLOPS_ENV, TUNE_CACHE_ENV) == (throughput.PEAK_ENV, cache.ENV_VAR)


@pytest.mark.parametrize("name,value,match", [
    (PEAK_TFLOPS_ENV, "0", "OVERLAP_TP_PEAK_TFLOPS='0': expected a positive number"),
    (PEAK_TFLOPS_ENV, "-5", "expected a positive number"),
    (PEAK_TFLOPS_ENV, "inf", "expected a positive number"),
    (PEAK_TFLOPS_ENV, "fast", "OVERLAP_TP_PEAK_TFLOPS='fast': expected a positive number"),
    (WATCHDOG_ENV, "-1", "OVERLAP_TP_WATCHDOG_S='-1': expected a number of seconds >= 0"),
    (WATCHDOG_ENV, "nan", "expected a number of seconds >= 0"),
    (WATCHDOG_ENV, "5s", "expected a number of seconds >= 0"),
    (WATCHDOG_ENV, "", "expected a number of seconds >= 0"),   # the watchdog's reader refuses it too
    (replay.ENV, "off", "OVERLAP_TP_EAGER_GRAPHS='off': expected 1"),
    (replay.ENV, "2", "expected 1 .* or 0"),
])
def test_bad_env_overrides_stop_the_run_at_start(monkeypatch, name, value, match):
    monkeypatch.setenv(name, value)
    with pytest.raises(OverlapArgumentError, match=match):
        validate_overlap_args(megatron_like(), warn=None)
    with pytest.raises(OverlapArgumentError, match=match):   # with overlap off too: the variables are read anyway
        validate_overlap_args(megatron_like(overlap_tp="off"), warn=None)


def test_good_env_overrides_pass(monkeypatch, tmp_path):
    for name, value in ((PEAK_TFLOPS_ENV, "756.5"), (WATCHDOG_ENV, "0"), (TUNE_CACHE_ENV, str(tmp_path / "a/b.json")),
                        (replay.ENV, "0")):
        monkeypatch.setenv(name, value)
    validate_overlap_args(megatron_like(), warn=None)
    monkeypatch.setenv(PEAK_TFLOPS_ENV, "")    # empty = unset, as the MFU reads it
    monkeypatch.delenv(WATCHDOG_ENV)
    validate_overlap_env(megatron_like())


def test_tune_cache_location_is_checked_at_start(monkeypatch, tmp_path):
    monkeypatch.delenv(TUNE_CACHE_ENV, raising=False)
    blocker = tmp_path / "a_file"      # a file where a folder should be: cannot be created, even as root
    blocker.write_text("")
    monkeypatch.setenv(TUNE_CACHE_ENV, str(blocker / "sub" / "t.json"))
    with pytest.raises(OverlapArgumentError, match=f"{TUNE_CACHE_ENV}: .*a_file is a file, so .* cannot be created"):
        validate_overlap_env(megatron_like())
    monkeypatch.delenv(TUNE_CACHE_ENV)
    with pytest.raises(OverlapArgumentError, match="--overlap-tp-tune-cache: .*cannot be created"):
        validate_overlap_env(megatron_like(overlap_tp_tune_cache=str(blocker / "t.json")))
    # the --save default is checked only when the tuner runs (--overlap-tp auto)
    validate_overlap_env(megatron_like(save=str(blocker / "ckpt")))
    with pytest.raises(OverlapArgumentError, match="the tune cache in --save: .*cannot be created"):
        validate_overlap_env(megatron_like(overlap_tp="auto", save=str(blocker / "ckpt")))
    monkeypatch.setenv(TUNE_CACHE_ENV, str(tmp_path))
    with pytest.raises(OverlapArgumentError, match="is a folder"):
        validate_overlap_env(megatron_like())
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if not os.access(locked, os.W_OK):   # root may write anyway
            monkeypatch.setenv(TUNE_CACHE_ENV, str(locked / "sub" / "t.json"))
            with pytest.raises(OverlapArgumentError, match="locked is not writable"):
                validate_overlap_env(megatron_like())
    finally:
        locked.chmod(0o700)
    monkeypatch.setenv(TUNE_CACHE_ENV, str(tmp_path / "new" / "deeper" / "t.json"))
    validate_overlap_env(megatron_like())
    assert not (tmp_path / "new").exists()    # checking creates nothing


def test_tune_cache_path_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv(TUNE_CACHE_ENV, raising=False)
    args = megatron_like(save=str(tmp_path / "ckpt"))
    assert tune_cache_path(args) == str(tmp_path / "ckpt" / "overlap_tp_tune.json")
    monkeypatch.setenv(TUNE_CACHE_ENV, "/e.json")
    assert tune_cache_path(args) == "/e.json"
    args.overlap_tp_tune_cache = "/f.json"
    assert tune_cache_path(args) == "/f.json"
    monkeypatch.delenv(TUNE_CACHE_ENV)
    assert tune_cache_path(megatron_like()) is None


def test_token_split_lives_in_the_config_file_and_what_it_needs():
    """Measured no faster, the token split is no flag: the file's layers.token_split turns it on."""
    assert "--overlap-tp-token-split" not in build_parser().format_help()
    split = {"layers": {"token_split": True}}
    assert validate_overlap_args(megatron_like(overlap_tp_config=split, micro_batch_size=2), warn=None) == []
    for overrides, match in (({"overlap_tp": "off", "overlap_tp_layers": True}, "with --overlap-tp off"),
                             ({"overlap_tp_config": {"layers": {"token_split": True, "fused_norms": False}}},
                              "fused_norms false"),
                             ({"sequence_parallel": False}, "without --sequence-parallel"),
                             ({"micro_batch_size": 1}, "--micro-batch-size 1: .* even micro-batch size"),
                             ({"micro_batch_size": 3}, "--micro-batch-size 3")):
        with pytest.raises(OverlapArgumentError, match=match):
            validate_overlap_args(megatron_like(**{"overlap_tp_config": split, "micro_batch_size": 2, **overrides}),
                                  warn=None)
