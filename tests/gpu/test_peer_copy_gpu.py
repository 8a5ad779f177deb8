"""The SM pull kernel (kernels/peer_copy.py) compiled, on one GPU: other tensors of the same device stand in for the
peers' mapped buffers (the kernel addresses both as element offsets from the receiving buffer), one tensor for the
signal words, against the torch reference, bit for bit, with the flags, counters and words a call leaves (twice); the 16-element alignment hint taken where every offset allows it and not where one does
not. Through the peers' real NVLink mappings: tests/gpu/test_ag_gemm_gpu.py (ag_gemm p2p with comm_sms > 0).

Run: `pytest -m gpu tests/gpu/test_peer_copy_gpu.py` on one GPU."""
import pytest
import torch

from overlap_tp.kernels.peer_copy import BLOCK
from peer_pulls import check_pull

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("peers, rows, cols, chunks, programs", [
    (1, 4096, 4096, [(0, 2048), (2048, 4096)], 16),   # t = 2, an 8B shard in two chunks
    (3, 2048, 4096, [(512, 1024)], 32),               # t = 4, one chunk
    (7, 64, 1000, [(3, 30), (30, 61)], 132),          # t = 8, a row length that is no multiple of 16 (no alignment hint)
    (2, 5, BLOCK + 24, [(1, 4)], 3),                  # rows longer than a block
])
def test_pulls_match_the_reference(dtype, peers, rows, cols, chunks, programs):
    pull = check_pull("cuda", dtype, peers, rows, cols, chunks, programs, seed=peers * 100 + cols)
    assert pull.align == (16 if cols % 16 == 0 else 1)   # CUDA allocations start on 512-byte boundaries
