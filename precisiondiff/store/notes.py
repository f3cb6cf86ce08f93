"""Notes a dump's meta.json carries about its own capture, for ``ls`` and ``compare``."""
from __future__ import annotations

from typing import List

__all__ = ["meta_notes", "conversion_notes", "dump_conversion_notes"]


def meta_notes(meta: dict) -> List[str]:
    """What a dump's meta.json says about its capture: capture's own errors, a captured step
    that differs from the same step without capture, higher-order operators recorded as units
    (one line each)."""
    notes = [f"capture stopped: {e}" for e in meta.get("capture_errors") or ()]
    if meta.get("target_asked"):
        notes.append(f"target {meta['target_asked']} was asked, but the device holds float64 as float32: it ran, "
                     f"and is recorded, as {meta.get('target')} (--allow-narrowed)")
    observed = meta.get("observer_effect")
    if observed and not observed.get("bitwise_equal", True):
        parts = ", ".join(f"{d['what']} (max |diff| {d['max_abs_diff']})" for d in observed.get("differs", [])[:4])
        notes.append(f"the captured step differs from the same step without capture: {parts}")
    for name, hop in sorted((meta.get("higher_order_ops") or {}).items()):
        notes.append(f"{name} ({hop.get('calls', 0)} calls): {hop.get('note', '')}")
    return notes


def conversion_notes(held: list, overflows: list) -> List[str]:
    """A dump's silent conversions, one line each (``ls``, ``compare``): ``held`` and
    ``overflows`` are ``(event, record)`` pairs of float64 tensors the device held as float32 and
    of int64 tensors on the device whose values leave int32 (a finding of its own: a kernel that
    computes them in int32 wraps them without a check)."""
    lines = []
    if held:
        ops = sorted({ev.name for ev, _ in held})
        lines.append(f"{len(held)} float64 tensors were held as {held[0][1].held_dtype} by the device (dtype "
                     f"asked float64, values {held[0][1].held_dtype}: torch_mlu narrows 64-bit floats): "
                     f"{', '.join(ops[:6])}{' ...' if len(ops) > 6 else ''}")
    for ev, t in overflows[:5]:
        r = t.int32_overflow
        lines.append(f"int64 beyond int32: {ev.scope or '(root)'} {ev.name} #{ev.call} {t.slot} ranges "
                     f"{r.get('min'):.6g}..{r.get('max'):.6g} on {ev.device}: a kernel that computes it in "
                     "int32 (torch_mlu does for many ops) wraps it without a check (ENABLE_MLU_OVERFLOW_CHECK=1 "
                     "checks)")
    if len(overflows) > 5:
        lines.append(f"... and {len(overflows) - 5} more int64 tensors beyond int32")
    return lines


def dump_conversion_notes(dump) -> List[str]:
    """:func:`conversion_notes` of every event of a dump."""
    held, overflows = [], []
    for ev in dump.events():
        held += [(ev, t) for t in ev.tensors if t.held_dtype]
        overflows += [(ev, t) for t in ev.tensors if t.int32_overflow]
    return conversion_notes(held, overflows)
