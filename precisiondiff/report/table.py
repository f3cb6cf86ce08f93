"""The terminal table of a comparison (rich): rows in execution order, first divergence marked."""
from __future__ import annotations

from typing import Any, List, Optional

from ..compare.comparison import Comparison, Row
from .listing import format_number

__all__ = ["render_table", "summary_lines", "suspect_lines", "layer_growth"]

_STYLE = {"pass": "green", "fail": "bold red", "unmatched": "yellow"}


def layer_growth(comparison: Comparison, direction: str = "forward") -> List[dict]:
    """The per-layer growth curve: module outputs of repeated layers (``blocks.3``), else
    the top-level modules, in execution order, each with its error and growth ratio."""
    series = comparison.growth.get(direction, [])
    steps = {g.get("step") for g in series}
    if len(steps) > 1:  # a multi-step dump: the curve of the last step (where drift has grown most)
        last = max(steps, key=lambda v: -1 if v is None else v)
        series = [g for g in series if g.get("step") == last]
    layers = [g for g in series if g["scope"].rpartition(".")[2].isdigit()]
    if not layers:
        layers = [g for g in series if g["scope"] and "." not in g["scope"]]
    out, prev = [], None
    for g in layers:
        out.append(dict(g, growth=(g["error"] / prev) if prev else None))
        prev = g["error"]
    return out


def summary_lines(c: Comparison) -> List[str]:
    """The summary as plain sentences (shared by the table, CSV-less outputs and HTML)."""
    s = c.summary
    lines = [f"{c.a} ({c.meta_a.get('target', '?')}) vs {c.b} ({c.meta_b.get('target', '?')}): "
             f"{s['tensors']} tensors compared, {s['failed']} failed, {s['passed']} passed"
             + (f" ({s['within_noise']} within run-to-run noise)" if s.get("within_noise") else "")
             + f"; {s['unmatched_a']} events only in A, {s['unmatched_b']} only in B"]
    fd = c.first_divergence
    if fd:
        lines.append(f"first divergence: seq {fd['seq']} {fd['direction']} {fd['kind']} "
                     f"{fd['scope'] or '(root)'} {fd['name']} {fd['slot']}"
                     + (f" (rank {fd['rank']})" if c.ranks else "")
                     + (f": {fd['message']}" if fd.get("message") else ""))
    else:
        lines.append("no divergence: every compared tensor is within the end-to-end budget of the run's "
                     "precision (a kernel that loses a few bits can hide inside it: precisiondiff "
                     "bisect judges each kernel's own arithmetic)")
    for direction in ("forward", "backward"):
        layers = layer_growth(c, direction)
        if len(layers) >= 2:
            worst = max(layers[1:], key=lambda g: g["growth"] or 0.0)
            curve = " -> ".join(f"{g['scope']} {format_number(g['error'])}" for g in layers[:8])
            more = " ..." if len(layers) > 8 else ""
            growth = (f"; largest growth x{format_number(worst['growth'])} at {worst['scope']}"
                      if worst["growth"] else "")
            at_step = f" (step {layers[0]['step']})" if len({g.get("step") for g in c.growth.get(direction, [])}) > 1 else ""
            lines.append(f"{direction} error by layer{at_step}: {curve}{more}{growth}")
    lines.extend(suspect_lines(c))
    for rank, rs in sorted(c.ranks.items()):
        fd = rs.get("first_divergence")
        lines.append(f"rank {rank}: {rs['tensors']} tensors, {rs['failed']} failed"
                     + (f", first divergence {fd['scope']} {fd['name']} {fd['slot']}" if fd else ""))
    lines.extend(f"note: {n}" for n in c.notes if not n.startswith("Hint:"))  # hints follow the suspects
    return lines


def suspect_lines(c: Comparison) -> List[str]:
    """Where error is introduced: one line per suspect (compare/suspects.py), worst first."""
    if not c.suspects:
        return []
    typical = c.suspects[0].get("typical_growth")
    lines = [f"suspects (output error against their own inputs' error; typical growth "
             f"x{format_number(typical)}):"]
    for i, s in enumerate(c.suspects, start=1):
        lines.append(f"  {i}. seq {s['seq']} {s['direction']} {s['kind']} {s['scope'] or '(root)'} "
                     f"{s['name']} {s['slot']}: error {format_number(s['error'])} from inputs' "
                     f"{_fmt(s.get('input_error'))}, x{format_number(s['growth'])}")
    return lines + [n for n in c.notes if n.startswith("Hint:")]


def _fmt(v: Any) -> str:
    return format_number(v) if v is not None else "-"


def render_table(c: Comparison, console: Any, *, rows: Optional[List[Row]] = None,
                 title: Optional[str] = None) -> None:
    """Print the comparison table and its summary to ``console`` (a rich Console).

    Args:
        c: the comparison.
        console: where to print.
        rows: the rows to show (default: all of ``c.rows``, in execution order).
        title: a table title.
    """
    from rich.table import Table
    from rich.text import Text

    rows = c.rows if rows is None else rows
    fd = c.first_divergence
    multi = bool(c.ranks)
    suspects = {s["key"]: i for i, s in enumerate(c.suspects, start=1)}
    table = Table(header_style="bold", pad_edge=False, title=title)
    cols = (["rank"] if multi else []) + ["", "seq", "dir", "kind", "scope", "name", "slot",
                                          "dtype A/B", "rel err", "max ulp", "verdict", "note"]
    for col in cols:
        table.add_column(col, justify="right" if col in ("seq", "rel err", "max ulp", "rank") else "left",
                         overflow="fold")
    for r in rows:
        first = bool(fd) and r.key == fd["key"] and r.rank == fd.get("rank", r.rank) and r.verdict == "fail"
        note = "within noise" if r.within_noise else ("fused" if r.match == "fused" else "")
        if r.note:  # its first clause: "dtype fill constants", "reassembled from ranks [0, 1] (S(1))"...
            note = r.note.split(":")[0].split(";")[0]
        if r.key in suspects:
            note = f"SUSPECT {suspects[r.key]} (x{format_number(r.growth)})"
        if r.mode == "uninitialized":
            note = "uninitialized, skipped"
        if r.verdict == "unmatched":
            note = "shard, not compared" if r.mode == "shard" else f"only in {'A' if r.side == 'a' else 'B'}"
        if first:
            note = "FIRST DIVERGENCE" + (f"; SUSPECT {suspects[r.key]} (x{format_number(r.growth)})"
                                         if r.key in suspects else "")
        cells = ([str(r.rank)] if multi else []) + [
            ">>" if first else "", str(r.seq), {"forward": "fwd", "backward": "bwd", "optimizer": "opt"}.get(r.direction, r.direction), r.kind, r.scope or "(root)", r.name,
            r.slot, f"{r.dtype_a or '-'}/{r.dtype_b or '-'}", _fmt(r.error), _fmt(r.ulp),
            Text(r.verdict, style=_STYLE.get(r.verdict, "")), note]
        table.add_row(*cells, style="on dark_red" if first else None)
    console.print(table)
    for line in summary_lines(c):
        style = "bold red" if line.startswith("first divergence") else None
        console.print(line, style=style, markup=False)
