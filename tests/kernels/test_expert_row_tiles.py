"""The dispatch's row-tile table built by kernels/expert_row_tiles.py (in the CPU interpreter here; on the GPU in
tests/gpu/test_moe_ops_one_gpu.py through a2a_gemm) equals the host's (moe_tile_plan._dispatch_table), row for row,
for random and extreme token-count matrices, every rank, several tile heights and part counts."""
import random

import pytest
import torch

from overlap_tp.kernels.expert_row_tiles import dispatch_row_tiles
from overlap_tp.ops.moe_tile_plan import dispatch_plan, layout, part_tiles


def count_matrices(ep, experts, seed):
    g = torch.Generator().manual_seed(seed)
    E = ep * experts
    rand = torch.randint(0, 40, (ep, E), generator=g) * (torch.rand(ep, E, generator=g) > 0.25)
    hot = torch.randint(0, 3, (ep, E), generator=g)
    hot[:, E // 2] = 300                                  # one expert with many row tiles (several BLOCK_T chunks)
    no_tokens = rand.clone()
    no_tokens[-1] = 0                                     # a rank that sends nothing
    receives_nothing = rand.clone()
    receives_nothing[:, :experts] = 0                     # rank 0 receives nothing
    return [rand, hot, no_tokens, receives_nothing, torch.zeros(ep, E, dtype=torch.int64)]


@pytest.mark.parametrize("ep, experts", [(1, 1), (1, 4), (2, 3), (3, 2), (4, 5)])
def test_device_table_matches_the_host_table(ep, experts):
    rng = random.Random(ep * 10 + experts)
    for counts in count_matrices(ep, experts, seed=ep * 100 + experts):
        for rank in range(ep):
            block_m, parts, n, block_n = rng.choice([1, 4, 8]), rng.choice([1, 2, 3, 5]), 20, 8
            lay = layout(counts, rank)
            plan = dispatch_plan(lay, n, block_m, block_n, parts)
            want = plan.tiles
            got = dispatch_row_tiles(counts, rank, experts, parts, block_m, sum(part_tiles(lay, block_m, parts)[0]),
                                     want.n_tiles, want.raster_m)
            assert torch.equal(got.starts, want.starts), (counts.tolist(), rank, block_m, parts)
            assert torch.equal(got.rows, want.rows), (counts.tolist(), rank, block_m, parts)
