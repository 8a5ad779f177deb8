"""overlap_tp's Megatron flags: parsing (plain argparse and, where importable, Megatron's own parser)
and the combination checks of validate_overlap_args."""
import argparse
import os
import sys
from types import SimpleNamespace

import pytest

from overlap_tp import OverlapConfig
from overlap_tp.megatron.arguments import (PEAK_TFLOPS_ENV, TUNE_CACHE_ENV, OverlapArgumentError,
                                           add_overlap_args, build_parser, layer_configs, moe_overlap_config_kwargs,
                                           overlap_config_kwargs, tune_cache_path, validate_overlap_args,
                                           validate_overlap_env)
from overlap_tp.megatron_patches.apply import SPEC
from overlap_tp.ops import replay
from overlap_tp.ops.watchdog import WATCHDOG_ENV


def megatron_like(**overrides):
    """The Megatron attributes validate_overlap_args reads, as after Megatron's validate_args."""
    values = dict(overlap_tp="signal", overlap_tp_transport="nccl", overlap_tp_comm_sms=None,
                  overlap_tp_tune_cache=None, overlap_tp_layers=False, overlap_tp_peak_tflops=None,
                  overlap_moe="off", tensor_model_parallel_size=2, sequence_parallel=True,
                  transformer_impl="local", spec=None, num_experts=None, tp_comm_overlap=False,
                  normalization="RMSNorm", fp8=None, yaml_cfg=None, multi_latent_attention=False,
                  heterogeneous_layers_config_path=None, experimental_attention_variant=None)
    values.update(overrides)
    return SimpleNamespace(**values)


def test_defaults_leave_overlap_off():
    args = build_parser().parse_args([])
    assert args.overlap_tp == "off" and args.overlap_tp_transport == "auto"
    assert args.overlap_tp_comm_sms is None and args.overlap_tp_tune_cache is None
    assert args.overlap_moe == "off" and not args.overlap_tp_layers and args.overlap_tp_stats
    assert validate_overlap_args(args, warn=None) == []
    assert OverlapConfig(**overlap_config_kwargs(args)).method == "off"


def test_all_flags_parse_into_an_overlap_config():
    args = build_parser().parse_args(["--overlap-tp", "signal", "--overlap-tp-transport", "p2p",
                                      "--overlap-tp-comm-sms", "0", "--overlap-tp-tune-cache", "/tmp/t.json",
                                      "--overlap-tp-peak-tflops", "900", "--no-overlap-tp-stats"])
    config = OverlapConfig(**overlap_config_kwargs(args))
    assert (config.method, config.transport, config.comm_sms) == ("signal", "p2p", 0)
    assert args.overlap_tp_tune_cache == "/tmp/t.json" and args.overlap_tp_peak_tflops == 900.0
    assert args.overlap_tp_stats is False


def test_tp8_signal_gets_the_measured_warning():
    given = validate_overlap_args(megatron_like(tensor_model_parallel_size=8), warn=None)
    assert any("TP 8" in g and "host-bound" in g for g in given)
    assert not any("TP 8" in g for g in validate_overlap_args(megatron_like(), warn=None))


def test_chunk_by_reaches_the_allgathers_and_what_it_needs():
    """--overlap-tp-chunk-by peer: every op kind's config carries it (only ag_gemm reads it); it needs signal or
    decompose on the p2p transport with one copy lane and no pull SMs, else a clear error."""
    parser = build_parser()
    assert parser.parse_args([]).overlap_tp_chunk_by is None
    configs = layer_configs(parser.parse_args(["--overlap-tp", "signal", "--overlap-tp-chunk-by", "peer"]))
    assert (configs["ag_gemm"].transport, configs["ag_gemm"].chunk_by) == ("p2p", "peer")
    # the default leaves it to the plan (chunk_by_for: by peer where TP > 2)
    assert layer_configs(parser.parse_args(["--overlap-tp", "signal"]))["ag_gemm"].chunk_by == "auto"
    assert layer_configs(parser.parse_args(["--overlap-tp", "signal", "--overlap-tp-chunk-by", "rows"]))[
        "ag_gemm"].chunk_by == "rows"
    with pytest.raises(SystemExit):
        parser.parse_args(["--overlap-tp-chunk-by", "ring"])
    for ok in (dict(overlap_tp="signal"), dict(overlap_tp="decompose", overlap_tp_transport="p2p"),
               dict(overlap_tp="decompose", overlap_tp_transport="p2p", overlap_tp_comm_sms=8)):
        validate_overlap_args(megatron_like(**{"overlap_tp_transport": "auto", **ok}, overlap_tp_chunk_by="peer"),
                              warn=None)
    for bad in (dict(overlap_tp_transport="nccl"), dict(overlap_tp="auto"), dict(overlap_tp_copy_lanes=2),
                dict(overlap_tp_transport="p2p", overlap_tp_comm_sms=16)):
        with pytest.raises(OverlapArgumentError, match="--overlap-tp-chunk-by peer with"):
            validate_overlap_args(megatron_like(**{"overlap_tp_transport": "auto", **bad}, overlap_tp_chunk_by="peer"),
                                  warn=None)
    validate_overlap_args(megatron_like(overlap_tp_chunk_by="rows"), warn=None)


def test_rs_transfer_reaches_the_reduce_scatters_and_what_it_needs():
    """--overlap-tp-rs-transfer copy: gemm_rs's config carries it (the default leaves 'auto' to the plan:
    rs_transfer_for, the copy engines where TP > 2); it needs signal, decompose or auto on the p2p transport, else a
    clear error."""
    parser = build_parser()
    assert parser.parse_args([]).overlap_tp_rs_transfer is None
    configs = layer_configs(parser.parse_args(["--overlap-tp", "signal", "--overlap-tp-rs-transfer", "copy"]))
    assert (configs["gemm_rs"].transport, configs["gemm_rs"].rs_transfer) == ("p2p", "copy")
    assert layer_configs(parser.parse_args(["--overlap-tp", "signal"]))["gemm_rs"].rs_transfer == "auto"
    assert layer_configs(parser.parse_args(["--overlap-tp", "signal", "--overlap-tp-rs-transfer", "epilogue"]))[
        "gemm_rs"].rs_transfer == "epilogue"
    with pytest.raises(SystemExit):
        parser.parse_args(["--overlap-tp-rs-transfer", "nvlink"])
    for ok in (dict(overlap_tp="signal"), dict(overlap_tp="signal", overlap_tp_transport="p2p"),
               dict(overlap_tp="auto"), dict(overlap_tp="decompose")):
        validate_overlap_args(megatron_like(**{"overlap_tp_transport": "auto", **ok}, overlap_tp_rs_transfer="copy"),
                              warn=None)
    for bad in (dict(overlap_tp="signal", overlap_tp_transport="nccl"), dict(overlap_tp="decompose",
                overlap_tp_transport="nccl"), dict(overlap_tp="off")):
        with pytest.raises(OverlapArgumentError, match="--overlap-tp-rs-transfer copy with"):
            validate_overlap_args(megatron_like(**{"overlap_tp_transport": "auto", **bad},
                                                overlap_tp_rs_transfer="copy"), warn=None)
    validate_overlap_args(megatron_like(overlap_tp_rs_transfer="epilogue"), warn=None)


def test_copy_lanes_reach_the_p2p_allgather():
    """--overlap-tp-copy-lanes: ag_gemm's (and the backward's re-gather's) pulls split over that many streams."""
    configs = layer_configs(build_parser().parse_args(["--overlap-tp", "signal", "--overlap-tp-copy-lanes", "2"]))
    assert (configs["ag_gemm"].transport, configs["ag_gemm"].copy_lanes) == ("p2p", 2)
    assert layer_configs(build_parser().parse_args(["--overlap-tp", "signal"]))["ag_gemm"].copy_lanes == 1


@pytest.mark.parametrize("argv, expected", [
    # (transport, comm_sms) of ag_gemm, gemm_rs, gemm_ar
    (["--overlap-tp", "signal"], [("p2p", 0), ("p2p", 0), ("nccl", 16)]),
    (["--overlap-tp", "signal", "--overlap-tp-comm-sms", "8"], [("p2p", 0), ("p2p", 0), ("nccl", 8)]),
    (["--overlap-tp", "signal", "--overlap-tp-transport", "nccl"], [("nccl", 16)] * 3),
    (["--overlap-tp", "signal", "--overlap-tp-transport", "p2p", "--overlap-tp-comm-sms", "0"],
     [("p2p", 0), ("p2p", 0), ("nccl", 0)]),
    # cuBLAS over the p2p transports: auto moves decompose's ag_gemm and gemm_rs too (s20: faster than cuBLAS chunks
    # over NCCL on every measured shape); gemm_ar has none and stays on NCCL
    (["--overlap-tp", "decompose"], [("p2p", 0), ("p2p", 0), ("nccl", 16)]),
    (["--overlap-tp", "decompose", "--overlap-tp-transport", "p2p"], [("p2p", 0), ("p2p", 0), ("nccl", 16)]),
    # explicit p2p: no SM beside the GEMMs unless asked; asked, ag_gemm's pulls run on those SMs
    (["--overlap-tp", "signal", "--overlap-tp-transport", "p2p"], [("p2p", 0), ("p2p", 0), ("nccl", 16)]),
    (["--overlap-tp", "signal", "--overlap-tp-transport", "p2p", "--overlap-tp-comm-sms", "16"],
     [("p2p", 16), ("p2p", 0), ("nccl", 16)]),
    (["--overlap-tp", "decompose", "--overlap-tp-transport", "nccl"], [("nccl", 16)] * 3),
    (["--overlap-tp", "auto"], [("nccl", 16)] * 3),        # the tuner picks transports itself
])
def test_layer_configs_per_op_kind(argv, expected):
    configs = layer_configs(build_parser().parse_args(argv))
    assert [(configs[op].transport, configs[op].comm_sms) for op in ("ag_gemm", "gemm_rs", "gemm_ar")] == expected
    assert len({configs[op].method for op in configs}) == 1


@pytest.mark.parametrize("argv", [["--overlap-tp", "fast"], ["--overlap-tp-transport", "ib"],
                                  ["--overlap-tp-comm-sms", "x"]])
def test_bad_values_are_refused_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)


def test_fused_norms_flag():
    parser = add_overlap_args(argparse.ArgumentParser())
    assert parser.parse_args([]).overlap_tp_fused_norms is True
    assert parser.parse_args(["--no-overlap-tp-fused-norms"]).overlap_tp_fused_norms is False


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


def test_overlap_moe_parses_into_its_own_overlap_config():
    args = build_parser().parse_args(["--overlap-moe", "decompose", "--overlap-tp-transport", "p2p",
                                      "--overlap-tp-comm-sms", "4"])
    config = OverlapConfig(**moe_overlap_config_kwargs(args))
    assert (config.method, config.transport, config.comm_sms) == ("decompose", "nccl", 4)
    # without the flag the expert ops' own defaults apply (2 groups, 4 SMs), not the dense ops' 16 SMs
    config = OverlapConfig(**moe_overlap_config_kwargs(build_parser().parse_args(["--overlap-moe", "signal"])))
    assert (config.method, config.groups, config.comm_sms) == ("signal", 2, 4)
    config = OverlapConfig(**moe_overlap_config_kwargs(build_parser().parse_args(
        ["--overlap-moe", "signal", "--overlap-tp-comm-sms", "8"])))
    assert (config.groups, config.comm_sms) == (2, 8)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--overlap-moe", "fast"])
    # --overlap-moe-transport p2p: the copy engines, every SM to the GEMMs unless --overlap-tp-comm-sms says more
    config = OverlapConfig(**moe_overlap_config_kwargs(build_parser().parse_args(
        ["--overlap-moe", "signal", "--overlap-moe-transport", "p2p"])))
    assert (config.transport, config.comm_sms, config.groups) == ("p2p", 0, 2)
    config = OverlapConfig(**moe_overlap_config_kwargs(build_parser().parse_args(
        ["--overlap-moe", "signal", "--overlap-moe-transport", "p2p", "--overlap-tp-comm-sms", "4"])))
    assert (config.transport, config.comm_sms) == ("p2p", 4)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--overlap-moe-transport", "ib"])


def test_overlap_moe_comm_sms_0_needs_the_p2p_transport():
    """a2a_gemm's GEMM spins on flags that NCCL raises: no SM left to NCCL is refused with nccl, fine with p2p."""
    with pytest.raises(OverlapArgumentError, match="--overlap-moe-transport p2p"):
        validate_overlap_args(moe_like(overlap_tp_comm_sms=0, overlap_moe_transport="nccl"), warn=None)
    assert validate_overlap_args(moe_like(overlap_tp_comm_sms=0, overlap_moe_transport="p2p"), warn=None) == []


def test_overlap_moe_decompose_runs_on_either_transport():
    """The expert ops' decompose method exchanges through NCCL or the copy engines (p2p), neither needing SMs left
    free (its matmuls are not spinning on flags)."""
    for transport in ("nccl", "p2p"):
        assert validate_overlap_args(moe_like(overlap_moe="decompose", overlap_moe_transport=transport,
                                              overlap_tp_comm_sms=0), warn=None) == []
    config = OverlapConfig(**moe_overlap_config_kwargs(build_parser().parse_args(
        ["--overlap-moe", "decompose", "--overlap-moe-transport", "p2p"])))
    assert (config.method, config.transport, config.comm_sms) == ("decompose", "p2p", 0)


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
    ({"moe_shared_expert_overlap": True}, "Drop --moe-shared-expert-overlap"),
    ({"overlap_moe_expert_parallel_comm": True}, "Drop --overlap-moe-expert-parallel-comm"),
    ({"overlap_tp_comm_sms": 0}, "--overlap-tp-comm-sms >= 1"),
    ({"overlap_moe": "auto", "overlap_tp_comm_sms": 0}, "--overlap-tp-comm-sms >= 1"),   # auto tries signal
    ({"moe_layer_freq": 2}, "--moe-layer-freq"),
    ({"sequence_parallel": False}, "--overlap-moe signal needs --sequence-parallel"),
    ({"spec": ["my.module", "my_spec"]}, "--overlap-moe off to keep your spec"),
    ({"overlap_moe": "fast"}, "expected one of"),
])
def test_overlap_moe_conflicts_say_what_to_change(overrides, match):
    with pytest.raises(OverlapArgumentError, match=match):
        validate_overlap_args(moe_like(**overrides), warn=None)


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
    ({"fp8": "hybrid"}, "bf16"),
    ({"overlap_tp_comm_sms": -1}, ">= 0"),
    ({"overlap_tp_copy_lanes": 0}, "--overlap-tp-copy-lanes 0: expected an integer >= 1"),
    ({"overlap_tp_transport": "p2p", "overlap_tp_comm_sms": 16, "overlap_tp_copy_lanes": 2}, "give one of the two"),
    ({"multi_latent_attention": True}, "--multi-latent-attention"),
])
def test_conflicts_say_what_to_change(overrides, match):
    with pytest.raises(OverlapArgumentError, match=match):
        validate_overlap_args(megatron_like(**overrides), warn=None)


def test_gather_in_place_flag_and_what_it_needs():
    parser = build_parser()
    assert parser.parse_args([]).overlap_tp_gather_in_place is False
    assert parser.parse_args(["--overlap-tp-gather-in-place"]).overlap_tp_gather_in_place is True
    for transport in ("p2p", "auto"):
        for method in ("signal", "decompose"):
            validate_overlap_args(megatron_like(overlap_tp=method, overlap_tp_transport=transport,
                                                overlap_tp_gather_in_place=True), warn=None)
        # auto: in place for the AllGathers the tuner puts on p2p signal or decompose, and said so
        notes = validate_overlap_args(megatron_like(overlap_tp="auto", overlap_tp_transport=transport,
                                                    overlap_tp_gather_in_place=True), warn=None)
        assert any("gather in place where the tuner picks signal or decompose" in n for n in notes), notes
    for overrides in ({"overlap_tp_transport": "nccl"}, {"overlap_tp": "auto", "overlap_tp_transport": "nccl"},
                      {"overlap_tp": "off", "overlap_tp_layers": True, "overlap_tp_transport": "p2p"}):
        with pytest.raises(OverlapArgumentError, match="drop --overlap-tp-gather-in-place"):
            validate_overlap_args(megatron_like(overlap_tp_gather_in_place=True, **overrides), warn=None)
    with pytest.raises(OverlapArgumentError, match="--no-overlap-tp-fused-norms"):
        validate_overlap_args(megatron_like(overlap_tp_transport="p2p", overlap_tp_gather_in_place=True,
                                            overlap_tp_fused_norms=False), warn=None)


def test_defer_wgrad_flag_and_what_it_needs():
    parser = build_parser()
    assert parser.parse_args([]).overlap_tp_defer_wgrad is False
    assert parser.parse_args(["--overlap-tp-defer-wgrad"]).overlap_tp_defer_wgrad is True
    validate_overlap_args(megatron_like(overlap_tp_transport="p2p", overlap_tp_gather_in_place=True,
                                        overlap_tp_defer_wgrad=True), warn=None)
    with pytest.raises(OverlapArgumentError, match="needs --overlap-tp-gather-in-place"):
        validate_overlap_args(megatron_like(overlap_tp_transport="p2p", overlap_tp_defer_wgrad=True), warn=None)
    validate_overlap_args(megatron_like(overlap_tp_transport="p2p", overlap_tp_gather_in_place=True,
                                        overlap_tp_defer_wgrad=True, overlap_grad_reduce=True), warn=None)
    # eagerly it runs (the same gradient) but hides nothing: said once; under either graph mode nothing is said
    deferred = dict(overlap_tp_transport="p2p", overlap_tp_gather_in_place=True, overlap_tp_defer_wgrad=True)
    eager = validate_overlap_args(megatron_like(cuda_graph_impl="none", **deferred), warn=None)
    assert [m for m in eager if "--overlap-tp-defer-wgrad without CUDA graphs" in m and "hides nothing" in m] == eager
    assert len(eager) == 1
    for impl in ("local", "full_iteration"):
        assert validate_overlap_args(megatron_like(cuda_graph_impl=impl, **deferred), warn=None) == []
    assert validate_overlap_args(megatron_like(cuda_graph_impl="none", overlap_tp_transport="p2p",
                                               overlap_tp_gather_in_place=True), warn=None) == []


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
                                      "--overlap-tp-comm-sms", "8", "--sequence-parallel",
                                      "--tensor-model-parallel-size", "2"])
    args = arguments.parse_args(extra_args_provider=add_overlap_args)
    assert args.overlap_tp == "decompose" and args.overlap_tp_comm_sms == 8 and args.sequence_parallel
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


def test_token_split_flag_and_what_it_needs():
    parser = build_parser()
    assert parser.parse_args([]).overlap_tp_token_split is False
    assert parser.parse_args(["--overlap-tp-token-split"]).overlap_tp_token_split is True
    assert validate_overlap_args(megatron_like(overlap_tp_token_split=True, micro_batch_size=2), warn=None) == []
    for overrides, match in (({"overlap_tp": "off", "overlap_tp_layers": True}, "with --overlap-tp off"),
                             ({"overlap_tp_fused_norms": False}, "--no-overlap-tp-fused-norms"),
                             ({"sequence_parallel": False}, "without --sequence-parallel"),
                             ({"micro_batch_size": 1}, "--micro-batch-size 1: .* even micro-batch size"),
                             ({"micro_batch_size": 3}, "--micro-batch-size 3")):
        with pytest.raises(OverlapArgumentError, match=match):
            validate_overlap_args(megatron_like(overlap_tp_token_split=True, **{"micro_batch_size": 2, **overrides}),
                                  warn=None)
