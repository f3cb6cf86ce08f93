"""Notes a dump's meta.json carries about its own capture, for ``ls`` and ``compare``."""
from __future__ import annotations

from typing import List

__all__ = ["meta_notes"]


def meta_notes(meta: dict) -> List[str]:
    """What a dump's meta.json says about its capture: capture's own errors, a captured step
    that differs from the same step without capture, higher-order operators recorded as units
    (one line each)."""
    notes = [f"capture stopped: {e}" for e in meta.get("capture_errors") or ()]
    observed = meta.get("observer_effect")
    if observed and not observed.get("bitwise_equal", True):
        parts = ", ".join(f"{d['what']} (max |diff| {d['max_abs_diff']})" for d in observed.get("differs", [])[:4])
        notes.append(f"the captured step differs from the same step without capture: {parts}")
    for name, hop in sorted((meta.get("higher_order_ops") or {}).items()):
        notes.append(f"{name} ({hop.get('calls', 0)} calls): {hop.get('note', '')}")
    return notes
