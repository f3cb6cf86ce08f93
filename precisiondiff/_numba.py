"""numba, an optional dependency: whether it may be used, and kernel modules imported on first use.

The compiled kernels (``capture/_stats_jit.py``, ``comparators/_tiles_jit.py``) live in their own
modules because importing numba costs about half a second: :class:`Kernels` imports one when it
is first needed. ``PRECISIONDIFF_NO_NUMBA=1`` disables them all (the eager PyTorch paths, which
are also the oracles of the kernels' tests).
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from types import ModuleType
from typing import Optional

__all__ = ["ENABLED", "Kernels"]

_log = logging.getLogger(__name__)

#: numba is installed and not disabled by ``PRECISIONDIFF_NO_NUMBA``
ENABLED = importlib.util.find_spec("numba") is not None and not os.environ.get("PRECISIONDIFF_NO_NUMBA")


class Kernels:
    """A module of numba kernels, imported on the first call.

    Args:
        module: the absolute module name, e.g. ``"precisiondiff.capture._stats_jit"``.

    Example:
        >>> kernels = Kernels("precisiondiff.capture._stats_jit")
        >>> module = kernels()  # doctest: +SKIP
    """

    def __init__(self, module: str) -> None:
        self.module = module
        self.failed = not ENABLED
        self._loaded: Optional[ModuleType] = None

    def __call__(self) -> Optional[ModuleType]:
        """The kernel module; None when numba is disabled or the import fails (a broken numba
        install: the callers take their PyTorch path, and the failure is logged once)."""
        if self._loaded is None and not self.failed:
            try:
                self._loaded = importlib.import_module(self.module)
            except Exception as err:  # noqa: BLE001 - any failure means: no kernels
                self.failed = True
                _log.warning("numba kernels %s unavailable (%s): using PyTorch", self.module, err)
        return self._loaded
