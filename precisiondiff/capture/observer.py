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

from ..store.fingerprint import fingerprint_tensor
from .serialize import flatten_tensors

__all__ = ["Snapshot", "snapshot", "compare_snapshots", "rng_state", "set_rng_state", "restored_rng"]

Snapshot = List[Tuple[str, torch.Tensor]]


def snapshot(output: Any, loss: Optional[torch.Tensor], model: torch.nn.Module) -> Snapshot:
    """What a step produced, by name: outputs, loss, parameter gradients (references, no copy:
    compare them before anything modifies them)."""
    found: Snapshot = [(f"output.{i}", t) for i, t in enumerate(flatten_tensors(output))]
    if loss is not None:
        found.append(("loss", loss))
    found += [(f"grad.{name}", p.grad) for name, p in model.named_parameters() if p.grad is not None]
    return [(name, getattr(t, "_local_tensor", t).detach()) for name, t in found]  # a DTensor: its shard


def _bits(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> Optional[float]:
    a, b = _bits(a), _bits(b)
    if not a.numel():
        return 0.0
    d = (a.double() - b.double()).abs() if a.is_floating_point() else (a.long() - b.long()).abs().double()
    return float(d.nan_to_num(nan=float("inf")).max())


def compare_snapshots(plain: Snapshot, captured: Snapshot) -> Dict[str, Any]:
    """The ``observer_effect`` meta field: bitwise equality of an uninstrumented and a captured step.

    Equality is decided by content fingerprints computed where the tensors live and read back
    once per device (no copy of the tensors to the host); the largest difference is computed
    only for tensors that differ."""
    names_plain = [n for n, _ in plain]
    result: Dict[str, Any] = {"checked": names_plain if len(names_plain) <= 8 else
                              names_plain[:8] + [f"... {len(names_plain) - 8} more"]}
    captured_map = dict(captured)
    differs: List[Dict[str, Any]] = []
    pairs: Dict[torch.device, List[Tuple[str, torch.Tensor, torch.Tensor]]] = {}
    for name, a in plain:
        b = captured_map.get(name)
        if b is None or a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            differs.append({"what": name, "max_abs_diff": None})
        elif a.numel():
            pairs.setdefault(a.device, []).append((name, a, b))
    for device, items in pairs.items():
        prints = torch.stack([torch.stack([fingerprint_tensor(_bits(a)), fingerprint_tensor(_bits(b))])
                              for _, a, b in items]).cpu()  # one read-back per device
        for (name, a, b), fp in zip(items, prints):
            if not torch.equal(fp[0], fp[1]):
                differs.append({"what": name, "max_abs_diff": _max_abs_diff(a, b)})
    order = {n: i for i, n in enumerate(names_plain)}
    differs.sort(key=lambda d: order[d["what"]])
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
