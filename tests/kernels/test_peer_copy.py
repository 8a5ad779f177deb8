"""The SM pulls of the p2p AllGather (kernels/peer_copy.py) against their torch reference in the Triton CPU
interpreter: separate tensors stand in for the peers' mapped buffers (the kernel reads them at element offsets from
the receiving buffer, as it reads a peer's buffer through its NVLink mapping); a copy, so bit for bit (the check:
tests/peer_pulls.py). On the GPU: tests/gpu/test_peer_copy_gpu.py (the same check compiled), test_ag_gemm_gpu.py and
test_graphs_gpu.py (ag_gemm with transport 'p2p' and comm_sms > 0)."""
import pytest
import torch

from overlap_tp.kernels.peer_copy import BLOCK, PeerPull
from peer_pulls import check_pull


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("peers, rows, cols, lo, hi, programs", [
    (1, 4, 40, 0, 4, 1),                     # t = 2, the whole region, one program
    (3, 8, 96, 2, 7, 3),                     # t = 4, a chunk inside the region
    (7, 5, 24, 1, 2, 16),                    # t = 8, one row, more programs than blocks
    (2, 3, BLOCK // 2 + 8, 0, 3, 2),         # blocks straddling rows
    (3, 2, BLOCK + 5, 1, 2, 4),              # a row longer than a block
])
def test_pulls_copy_every_peers_rows_into_their_region(dtype, peers, rows, cols, lo, hi, programs):
    check_pull("cpu", dtype, peers, rows, cols, lo, hi, programs, seed=peers * 1000 + rows * cols + lo)


def test_peer_pull_rejects_bad_arguments():
    buf = torch.zeros(8)
    with pytest.raises(ValueError, match="programs"):
        PeerPull(buf, [8], [0], 4, 0)
    with pytest.raises(ValueError, match="one destination offset per source offset"):
        PeerPull(buf, [8], [0, 4], 4, 1)
