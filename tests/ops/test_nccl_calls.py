"""The raw NCCL communicator's calls (overlap_tp/ops/nccl.py), against a stand-in library that records them: what an
AllGather+GEMM chunk over NCCL enqueues, for every rank of several group sizes (the GPU tests check the rows that
arrive)."""
import pytest

from overlap_tp.ops import nccl


class RecordingLibrary:
    """libnccl's entry points as recorders: (name, args) per call; every call succeeds."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, args))
            return 0
        return call


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_a_chunk_is_one_in_place_broadcast_per_root_in_one_group(monkeypatch, world):
    """Rows [lo, hi) of every root's region: broadcast in place from that region (the same address on every rank,
    so each rank's rows land at their standard place), in one group call, in root order on every rank (NCCL
    matches a group's collectives by their order)."""
    rows, cols, lo, hi, base, stream = 64, 48, 16, 40, 1 << 20, 7
    spans = nccl.gather_spans(world, rows, cols, 2, lo, hi)
    dtype = nccl.NCCL_DTYPES[nccl.torch.bfloat16]
    for rank in range(world):
        lib = RecordingLibrary()
        monkeypatch.setattr(nccl, "library", lambda: lib)
        comm = object.__new__(nccl.Communicator)   # no NCCL init: only the fields the call reads
        comm.rank, comm.world, comm.comm = rank, world, "comm"
        comm.all_gather_rows_at(base, spans, nccl.torch.bfloat16, stream)
        assert [name for name, _ in lib.calls] == ["ncclGroupStart"] + ["ncclBroadcast"] * world + ["ncclGroupEnd"]
        region = base + lo * cols * 2
        assert [args for _, args in lib.calls[1:-1]] == [
            (region + root * rows * cols * 2,) * 2 + ((hi - lo) * cols, dtype, root, "comm", stream)
            for root in range(world)]
