"""The check shared by the SM pull kernel's tests (tests/kernels/test_peer_copy.py on the CPU interpreter,
tests/gpu/test_peer_copy_gpu.py compiled): separate tensors of one device stand in for the peers' mapped buffers,
addressed as element offsets from the receiving buffer, as the kernel addresses a peer's buffer through its NVLink
mapping; one int32 tensor holds our signal words and stands in for the peers' (READY and PULLED words we raise in
their memory). The data is a copy, so bit for bit, and nothing is written outside the pulled rows; each call leaves
every chunk's flag raised, its counters at zero, our READY words reset and READY / PULLED raised at every peer, and
a second call (the peers' READY raised again, the flags lowered, as the next call finds them) does the same."""
import torch

from overlap_tp.kernels.peer_copy import SignaledPull, reference_pull


def check_pull(device, dtype, peers, rows, cols, chunks, programs, seed) -> SignaledPull:
    """`chunks` (local row ranges) of `peers` regions [rows, cols] pulled into regions 1..peers of a NaN-filled
    buffer, against the reference. Returns the SignaledPull (its alignment choice)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    region = rows * cols
    sources = [torch.randn(region, device=device, generator=gen).to(dtype) for _ in range(peers)]
    ours = torch.full(((peers + 1) * region,), float("nan"), dtype=dtype, device=device)
    dst_offsets = [(j + 1) * region for j in range(peers)]
    size = ours.element_size()
    assert all((src.data_ptr() - ours.data_ptr()) % size == 0 for src in sources)
    words = torch.zeros(3 * peers, dtype=torch.int32, device=device)   # ready_in | ready_out | pulled_out
    ready_in, ready_out, pulled_out = (list(range(k * peers, (k + 1) * peers)) for k in range(3))
    flags = torch.zeros(len(chunks), dtype=torch.int32, device=device)
    mailbox = torch.zeros(1, dtype=torch.int64, device=device)
    pull = SignaledPull(ours, [(src.data_ptr() - ours.data_ptr()) // size for src in sources], dst_offsets, cols,
                        programs, chunks, words, ready_in, ready_out, pulled_out, flags, 30.0, mailbox, 1)
    expected = ours.clone()
    reference_pull(expected, sources, dst_offsets, chunks, cols)
    for call in range(2):
        words[:peers] = 1            # every peer's READY
        words[peers:] = 0
        flags.zero_()
        pull(torch.cuda.current_stream().cuda_stream if ours.is_cuda else 0)
        if ours.is_cuda:
            torch.cuda.synchronize()
        assert torch.equal(ours.isnan(), expected.isnan()), call   # nothing outside the chunks' rows of each region
        assert torch.equal(ours.nan_to_num(0), expected.nan_to_num(0)), call
        assert flags.tolist() == [1] * len(chunks), (call, flags.tolist())
        assert pull.counters.tolist() == [0] * (len(chunks) + 1), (call, pull.counters.tolist())
        assert words.tolist() == [0] * peers + [1] * (2 * peers), (call, words.tolist())
        assert mailbox.item() == 0
    return pull
