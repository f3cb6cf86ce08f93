"""Targets: where and in which precision a workload runs.

A target string is ``DEVICE[/DTYPE][+autocast]``: ``cpu/float64``, ``cpu/bf16``,
``cuda:0/fp16``, ``mlu/bf16+autocast``. Without ``+autocast`` floating parameters and floating
inputs are cast to DTYPE; with it they stay float32 and the forward runs under
``torch.autocast(DEVICE, DTYPE)``. Integer inputs are never cast. Complex parameters, buffers
and inputs (a RoPE table ``freqs_cis``) keep a complex dtype of the target's precision:
complex128 for float64, complex64 for every narrower float (there is no bf16 complex), never a
real dtype (``Module.to(dtype)`` would discard their imaginary part).

All accelerators (MLU, CUDA, anything registered as a PyTorch backend) share one code path:
the device module comes from ``torch.get_device_module`` where it exists, else
``getattr(torch, device_type)``, so MLU software stacks that trail upstream still work.

An out-of-tree device is found, in order: a device module already registered under its name
(``torch.mlu`` from torch_mlu or any PrivateUse1 backend renamed ``mlu``); the modules named in
``PRECISIONDIFF_IMPORT`` (comma-separated), imported first; for ``mlu``, ``import torch_mlu``.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from ..errors import TargetError

__all__ = [
    "Target",
    "parse_dtype",
    "dtype_name",
    "device_module",
    "default_dut",
    "default_ref",
    "move_inputs",
    "complex_dtype",
    "import_backends",
]

# Short dtype names accepted on the command line, and the canonical spelling we print.
_SHORT = {"bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16,
          "fp32": torch.float32, "float": torch.float32, "fp64": torch.float64,
          "double": torch.float64}
_CANONICAL = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
              torch.float64: "float64"}

_DEVICE_RE = re.compile(r"^([a-z_][a-z0-9_]*)(?::(\d+))?$")
_OUT_OF_TREE = {"mlu", "npu", "hpu", "musa", "gcu", "dcu"}

IMPORT_ENV = "PRECISIONDIFF_IMPORT"

MLU_INSTALL_HINT = ("torch_mlu is not installed: install Cambricon's PyTorch and torch_mlu "
                    "wheels for your Neuware/CNToolkit release (see docs/mlu.md), then retry")


def parse_dtype(name: str) -> torch.dtype:
    """Parse a dtype name: torch names (``bfloat16``, ``float8_e4m3fn``) or short forms.

    Raises:
        TargetError: the name is not a floating dtype torch knows.

    Example:
        >>> parse_dtype("bf16")
        torch.bfloat16
    """
    key = name.strip().lower().removeprefix("torch.")
    if key in _SHORT:
        return _SHORT[key]
    dtype = getattr(torch, key, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TargetError(f"unknown dtype {name!r}: use bf16, fp16, fp32, fp64 or a torch "
                          "floating dtype name such as float8_e4m3fn")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical short name of a dtype (``bf16``, ``fp16``, ``fp32``, ``float64``...)."""
    return _CANONICAL.get(dtype, str(dtype).removeprefix("torch."))


def import_backends() -> None:
    """Import the modules named in ``PRECISIONDIFF_IMPORT`` (comma-separated), each once.

    For device backends that register themselves on import (a PrivateUse1 backend renamed
    ``mlu``, say) when nothing imports them in the user's own code.

    Raises:
        TargetError: a module cannot be imported.
    """
    for name in filter(None, (part.strip() for part in os.environ.get(IMPORT_ENV, "").split(","))):
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except Exception as err:  # any failure of a backend's import is a setup problem to fix
            raise TargetError(f"{IMPORT_ENV}: cannot import {name!r} ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''}); set {IMPORT_ENV} to "
                              "the module that registers your device backend") from err


def _registered(device_type: str) -> bool:
    """Whether a device module is registered under the name (by torch_mlu or any PrivateUse1 backend)."""
    return getattr(torch, device_type, None) is not None


def _import_backend(device_type: str) -> None:
    """Import the out-of-tree backend a device type needs (torch_mlu for ``mlu``)."""
    import_backends()
    if device_type == "mlu" and not _registered("mlu"):
        try:
            importlib.import_module("torch_mlu")
        except ImportError as err:
            raise TargetError(MLU_INSTALL_HINT) from err


def device_module(device_type: str) -> Any:
    """The torch device module (``torch.cuda``, ``torch.mlu``...) for a device type.

    Uses ``torch.get_device_module`` when this PyTorch has it, else ``getattr(torch, type)``.

    Raises:
        TargetError: no such device type.
    """
    _import_backend(device_type)
    getter = getattr(torch, "get_device_module", None)
    if getter is not None:
        try:
            return getter(device_type)
        except (RuntimeError, AttributeError, ValueError):
            pass
    module = getattr(torch, device_type, None)
    if module is None:
        raise TargetError(f"unknown device type {device_type!r}: use cpu, cuda, mlu or another "
                          "device PyTorch knows")
    return module


@dataclass(frozen=True)
class Target:
    """A device and a precision: where a workload runs.

    Attributes:
        device: a torch device string, ``cpu``, ``cuda:0``, ``mlu``.
        dtype: the floating dtype parameters and inputs are cast to (or the autocast dtype).
        autocast: keep float32 parameters and run the forward under ``torch.autocast``.

    Example:
        >>> str(Target.parse("cpu/bf16"))
        'cpu/bf16'
    """

    device: str
    dtype: torch.dtype = torch.bfloat16
    autocast: bool = False

    @classmethod
    def parse(cls, text: "str | Target") -> "Target":
        """Parse ``DEVICE[/DTYPE][+autocast]``; DTYPE defaults to bf16.

        Raises:
            TargetError: the string is malformed or names an unknown device type or dtype.
        """
        if isinstance(text, Target):
            return text
        spec = text.strip()
        autocast = False
        if spec.endswith("+autocast"):
            autocast, spec = True, spec[: -len("+autocast")]
        if "+" in spec or not spec:
            raise TargetError(f"malformed target {text!r}: expected DEVICE[/DTYPE][+autocast], "
                              "e.g. cpu/float64 or cuda:0/bf16")
        device, _, dtype_text = spec.partition("/")
        dtype = parse_dtype(dtype_text) if dtype_text else torch.bfloat16
        match = _DEVICE_RE.match(device)
        if match is None:
            raise TargetError(f"malformed device {device!r} in target {text!r}: use cpu, cuda, cuda:N, mlu or mlu:N")
        try:
            torch.device(device)
        except RuntimeError as err:
            # Out-of-tree backends (torch_mlu) register their device type only once imported.
            if match.group(1) not in _OUT_OF_TREE:
                raise TargetError(f"unknown device {device!r} in target {text!r}: use cpu, cuda, "
                                  "cuda:N, mlu or mlu:N") from err
        return cls(device, dtype, autocast)

    def __str__(self) -> str:
        return f"{self.device}/{dtype_name(self.dtype)}" + ("+autocast" if self.autocast else "")

    @property
    def device_type(self) -> str:
        """``cpu``, ``cuda``, ``mlu``..."""
        return self.device.partition(":")[0]

    @property
    def device_index(self) -> Optional[int]:
        """The device ordinal, or None when the target names the current device."""
        index = self.device.partition(":")[2]
        return int(index) if index else None

    def is_available(self) -> bool:
        """Whether this target's device exists on this machine."""
        try:
            self.check_available()
        except TargetError:
            return False
        return True

    def check_available(self) -> None:
        """Raise a :class:`TargetError` saying what to do when the device is missing."""
        if self.device_type == "cpu":
            return
        module = device_module(self.device_type)
        if not module.is_available():
            raise TargetError(f"target {self}: no {self.device_type} device is available on "
                              "this machine; pick another --target (cpu/bf16 always works)")
        index = self.device_index
        if index is not None and index >= module.device_count():
            raise TargetError(f"target {self}: device index {index} out of range "
                              f"({module.device_count()} {self.device_type} devices)")

    def synchronize(self) -> None:
        """Wait for the device's queued work (no-op on the CPU)."""
        if self.device_type != "cpu":
            device_module(self.device_type).synchronize()

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """A copy of ``model`` on this target: floating params and buffers cast unless autocast,
        complex ones to the complex dtype of the target's precision (:func:`complex_dtype`).

        Objects the model holds that cannot be deep-copied (process groups, locks) are shared
        with the copy (:func:`~precisiondiff.runtime.copying.copy_model`).

        Raises:
            WorkloadError: the model cannot be copied even so.
        """
        from .copying import copy_model
        moved = copy_model(model)
        if self.autocast:
            return moved.to(self.device)
        real, cplx = self.dtype, complex_dtype(self.dtype)
        # Module.to(dtype) casts complex tensors to the real dtype too (dropping the imaginary
        # part); Module._apply is what .to() itself runs on every parameter and buffer
        return moved._apply(lambda t: t.to(device=self.device, dtype=real if t.is_floating_point()
                                           else cplx if t.is_complex() else None))

    def prepare_inputs(self, inputs: Any) -> Any:
        """Inputs on this target: floating tensors cast (float32 under autocast), others moved."""
        dtype = torch.float32 if self.autocast else self.dtype
        return move_inputs(inputs, self.device, dtype)

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """Run the forward under ``torch.autocast`` when the target asks for it."""
        if self.autocast:
            with torch.autocast(self.device_type, dtype=self.dtype):
                yield
        else:
            yield


def complex_dtype(dtype: torch.dtype) -> torch.dtype:
    """The complex dtype that goes with a floating precision: complex128 for float64,
    complex64 for float32 and narrower (bf16, fp16, float8: torch has no complex of those that
    its kernels support)."""
    return torch.complex128 if dtype == torch.float64 else torch.complex64


def move_inputs(value: Any, device: "str | torch.device", dtype: "torch.dtype | None") -> Any:
    """Move a tensor, or a tuple/list/dict of them, to ``device``; cast floating ones to dtype
    and complex ones to its :func:`complex_dtype`."""
    if isinstance(value, torch.Tensor):
        if dtype is not None and value.is_floating_point():
            return value.detach().to(device=device, dtype=dtype)
        if dtype is not None and value.is_complex():
            return value.detach().to(device=device, dtype=complex_dtype(dtype))
        return value.detach().to(device=device)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(move_inputs(v, device, dtype) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(move_inputs(v, device, dtype) for v in value)
    if isinstance(value, dict):
        return {k: move_inputs(v, device, dtype) for k, v in value.items()}
    return value


def default_dut() -> Target:
    """The first available of mlu, cuda, cpu, in bf16."""
    import_backends()
    if importlib.util.find_spec("torch_mlu") is not None or _registered("mlu"):
        candidate = Target("mlu", torch.bfloat16)
        if candidate.is_available():
            return candidate
    if torch.cuda.is_available():
        return Target("cuda", torch.bfloat16)
    return Target("cpu", torch.bfloat16)


def default_ref() -> Target:
    """The golden reference: ``cpu/float64``."""
    return Target("cpu", torch.float64)
