"""gemm_rs's cuBLAS stores over the p2p transport (ops/p2p_reduction.py RegionGemms, method 'decompose' with transport
'p2p'), on the CPU: t ranks' receive buffers as plain tensors, a stand-in for the symmetric-memory handle that hands
out a peer's buffer as a tensor (as PyTorch's `get_buffer` does), every rank's stores run, then every owner's slots
read.
What is checked is the addressing the GPU tests cannot tell apart from a lucky layout: which rows of a go to which
owner and which slot, the bias in the owner's own partial only, the order of the owners, and that nothing outside
the slots is written. The protocol around the stores (signals, the slot sum) is P2PReduceScatter's, tested in
test_sync_protocols.py."""
import pytest
import torch

from overlap_tp.ops.p2p_reduction import RegionGemms


class _Handle:
    """What RegionGemms uses of a symmetric-memory handle: rank k's buffer as a tensor of the given shape, starting
    `storage_offset` elements into its allocation."""

    def __init__(self, allocations):
        self.allocations = allocations

    def get_buffer(self, rank, shape, dtype, storage_offset=0):
        flat = self.allocations[rank]
        assert flat.dtype == dtype
        numel = 1
        for d in shape:
            numel *= d
        return flat[storage_offset:storage_offset + numel].view(shape)


@pytest.mark.parametrize("t, m_local, n, k, within", [(2, 8, 16, 32, 0), (3, 5, 24, 16, 40), (4, 3, 8, 8, 8)])
def test_each_region_lands_in_its_owners_slot_of_this_rank(t, m_local, n, k, within):
    torch.manual_seed(t * 100 + m_local)
    sentinel = -7.0
    # each rank's allocation: `within` elements before its [t, m_local, n] receive buffer and a few after
    allocations = [torch.full((within + t * m_local * n + 16,), sentinel) for _ in range(t)]
    handle = _Handle(allocations)
    bufs = [a[within:within + t * m_local * n].view(t * m_local, n) for a in allocations]
    operands = [(torch.randn(t * m_local, k), torch.randn(n, k)) for _ in range(t)]
    bias = torch.randn(n)
    for rank in range(t):
        stores = RegionGemms.into_owners(handle, bufs[rank], rank, t, within)
        # the next rank's region first, ours last
        assert [first // m_local for first, _, _ in stores.runs] == [(rank + i) % t for i in range(1, t + 1)]
        a, w = operands[rank]
        stores(a, w, bias)
    for owner in range(t):
        slots = bufs[owner].view(t, m_local, n)
        for source in range(t):
            a, w = operands[source]
            want = a[owner * m_local:(owner + 1) * m_local] @ w.t()
            if source == owner:
                want = want + bias
            torch.testing.assert_close(slots[source], want, msg=f"owner {owner}, slot {source}")
        outside = torch.cat((allocations[owner][:within], allocations[owner][within + t * m_local * n:]))
        assert torch.all(outside == sentinel), f"rank {owner}: written outside its receive buffer"


def test_without_bias_every_slot_is_the_plain_product():
    t, m_local, n, k = 2, 4, 8, 8
    allocations = [torch.zeros(t * m_local * n) for _ in range(t)]
    handle = _Handle(allocations)
    bufs = [a.view(t * m_local, n) for a in allocations]
    operands = [(torch.randn(t * m_local, k), torch.randn(n, k)) for _ in range(t)]
    for rank in range(t):
        RegionGemms.into_owners(handle, bufs[rank], rank, t, 0)(*operands[rank], None)
    for owner in range(t):
        for source in range(t):
            a, w = operands[source]
            torch.testing.assert_close(bufs[owner].view(t, m_local, n)[source],
                                       a[owner * m_local:(owner + 1) * m_local] @ w.t())
