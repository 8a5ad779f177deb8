"""The raw NCCL communicator's calls (overlap_tp/ops/nccl.py), against a stand-in library that records them: what an
AllGather+GEMM over NCCL enqueues per chunk, for every rank of several group sizes (the GPU tests check the rows that
arrive)."""
import pytest

from overlap_tp.ops import nccl
from overlap_tp.ops.tile_plan import chunk_major_pieces, chunk_major_rows


class RecordingLibrary:
    """libnccl's entry points as recorders: (name, args) per call; every call succeeds."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, args))
            return 0
        return call


def communicator(rank, world, lib):
    comm = object.__new__(nccl.Communicator)   # no NCCL init: only the fields the calls read
    comm.rank, comm.world, comm.comm, comm._all_gather = rank, world, "comm", lib.ncclAllGather
    return comm


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_each_chunk_is_one_in_place_allgather_that_fills_its_block(monkeypatch, world):
    """Per chunk one ncclAllGather: this rank's rows sent from its place in the chunk's block, every rank's rows
    received into the block (NCCL's in-place rule: send address = receive address + rank * count). Replayed over
    every rank's calls, the blocks hold each rank's rows where chunk_major_rows says."""
    rows, cols, chunks, base, stream, elem = 64, 48, [(0, 16), (16, 40), (40, 64)], 1 << 20, 7, 2
    row_bytes = cols * elem
    dtype = nccl.NCCL_DTYPES[nccl.torch.bfloat16]
    landed = {}   # buffer row -> (rank, local row) that every rank's buffer holds there
    for rank in range(world):
        lib = RecordingLibrary()
        monkeypatch.setattr(nccl, "library", lambda: lib)
        comm = communicator(rank, world, lib)
        for own, block, n in chunk_major_pieces(world, rank, chunks):
            comm.all_gather_at(base + own * row_bytes, base + block * row_bytes, n * cols, nccl.torch.bfloat16,
                               stream)
        assert [name for name, _ in lib.calls] == ["ncclAllGather"] * len(chunks)
        for (_, (src, dst, count, dt, c, s)), (lo, hi) in zip(lib.calls, chunks):
            assert (count, dst, (dt, c, s)) == ((hi - lo) * cols, base + world * lo * row_bytes, (dtype, "comm", stream))
            assert src == dst + rank * count * elem
            first = (src - base) // row_bytes   # rank's rows [lo, hi) go to every rank's buffer at the same rows
            for r in range(hi - lo):
                assert landed.setdefault(first + r, (rank, lo + r)) == (rank, lo + r)
    where = chunk_major_rows(rows, world, chunks).tolist()
    assert sorted(landed) == list(range(world * rows))
    assert all(where[p * rows + r] == row for row, (p, r) in landed.items())
