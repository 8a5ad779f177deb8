"""The SM pull kernel (kernels/peer_copy.py) compiled, on one GPU: other tensors of the same device stand in for the
peers' mapped buffers (the kernel addresses both as element offsets from the receiving buffer), against the torch
reference, bit for bit; the 16-element alignment hint taken where every offset allows it and not where one does
not. Through the peers' real NVLink mappings: tests/gpu/test_ag_gemm_gpu.py (ag_gemm p2p with comm_sms > 0).

Run: `pytest -m gpu tests/gpu/test_peer_copy_gpu.py` on one GPU."""
import pytest
import torch

from overlap_tp.kernels.peer_copy import BLOCK, PeerPull, reference_peer_pull

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("peers, rows, cols, lo, hi, programs", [
    (1, 4096, 4096, 0, 4096, 16),       # t = 2, an 8B shard whole
    (3, 2048, 4096, 512, 1024, 32),     # t = 4, one chunk
    (7, 64, 1000, 3, 61, 132),          # t = 8, a row length that is no multiple of 16 (no alignment hint)
    (2, 5, BLOCK + 24, 1, 4, 3),        # rows longer than a block
])
def test_pulls_match_the_reference(dtype, peers, rows, cols, lo, hi, programs):
    gen = torch.Generator(device="cuda").manual_seed(peers * 100 + cols)
    region = rows * cols
    sources = [torch.randn(region, device="cuda", generator=gen).to(dtype) for _ in range(peers)]
    ours = torch.full(((peers + 1) * region,), float("nan"), dtype=dtype, device="cuda")
    dst_offsets = [(j + 1) * region for j in range(peers)]
    size = ours.element_size()
    src_offsets = [(src.data_ptr() - ours.data_ptr()) // size for src in sources]
    pull = PeerPull(ours, src_offsets, dst_offsets, cols, programs)
    assert pull.align == (16 if cols % 16 == 0 else 1)   # CUDA allocations start on 512-byte boundaries
    expected = ours.clone()
    reference_peer_pull(expected, sources, dst_offsets, lo * cols, (hi - lo) * cols)
    pull(lo, hi)
    torch.cuda.synchronize()
    assert torch.equal(ours.isnan(), expected.isnan())                # nothing written outside the chunk
    assert torch.equal(ours.nan_to_num(0), expected.nan_to_num(0))
