import pytest

from overlap_tp import OverlapConfig


def test_defaults_are_valid():
    config = OverlapConfig()
    assert config.method == "auto" and config.schedule == "row_slice"


def test_list_groups_become_a_tuple():
    assert OverlapConfig(groups=[1, 2]).groups == (1, 2)


@pytest.mark.parametrize("kwargs,match", [
    (dict(method="fast"), "method"),
    (dict(schedule="rows"), "schedule"),
    (dict(transport="mpi"), "transport"),
    (dict(groups=0), "at least one group"),
    (dict(groups=(2, 0)), "positive ints"),
    (dict(groups=()), "positive ints"),
    (dict(groups="many"), "groups"),
    (dict(groups=True), "groups"),
    (dict(comm_sms=-1), "comm_sms"),
    (dict(chunks=0), "chunks"),
    (dict(block_m=96), "power of two"),
    (dict(block_k=8), "power of two"),
    (dict(num_warps=6), "power of two"),
    (dict(num_stages=0), "num_stages"),
])
def test_bad_values_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OverlapConfig(**kwargs)


class _FakeCuda:
    """What resolve_transport reads of a tensor: is_cuda and the shape."""
    is_cuda = True

    def __init__(self, k):
        self.shape = (4096, k)


@pytest.mark.parametrize("op,k,backend,want", [
    ("ag_gemm", 8192, "nccl", ("p2p", 0)),
    ("gemm_rs", 4096, "nccl", ("p2p", 0)),          # up to AUTO_RS_P2P_MAX_K: the short GEMMs
    ("gemm_rs", 4104, "nccl", ("nccl", 16)),        # longer: NCCL beside a GEMM on SMs - comm_sms
    ("gemm_ar", 1024, "nccl", ("nccl", 16)),        # p2p is RS/AG only
    ("ag_gemm", 1024, "gloo", ("nccl", 16)),        # no symmetric memory without NCCL
])
def test_transport_auto_resolves_per_call(monkeypatch, op, k, backend, want):
    from overlap_tp import ops
    assert ops.AUTO_RS_P2P_MAX_K == 4096
    monkeypatch.setattr(ops.dist, "get_backend", lambda group: backend)
    config = ops.resolve_transport(OverlapConfig(method="signal", transport="auto"), op, _FakeCuda(k), None)
    assert (config.transport, config.comm_sms) == want


def test_transport_auto_is_nccl_on_cpu_tensors():
    import torch
    from overlap_tp import ops
    config = ops.resolve_transport(OverlapConfig(method="signal", transport="auto"), "ag_gemm", torch.zeros(2, 8), None)
    assert config.transport == "nccl"


def test_concrete_transports_pass_through():
    from overlap_tp import ops
    config = OverlapConfig(method="signal", transport="p2p", comm_sms=4)
    assert ops.resolve_transport(config, "gemm_rs", _FakeCuda(1 << 20), None) is config
