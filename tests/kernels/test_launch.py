"""Which compiled kernels kernels/launch.py launches directly, decided without a GPU: the C launch function is found
behind Triton 3.6's launcher (bare, or inside its tensor-descriptor wrapper), and every other layout gives a reason
(the DirectKernel then launches through CompiledKernel.run and warns). The launches themselves need a GPU:
tests/gpu/test_direct_launch_gpu.py."""
import types

import pytest

from overlap_tp.kernels import launch

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
    monkeypatch.setattr(nvidia_driver, "_BASE_ARGS_FORMAT", launch.DIRECT_LAYOUT, raising=False)


def test_the_c_launcher_is_found_bare_or_behind_the_descriptor_wrapper(triton_36_layout):
    assert launch._c_launcher(fake_run(c_launch)) == (c_launch, None)
    assert launch._c_launcher(fake_run(wrapped(c_launch))) == (c_launch, None)


def test_unknown_layouts_give_a_reason(triton_36_layout, monkeypatch):
    other = 1

    def closure_without_launcher(*args):
        return other

    found, reason = launch._c_launcher(fake_run(closure_without_launcher))
    assert found is None and "tensor-descriptor wrapper" in reason
    found, reason = launch._c_launcher(fake_run(c_launch, scratch=128))
    assert found is None and "scratch" in reason
    found, reason = launch._c_launcher(types.SimpleNamespace())
    assert found is None and "no launch function" in reason
    monkeypatch.setattr(nvidia_driver, "_BASE_ARGS_FORMAT", "iiiKKOOOO", raising=False)
    found, reason = launch._c_launcher(fake_run(c_launch))
    assert found is None and "not 3.6's" in reason
