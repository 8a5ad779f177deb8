"""Which compiled kernels kernels/direct_launch.py launches directly, decided without a GPU: the C launch function is
found behind Triton 3.6's launcher (bare, or inside its tensor-descriptor wrapper), and every other layout gives a
reason (the DirectKernel then launches through CompiledKernel.run and warns). The launches themselves need a GPU:
tests/gpu/test_direct_launch_gpu.py."""
import types

import pytest

from overlap_tp.kernels import direct_launch

nvidia_driver = pytest.importorskip("triton.backends.nvidia.driver")


def c_launch(*args):
    return args


def wrapped(launcher):
    def inner(*args):   # as wrap_handle_tensordesc's: a closure over the C launcher
        return launcher(*args)
    return inner


def fake_run(launch_fn, scratch=0):
    return types.SimpleNamespace(launch=launch_fn, global_scratch_size=scratch, profile_scratch_size=0,
                                 launch_cooperative_grid=False, launch_pdl=False)


@pytest.fixture
def triton_36_layout(monkeypatch):
    monkeypatch.setattr(nvidia_driver, "_BASE_ARGS_FORMAT", direct_launch.DIRECT_LAYOUT, raising=False)


def test_the_c_launcher_is_found_bare_or_behind_the_descriptor_wrapper(triton_36_layout):
    assert direct_launch._c_launcher(fake_run(c_launch)) == (c_launch, None)
    assert direct_launch._c_launcher(fake_run(wrapped(c_launch))) == (c_launch, None)


def test_unknown_layouts_give_a_reason(triton_36_layout, monkeypatch):
    other = 1

    def closure_without_launcher(*args):
        return other

    found, reason = direct_launch._c_launcher(fake_run(closure_without_launcher))
    assert found is None and "tensor-descriptor wrapper" in reason
    found, reason = direct_launch._c_launcher(fake_run(c_launch, scratch=128))
    assert found is None and "scratch" in reason
    found, reason = direct_launch._c_launcher(types.SimpleNamespace())
    assert found is None and "no launch function" in reason
    monkeypatch.setattr(nvidia_driver, "_BASE_ARGS_FORMAT", "iiiKKOOOO", raising=False)
    found, reason = direct_launch._c_launcher(fake_run(c_launch))
    assert found is None and "not 3.6's" in reason


def test_a_plans_launch_arguments_are_kept_by_address_and_layout(monkeypatch):
    """SignaledGemm.launch_checked builds a call's launch arguments (_bind) once per (a, w, dst, bias) addresses and
    w's layout, launches the kept ones after, and clears them at MAX_CACHED_LAUNCHES."""
    import torch
    from overlap_tp import OverlapConfig
    from overlap_tp.kernels import signaled_gemm as S

    monkeypatch.setattr(S, "INTERPRET", False)
    monkeypatch.setattr(S, "MAX_CACHED_LAUNCHES", 4)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)
    gemm = S.SignaledGemm(torch.zeros(1, S.TILE_FIELDS, dtype=torch.int32), 4, OverlapConfig())
    binds, launches = [], []

    def bind(a, w, dst, bias, layout):
        binds.append((a.data_ptr(), w.data_ptr(), layout, bias is not None))
        return lambda grid, stream, *args: launches.append((grid, stream, args)), 4, (len(binds),)
    monkeypatch.setattr(gemm, "_bind", bind)
    a, other_a, w, dst, bias = (torch.zeros(8, 8) for _ in range(5))
    for _ in range(3):
        gemm.launch_checked(a, w, dst)
    assert len(binds) == 1 and launches == [(4, 7, (1,))] * 3
    gemm.launch_checked(a, w.t(), dst)          # the same address read as the transposed view of a [K, N]
    gemm.launch_checked(other_a, w, dst)        # another activation
    gemm.launch_checked(a, w, dst, bias)        # a bias
    assert [layout for _, _, layout, _ in binds] == ["nk", "kn", "nk", "nk"] and len(gemm._launches) == 4
    gemm.launch_checked(a, w, dst)              # kept
    assert len(binds) == 4 and launches[-1] == (4, 7, (1,))
    gemm.launch_checked(a, w, torch.zeros(8, 8))   # a fifth key: the kept ones were cleared first
    assert len(binds) == 5 and len(gemm._launches) == 1
