"""Test set-up shared by every test file.

Without a GPU the Triton kernels run in Triton's CPU interpreter; that must be decided before any
kernel module is imported (triton.jit reads TRITON_INTERPRET when it decorates). GPU tests carry the
`gpu` marker and are skipped where CUDA is absent.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
