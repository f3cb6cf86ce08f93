"""One-pass statistics and fingerprint of a CPU tensor, compiled with numba (optional).

:func:`fused_stats` reads each element once and returns what the eager path of
:mod:`precisiondiff.capture.stats` computes with about a dozen passes: ``min, max, sum,
sum |x|, sum x^2, NaN count, Inf count`` (float64 accumulation of the exact float64 value of
every element) and the two 64-bit words of :mod:`precisiondiff.store.fingerprint` (exact:
integer arithmetic modulo 2**64, the same value in any order). Sums are accumulated in a
different order from PyTorch's reductions, so ``mean``, ``abs_mean`` and ``norm`` may differ
from the eager path's in the last bits of float64; minimum, maximum, counts and fingerprint
are identical.

numba is an optional dependency (``pip install precisiondiff[fast]``): without it,
:data:`AVAILABLE` is False and the callers use the eager PyTorch path. Compiled code is
cached on disk (``cache=True``); four entry points are compiled, on first use.
"""
from __future__ import annotations

import logging
import math
from typing import Tuple

import numpy as np
import torch

from .. import _numba
from ..store.fingerprint import PERIOD, salts

__all__ = ["AVAILABLE", "fused_stats", "stats_into", "stats_at", "stats_in_parts", "supports", "PARTS_FROM",
           "c_entries"]

_log = logging.getLogger(__name__)

#: whether the fused kernel can be used (numba installed and not disabled by PRECISIONDIFF_NO_NUMBA;
#: False after a failed import of the kernels)
AVAILABLE = _numba.ENABLED
_loader = _numba.Kernels(__name__.rpartition(".")[0] + "._stats_jit")
_parts_loader = _numba.Kernels(__name__.rpartition(".")[0] + "._stats_par_jit")
_c_loader = _numba.Kernels(__name__.rpartition(".")[0] + "._stats_cjit")
#: tensors of at least this many elements take :func:`stats_in_parts` where a caller asks for it
#: (four of ``_stats_par_jit.PART``: below that, starting the threads costs more than they save)
PARTS_FROM = 4 * PERIOD
_PARTS_ENTRIES = {torch.float32: "parts_f32", torch.float64: "parts_f64", torch.bfloat16: "parts_bf16",
                  torch.float16: "parts_f16"}


def _kernels():
    """The compiled kernels, imported on first use; None (and AVAILABLE False) when that fails."""
    global AVAILABLE
    kernels = _loader() if AVAILABLE else None
    AVAILABLE = kernels is not None
    return kernels


_TABLE = salts("cpu").numpy()  # 1 ms (store.fingerprint builds it with NumPy)
assert _TABLE.shape[0] == PERIOD
# _CUMULATIVE[r] = S[0] + ... + S[r-1] modulo 2**64 (NumPy's uint64 sums wrap)
_CUMULATIVE = np.concatenate([np.zeros(1, np.uint64), np.cumsum(_TABLE.view(np.uint64))]).view(np.int64)
_KINDS = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}


def _infinity_keys(dtype: torch.dtype) -> np.ndarray:
    """The ordered keys (see ``_stats_jit._key``) of +Inf and -Inf in ``dtype``'s bits."""
    bits = torch.tensor([math.inf, -math.inf], dtype=dtype).view(_INT[dtype.itemsize]).numpy()
    width = 8 * dtype.itemsize
    return bits ^ ((bits >> (width - 1)) & np.array((1 << (width - 1)) - 1, dtype=bits.dtype))


_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_INFINITIES = {dtype: _infinity_keys(dtype) for dtype in _KINDS}
_ENTRIES = {torch.float32: "stats_f32", torch.float64: "stats_f64", torch.bfloat16: "stats_bf16",
            torch.float16: "stats_f16"}
_LOADED: dict = {}  # dtype -> its compiled entry point, once the kernels are imported
_LOADED_AT: dict = {}  # dtype -> (its ``*_at`` entry point, the address of its infinities' keys)
_LOADED_STRIDED: dict = {}  # dtype -> its ``strided_*_at`` entry point
_TABLES_AT = (_TABLE.ctypes.data, _CUMULATIVE.ctypes.data)
# tensors whose data_ptr() holds their values; a subclass goes through DLPack, which asks it
_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))


def supports(t: torch.Tensor) -> bool:
    """Whether :func:`stats_into` handles ``t`` (a CPU float16/bfloat16/float32/float64 tensor)."""
    return AVAILABLE and t.dtype in _KINDS and t.device.type == "cpu"


def stats_into(t: torch.Tensor, out: np.ndarray, fps: np.ndarray, row: int) -> None:
    """Statistics and fingerprint of a CPU floating tensor in one pass over its memory.

    Writes ``out[row] = [min, max, sum, sum|x|, sum x^2, nan, inf]`` (float64; min and max
    ignore NaN: the caller applies NaN propagation) and ``fps[row, :2] = [h1, h2]`` (int64).

    Args:
        t: a tensor with :func:`supports` true and at least one element, any shape and strides
            (a strided one is read in row-major order in place; a subclass's memory is copied
            once through DLPack).
        out: float64 array of shape ``(rows, 7)``.
        fps: int64 array of shape ``(rows, 2)`` or more columns.
        row: the row to write.

    Raises:
        RuntimeError: PyTorch cannot expose the tensor's memory to NumPy (conjugate or
            negative views), or the kernel failed (then :data:`AVAILABLE` becomes False): use
            the eager path.
    """
    dtype = t.dtype
    entry = _LOADED.get(dtype)
    if entry is None:
        k = _kernels()
        if k is None:
            raise RuntimeError("numba is not available")
        entry = _LOADED[dtype] = getattr(k, _ENTRIES[dtype])
    if type(t) in _PLAIN and not (t.is_neg() or t.is_conj()) and not t.is_contiguous():
        _strided_into(t, out, fps, row)
        return
    if type(t) in _PLAIN and not (t.is_neg() or t.is_conj()):
        data, address, n = t, t.data_ptr(), t.numel()
    else:  # a row-major copy made by NumPy (no PyTorch op), or a subclass's memory through DLPack
        if t.requires_grad:  # DLPack refuses such a tensor (e.g. a parameter's transpose)
            t = t.detach()
        data = _array(t.view(torch.int16) if dtype.itemsize == 2 else t)
        address, n = data.ctypes.data, data.size
    if not address:
        raise RuntimeError("the tensor has no memory of its own")
    try:  # ``data`` holds the memory while the kernel reads it
        entry(address, n, _INFINITIES[dtype], _TABLE, _CUMULATIVE, out, fps, row)
    except Exception as err:  # noqa: BLE001 - a kernel that fails to compile (another numba) or run
        _failed(err)


def _strided_into(t: torch.Tensor, out: np.ndarray, fps: np.ndarray, row: int) -> None:
    """:func:`stats_into` of a plain strided tensor, read in row-major order in place (a
    transposed weight costs ~2-3 ns per element here, ~7.6 through a NumPy copy): the results
    of its row-major copy, bit for bit."""
    entry = _LOADED_STRIDED.get(t.dtype)
    if entry is None:
        k = _kernels()
        if k is None:
            raise RuntimeError("numba is not available")
        entry = _LOADED_STRIDED[t.dtype] = getattr(k, "strided_" + _ENTRIES[t.dtype][len("stats_"):] + "_at")
    address = t.data_ptr()
    if not address:
        raise RuntimeError("the tensor has no memory of its own")
    geometry = np.array((t.shape, t.stride()), dtype=np.int64)
    try:  # the caller holds ``t`` (and so its memory) while the kernel reads it
        entry(address, t.dim(), geometry.ctypes.data, geometry.ctypes.data + 8 * t.dim(),
              _INFINITIES[t.dtype].ctypes.data, _TABLES_AT[0], _TABLES_AT[1],
              out.ctypes.data + row * out.strides[0], fps.ctypes.data + row * fps.strides[0])
    except Exception as err:  # noqa: BLE001 - as in stats_into
        _failed(err)


def stats_at(t: torch.Tensor, out: int, fps: int) -> bool:
    """:func:`stats_into` for a plain contiguous tensor, the results' row given by address:
    ``out`` of 7 float64, ``fps`` of 2 int64 (what the caller's arrays hold at that row).

    The per-event path's entry point: every argument an integer, which numba checks faster than
    arrays. Returns False, writing nothing, for a tensor it does not take (a subclass, a strided
    or negative view, no memory): :func:`stats_into` handles those. Raises as :func:`stats_into`
    when the kernel fails."""
    dtype = t.dtype
    entry = _LOADED_AT.get(dtype)
    if entry is None:
        k = _kernels()
        if k is None:
            raise RuntimeError("numba is not available")
        entry = _LOADED_AT[dtype] = (getattr(k, _ENTRIES[dtype] + "_at"), _INFINITIES[dtype].ctypes.data)
    # (real dtypes only here: no conjugate views)
    if type(t) not in _PLAIN or not t.is_contiguous() or t.is_neg():
        return False
    address = t.data_ptr()
    if not address:
        return False
    try:  # the caller holds ``t`` (and so its memory) while the kernel reads it
        entry[0](address, t.numel(), entry[1], _TABLES_AT[0], _TABLES_AT[1], out, fps)
    except Exception as err:  # noqa: BLE001 - as in stats_into
        _failed(err)
    return True


def stats_in_parts(t: torch.Tensor, out: np.ndarray, fps: np.ndarray, row: int) -> None:
    """:func:`stats_into` for a large tensor, cut into parts of a fixed size (``_stats_par_jit``)
    that run on numba's threads, as many as PyTorch's intra-op threads. The minimum, maximum,
    counts and fingerprint are :func:`stats_into`'s; the sums are added part by part (the same
    values on one thread or several, not always the last bits of one pass's).

    Takes a plain contiguous tensor; any other goes to :func:`stats_into`. Raises as it does."""
    if type(t) not in _PLAIN or not t.is_contiguous() or t.is_neg() or not t.data_ptr() \
            or t.dtype not in _PARTS_ENTRIES:
        stats_into(t, out, fps, row)
        return
    k = _parts_loader() if _kernels() is not None else None
    if k is None:  # no parallel kernels (or no numba at all: stats_into raises, as documented)
        stats_into(t, out, fps, row)
        return
    from ._stats_par_jit import PART
    n = t.numel()
    parts = -(-n // PART)
    part_out = np.empty((parts, 7))
    part_fps = np.empty((parts, 2), dtype=np.int64)
    try:
        if _numba.threads(torch.get_num_threads()):
            getattr(k, _PARTS_ENTRIES[t.dtype])(t.data_ptr(), n, _INFINITIES[t.dtype], _TABLE, _CUMULATIVE,
                                               part_out, part_fps)
        else:  # the same parts, one after another: the same results
            flat = t.reshape(-1)
            for i in range(parts):
                stats_into(flat[i * PART:(i + 1) * PART], part_out, part_fps, i)
        k.combine(part_out, part_fps, n, _CUMULATIVE, out[row], fps[row])
    except RuntimeError:
        raise
    except Exception as err:  # noqa: BLE001 - as in stats_into
        _failed(err)


def _failed(err: Exception) -> None:
    global AVAILABLE
    AVAILABLE = False  # the eager path from now on: capture never raises into the workload
    _LOADED.clear()
    _LOADED_AT.clear()
    _LOADED_STRIDED.clear()
    _log.warning("the fused statistics kernel failed (%s): using PyTorch", err)
    raise RuntimeError(f"the fused statistics kernel failed: {err}") from err


def _array(t: torch.Tensor) -> np.ndarray:
    """The tensor's memory as a flat NumPy array, through DLPack: ``Tensor.numpy()`` would mark
    the storage non-resizable for good, which breaks FSDP2 freeing its unsharded parameters."""
    if t.is_neg() or t.is_conj():  # lazy views whose memory does not hold their values
        raise RuntimeError("a negative or conjugate view: its memory does not hold its values")
    try:
        return np.from_dlpack(t).ravel()
    except (BufferError, TypeError, ValueError) as err:
        raise RuntimeError(f"cannot expose the tensor to NumPy: {err}") from err


def fused_stats(t: torch.Tensor) -> Tuple[np.ndarray, np.ndarray]:
    """:func:`stats_into` for one tensor: ``([min, max, sum, sum|x|, sum x^2, nan, inf],
    [h1, h2])`` with min and max as floats (NaN ignored).

    Example:
        >>> acc, fp = fused_stats(torch.tensor([1.0, -2.0]))  # doctest: +SKIP
        >>> acc[:3].tolist()  # doctest: +SKIP
        [-2.0, 1.0, -1.0]
    """
    out = np.zeros((1, 7))
    fps = np.zeros((1, 2), dtype=np.int64)
    stats_into(t, out, fps, 0)
    return out[0], fps[0]


_C_ENTRIES = {torch.float32: "cstats_f32", torch.float64: "cstats_f64", torch.bfloat16: "cstats_bf16",
              torch.float16: "cstats_f16"}


def c_entries() -> "dict | None":
    """What the compiled capture engine's hook needs to call the kernel itself: per dtype, the
    address of the ``*_at`` entry point compiled as a C function (``_stats_jit.cstats_*``) and of
    its infinities' keys; the addresses of the salt table and its prefix sums (module globals:
    alive as long as the process). None without numba."""
    k = _c_loader() if _kernels() is not None else None
    if k is None:
        return None
    try:
        fns = {dtype: getattr(k, name).address for dtype, name in _C_ENTRIES.items()}
    except Exception as err:  # noqa: BLE001 - a numba without cfunc: the hook leaves them to Python
        _log.warning("the statistics kernel's C entry points are unavailable: %s", err)
        return None
    return {"functions": fns, "infinities": {d: _INFINITIES[d].ctypes.data for d in fns},
            "table": _TABLES_AT[0], "cumulative": _TABLES_AT[1]}
