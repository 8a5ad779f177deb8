"""The raw NCCL communicator's calls (overlap_tp/ops/nccl.py), against a stand-in library that records them: what an
AllGather+GEMM chunk enqueues, for every rank of several group sizes (the GPU tests check the rows that arrive)."""
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


def communicator(rank, world):
    comm = object.__new__(nccl.Communicator)   # no NCCL init: only the fields the calls read
    comm.rank, comm.world, comm.comm = rank, world, "comm"
    return comm


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_a_chunk_sends_this_ranks_rows_to_every_peer_and_receives_theirs_into_place(monkeypatch, world):
    rows, cols, lo, hi, base, stream = 64, 48, 16, 40, 1 << 20, 7
    spans = nccl.gather_spans(world, rows, cols, 2, lo, hi)
    for rank in range(world):
        lib = RecordingLibrary()
        monkeypatch.setattr(nccl, "library", lambda: lib)
        communicator(rank, world).all_gather_rows_at(base, spans, nccl.torch.bfloat16, stream)
        names = [name for name, _ in lib.calls]
        assert names[0] == "ncclGroupStart" and names[-1] == "ncclGroupEnd"   # one group: all at once
        sends = [args for name, args in lib.calls if name == "ncclSend"]
        recvs = [args for name, args in lib.calls if name == "ncclRecv"]
        assert "ncclBroadcast" not in names and len(names) == 2 + 2 * (world - 1)
        own = base + (rank * rows + lo) * cols * 2
        dtype = nccl.NCCL_DTYPES[nccl.torch.bfloat16]
        peers = [p for p in range(world) if p != rank]
        # (buffer, elements, dtype, peer, comm, stream): our rows [lo, hi) from our region to each peer, ...
        assert sends == [(own, (hi - lo) * cols, dtype, p, "comm", stream) for p in peers]
        # ... and each peer's rows [lo, hi) into its region of ours
        assert recvs == [(base + (p * rows + lo) * cols * 2, (hi - lo) * cols, dtype, p, "comm", stream) for p in peers]


def test_every_byte_of_a_chunk_arrives_once_from_its_owner(monkeypatch):
    """Over all ranks' calls: every receive of rank r from peer p matches p's send to r (same count), and the
    receives of one rank tile the chunk's rows of every other region exactly once."""
    world, rows, cols, lo, hi = 4, 32, 8, 8, 24
    spans = nccl.gather_spans(world, rows, cols, 2, lo, hi)
    sent, received = {}, {}
    for rank in range(world):
        lib = RecordingLibrary()
        monkeypatch.setattr(nccl, "library", lambda: lib)
        communicator(rank, world).all_gather_rows_at(0, spans, nccl.torch.bfloat16, 0)
        for name, (ptr, count, _, peer, _, _) in (c for c in lib.calls if c[0] in ("ncclSend", "ncclRecv")):
            (sent if name == "ncclSend" else received)[rank, peer] = (ptr, count)
    for (rank, peer), (ptr, count) in received.items():
        assert sent[peer, rank] == (spans[peer][0], count)   # the peer sends its own rows, as many as we take
        assert ptr == spans[peer][0]                           # into the same place of our buffer
    for rank in range(world):
        regions = sorted(ptr for (r, _), (ptr, _) in received.items() if r == rank)
        assert regions == sorted(spans[p][0] for p in range(world) if p != rank)
