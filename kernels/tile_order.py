"""TileOrder: the tile-exact layout, the data contract between the signaled GEMM+ReduceScatter (which
leaves its result tile by tile in execution order) and the kernels that read it there (the fused
residual-add + RMSNorm), with the pure-torch `undo` / `apply` references."""
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TileOrder:
    """Where the tile-exact GEMM+ReduceScatter left each BM x BN block of the [M, N] result.

    `slot_of[mi, ni]` (int32, shape [M // BM, N // BN]) is the slot of the block of rows
    [mi*BM, (mi+1)*BM) and columns [ni*BN, (ni+1)*BN); slot s occupies elements
    [s*BM*BN, (s+1)*BM*BN) of the buffer, row-major. Checked to be a permutation on construction.
    """
    block_m: int
    block_n: int
    slot_of: torch.Tensor

    def __post_init__(self):
        if not (isinstance(self.block_m, int) and self.block_m > 0):
            raise ValueError(f"TileOrder: block_m must be a positive int, got {self.block_m!r}")
        if not (isinstance(self.block_n, int) and self.block_n >= 4 and self.block_n & (self.block_n - 1) == 0):
            raise ValueError(f"TileOrder: block_n must be a power of two >= 4, got {self.block_n!r}")
        slot_of = self.slot_of
        if not (isinstance(slot_of, torch.Tensor) and slot_of.dtype == torch.int32 and slot_of.dim() == 2
                and slot_of.is_contiguous()):
            raise ValueError("TileOrder: slot_of must be a contiguous 2-D int32 tensor "
                             f"[M // block_m, N // block_n], got {slot_of!r:.80}")
        if not torch.equal(slot_of.flatten().sort().values.cpu(), torch.arange(slot_of.numel(), dtype=torch.int32)):
            raise ValueError(f"TileOrder: slot_of must be a permutation of 0..{slot_of.numel() - 1}")

    @property
    def shape(self):
        """The [M, N] of the standard matrix this order describes."""
        return self.slot_of.shape[0] * self.block_m, self.slot_of.shape[1] * self.block_n

    def undo(self, buf):
        """Reference: the standard [M, N] matrix held by the tile-ordered buffer `buf`."""
        (rows, cols), (mb, nb) = self.shape, self.slot_of.shape
        blocks = buf.reshape(mb * nb, self.block_m, self.block_n)[self.slot_of.long()]
        return blocks.permute(0, 2, 1, 3).reshape(rows, cols)

    def apply(self, matrix):
        """Reference: the tile-ordered buffer (flat) that holds the standard [M, N] `matrix`."""
        mb, nb = self.slot_of.shape
        blocks = matrix.reshape(mb, self.block_m, nb, self.block_n).permute(0, 2, 1, 3)
        buf = torch.empty_like(blocks).reshape(mb * nb, self.block_m, self.block_n)
        buf[self.slot_of.long().flatten()] = blocks.reshape(mb * nb, self.block_m, self.block_n)
        return buf.flatten()
