"""The HTML report: one self-contained file (inline CSS, JS and SVG; no network access).

Every string that comes from a dump or a path is escaped with :func:`html.escape`. Plots need
matplotlib (the ``report`` extra); without it the report is written without plots and says so.
"""
from __future__ import annotations

import html
import json
import logging
import math
from typing import Any, Dict, List, Optional

from ..compare.comparison import Comparison, Row
from . import plots
from .listing import format_number
from .table import layer_growth, summary_lines, suspect_lines

__all__ = ["render_html", "ulp_histogram_data"]

log = logging.getLogger(__name__)

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:20px;margin:0 0 8px} h2{font-size:16px;margin:24px 0 8px;border-bottom:1px solid #ddd}
.summary p{margin:2px 0;font-family:ui-monospace,Menlo,Consolas,monospace;font-size:13px}
.first{background:#fde2e1;border-left:4px solid #c62828;padding:8px 12px;margin:8px 0;font-size:13px}
.ok{background:#e3f5e1;border-left:4px solid #2e7d32;padding:8px 12px;margin:8px 0}
.note{color:#555;font-size:13px}
table{border-collapse:collapse;font-size:12px;font-family:ui-monospace,Menlo,Consolas,monospace}
th,td{border-bottom:1px solid #eee;padding:2px 6px;text-align:left;white-space:nowrap}
th{position:sticky;top:0;background:#f5f5f5;cursor:pointer;user-select:none}
th.sorted-asc::after{content:" \\25B2"} th.sorted-desc::after{content:" \\25BC"}
td.num{text-align:right} tr.fail td.v{color:#c62828;font-weight:bold} tr.pass td.v{color:#2e7d32}
tr.unmatched td.v{color:#b26a00} tr.firstdiv{background:#fde2e1}
.plot svg{max-width:100%;height:auto} #filter{margin:6px 0;padding:3px;width:320px}
"""

_JS = """
(function(){
  var table=document.getElementById('rows'); if(!table) return;
  var tbody=table.tBodies[0];
  function key(td){var v=td.getAttribute('data-v'); if(v!==null&&v!==''){var f=parseFloat(v); if(!isNaN(f)) return f;
    if(v==='nan'||v==='inf') return Infinity;} return td.textContent;}
  Array.prototype.forEach.call(table.tHead.rows[0].cells,function(th,i){
    th.addEventListener('click',function(){
      var asc=!th.classList.contains('sorted-asc');
      Array.prototype.forEach.call(table.tHead.rows[0].cells,function(h){h.classList.remove('sorted-asc','sorted-desc');});
      th.classList.add(asc?'sorted-asc':'sorted-desc');
      var rows=Array.prototype.slice.call(tbody.rows);
      rows.sort(function(a,b){var x=key(a.cells[i]),y=key(b.cells[i]);
        if(typeof x==='number'&&typeof y==='number') return asc?x-y:y-x;
        x=String(x);y=String(y); return asc?x.localeCompare(y):y.localeCompare(x);});
      rows.forEach(function(r){tbody.appendChild(r);});
    });
  });
  var f=document.getElementById('filter');
  if(f) f.addEventListener('input',function(){var q=f.value.toLowerCase();
    Array.prototype.forEach.call(tbody.rows,function(r){r.style.display=r.textContent.toLowerCase().indexOf(q)>=0?'':'none';});});
})();
"""

_COLUMNS = ("rank", "seq", "dir", "kind", "scope", "name", "slot", "dtype A", "dtype B", "rel err",
            "max ulp", "verdict", "note")


def _e(v: Any) -> str:
    return html.escape(str(v), quote=True)


def _num_cell(v: Optional[float]) -> str:
    if v is None:
        return '<td class="num" data-v="">-</td>'
    raw = "nan" if isinstance(v, float) and math.isnan(v) else (
        "inf" if isinstance(v, float) and math.isinf(v) else repr(float(v)))
    return f'<td class="num" data-v="{_e(raw)}">{_e(format_number(v))}</td>'


def _row_html(r: Row, first_key: Optional[tuple], suspects: Optional[Dict[str, int]] = None) -> str:
    is_first = first_key == (r.rank, r.key) and r.verdict == "fail"
    rank = (suspects or {}).get(r.key)
    note = "FIRST DIVERGENCE" + (f"; SUSPECT {rank} (x{format_number(r.growth)})" if rank else "") if is_first else (
        ("shard, not compared" if r.mode == "shard" else f"only in {'A' if r.side == 'a' else 'B'}")
        if r.verdict == "unmatched" else
        f"SUSPECT {rank} (x{format_number(r.growth)})" if rank else
        "within noise" if r.within_noise else "uninitialized, skipped" if r.mode == "uninitialized"
        else r.note.split(":")[0].split(";")[0] if r.note else "fused" if r.match == "fused" else "")
    cls = r.verdict + (" firstdiv" if is_first else "")
    cells = [f'<td class="num" data-v="{r.rank}">{r.rank}</td>', f'<td class="num" data-v="{r.seq}">{r.seq}</td>']
    cells += [f"<td>{_e(x)}</td>" for x in (r.direction, r.kind, r.scope or "(root)", r.name, r.slot,
                                             r.dtype_a or "-", r.dtype_b or "-")]
    cells += [_num_cell(r.error), _num_cell(r.ulp), f'<td class="v">{_e(r.verdict)}</td>',
              f'<td title="{_e(r.message or r.note)}">{_e(note)}</td>']
    return f'<tr class="{_e(cls)}">' + "".join(cells) + "</tr>"


def ulp_histogram_data(c: Comparison, rows: List[Row], *, worst: int = 6,
                       device: Optional[str] = None) -> List[Dict[str, Any]]:
    """ULP-distance histograms (bins of ``log2(1 + ulp)``) of the ``worst`` tensor rows.

    Reads the two tensors of each row again and measures them with
    :func:`precisiondiff.comparators.ulp_distance` in A's dtype.
    """
    import torch

    from ..comparators import ulp_distance
    from ..store import load
    picked = [r for r in sorted(rows, key=lambda r: -(r.ulp if r.ulp is not None and math.isfinite(r.ulp)
                                                       else (math.inf if r.ulp is not None else -1)))
              if r.mode == "tensors" and r.verdict != "unmatched" and r.ulp is not None
              and str(r.dtype_a).startswith(("float", "bfloat")) and str(r.dtype_b).startswith(("float", "bfloat"))]
    out: List[Dict[str, Any]] = []
    if not picked:
        return out
    da, db = load(c.a), load(c.b)
    try:
        for r in picked[:worst]:
            ta = da.ranks[r.rank].tensor(r.key)
            tb = db.ranks[r.rank].tensor(r.key_b or r.key)
            if device:
                ta, tb = ta.to(device), tb.to(device)
            d = ulp_distance(ta, tb).flatten()
            d = d[~torch.isnan(d)]
            d = torch.log2(1 + d.clamp(max=2.0 ** 62)).cpu()
            top = max(1, int(math.ceil(float(d.max()))) if d.numel() else 1)
            counts = torch.histc(d, bins=top, min=0, max=top).tolist() if d.numel() else [0] * top
            out.append({"key": r.key, "edges": list(range(top + 1)), "counts": counts})
    finally:
        da.close()
        db.close()
    return out


def render_html(c: Comparison, *, rows: Optional[List[Row]] = None, worst: int = 6,
                device: Optional[str] = None, title: Optional[str] = None) -> str:
    """Render the comparison as one self-contained HTML page.

    Args:
        c: the comparison.
        rows: the table rows (default: all rows).
        worst: number of worst tensors to draw ULP histograms for.
        device: where to compute the histograms.
        title: page title.

    Returns:
        The HTML text.
    """
    rows = c.rows if rows is None else rows
    title = title or f"precisiondiff: {c.a} vs {c.b}"
    fd = c.first_divergence
    first_key = (fd.get("rank", 0), fd["key"]) if fd else None
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>",
             f"<h1>{_e(title)}</h1>", '<div class="summary">']
    lines = summary_lines(c)
    suspect_text = set(suspect_lines(c))  # shown in their own section
    for line in lines:
        if line in suspect_text:
            continue
        if line.startswith("first divergence"):
            parts.append(f'<div class="first">{_e(line)}</div>')
        elif line.startswith("no divergence"):
            parts.append(f'<div class="ok">{_e(line)}</div>')
        else:
            parts.append(f"<p>{_e(line)}</p>")
    parts.append("</div>")
    parts.append(_suspects_html(c))
    parts.append(_plots_html(c, rows, worst, device))
    parts.append(f"<h2>Tensors ({len(rows)} rows, execution order; click a header to sort)</h2>")
    parts.append('<input id="filter" type="search" placeholder="filter rows (scope, op, verdict...)">')
    parts.append('<table id="rows"><thead><tr>' + "".join(f"<th>{_e(h)}</th>" for h in _COLUMNS)
                 + "</tr></thead><tbody>")
    ranked = {s["key"]: i for i, s in enumerate(c.suspects, start=1)}
    parts.extend(_row_html(r, first_key, ranked) for r in rows)
    parts.append("</tbody></table>")
    meta = {"a": c.meta_a, "b": c.meta_b}
    parts.append("<h2>Provenance</h2><pre class=\"note\">" + _e(json.dumps(meta, indent=1, default=str))
                 + "</pre>")
    parts.append(f"<script>{_JS}</script></body></html>")
    return "\n".join(parts) + "\n"


def _suspects_html(c: Comparison) -> str:
    """Where error is introduced: the suspects' table and the bisect hint (from the notes)."""
    if not c.suspects:
        return ""
    head = ("#", "seq", "dir", "kind", "scope", "name", "slot", "error", "inputs' error", "growth", "verdict")
    out = ["<h2>Suspects: where error is introduced</h2>",
           f'<p class="note">Rows whose error grows most against the error of their own inputs '
           f'(typical growth x{_e(format_number(c.suspects[0].get("typical_growth")))}).</p>',
           '<table id="suspects"><thead><tr>' + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr></thead><tbody>"]
    for i, s in enumerate(c.suspects, start=1):
        cells = [f"<td>{i}</td>", f'<td class="num">{_e(s["seq"])}</td>']
        cells += [f"<td>{_e(x)}</td>" for x in (s["direction"], s["kind"], s["scope"] or "(root)", s["name"], s["slot"])]
        cells += [_num_cell(s.get("error")), _num_cell(s.get("input_error")), _num_cell(s.get("growth")),
                  f'<td class="v">{_e(s["verdict"])}</td>']
        out.append(f'<tr class="{_e(s["verdict"])}">' + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    out.extend(f'<p class="note">{_e(n)}</p>' for n in c.notes if n.startswith("Hint:"))
    return "\n".join(out)


def _plots_html(c: Comparison, rows: List[Row], worst: int, device: Optional[str]) -> str:
    if not plots.available():
        return ('<p class="note">Plots are not included: matplotlib is not installed '
                "(pip install 'precisiondiff[report]').</p>")
    out = []
    fd = c.first_divergence
    try:
        out.append("<h2>Error along execution order</h2>")
        out.append(f'<div class="plot">{plots.error_along_order(rows, fd["seq"] if fd else None)}</div>')
        curves = {d: layer_growth(c, d) for d in ("forward", "backward")}
        if any(len(v) >= 2 for v in curves.values()):
            out.append("<h2>Error growth per layer</h2>")
            out.append(f'<div class="plot">{plots.layer_growth_plot(curves)}</div>')
        hists = ulp_histogram_data(c, rows, worst=worst, device=device) if worst > 0 else []
        if hists:
            out.append(f"<h2>ULP distance histograms of the {len(hists)} worst tensors</h2>")
            out.append(f'<div class="plot">{plots.ulp_histograms(hists)}</div>')
        if c.ranks:
            out.append("<h2>Ranks</h2>")
            out.append(f'<div class="plot">{plots.rank_overview(c.ranks)}</div>')
    except Exception as err:  # a plot must never cost the user the report
        log.warning("plots failed: %s", err, exc_info=True)
        out.append(f'<p class="note">Plots failed: {_e(err)}</p>')
    return "\n".join(out)
