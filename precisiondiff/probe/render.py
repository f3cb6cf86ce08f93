"""Rendering cards: a text table, JSON, self-contained HTML, and two cards side by side."""
from __future__ import annotations

import html
import json
from typing import Any, List, Tuple

from .card import Card

__all__ = ["format_value", "render_table", "render_json", "render_html", "diff_rows",
           "render_diff_table", "render_diff_html"]


def format_value(value: Any) -> str:
    """A card value as printed: ``yes``/``no`` for booleans, ``-`` for missing."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _header(card: Card) -> str:
    meta = card.meta
    bits = [f"torch {meta['torch']}"] if "torch" in meta else []
    if "cpu_capability" in meta:
        bits.append(f"CPU capability {meta['cpu_capability']}")
    if meta.get("device_name"):
        bits.append(str(meta["device_name"]))
    if meta.get("kernels"):
        bits.append("kernels: " + ", ".join(f"{f}={n}" for f, n in meta["kernels"].items()))
    return f"numerics card: {card.target}" + (f" ({'; '.join(bits)})" if bits else "")


def _table(rows: List[Tuple[str, ...]], header: Tuple[str, ...]) -> List[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    lines = []
    for r in [header, *rows]:
        cells = [c.ljust(w) for c, w in zip(r, widths)] + [r[-1]]
        lines.append("  ".join(cells).rstrip())
    return lines


def render_table(card: Card) -> str:
    """The card as an aligned text table: op, property, value, evidence."""
    rows, last = [], None
    for f in card.findings:
        rows.append((f.op if f.op != last else "", f.prop, format_value(f.value), f.detail))
        last = f.op
    return "\n".join([_header(card), *_table(rows, ("op", "property", "value", "evidence"))]) + "\n"


def render_json(card: Card) -> str:
    """The card as JSON (the format ``--diff`` and :func:`~.card.load_card` read)."""
    return json.dumps(card.to_dict(), indent=1, allow_nan=False) + "\n"


_STYLE = ("body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse}"
          "td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}"
          "th{background:#eee}tr.differs td{background:#fff3cd}td.ev{color:#555;font-size:90%}")


def _page(title: str, body: str) -> str:
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>{body}</body></html>\n")


def render_html(card: Card) -> str:
    """The card as one self-contained HTML page (no scripts, no external files)."""
    cells = "".join(
        f"<tr><td>{html.escape(f.op)}</td><td>{html.escape(f.prop)}</td>"
        f"<td>{html.escape(format_value(f.value))}</td><td class=\"ev\">{html.escape(f.detail)}</td></tr>"
        for f in card.findings)
    body = (f"<p>{html.escape(_header(card))}</p><table><tr><th>op</th><th>property</th><th>value</th>"
            f"<th>evidence</th></tr>{cells}</table>")
    return _page(f"numerics card: {card.target}", body)


def diff_rows(a: Card, b: Card) -> List[Tuple[str, str, str, str, bool]]:
    """``(op, property, value in a, value in b, differs)`` for every property on either card."""
    keys = list(dict.fromkeys([(f.op, f.prop) for f in a.findings] + [(f.op, f.prop) for f in b.findings]))
    out = []
    for op, prop in keys:
        fa, fb = a.finding(op, prop), b.finding(op, prop)
        va = format_value(fa.value) if fa else "(absent)"
        vb = format_value(fb.value) if fb else "(absent)"
        out.append((op, prop, va, vb, va != vb))
    return out


def render_diff_table(a: Card, b: Card, *, only_differences: bool = False) -> str:
    """Two cards side by side; ``*`` marks the properties that differ."""
    rows, last = [], None
    for op, prop, va, vb, differs in diff_rows(a, b):
        if only_differences and not differs:
            continue
        rows.append(("*" if differs else "", op if op != last else "", prop, va, vb))
        last = op
    count = sum(1 for r in diff_rows(a, b) if r[4])
    head = [f"A: {_header(a)}", f"B: {_header(b)}",
            f"{count} propert{'y differs' if count == 1 else 'ies differ'}"]
    return "\n".join(head + (_table(rows, ("", "op", "property", "A", "B")) if rows else [])) + "\n"


def render_diff_html(a: Card, b: Card) -> str:
    """Two cards side by side as HTML, differing rows highlighted."""
    cells = "".join(
        f"<tr class=\"{'differs' if d else ''}\"><td>{html.escape(op)}</td><td>{html.escape(prop)}</td>"
        f"<td>{html.escape(va)}</td><td>{html.escape(vb)}</td></tr>"
        for op, prop, va, vb, d in diff_rows(a, b))
    body = (f"<p>A: {html.escape(_header(a))}<br>B: {html.escape(_header(b))}</p><table><tr><th>op</th>"
            f"<th>property</th><th>A</th><th>B</th></tr>{cells}</table>")
    return _page(f"numerics cards: {a.target} vs {b.target}", body)
