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

__all__ = ["ENABLED", "Kernels", "threads"]

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

    def disable(self) -> None:
        """Stop using the kernels (one failed at run time): the callers take their PyTorch path."""
        self.failed = True
        self._loaded = None


_threads_ok: Optional[bool] = None  # numba's threads may run: None until first asked
_threads_pid = 0  # the process that asked


def threads(count: int) -> bool:
    """Whether numba's parallel kernels may run here, and if so, set them to ``count`` threads
    (PyTorch's intra-op count, at most numba's).

    Only a threading layer that is safe to launch from several threads at once (OpenMP or TBB;
    not numba's ``workqueue``, which aborts the process when two threads launch together: watch's
    hooks may run on autograd's threads). When the user has chosen no layer, numba is asked for a
    thread-safe one (``NUMBA_THREADING_LAYER=threadsafe``); without one, False. False in a child
    forked after the threads started: GNU OpenMP cannot run there (numba stops the process)."""
    global _threads_ok, _threads_pid
    if _threads_pid != os.getpid():
        if _threads_ok:
            return False  # forked from a process whose threads ran
        _threads_pid = os.getpid()
        _threads_ok = None
    if _threads_ok is None:
        _threads_ok = False
        torch_threads = None
        try:
            if not ENABLED:
                raise RuntimeError("numba is not installed or disabled")
            import numba
            import torch
            from numba.np.ufunc import parallel
            # numba's OpenMP layer may share PyTorch's libgomp, and starting it sets that runtime's
            # thread count to numba's (2 where torchrun set OMP_NUM_THREADS=1): PyTorch's is put
            # back, or the watched run would reduce in another order than the unwatched one
            torch_threads = torch.get_num_threads()
            chosen = bool(os.environ.get("NUMBA_THREADING_LAYER")) or numba.config.THREADING_LAYER != "default"
            if not parallel._is_initialized and not chosen:
                numba.config.THREADING_LAYER = "threadsafe"
                try:
                    parallel._launch_threads()
                except Exception:  # noqa: BLE001 - neither OpenMP nor TBB: leave numba's default to the user
                    numba.config.THREADING_LAYER = "default"
                    raise
            else:
                parallel._launch_threads()
            _threads_ok = numba.threading_layer() in ("omp", "tbb")
        except Exception as err:  # noqa: BLE001 - no threads: the callers run their parts on one thread
            _log.info("numba's threads unavailable (%s)", err)
        finally:
            if torch_threads is not None and torch.get_num_threads() != torch_threads:
                torch.set_num_threads(torch_threads)
    if _threads_ok:
        import numba
        numba.set_num_threads(max(1, min(int(count), numba.config.NUMBA_NUM_THREADS)))
    return bool(_threads_ok)
