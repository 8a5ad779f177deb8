"""The reduce-scatter's slot sum (kernels/sum_slots.py) against its torch reference in the Triton CPU interpreter,
which rounds fp32 -> bf16/fp16 toward zero (the compiled kernel rounds to nearest even): within one unit in the
last place here, bit for bit on the GPU (tests/gpu/test_gemm_rs_gpu.py)."""
import pytest
import torch

from overlap_tp.kernels import sum_slots
from overlap_tp.kernels.sum_slots import BLOCK, SlotsSummed, SumSlots, reference_sum_slots


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("slots, rows, cols", [(2, 3, 40), (1, 5, 8), (3, 17, 96), (4, 2, BLOCK // 2 + 8),
                                               (2, 1, BLOCK + 1)])
def test_sum_slots_equals_the_fp32_sum_rounded_once(dtype, slots, rows, cols):
    gen = torch.Generator().manual_seed(slots * 1000 + rows * cols)
    x = (torch.randn(slots, rows, cols, generator=gen) * 3).to(dtype)
    out = torch.full((rows, cols), float("nan"), dtype=dtype)
    SumSlots(slots, rows * cols)(x.view(slots, -1), out)
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(out, reference_sum_slots(x), rtol=ulp, atol=ulp)
    assert not out.isnan().any()


def test_sum_slots_rejects_a_buffer_of_another_shape():
    op = SumSlots(2, 12)
    with pytest.raises(ValueError, match="built for"):
        op(torch.zeros(2, 10, dtype=torch.bfloat16), torch.zeros(10, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="same dtype"):
        op(torch.zeros(2, 12, dtype=torch.bfloat16), torch.zeros(12, dtype=torch.float16))


@pytest.mark.parametrize("peers, progress", [(1, 7), (3, 0)])
def test_a_signalling_sum_raises_every_peers_word_and_reports_its_call_once_every_program_is_done(peers, progress):
    """With SlotsSummed the last of the programs (4 here) raises each peer's SUMMED word (words standing in for the
    peers' memory, at scattered offsets), resets its done counter for the next call, and writes a non-zero call
    number into the progress word (0: nothing); the sum is the plain kernel's."""
    slots, numel = peers + 1, 3 * BLOCK + 5
    gen = torch.Generator().manual_seed(peers)
    x = torch.randn(slots, numel, generator=gen).to(torch.bfloat16)
    words = torch.zeros(16, dtype=torch.int32)
    summed_out = [5, 11, 2][:peers]
    progress_word = torch.full((1,), -1, dtype=torch.int32)
    op = SumSlots(slots, numel, SlotsSummed(words, summed_out, progress_word))
    for call in range(2):
        words.zero_()
        out = op(x, torch.empty(numel, dtype=torch.bfloat16), progress)
        assert words.nonzero().flatten().tolist() == sorted(summed_out) and words.max() == 1
        assert op._done.item() == 0
        assert progress_word.item() == (progress if progress else -1)
        torch.testing.assert_close(out, reference_sum_slots(x), rtol=2 ** -7, atol=2 ** -7)


@pytest.mark.parametrize("signalling", [False, True])
def test_launch_checked_launches_what_the_checked_call_launches(signalling, monkeypatch):
    """SumSlots.launch_checked (arguments made once per slots buffer) passes the compiled kernel the arguments that
    __call__ passes it, for each output and progress number; an output off 16 bytes goes through __call__. The
    kernels are stand-ins recording their launches (the launches themselves: tests/gpu/test_direct_launch_gpu.py)."""
    monkeypatch.setattr(sum_slots, "INTERPRET", False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)
    t, numel = 2, 64
    summed = None
    if signalling:
        summed = SlotsSummed(torch.zeros(2, t, dtype=torch.int32), [3], torch.zeros(1, dtype=torch.int32))
    op = SumSlots(t, numel, summed)
    slots = torch.zeros(t, numel, dtype=torch.bfloat16)
    launches = []
    for aligned in (True, False):   # the compiled kernels __call__ would have kept, per out alignment
        op._compiled[(slots.dtype, True, aligned)] = lambda *args, aligned=aligned: launches.append((aligned, args))
    outs = [torch.zeros(numel, dtype=torch.bfloat16) for _ in range(3)]
    unaligned = torch.zeros(numel + 1, dtype=torch.bfloat16)[1:]
    for out, progress in zip(outs + [unaligned] + outs, (5, 6, 7, 8, 9, 10, 11)):
        op(slots, out, progress)
        assert op.launch_checked(slots, out, progress) is out
        (checked, want), (bound, got) = launches[-2:]
        assert got == want and bound == checked == (out.data_ptr() % 16 == 0)
    assert op._bound[0] is slots
