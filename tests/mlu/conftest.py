"""The MLU suite: runs where ``torch.mlu`` exists, a real MLU (torch_mlu) or the stand-in.

In the main test session these files are not collected; ``tests/test_mlu_standin.py`` runs them
in a session of their own with the stand-in registered (``-p tests.mlu_backend.plugin``). On a
machine with torch_mlu: ``pytest tests/mlu`` (see docs/mlu.md).
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

if getattr(torch, "mlu", None) is None and importlib.util.find_spec("torch_mlu") is not None:
    import torch_mlu  # noqa: F401  (a real MLU machine)


def pytest_ignore_collect(collection_path, config):
    """Leave the suite out of sessions without an ``mlu`` device (decided after plugins loaded)."""
    if collection_path.name.startswith("test_"):
        return getattr(torch, "mlu", None) is None or torch._C._get_privateuse1_backend_name() != "mlu"
    return None


@pytest.fixture
def standin():
    """The stand-in's controls (fallback set, planted numerics), restored after the test."""
    import tests.mlu_backend as backend

    if not backend.active():
        pytest.skip("controls of the stand-in accelerator; real MLU kernels are what they are")
    backend.set_unimplemented(backend.DEFAULT_UNIMPLEMENTED)
    backend.reset_fallback_counts()
    with backend.planted(gemm_chunk=0, truncate_cast=False, ftz=False, warn=False, narrow_float64=False,
                         narrow_int64=()):
        yield backend
    backend.set_unimplemented(backend.DEFAULT_UNIMPLEMENTED)
