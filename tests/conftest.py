"""Test setup. On a machine without CUDA, Triton kernels run under the interpreter
(TRITON_INTERPRET=1 must be set before any kernel module is imported); `-m gpu` selects the GPU
suite on the device machine, where gpu-marked tests run and everything else may be deselected."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def _fix_interpreter_scalar_index():
    """Triton 3.6's interpreter holds scalars as shape-(1,) arrays and converts them with
    int(array), which NumPy >= 2.4 rejects; every loop with runtime bounds (`range(lo, hi)`) needs
    that conversion. Re-register __index__ through .item() after the interpreter's own patching."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_linrnn_fixed", False):
        return

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0].item()))

    patch._linrnn_fixed = True
    interpreter._patch_lang_tensor = patch


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter_scalar_index()


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
