"""A stand-in Cambricon MLU: an out-of-tree PyTorch accelerator on PrivateUse1, renamed ``mlu``.

Test infrastructure, never shipped. ``register()`` compiles ``csrc/standin.cpp`` with
``torch.utils.cpp_extension`` (cached under ``build/mlu_standin``, so once per machine), loads
it, renames PrivateUse1 to ``mlu`` and registers :mod:`tests.mlu_backend.device` as
``torch.mlu``. Importing :mod:`tests.mlu_backend.load` does all of that, so a subprocess gets
the device with ``PRECISIONDIFF_IMPORT=tests.mlu_backend.load``.

Vendor-like behaviour, set from Python or from the environment of a fresh process:

* ops the device does not implement run through a CPU fallback (silently unless
  ``warn=True``): :func:`set_unimplemented`, ``MLU_STANDIN_FALLBACK=op,op``;
* planted numerics: :func:`plant` (``gemm_chunk``: bf16 GEMMs accumulate in bf16 every
  ``gemm_chunk`` terms; ``truncate_cast``: fp32->bf16 casts on the device round toward zero;
  ``ftz``: device kernels flush subnormal results to zero),
  ``MLU_STANDIN_PLANT=gemm_chunk=1,truncate_cast,ftz``;
* torch_mlu's silent conversions, off by default (docs/mlu.md, "Silent conversions"):
  ``narrow_float64`` (float64 copied to the device holds float32 values, with one warning;
  device kernels on float64 compute in float32) and ``narrow_int64`` (the ops named read and
  write their int64 tensors as int32, wrapping without a check):
  ``plant(narrow_float64=True, narrow_int64=("cumsum",))``,
  ``MLU_STANDIN_PLANT=narrow_float64,narrow_int64=cumsum:add.Tensor``.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Dict, Iterable, Iterator, Optional

import torch

__all__ = ["build", "register", "set_unimplemented", "unimplemented", "plant", "planted",
           "fallback_counts", "reset_fallback_counts", "to_host_traffic", "active", "DEFAULT_UNIMPLEMENTED", "BUILD_DIR"]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SOURCE = os.path.join(HERE, "csrc", "standin.cpp")
BUILD_DIR = os.environ.get("MLU_STANDIN_BUILD_DIR") or os.path.join(ROOT, "build", "mlu_standin")

# Like torch_mlu, the stand-in lacks a few kernels; these run on the CPU by default.
DEFAULT_UNIMPLEMENTED = ("aten::gelu", "aten::gelu_backward")

# Kernels the C++ side registers itself (allocation, views, copies, the planted GEMMs).
_OWN = {"empty.memory_format", "empty_strided", "as_strided", "view", "_reshape_alias", "resize_",
        "set_.source_Storage_storage_offset", "_copy_from", "_copy_from_and_resize",
        "_local_scalar_dense", "mm", "bmm", "addmm"}

_state = {"gemm_chunk": 0, "truncate_cast": False, "ftz": False, "warn": False,
          "narrow_float64": False, "narrow_int64": ()}
_unimplemented: "tuple[str, ...]" = ()
build_seconds: Optional[float] = None


def build(*, verbose: bool = False) -> float:
    """Compile (or find up to date) and load the extension; returns the seconds it took.

    Raises:
        RuntimeError: the compiler failed (the message carries its output).
    """
    global build_seconds
    if build_seconds is not None:
        return build_seconds
    from torch.utils import cpp_extension

    os.makedirs(BUILD_DIR, exist_ok=True)
    # a venv's own tools (ninja from pip) when the venv is not activated
    bindir = os.path.dirname(sys.executable)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    start = time.perf_counter()
    built = os.path.join(BUILD_DIR, "mlu_standin.so")
    if os.path.isfile(built) and os.path.getmtime(built) >= os.path.getmtime(SOURCE):
        # built from this source already: loaded as is, also by a copy of this package elsewhere
        # (a repro test's isolated process) that points MLU_STANDIN_BUILD_DIR here
        torch.ops.load_library(built)
    else:
        cpp_extension.load(name="mlu_standin", sources=[SOURCE], build_directory=BUILD_DIR,
                           extra_cflags=["-O1"], is_python_module=False, verbose=verbose)
    build_seconds = time.perf_counter() - start
    return build_seconds


def _op_key(name: str) -> str:
    """``aten::add.Tensor``, ``aten.add.Tensor``, ``aten.gelu.default`` -> ``add.Tensor``, ``gelu``."""
    text = name.removeprefix("aten::").removeprefix("aten.")
    base, _, overload = text.partition(".")
    return base if overload in ("", "default") else f"{base}.{overload}"


def _cpu_ops() -> "list[str]":
    names = []
    for full in torch._C._dispatch_get_all_op_names():
        if full.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(full, "CPU"):
            key = _op_key(full)
            if key not in _OWN:
                names.append(key)
    return names


def set_unimplemented(ops: Iterable[str]) -> None:
    """Leave ``ops`` to the CPU fallback; every other op with a CPU kernel gets a device kernel.

    ``aten::gelu`` (no overload) means every overload of ``gelu`` (``gelu``, ``gelu.out``), as a
    vendor that lacks a kernel lacks all its variants; ``add.Tensor`` means that overload only.
    """
    global _unimplemented
    every = _cpu_ops()
    missing = set()
    for op in ops:
        key = _op_key(op)
        exact = "." in key or op.endswith(".default")
        matches = {n for n in every if n == key or (not exact and n.partition(".")[0] in (key, key + "_"))}
        if not matches:
            raise ValueError(f"{op!r} is not an op with a CPU kernel the stand-in could implement")
        missing |= matches
    torch.ops.mlu_standin.implement([n for n in every if n not in missing])
    _unimplemented = tuple(sorted(missing))


def unimplemented() -> "tuple[str, ...]":
    """The ops now left to the CPU fallback."""
    return _unimplemented


def plant(*, gemm_chunk: Optional[int] = None, truncate_cast: Optional[bool] = None,
          ftz: Optional[bool] = None, warn: Optional[bool] = None, narrow_float64: Optional[bool] = None,
          narrow_int64: Optional[Iterable[str]] = None) -> None:
    """Switch planted numerics, the silent conversions (and the fallback warning) on or off;
    None keeps a setting. ``narrow_int64``: the ops (``cumsum``, ``add.Tensor``) that narrow."""
    for key, value in (("gemm_chunk", gemm_chunk), ("truncate_cast", truncate_cast), ("ftz", ftz), ("warn", warn),
                       ("narrow_float64", narrow_float64)):
        if value is not None:
            _state[key] = value
    if narrow_int64 is not None:
        _state["narrow_int64"] = tuple(_op_key(op) for op in narrow_int64)
    torch.ops.mlu_standin.configure(int(_state["gemm_chunk"]), bool(_state["truncate_cast"]),
                                    bool(_state["ftz"]), bool(_state["warn"]))
    torch.ops.mlu_standin.configure_narrowing(bool(_state["narrow_float64"]), list(_state["narrow_int64"]))


@contextlib.contextmanager
def planted(**settings) -> Iterator[None]:
    """:func:`plant` inside the block, the previous settings after it."""
    before = dict(_state)
    plant(**settings)
    try:
        yield
    finally:
        plant(**before)


def fallback_counts() -> Dict[str, int]:
    """How many times each op ran through the CPU fallback since the last reset."""
    out = {}
    for item in torch.ops.mlu_standin.fallback_ops():
        name, _, count = item.rpartition("=")
        out[name] = int(count)
    return out


def reset_fallback_counts() -> None:
    torch.ops.mlu_standin.reset_fallback_counts()


def to_host_traffic() -> "tuple[int, int]":
    """(bytes, copies) read back from the device to the host so far (CPU-fallback copies excluded)."""
    nbytes, copies = torch.ops.mlu_standin.to_host_traffic()
    return int(nbytes), int(copies)


def active() -> bool:
    """Whether ``torch.mlu`` is this stand-in (not torch_mlu, not nothing)."""
    from . import device
    return getattr(torch, "mlu", None) is device


def _from_env() -> None:
    ops = os.environ.get("MLU_STANDIN_FALLBACK")
    set_unimplemented(DEFAULT_UNIMPLEMENTED if ops is None else [o for o in ops.split(",") if o.strip()])
    settings: dict = {}
    for item in filter(None, (s.strip() for s in os.environ.get("MLU_STANDIN_PLANT", "").split(","))):
        key, _, value = item.partition("=")
        if key not in _state:
            raise ValueError(f"MLU_STANDIN_PLANT: unknown setting {key!r} (gemm_chunk=N, truncate_cast, ftz, "
                             "warn, narrow_float64, narrow_int64=op:op)")
        if key == "narrow_int64":
            settings[key] = tuple(filter(None, value.replace("+", ":").split(":")))
        else:
            settings[key] = int(value) if key == "gemm_chunk" else value.lower() not in ("0", "false", "no")
    if os.environ.get("MLU_STANDIN_FALLBACK_WARN"):
        settings["warn"] = True
    plant(**settings)


def register() -> None:
    """Build, load and register the stand-in as ``torch.mlu`` (idempotent)."""
    if getattr(torch, "mlu", None) is not None and torch._C._get_privateuse1_backend_name() == "mlu":
        return
    build()
    from . import device

    torch.utils.rename_privateuse1_backend("mlu")
    torch._register_device_module("mlu", device)
    torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True,
                                                         for_packed_sequence=True, for_storage=True)
    _from_env()
