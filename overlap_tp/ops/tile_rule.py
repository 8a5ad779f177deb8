"""The signaled GEMM's tile by shape: the default tile, and the narrow one where it fills the GPU's waves enough
better to win (OverlapConfig.tile_by_shape)."""
from dataclasses import replace

from overlap_tp.ops.config import OverlapConfig

DEFAULT_TILE = dict(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8)
NARROW_TILE = dict(block_n=128, num_stages=4, num_warps=4)
# The time of one wave of narrow tiles relative to one wave of default tiles: half the FLOPs per tile at a
# somewhat lower throughput than the default tile's, measured at the 8B GEMMs where both fill many waves
# (docs/performance.md).
NARROW_WAVE_COST = 0.55


def tile_for_shape(config: OverlapConfig, m: int, n: int, programs: int) -> OverlapConfig:
    """The config with the tile its signaled GEMM C[m, n] runs on `programs` persistent programs (see
    OverlapConfig.tile_by_shape; tile fields left unset count as the default tile's): the narrow tile where its
    waves cost less than the default tile's,

        ceil(tiles_narrow / programs) * NARROW_WAVE_COST < ceil(tiles_default / programs)

    (a wave's time is its slowest program's, so a last wave half full costs a whole one). At the smoke
    recipe's backward GEMMs (M 4096, N 512 or 1408) the default tile leaves half the SMs idle or runs a second
    wave under half full; at the public 8B and 70B shapes (overlap_tp/tune/shapes.py) the rule keeps the default
    tile. The config is returned as it is where the rule does not apply (another tile, tile_by_shape False, an
    empty GEMM)."""
    if (config.tile_by_shape is False or m == 0 or n == 0
            or any(getattr(config, k) not in (None, v) for k, v in DEFAULT_TILE.items())):
        return config
    rows = -(-m // DEFAULT_TILE["block_m"])

    def waves(block_n):
        return -(-rows * -(-n // block_n) // programs)

    narrow = waves(NARROW_TILE["block_n"]) * NARROW_WAVE_COST < waves(DEFAULT_TILE["block_n"])
    return replace(config, **{**DEFAULT_TILE, **(NARROW_TILE if narrow else {})})


def tile_of(config: OverlapConfig) -> dict:
    """The config's tile fields (block_m, block_n, block_k, num_stages, num_warps), the default tile's where unset."""
    return {name: default if getattr(config, name) is None else getattr(config, name)
            for name, default in DEFAULT_TILE.items()}


def given_tile(config: OverlapConfig) -> dict:
    """The tile fields the config sets (the unset ones left out)."""
    return {name: getattr(config, name) for name in DEFAULT_TILE if getattr(config, name) is not None}
