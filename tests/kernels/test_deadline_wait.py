"""The capture-time wait kernel's wait-and-reset (on the GPU where there is one, else in the CPU interpreter,
which has no deadline; the deadline, the mailbox record and the trap: tests/gpu/test_graphs_gpu.py)."""
import torch

from overlap_tp.kernels.deadline_wait import deadline_wait_kernel
from overlap_tp.kernels.signaled_gemm import INTERPRET


def test_a_word_at_its_target_passes_and_is_reset_to_zero():
    for target in (1, 5, 160):
        word = torch.tensor([target], dtype=torch.int32, device="cpu" if INTERPRET else "cuda")
        mailbox = torch.zeros(1, dtype=torch.int64, pin_memory=not INTERPRET)
        deadline_wait_kernel[(1,)](word, target, 5.0, mailbox, 7, INTERPRET, num_warps=1)
        if not INTERPRET:
            torch.cuda.synchronize()
        assert word.item() == 0
        assert mailbox.item() == 0     # nothing to report
