"""The GEMM benchmark's shape table and config parsing (the timing itself needs a GPU)."""
import pytest

from overlap_tp.bench.gemm import DEFAULT, label, layer_gemms, parse_config


def test_layer_gemms_follow_the_ops_each_layer_issues():
    gemms = {name: (op, k, n, layout) for name, op, k, n, layout in layer_gemms("l8b", 8192, 2)}
    assert gemms == {
        "l8b.qkv fwd": ("ag", 4096, 3072, "nk"), "l8b.qkv dgrad": ("rs", 3072, 4096, "kn"),
        "l8b.fc1 fwd": ("ag", 4096, 14336, "nk"), "l8b.fc1 dgrad": ("rs", 14336, 4096, "kn"),
        "l8b.proj fwd": ("rs", 2048, 4096, "nk"), "l8b.proj dgrad": ("ag", 4096, 2048, "kn"),
        "l8b.fc2 fwd": ("rs", 7168, 4096, "nk"), "l8b.fc2 dgrad": ("ag", 4096, 7168, "kn"),
    }
    # at TP 4 the sharded dimension halves: qkv's output columns, proj's inner dimension
    at_4 = {name: (k, n) for name, _, k, n, _ in layer_gemms("l8b", 8192, 4)}
    assert at_4["l8b.qkv fwd"] == (4096, 1536) and at_4["l8b.proj fwd"] == (1024, 4096)


def test_the_smoke_layer_has_the_recipes_shards():
    # recipes/smoke.sh at TP 2: qkv (16 + 2 * 4) heads of 64 -> 768 columns per rank, fc1 2 * 2816 / 2,
    # proj's inner 16 * 64 / 2, fc2's inner 2816 / 2
    gemms = {name: (op, k, n) for name, op, k, n, _ in layer_gemms("smoke", 4096, 2)}
    assert gemms["smoke.qkv fwd"] == ("ag", 1024, 768) and gemms["smoke.fc1 fwd"] == ("ag", 1024, 2816)
    assert gemms["smoke.proj fwd"] == ("rs", 512, 1024) and gemms["smoke.fc2 fwd"] == ("rs", 1408, 1024)
    assert len(gemms) == 8


def test_configs_parse_and_print_the_same_way():
    config = parse_config("128x128x64/4/8")
    assert (config.block_m, config.block_n, config.block_k, config.num_stages, config.num_warps) == (128, 128, 64, 4, 8)
    assert label(config) == "128x128x64/4/8"
    assert parse_config(label(DEFAULT)) == DEFAULT
    with pytest.raises(ValueError, match="power of two"):
        parse_config("96x128x64/3/8")
