"""The sum of a reduce-scatter's received partials: out = slots[0] + slots[1] + ... + slots[t-1].

The peer-to-peer GEMM+ReduceScatter (overlap_tp/ops/p2p.py) leaves t partials of this rank's rows in a
[t, M/t, N] receive buffer (slot s: rank s's partial). One pass reads them and writes the sum:

    out[i] = round(sum over s of float(slots[s, i]))      s in order 0, 1, ..., t-1; fp32, rounded once

At t = 2 that is the correctly rounded a + b, the bits NCCL's bf16 reduce-scatter gives. The pass moves
(t + 1) * M/t * N elements, so it should run at HBM speed: torch's `slots.sum(0)` reached ~1.4 TB/s on an
H200 for [2, 4096, 4096] bf16 (67 us, docs/perf/s11/README.md); this kernel streams 16-byte vectors.
"""
import torch
import triton
import triton.language as tl

from overlap_tp.kernels.launch import DirectKernel
from overlap_tp.kernels.signaled_gemm import INTERPRET

BLOCK = 4096      # elements per program: 16 per thread at 8 warps (two 16-byte loads per slot)
NUM_WARPS = 8


@triton.jit
def sum_slots_kernel(slots_ptr, out_ptr, numel, SLOTS: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = sum over s of slots[s * numel + i] for the BLOCK elements of this program."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SLOTS):
        acc += tl.load(slots_ptr + s * numel + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def reference_sum_slots(slots: torch.Tensor) -> torch.Tensor:
    """The same sum in torch: fp32, slot by slot in order, rounded once."""
    acc = torch.zeros(slots.shape[1:], dtype=torch.float32, device=slots.device)
    for s in range(slots.shape[0]):
        acc += slots[s].float()
    return acc.to(slots.dtype)


class SumSlots:
    """sum_slots for one buffer shape, launched without Triton's launch path after the first call (as
    SignaledGemm: the compiled kernel of each alignment variant is kept as a DirectKernel)."""

    def __init__(self, slots: int, numel: int):
        self.slots, self.numel = slots, numel
        self.grid = max(1, triton.cdiv(numel, BLOCK))
        self._compiled = {}

    def __call__(self, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if slots.shape[0] != self.slots or out.numel() != self.numel or slots.numel() != self.slots * self.numel:
            raise ValueError(f"sum_slots: built for [{self.slots}, {self.numel}] elements, got slots "
                             f"{tuple(slots.shape)} and out {tuple(out.shape)}")
        if not (slots.is_contiguous() and out.is_contiguous()) or out.dtype != slots.dtype:
            raise ValueError("sum_slots: slots and out must be contiguous and of the same dtype")
        slots_ptr, out_ptr = slots.data_ptr(), out.data_ptr()
        variant = (slots.dtype, slots_ptr % 16 == 0, out_ptr % 16 == 0)
        kernel = None if INTERPRET else self._compiled.get(variant)
        if kernel is None:
            compiled = sum_slots_kernel[(self.grid,)](slots, out, self.numel, SLOTS=self.slots, BLOCK=BLOCK,
                                                      num_warps=NUM_WARPS)
            if not INTERPRET:
                self._compiled[variant] = DirectKernel(compiled)
            return out
        kernel(self.grid, torch._C._cuda_getCurrentRawStream(out.device.index), slots_ptr, out_ptr, self.numel,
               self.slots, BLOCK)
        return out
