"""``precisiondiff ls``: a dump's events and tensors, with statistics and sizes."""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

__all__ = ["render_listing", "format_bytes", "format_number"]


def format_bytes(n: float) -> str:
    """``1536`` → ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def format_number(v: Any) -> str:
    """Short, aligned-friendly numbers: 4 significant digits, NaN/inf spelled out."""
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return f"{v:.4g}"
    return str(v)


def _nbytes(dtype: str, shape: list) -> int:
    numel = math.prod(shape) if shape else 1
    return numel * getattr(torch, dtype).itemsize


def render_listing(path: str, console: Any, *, kind: Optional[str] = None, direction: Optional[str] = None,
                   scope: Optional[str] = None, name: Optional[str] = None, step: Optional[int] = None,
                   limit: Optional[int] = None) -> int:
    """Print the dump's provenance and a table of its events; returns the number of events shown."""
    from rich.table import Table

    from ..capture.filters import compile_regex
    from ..store import load
    from ..store.notes import meta_notes
    scope_re, name_re = compile_regex(scope, "--scope"), compile_regex(name, "--name")
    dump = load(path)
    meta = dump.meta
    state = "complete" if dump.complete else "PARTIAL (the run did not finish)"
    console.print(f"[bold]{path}[/]: target {meta.get('target', '?')}, {meta.get('level', '?')}/"
                  f"{meta.get('mode', '?')}, {meta.get('format', '?')}, torch {meta.get('torch', '?')}, "
                  f"{state}")
    for rank, sub in sorted(dump.ranks.items()):
        for note in meta_notes(sub.meta):
            console.print(f"[yellow]note:[/] {f'rank{rank}: ' if len(dump.ranks) > 1 else ''}{note}")
    table = Table(show_lines=False, header_style="bold", pad_edge=False)
    for col in ("seq", "step", "kind", "dir", "scope", "name", "#", "device", "slot", "dtype", "shape",
                "min", "max", "mean", "norm", "nan/inf", "data"):
        table.add_column(col, justify="right" if col in ("seq", "step", "#", "min", "max", "mean", "norm") else "left",
                         no_wrap=col not in ("scope", "name"), overflow="fold")
    shown = events = tensors = stored = 0
    target_device = str(meta.get("target", "")).split("/")[0]
    fallbacks: dict = {}  # op name -> events that ran on another device than the target's
    for ev in dump.events():
        events += 1
        moved = bool(target_device) and target_device not in ("script", "?") and bool(ev.device) and \
            ev.device.split(":")[0] != target_device.split(":")[0]
        if moved:
            fallbacks[ev.name] = fallbacks.get(ev.name, 0) + 1
        tensors += len(ev.tensors)
        stored += sum(_nbytes(t.dtype, list(t.shape)) for t in ev.tensors if t.has_data and t.data_key == t.key)
        if (kind and ev.kind != kind) or (direction and ev.direction != direction) or \
                (scope_re and not scope_re.search(ev.scope)) or (name_re and not name_re.search(ev.name)) or \
                (step is not None and ev.step != step) or (limit is not None and shown >= limit):
            continue
        shown += 1
        device = f"[red]{ev.device} (fallback)[/]" if moved else (ev.device or "-")
        for i, t in enumerate(ev.tensors):
            s = t.stats or {}
            bad = (s.get("nan") or 0) + (s.get("inf") or 0)
            naninf = f"{s.get('nan', 0)}/{s.get('inf', 0)}"
            head = (str(ev.seq), str(ev.step), ev.kind, {"forward": "fwd", "backward": "bwd", "optimizer": "opt"}.get(ev.direction, ev.direction), ev.scope or "(root)", ev.name,
                    str(ev.call), device) if i == 0 else ("",) * 8
            data = format_bytes(_nbytes(t.dtype, list(t.shape))) if t.has_data else "-"
            table.add_row(*head, t.slot, t.dtype, "x".join(map(str, t.shape)) or "()",
                          format_number(s.get("min")), format_number(s.get("max")), format_number(s.get("mean")),
                          format_number(s.get("norm")), f"[red]{naninf}[/]" if bad else naninf, data)
    console.print(table)
    console.print(f"{shown} of {events} events shown, {tensors} tensors, {format_bytes(stored)} of tensor data")
    if fallbacks:
        names = ", ".join(f"{name} x{n}" for name, n in sorted(fallbacks.items()))
        console.print(f"[red]{sum(fallbacks.values())} events ran off the {target_device} device[/] (an op the "
                      f"device has no kernel for runs through its backend's CPU fallback): {names}")
    return shown
