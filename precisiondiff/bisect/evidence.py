"""What both bisect paths read off a capture besides the units: the final outputs and gradients
of a run, and the evidence that the culprit's inputs were fine (its inputs against the
reference run's corresponding tensors, matched by tensor key)."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..store import schema
from .isolate import UnitEvent
from .judge import parity_bound, rel_l2

__all__ = ["tensor_key", "param_grads_of", "finals_of", "input_evidence"]


def tensor_key(ev: UnitEvent, slot: str) -> str:
    """The store's key of an event's tensor (:func:`precisiondiff.store.schema.tensor_key`)."""
    return schema.tensor_key(ev.scope, ev.name, ev.call, ev.direction, slot)


def param_grads_of(events: List[UnitEvent]) -> Dict[str, Callable[[], torch.Tensor]]:
    """Full parameter name -> loader of its accumulated gradient, from ``param`` events."""
    grads: Dict[str, Callable[[], torch.Tensor]] = {}
    for ev in events:
        if ev.kind != "param":
            continue
        for slot, info in ev.slots.items():
            if slot.startswith("param_grad.") and info[2]:
                name = slot[len("param_grad."):]
                full = f"{ev.scope}.{name}" if ev.scope else name
                grads[full] = (lambda e=ev, s=slot: e.load(s))
    return grads


def finals_of(events: List[UnitEvent]) -> Tuple[Optional[List[torch.Tensor]], Dict[str, torch.Tensor]]:
    """The model output (the root module's first forward call, ``output.N``) and the parameter
    gradients recorded in a capture; ``(None, {})`` when the root call was not recorded."""
    roots = sorted((e for e in events if e.kind == "module" and e.scope == "" and e.direction == "forward"),
                   key=lambda e: e.seq)
    output = None
    if roots:
        slots = roots[0].floating_slots("output.")
        if slots and all(roots[0].slots[s][2] for s in slots):
            output = [roots[0].load(s) for s in slots]
    grads = {name: load() for name, load in param_grads_of(events).items()}
    return output, grads


def input_evidence(ev: UnitEvent, ref_tensor: Callable[[str], Optional[torch.Tensor]],
                   dut_dtype: torch.dtype) -> Dict[str, Any]:
    """The culprit's floating inputs (``input.N``; ``grad_output.N`` for a backward unit)
    against the reference run's tensors of the same key.

    Returns:
        ``{"inputs": [{"slot", "key", "rel_l2"}...], "bound": parity bound, "inputs_fine": bool}``;
        ``inputs_fine`` is None when no reference tensor matched. An input is fine when its
        relative L2 error against the reference is within the parity bound of the DUT dtype:
        the error it brings is what correct rounding upstream gives, not a fault.
    """
    prefix = "grad_output." if ev.direction == "backward" else "input."
    rows: List[Dict[str, Any]] = []
    for slot in ev.floating_slots(prefix):
        if not ev.slots[slot][2]:
            continue
        key = tensor_key(ev, slot)
        ref = ref_tensor(key)
        if ref is None or tuple(ref.shape) != tuple(ev.slots[slot][1]):
            rows.append({"slot": slot, "key": key, "rel_l2": None})
            continue
        rows.append({"slot": slot, "key": key, "rel_l2": rel_l2(ev.load(slot), ref)})
    bound = parity_bound(dut_dtype)
    known = [r["rel_l2"] for r in rows if r["rel_l2"] is not None]
    return {"inputs": rows, "bound": bound, "inputs_fine": (all(x <= bound for x in known) if known else None)}
