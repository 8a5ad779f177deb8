"""The check shared by the SM pull kernel's tests (tests/kernels/test_peer_copy.py on the CPU interpreter,
tests/gpu/test_peer_copy_gpu.py compiled): separate tensors of one device stand in for the peers' mapped buffers,
addressed as element offsets from the receiving buffer, as the kernel addresses a peer's buffer through its NVLink
mapping; a copy, so bit for bit, and nothing written outside the pulled rows."""
import torch

from overlap_tp.kernels.peer_copy import PeerPull, reference_peer_pull


def check_pull(device, dtype, peers, rows, cols, lo, hi, programs, seed) -> PeerPull:
    """Rows [lo, hi) of `peers` regions [rows, cols] pulled into regions 1..peers of a NaN-filled buffer, against the
    reference; then an empty chunk, which writes nothing. Returns the PeerPull (its alignment choice)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    region = rows * cols
    sources = [torch.randn(region, device=device, generator=gen).to(dtype) for _ in range(peers)]
    ours = torch.full(((peers + 1) * region,), float("nan"), dtype=dtype, device=device)
    dst_offsets = [(j + 1) * region for j in range(peers)]
    size = ours.element_size()
    assert all((src.data_ptr() - ours.data_ptr()) % size == 0 for src in sources)
    pull = PeerPull(ours, [(src.data_ptr() - ours.data_ptr()) // size for src in sources], dst_offsets, cols, programs)
    expected = ours.clone()
    reference_peer_pull(expected, sources, dst_offsets, lo * cols, (hi - lo) * cols)
    for chunk in ((lo, hi), (hi, hi)):
        pull(*chunk)
        if ours.is_cuda:
            torch.cuda.synchronize()
        assert torch.equal(ours.isnan(), expected.isnan()), chunk   # nothing outside rows [lo, hi) of each region
        assert torch.equal(ours.nan_to_num(0), expected.nan_to_num(0)), chunk
    return pull
