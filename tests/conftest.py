"""Test setup. On a machine without CUDA, Triton kernels run under the interpreter
(TRITON_INTERPRET=1 must be set before any kernel module is imported); `-m gpu` selects the GPU
suite on the device machine, where gpu-marked tests run and everything else may be deselected."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
