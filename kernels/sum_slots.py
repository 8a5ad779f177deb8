"""The sum of a reduce-scatter's received partials: out = slots[0] + slots[1] + ... + slots[t-1], and, for the
peer-to-peer protocol, the signal that the slots may be written again.

The peer-to-peer GEMM+ReduceScatter (overlap_tp/ops/p2p_reduction.py) leaves t partials of this rank's rows in a
[t, M/t, N] receive buffer (slot s: rank s's partial). One pass reads them and writes the sum:

    out[i] = round(sum over s of float(slots[s, i]))      s in order 0, 1, ..., t-1; fp32, rounded once

At t = 2 that is the correctly rounded a + b, the bits NCCL's bf16 reduce-scatter gives. The pass moves
(t + 1) * M/t * N elements, so it should run at HBM speed, as torch's `slots.sum(0)` does; this kernel streams
16-byte vectors, and being ours it can end the protocol (below).

Built with `summed` (SlotsSummed), the kernel ends the protocol's reduce half itself: its last program (the last to
count itself in a done counter, so every program's loads of the slots are complete) resets the counter, raises the
SUMMED word in every peer's memory (release, system scope, as a stream write-value would, without its driver call)
and, eagerly, writes the call's number into the plan's progress word in pinned host memory (what the watchdog polls
instead of an event record: one driver call less).
"""
from typing import NamedTuple, Sequence

import torch
import triton
import triton.language as tl

from overlap_tp.kernels.direct_launch import DirectKernel
from overlap_tp.kernels.signaled_gemm import INTERPRET

BLOCK = 4096      # elements per program: 16 per thread at 8 warps (two 16-byte loads per slot)
NUM_WARPS = 8


@triton.jit
def store_system(ptr, value, INTERPRETED: tl.constexpr):
    """*ptr = value (int32) with a system-scope store: ptr may be pinned host memory, which the host reads."""
    if INTERPRETED:
        tl.store(ptr, value)
    else:
        tl.inline_asm_elementwise("st.relaxed.sys.global.b32 [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r", [ptr, value],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["progress"])
def sum_slots_kernel(slots_ptr, out_ptr, numel, done_ptr, words_ptr, summed_out_ptr, progress_ptr, progress,
                     SLOTS: tl.constexpr, BLOCK: tl.constexpr, PEERS: tl.constexpr, INTERPRETED: tl.constexpr):
    """out[i] = sum over s of slots[s * numel + i] for the BLOCK elements of this program. PEERS > 0: then the last
    program raises words_ptr[summed_out[j]] for every peer j and, where progress != 0, writes it into *progress_ptr
    (done: int32, zero between calls)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SLOTS):
        acc += tl.load(slots_ptr + s * numel + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    if PEERS > 0:
        tl.debug_barrier()   # every thread's loads consumed (their stores issued) before the count (release)
        if tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
            tl.store(done_ptr, 0)   # the next launch follows in stream order
            for j in tl.static_range(PEERS):
                tl.atomic_xchg(words_ptr + tl.load(summed_out_ptr + j), 1, sem="release", scope="sys")
            if progress != 0:
                store_system(progress_ptr, progress, INTERPRETED)


def reference_sum_slots(slots: torch.Tensor) -> torch.Tensor:
    """The same sum in torch: fp32, slot by slot in order, rounded once."""
    acc = torch.zeros(slots.shape[1:], dtype=torch.float32, device=slots.device)
    for s in range(slots.shape[0]):
        acc += slots[s].float()
    return acc.to(slots.dtype)


class SlotsSummed(NamedTuple):
    """What a signalling sum raises at its end: words (int32, ours: the kernel addresses every word from them),
    summed_out[j] (peer j's SUMMED word for us, mapped here, in words from `words`), progress (a pinned int32 word
    of host memory the eager calls' numbers go into)."""
    words: torch.Tensor
    summed_out: Sequence[int]
    progress: torch.Tensor


def _variant(slots: torch.Tensor, out_ptr: int) -> tuple:
    """What the compiled kernel is specialized on beyond the shape: the dtype and both pointers' 16-byte alignment."""
    return slots.dtype, slots.data_ptr() % 16 == 0, out_ptr % 16 == 0


class SumSlots:
    """sum_slots for one buffer shape, launched without Triton's launch path after the first call (as
    SignaledGemm: the compiled kernel of each alignment variant is kept as a DirectKernel). With `summed`, every
    call also raises the peers' SUMMED words (module doc)."""

    def __init__(self, slots: int, numel: int, summed: SlotsSummed = None):
        self.slots, self.numel = slots, numel
        self.grid = max(1, triton.cdiv(numel, BLOCK))
        self._compiled = {}
        self._bound = None   # launch_checked's (slots, kernel, and the arguments around out and progress)
        self.peers = 0 if summed is None else len(summed.summed_out)
        if summed is not None:
            device = summed.words.device
            self._done = torch.zeros(1, dtype=torch.int32, device=device)
            self._summed_out = torch.tensor(list(summed.summed_out), dtype=torch.int64, device=device)
            self._tables = (self._done, summed.words, self._summed_out, summed.progress)
            self._pointers = tuple(table.data_ptr() for table in self._tables)

    def __call__(self, slots: torch.Tensor, out: torch.Tensor, progress: int = 0) -> torch.Tensor:
        """out = the sum; with `summed`, then the SUMMED signals and `progress` (0: none) into the progress word."""
        if slots.shape[0] != self.slots or out.numel() != self.numel or slots.numel() != self.slots * self.numel:
            raise ValueError(f"sum_slots: built for [{self.slots}, {self.numel}] elements, got slots "
                             f"{tuple(slots.shape)} and out {tuple(out.shape)}")
        if not (slots.is_contiguous() and out.is_contiguous()) or out.dtype != slots.dtype:
            raise ValueError("sum_slots: slots and out must be contiguous and of the same dtype")
        slots_ptr, out_ptr = slots.data_ptr(), out.data_ptr()
        variant = _variant(slots, out_ptr)
        kernel = None if INTERPRET else self._compiled.get(variant)
        if kernel is None:
            compiled = self._jit(slots, out, progress)
            if not INTERPRET:
                self._compiled[variant] = DirectKernel(compiled)
            return out
        kernel(self.grid, torch._C._cuda_getCurrentRawStream(out.device.index), slots_ptr, out_ptr, self.numel,
               *self._signal_pointers(slots_ptr), progress, self.slots, BLOCK, self.peers, INTERPRET)
        return out

    def launch_checked(self, slots: torch.Tensor, out: torch.Tensor, progress: int = 0) -> torch.Tensor:
        """__call__ for a plan's call, whose slots are its own buffer of this shape and whose `out` it allocated
        (contiguous, `numel` elements of the slots' dtype): no checks, and the launch's arguments but `out` and
        `progress` made once per slots buffer."""
        bound, out_ptr = self._bound, out.data_ptr()
        if INTERPRET or bound is None or bound[0] is not slots or out_ptr % 16:
            self(slots, out, progress)   # the checks, and the compiled kernel of this variant
            # bound for outputs on 16 bytes (the allocator's): the others go through __call__ every time
            kernel = None if INTERPRET or out_ptr % 16 else self._compiled.get(_variant(slots, out_ptr))
            if kernel is not None:
                slots_ptr = slots.data_ptr()
                middle = (self.numel, *self._signal_pointers(slots_ptr))
                self._bound = (slots, kernel, slots.device.index, slots_ptr, middle,
                               (self.slots, BLOCK, self.peers, INTERPRET))
            return out
        _, kernel, device_index, slots_ptr, middle, tail = bound
        stream = torch._C._cuda_getCurrentRawStream(device_index)
        kernel(self.grid, stream, slots_ptr, out_ptr, *middle, progress, *tail)
        return out

    def _signal_pointers(self, slots_ptr: int) -> tuple:
        """The kernel's done, words, summed_out and progress pointers; without `summed` it reads none of them and the
        slots stand in."""
        return self._pointers if self.peers else (slots_ptr,) * 4

    def _jit(self, slots, out, progress):
        tables = self._tables if self.peers else (slots,) * 4
        return sum_slots_kernel[(self.grid,)](slots, out, self.numel, *tables, progress, SLOTS=self.slots,
                                              BLOCK=BLOCK, PEERS=self.peers, INTERPRETED=INTERPRET,
                                              num_warps=NUM_WARPS)
