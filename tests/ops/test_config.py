from dataclasses import replace

import pytest

from overlap_tp import OverlapConfig


def test_defaults_are_unset_and_the_resolver_fills_them():
    """Every field defaults to unset (None); ops/resolve.py fills them: the values the dataclass used to default to
    where the paths agreed (method 'auto', schedule 'row_slice', ...)."""
    import torch
    from overlap_tp.ops.resolve import fill_defaults
    config = OverlapConfig()
    assert config.unset() == tuple(config.__dataclass_fields__)
    resolved = fill_defaults(config, "gemm_rs", torch.device("cpu"), 2)
    assert resolved.method == "auto" and resolved.schedule == "row_slice"
    assert not resolved.unset()


def test_list_groups_become_a_tuple():
    assert OverlapConfig(groups=[1, 2]).groups == (1, 2)


@pytest.mark.parametrize("kwargs,match", [
    (dict(method="fast"), "method"),
    (dict(schedule="rows"), "schedule"),
    (dict(transport="mpi"), "transport"),
    (dict(groups=0), "at least one group"),
    (dict(groups=(2, 0)), "positive ints"),
    (dict(groups=()), "positive ints"),
    (dict(groups="many"), "groups"),
    (dict(groups=True), "groups"),
    (dict(comm_sms=-1), "comm_sms"),
    (dict(chunks=0), "chunks"),
    (dict(copy_lanes=0), "copy_lanes"),
    (dict(chunk_by="ring"), "chunk_by"),
    (dict(rs_transfer="nvlink"), "rs_transfer"),
    (dict(block_m=96), "power of two"),
    (dict(block_k=8), "power of two"),
    (dict(num_warps=6), "power of two"),
    (dict(num_stages=0), "num_stages"),
])
def test_bad_values_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OverlapConfig(**kwargs)


# tile_for_shape: the narrow tile where it fills the waves better, as measured under graph replays on an H200
# (132 SMs; the ratios below are cuBLAS time / ours)
from overlap_tp.ops.tile_rule import tile_for_shape  # noqa: E402

SIGNAL = OverlapConfig(method="signal")


@pytest.mark.parametrize("m, n, narrow", [
    (4096, 512, True),     # smoke proj dgrad: 64 default tiles leave half the SMs idle (measured 0.67 -> 1.04 of cuBLAS)
    (4096, 1408, True),    # smoke fc2 dgrad: a second default wave 45% full (0.81 -> 1.00)
    (4096, 768, False),    # smoke qkv fwd: 96 default tiles, one wave; narrow needs two (0.84 vs 0.83)
    (4096, 1024, False),   # smoke proj fwd, fc2 fwd, qkv/fc1 dgrad: one full default wave
    (4096, 2816, False),   # smoke fc1 fwd: 3 default waves vs 6 narrow ones (0.87 vs 0.82)
    (8192, 2048, False), (8192, 3072, False), (8192, 7168, False), (8192, 14336, False),   # l8b
    (8192, 5120, False), (8192, 28672, False),                                              # l70b
])
def test_the_narrow_tile_where_it_fills_the_waves_better(m, n, narrow):
    chosen = tile_for_shape(SIGNAL, m, n, programs=132)
    want = (128, 128, 64, 4, 4) if narrow else (128, 256, 64, 3, 8)
    assert (chosen.block_m, chosen.block_n, chosen.block_k, chosen.num_stages, chosen.num_warps) == want
    assert chosen.method == "signal" and chosen.transport == SIGNAL.transport


def test_a_tile_set_by_hand_or_the_switch_off_is_kept():
    for config in (OverlapConfig(method="signal", block_n=64), OverlapConfig(method="signal", num_stages=4),
                   OverlapConfig(method="signal", tile_by_shape=False)):
        assert tile_for_shape(config, 4096, 512, programs=132) is config
    assert tile_for_shape(SIGNAL, 0, 512, programs=132) is SIGNAL


def test_the_rule_counts_the_gemms_own_sms():
    # smoke fc2 dgrad beside 16 NCCL SMs: 192 default tiles on 116 programs = 2 waves, 352 narrow ones = 4
    assert tile_for_shape(SIGNAL, 4096, 1408, programs=116).block_n == 256
    assert tile_for_shape(SIGNAL, 4096, 1408, programs=132).block_n == 128


def test_chunk_by_auto_pulls_by_peer_only_where_t_exceeds_two_on_the_copy_engines():
    """chunk_by 'auto' (the default): 'peer' for the signaled AllGather's copy-engine pulls in the default groups at
    t > 2 (measured faster on every 8B / 70B AllGather shape at t = 4), 'rows' everywhere else; an
    explicit choice is kept as it is."""
    from overlap_tp.ops.resolve import chunk_by_for
    p2p = OverlapConfig(method="signal", transport="p2p", comm_sms=0)
    assert OverlapConfig().chunk_by is None and OverlapConfig(chunk_by="auto").chunk_by is None   # auto: unset
    assert chunk_by_for(p2p, 4).chunk_by == "peer" and chunk_by_for(p2p, 8).chunk_by == "peer"
    assert chunk_by_for(p2p, 3).chunk_by == "peer"
    assert chunk_by_for(p2p, 2).chunk_by == "rows" and chunk_by_for(p2p, 1).chunk_by == "rows"
    assert chunk_by_for(p2p, 4) == replace(p2p, chunk_by="peer")   # nothing else changes
    for other in (replace(p2p, comm_sms=16), replace(p2p, copy_lanes=2), replace(p2p, groups=4),
                  replace(p2p, groups=(2, 3)), replace(p2p, transport="nccl", comm_sms=16),
                  replace(p2p, method="decompose"), replace(p2p, method="off")):
        assert chunk_by_for(other, 4).chunk_by == "rows", other
    for explicit in ("rows", "peer"):
        assert chunk_by_for(replace(p2p, chunk_by=explicit), 2).chunk_by == explicit
        assert chunk_by_for(replace(p2p, chunk_by=explicit), 4).chunk_by == explicit


def test_rs_transfer_auto_pushes_with_the_copy_engines_only_where_t_exceeds_two():
    """rs_transfer 'auto' (the default): 'copy' for the signaled GEMM+ReduceScatter on the p2p transport at t > 2,
    'epilogue' everywhere else (and for every other method and transport, where it does not apply); an explicit
    choice is kept as it is."""
    from overlap_tp.ops.resolve import rs_transfer_for
    p2p = OverlapConfig(method="signal", transport="p2p", comm_sms=0)
    assert OverlapConfig().rs_transfer is None and OverlapConfig(rs_transfer="auto").rs_transfer is None
    assert rs_transfer_for(p2p, 4).rs_transfer == "copy" and rs_transfer_for(p2p, 3).rs_transfer == "copy"
    assert rs_transfer_for(p2p, 2).rs_transfer == "epilogue" and rs_transfer_for(p2p, 1).rs_transfer == "epilogue"
    assert rs_transfer_for(p2p, 8) == replace(p2p, rs_transfer="copy")   # nothing else changes
    for other in (replace(p2p, transport="nccl", comm_sms=16), replace(p2p, method="decompose"),
                  replace(p2p, method="off")):
        assert rs_transfer_for(other, 4).rs_transfer == "epilogue", other
    for explicit in ("epilogue", "copy"):
        assert rs_transfer_for(replace(p2p, rs_transfer=explicit), 2).rs_transfer == explicit
        assert rs_transfer_for(replace(p2p, rs_transfer=explicit), 4).rs_transfer == explicit


def test_gemm_programs_leave_the_collectives_sms_and_at_least_the_spare_ones(monkeypatch):
    """The persistent GEMM's grid: every SM but max(comm_sms, spare_sms) (rs_transfer 'copy' leaves one SM to the comm
    stream's graph waits even at comm_sms 0), never fewer than one program; 4 on a CPU (the interpreter)."""
    import torch
    from types import SimpleNamespace
    from overlap_tp.ops import plan_base
    monkeypatch.setattr(plan_base, "device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    gpu = torch.device("cuda", 0)
    assert plan_base.gemm_programs(gpu, OverlapConfig(comm_sms=0)) == 132
    assert plan_base.gemm_programs(gpu, OverlapConfig(comm_sms=0), spare_sms=1) == 131
    assert plan_base.gemm_programs(gpu, OverlapConfig(comm_sms=16), spare_sms=1) == 116
    assert plan_base.gemm_programs(gpu, OverlapConfig(comm_sms=200)) == 1
    assert plan_base.gemm_programs(torch.device("cpu"), OverlapConfig(), spare_sms=1) == 4
    with pytest.raises(ValueError, match="comm_sms is unset; resolve the config first"):
        plan_base.gemm_programs(gpu, OverlapConfig())   # a config the resolver has not filled
