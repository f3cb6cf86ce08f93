"""No observer effect: a captured step must compute exactly what the same step computes without
capture. The workload runner runs step 0 under capture, then once more uninstrumented (on a copy of
the model taken before any hook, same inputs, same RNG state), and compares the outputs, the loss and every parameter gradient
bit for bit. The verdict goes into ``meta.json`` as ``observer_effect``:

``{"checked": [...], "bitwise_equal": true}`` or, when capture changed the run,
``{"bitwise_equal": false, "differs": [{"what", "max_abs_diff"}...], "why": "..."}``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from .serialize import flatten_tensors

__all__ = ["Snapshot", "snapshot", "compare_snapshots", "rng_state", "set_rng_state", "restored_rng"]

Snapshot = List[Tuple[str, torch.Tensor]]


def snapshot(output: Any, loss: Optional[torch.Tensor], model: torch.nn.Module) -> Snapshot:
    """Host copies of what a step produced: outputs, loss, parameter gradients (named)."""
    found: Snapshot = [(f"output.{i}", t) for i, t in enumerate(flatten_tensors(output))]
    if loss is not None:
        found.append(("loss", loss))
    found += [(f"grad.{name}", p.grad) for name, p in model.named_parameters() if p.grad is not None]
    out = []
    for name, t in found:
        local = getattr(t, "_local_tensor", t)  # a DTensor: its shard
        out.append((name, local.detach().to("cpu", copy=True)))
    return out


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> Optional[float]:
    if a.shape != b.shape or a.dtype != b.dtype:
        return None
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if not a.is_floating_point():
        return float((a.long() - b.long()).abs().max()) if a.numel() else 0.0
    d = (a.double() - b.double()).abs()
    return float(d.nan_to_num(nan=float("inf")).max()) if d.numel() else 0.0


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
    if width is None or a.dtype == torch.bool:
        return torch.equal(a, b)
    return torch.equal(a.contiguous().view(width), b.contiguous().view(width))  # NaN == NaN, -0 != 0


def compare_snapshots(plain: Snapshot, captured: Snapshot) -> Dict[str, Any]:
    """The ``observer_effect`` meta field: bitwise equality of an uninstrumented and a captured step."""
    names_plain = [n for n, _ in plain]
    result: Dict[str, Any] = {"checked": names_plain if len(names_plain) <= 8 else
                              names_plain[:8] + [f"... {len(names_plain) - 8} more"]}
    captured_map = dict(captured)
    differs = []
    for name, a in plain:
        b = captured_map.get(name)
        if b is None:
            differs.append({"what": name, "max_abs_diff": None})
        elif not _bits_equal(a, b):
            differs.append({"what": name, "max_abs_diff": _max_abs_diff(a, b)})
    result["bitwise_equal"] = not differs
    if differs:
        result["differs"] = differs
        result["why"] = ("the captured step computed other values than the same step without capture: "
                         "a nondeterministic kernel (run `capture --repeat 2` and compare the runs) or "
                         "capture itself (hooks changing an accumulation order, a synchronization)")
    return result


def rng_state(device: "torch.device | str | None" = None) -> Tuple[torch.Tensor, Any]:
    """The CPU RNG state and ``device``'s (None for the CPU or a device without one)."""
    module = None
    if device is not None and torch.device(device).type not in ("cpu", "meta"):
        module = getattr(torch, torch.device(device).type, None)
    dev = module.get_rng_state() if module is not None and hasattr(module, "get_rng_state") else None
    return torch.get_rng_state(), dev


def set_rng_state(state: Tuple[torch.Tensor, Any], device: "torch.device | str | None" = None) -> None:
    """Restore a state taken by :func:`rng_state`."""
    torch.set_rng_state(state[0])
    if state[1] is not None:
        getattr(torch, torch.device(device).type).set_rng_state(state[1])


@contextlib.contextmanager
def restored_rng(state: Tuple[torch.Tensor, Any], device: "torch.device | str | None" = None) -> Iterator[None]:
    """Run the block from the RNG state ``state`` (from :func:`rng_state`)."""
    set_rng_state(state, device)
    yield
