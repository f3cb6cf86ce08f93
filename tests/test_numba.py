"""precisiondiff._numba: kernel modules imported on first use; a failed import means no kernels."""
from __future__ import annotations

import logging

from precisiondiff import _numba
from precisiondiff.capture import stats_kernel


def test_a_kernel_module_is_imported_on_first_call():
    kernels = _numba.Kernels("precisiondiff.capture._stats_jit")
    assert _numba.ENABLED and not kernels.failed
    module = kernels()
    assert module is not None and module is kernels() and hasattr(module, "stats_f32")


def test_a_failed_import_disables_the_kernels_once_and_says_why(caplog):
    kernels = _numba.Kernels("precisiondiff.capture._no_such_kernels")
    with caplog.at_level(logging.WARNING, logger="precisiondiff._numba"):
        assert kernels() is None and kernels() is None
    assert kernels.failed
    assert [r.getMessage() for r in caplog.records] == [
        "numba kernels precisiondiff.capture._no_such_kernels unavailable "
        "(No module named 'precisiondiff.capture._no_such_kernels'): using PyTorch"]


def test_the_statistics_kernel_uses_the_loader():
    assert stats_kernel._loader.module == "precisiondiff.capture._stats_jit"
    assert stats_kernel._kernels() is stats_kernel._loader()
