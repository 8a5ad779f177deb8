"""The p2p AllGather's pulls done by SMs: rows of the peers' symmetric buffers loaded over NVLink, stored into ours.

ops/p2p.py GatherBuffer keeps a gathered [t * m, k] buffer on every rank; rank p's own rows are region p of its
buffer. A pull of rows [lo, hi) copies, for every peer p,

    ours[p * m + i, :] = peer_p's buffer[p * m + i, :]          lo <= i < hi

The copy engines do it without SMs (GatherBuffer.pull), at 210-270 GB/s per rank on four H200s however they are
driven (docs/perf/s22/README.md), below what NVLink carries. This kernel does it with `programs` CTAs: each peer's
buffer is mapped into our address space, so a plain load reads it over NVLink, on the SMs a persistent GEMM beside it
leaves free (comm_sms). Measured (docs/perf/s23/README.md): alone it moves what the copy engines move (180-300 GB/s
per rank at t = 2 and 4, 16 to 132 programs, BLOCK 16K or 64K elements), so the AllGather+GEMM is no faster with it.
"""
from typing import Sequence

import torch
import triton
import triton.language as tl

from overlap_tp.kernels.launch import JitLauncher

BLOCK = 16384     # elements per program per step: 64 per thread at 8 warps (eight 16-byte loads in flight)
NUM_WARPS = 8


@triton.jit
def peer_pull_kernel(buf_ptr, src_offsets_ptr, dst_offsets_ptr, start, count, PEERS: tl.constexpr,
                     BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    """For each peer j < PEERS: buf[dst_offsets[j] + start + i] = buf[src_offsets[j] + start + i], 0 <= i < count.
    src_offsets[j]: where peer j's region (its own rows, in its buffer, mapped here) lies, in elements from buf_ptr:
    the peers' buffers are one flat address space with ours, as in the signaled GEMM's epilogue (no integer-to-pointer
    casts, so alignment hints hold). ALIGN: what every offset is a multiple of (16: 16-byte loads and stores). The
    programs stride over one peer's blocks, then the next's (the caller orders the peers: ring order)."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    blocks = tl.cdiv(count, BLOCK)
    for j in tl.static_range(PEERS):
        src = buf_ptr + tl.multiple_of(tl.load(src_offsets_ptr + j), ALIGN)
        dst = buf_ptr + tl.multiple_of(tl.load(dst_offsets_ptr + j), ALIGN)
        for b in range(pid, blocks, programs):
            offs = start + b * BLOCK + tl.arange(0, BLOCK)   # int32: a region has fewer than 2**31 elements
            mask = offs < start + count
            tl.store(dst + offs, tl.load(src + offs, mask=mask, cache_modifier=".cg"), mask=mask)


_pull = JitLauncher(peer_pull_kernel)


def reference_peer_pull(buf: torch.Tensor, sources: Sequence[torch.Tensor], dst_offsets: Sequence[int], start: int,
                        count: int):
    """The same copy in torch: buf (flat) at dst_offsets[j] + [start, start + count) from sources[j] (flat)."""
    for src, off in zip(sources, dst_offsets):
        buf[off + start:off + start + count] = src[start:start + count]


class PeerPull:
    """The pulls of one gathered buffer on `programs` CTAs: where the peers' regions lie (in the order they are read)
    and where ours receive them, as element offsets from the buffer, on the device, made once. __call__(lo, hi)
    pulls rows [lo, hi) of every peer's region on the current stream."""

    def __init__(self, buf: torch.Tensor, src_offsets: Sequence[int], dst_offsets: Sequence[int], row_elems: int,
                 programs: int):
        if programs < 1:
            raise ValueError(f"PeerPull: programs={programs}: expected >= 1")
        if len(src_offsets) != len(dst_offsets) or not src_offsets:
            raise ValueError("PeerPull: one destination offset per source offset, at least one peer")
        self.buf, self.row_elems, self.programs = buf, row_elems, programs
        self.peers = len(src_offsets)
        # the alignment hint (16-byte vectors) only where every offset the kernel forms is a multiple of 16 elements
        aligned = all(o % 16 == 0 for o in (*src_offsets, *dst_offsets, row_elems)) and buf.data_ptr() % 16 == 0
        self.align = 16 if aligned else 1
        self.src_offsets = torch.tensor(list(src_offsets), dtype=torch.int64, device=buf.device)
        self.dst_offsets = torch.tensor(list(dst_offsets), dtype=torch.int64, device=buf.device)
        # compile and load the kernel now, with a launch that copies nothing: a kernel's first launch loads its module,
        # which may wait for the kernels running on the device (CUDA's lazy loading), and the first pull runs beside
        # a persistent GEMM whose tiles spin until the pulls raise their flags: a deadlock (session 23, every call
        # with comm_sms > 0 hung before this)
        self._launch(0, 0)

    def _launch(self, start: int, count: int):
        _pull[(self.programs,)](self.buf, self.src_offsets, self.dst_offsets, start, count, PEERS=self.peers,
                                BLOCK=BLOCK, ALIGN=self.align, num_warps=NUM_WARPS)

    def __call__(self, lo: int, hi: int):
        if hi > lo:
            self._launch(lo * self.row_elems, (hi - lo) * self.row_elems)
