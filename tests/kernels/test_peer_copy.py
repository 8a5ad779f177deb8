"""The SM pulls of the p2p AllGather (kernels/peer_copy.py) against their torch reference in the Triton CPU
interpreter: separate tensors stand in for the peers' mapped buffers (the kernel reads them at element offsets from
the receiving buffer, as it reads a peer's buffer through its NVLink mapping), one tensor for the signal words; a
copy, so bit for bit, and the flags, counters and words as a call leaves them, twice (the check: tests/peer_pulls.py).
On the GPU: tests/gpu/test_peer_copy_gpu.py (the same check compiled), test_ag_gemm_gpu.py and test_graphs_gpu.py
(ag_gemm with transport 'p2p' and comm_sms > 0, through the peers' real mappings)."""
import pytest
import torch

from overlap_tp.kernels.peer_copy import BLOCK, SignaledPull
from peer_pulls import check_pull


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("peers, rows, cols, chunks, programs", [
    (1, 4, 40, [(0, 4)], 1),                          # t = 2, the whole region, one program
    (3, 8, 96, [(0, 2), (2, 7), (7, 8)], 3),          # t = 4, three chunks
    (7, 5, 24, [(1, 2)], 16),                         # t = 8, one row, more programs than blocks
    (2, 3, BLOCK // 2 + 8, [(0, 1), (1, 3)], 2),      # blocks straddling rows
    (3, 2, BLOCK + 5, [(1, 2), (2, 2)], 4),           # a row longer than a block, an empty chunk
])
def test_pulls_copy_every_peers_rows_and_raise_every_flag(dtype, peers, rows, cols, chunks, programs):
    check_pull("cpu", dtype, peers, rows, cols, chunks, programs, seed=peers * 1000 + rows * cols + len(chunks))


def test_signaled_pull_rejects_bad_arguments():
    buf, words, flags, mailbox = (torch.zeros(8), torch.zeros(3, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                                  torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="programs"):
        SignaledPull(buf, [8], [0], 4, 0, [(0, 1)], words, [0], [1], [2], flags, 1.0, mailbox, 1)
    with pytest.raises(ValueError, match="one destination offset"):
        SignaledPull(buf, [8], [0, 4], 4, 1, [(0, 1)], words, [0], [1], [2], flags, 1.0, mailbox, 1)
    with pytest.raises(ValueError, match="a flag per chunk"):
        SignaledPull(buf, [8], [0], 4, 1, [(0, 1), (1, 2)], words, [0], [1], [2], flags, 1.0, mailbox, 1)
