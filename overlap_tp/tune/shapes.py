"""The public operator shapes of shared/BENCHMARKS.md (Llama-3 8B and 70B at TP = 2), which the tuner's
validation and the benchmarks share."""


# name -> (K_local, N) of the row-parallel GEMMs (GEMM+RS, GEMM+AR), BENCHMARKS.md
SHAPES = {
    "l8b.proj": (2048, 4096),
    "l8b.fc2": (7168, 4096),
    "l70b.proj": (4096, 8192),
    "l70b.fc2": (14336, 8192),
}
# name -> (K, N_local) of the column-parallel GEMMs (AG+GEMM), BENCHMARKS.md
AG_SHAPES = {
    "l8b.qkv": (4096, 3072),
    "l8b.fc1": (4096, 14336),
    "l70b.qkv": (8192, 5120),
    "l70b.fc1": (8192, 28672),
}
# recipes/smoke.sh's layer (h 1024, 16 heads of 64, 4 KV heads, FFN 2816) in the same TP-2 convention: not a
# BENCHMARKS.md shape, the benchmarks take it by name (M = micro-batch 2 x s 2048 = 4096 tokens)
SMOKE_SHAPES = {"smoke.proj": (512, 1024), "smoke.fc2": (1408, 1024)}
SMOKE_AG_SHAPES = {"smoke.qkv": (1024, 768), "smoke.fc1": (1024, 2816)}
TABLE_TP = 2   # the tables hold BENCHMARKS.md's TP = 2 shards


def at_tp(op, k, n, t):
    """A table shape's GEMM at TP = t: the model's layer is the same, its sharded dimension (K_local of
    the row-parallel GEMMs, N_local of the column-parallel ones) is TABLE_TP / t times the table's."""
    if op == "ag":
        return k, n * TABLE_TP // t
    return k * TABLE_TP // t, n
