"""tests/distributed.py's run_distributed: how its ranks start, and that each rank sees the caller's environment as
it is at the call (a fork server's children would otherwise inherit the server's, from its start)."""
import os
import uuid

import torch

from distributed import fork_server_pid, run_distributed, start_method


def test_gloo_ranks_fork_from_a_server_only_where_cuda_is_absent():
    assert start_method("nccl") == "spawn"
    assert start_method("gloo") == ("spawn" if torch.cuda.is_available() else "forkserver")


def _sees(rank, world, name, value, server):
    assert os.environ.get(name) == value, (rank, os.environ.get(name))
    assert os.environ.get("OVERLAP_TP_TEST_UNSET") is None
    if server is not None:   # a rank of the fork server, not of this test's process
        assert os.getppid() == server, (os.getppid(), server)


def test_each_rank_sees_the_callers_environment_at_the_call(monkeypatch):
    run_distributed(2, _sees, "OVERLAP_TP_TEST_MARK", None, None)   # the server (if any) starts without the mark
    for _ in range(2):   # a new value on every call, after the server started
        value = uuid.uuid4().hex
        monkeypatch.setenv("OVERLAP_TP_TEST_MARK", value)
        monkeypatch.delenv("OVERLAP_TP_TEST_UNSET", raising=False)
        run_distributed(2, _sees, "OVERLAP_TP_TEST_MARK", value, fork_server_pid())
