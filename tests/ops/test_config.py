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
