"""The process-wide switches that change an accelerator's float32 arithmetic: TF32 for matmuls and
convolutions, on CUDA and on torch_mlu.

With TF32 on, a float32 matmul or convolution rounds its inputs to 11 significant bits before the product:
errors of ~1e-3 relative, far past what a float32 kernel may err. Bisect then names the matmul, rightly, but the
cause is a switch, not a wrong kernel (seen on an H200, docs/bisect.md, "On a GPU"). Capture records the
switches in meta.json (``float32_switches``) and bisect says which were on (:func:`tf32_notes`).
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

import torch

__all__ = ["float32_switches", "tf32_notes"]

#: switch name -> (device type it acts on, what it changes, where it lives under torch.backends)
_SWITCHES = {
    "cuda.matmul.allow_tf32": ("cuda", "matmuls", ("cuda", "matmul")),
    "cudnn.allow_tf32": ("cuda", "convolutions", ("cudnn",)),
    "mlu.matmul.allow_tf32": ("mlu", "matmuls", ("mlu", "matmul")),
    "cnnl.allow_tf32": ("mlu", "convolutions", ("cnnl",)),
}


def _read(path: tuple) -> Optional[bool]:
    node: Any = torch.backends
    for part in path:
        node = getattr(node, part, None)
        if node is None:
            return None  # a backend this torch does not have (torch_mlu not imported)
    try:
        value = getattr(node, "allow_tf32")
    except Exception:  # noqa: BLE001 - a backend that cannot say: not recorded
        return None
    return bool(value) if isinstance(value, bool) else None


def float32_switches() -> Dict[str, bool]:
    """The TF32 switches this process has, and whether each is on (``cudnn.allow_tf32`` is on by default)."""
    found = {}
    for name, (_, _, path) in _SWITCHES.items():
        value = _read(path)
        if value is not None:
            found[name] = value
    return found


def tf32_notes(dut: Any, switches: Optional[Mapping[str, bool]]) -> List[str]:
    """Sentences for a bisect whose float32 DUT ran with TF32 on (``switches`` as :func:`float32_switches`
    returns them: the live process's, or a dump's meta.json). None for another dtype or device."""
    if not switches or getattr(dut, "autocast", False) or getattr(dut, "dtype", None) != torch.float32:
        return []
    device_type = str(dut.device).split(":")[0]
    notes = []
    for name, (where, what, _) in _SWITCHES.items():
        if where == device_type and switches.get(name):
            notes.append(f"NOTE: TF32 was on for {device_type} {what} (torch.backends.{name} = True): float32 {what} "
                         f"round their inputs to 11 bits, far past a float32 kernel's budget, so a {what[:-1]} named "
                         f"here may be TF32's doing rather than a wrong kernel; set it False to judge the float32 "
                         f"kernels")
    return notes
