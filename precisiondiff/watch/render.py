"""A watch comparison as text (the terminal table), standard JSON, and a self-contained HTML page."""
from __future__ import annotations

import json
import math
from typing import Any, List, Optional

from .compare import WatchComparison

__all__ = ["render_text", "to_json", "render_html"]


def _g(x: Optional[float]) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return f"{x:.4g}"


def _steps_to_show(per_step: List[dict], first: Optional[int], limit: int = 16) -> List[dict]:
    """The first and last steps, and those around the first divergence; at most ``limit``."""
    if len(per_step) <= limit:
        return per_step
    index = {e["step"]: i for i, e in enumerate(per_step)}
    wanted = set(range(3)) | set(range(len(per_step) - 3, len(per_step)))
    if first is not None:
        i = index[first]
        wanted |= set(range(max(0, i - 4), min(len(per_step), i + 5)))
    if len(wanted) < limit:
        wanted |= set(range(0, len(per_step), max(1, len(per_step) // (limit - len(wanted)))))
    return [per_step[i] for i in sorted(wanted)]

def render_text(c: WatchComparison) -> str:
    """The comparison as lines: the loss curves by step, the first divergence, growth with depth."""
    d = c.data
    first = d["first_divergence"]
    lines = [f"watch compare: A {c.a}  vs  B {c.b}" + (f"  (noise band: {c.noise})" if c.noise else
                                                       "  (default thresholds)"),
             f"{d['steps']} common steps"]
    lines.append("")
    lines.append(f"{'step':>6} {'loss A':>12} {'loss B':>12} {'loss rel err':>12} {'max rel err':>12}  "
                 f"{'worst tensor':<36} {'over':>4}")
    for e in _steps_to_show(d["per_step"], first["step"] if first else None):
        mark = " <- first divergence" if first is not None and e["step"] == first["step"] else ""
        worst = "(bitwise equal)" if e["bitwise"] else (e["worst"] or "-")
        lines.append(f"{e['step']:>6} {_g(e['loss_a']):>12} {_g(e['loss_b']):>12} {_g(e['loss_error']):>12} "
                     f"{_g(e['max_error']):>12}  {worst[:36]:<36} {e['diverged']:>4}{mark}")
    lines.append("")
    if first is None:
        lines.append("no divergence: every step's loss and statistics stay within their thresholds")
    else:
        where = f"{first['scope'] or '(model)'} {first['tensor']}"
        rank = f" on rank {first['rank']}" if d.get("ranks") else ""
        lines.append(f"first divergence: step {first['step']}{rank}, {where} ({first['key']}): relative error "
                     f"{_g(first['error'])} > threshold {_g(first['threshold'])}"
                     + (" (a spike in one run only)" if first["reason"] == "spike" else ""))
        if d["growth"]:
            lines.append(f"error by depth at step {first['step']}:")
            for g in d["growth"]:
                over = "  over" if g["error"] > g["threshold"] else ""
                lines.append(f"  {g['depth']:>3} {g['key']:<40} {_g(g['error']):>10}  (threshold {_g(g['threshold'])}){over}")
    for note in d["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines) + "\n"


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def to_json(c: WatchComparison) -> str:
    """Standard JSON (NaN and infinities as strings, as compare's JSON writes them)."""
    return json.dumps(_clean(c.to_dict()), indent=1) + "\n"


def _loss_plot(c: WatchComparison) -> str:
    from ..report.plots import _figure, _pos, _svg
    d = c.data
    steps = [e["step"] for e in d["per_step"]]
    fig, axes = _figure(7, 3, 1, 2)
    ax, err = axes[0][0], axes[0][1]
    ax.plot(steps, [e["loss_a"] for e in d["per_step"]], label="A", color="#d62728")
    ax.plot(steps, [e["loss_b"] for e in d["per_step"]], label="B", color="#1f77b4", linestyle="--")
    ax.set_xlabel("step"), ax.set_ylabel("loss"), ax.legend()
    pairs = [(s, _pos(e["loss_error"])) for s, e in zip(steps, d["per_step"])]
    err.semilogy([s for s, v in pairs if v], [v for _, v in pairs if v], color="#d62728", label="loss")
    pairs = [(s, _pos(e["max_error"])) for s, e in zip(steps, d["per_step"])]
    err.semilogy([s for s, v in pairs if v], [v for _, v in pairs if v], color="#7f7f7f", label="largest")
    first = d["first_divergence"]
    for a in (ax, err):
        if first is not None:
            a.axvline(first["step"], color="#ff7f0e", linewidth=1)
    err.set_xlabel("step"), err.set_ylabel("relative error"), err.legend()
    return _svg(fig)


def _heat_map(c: WatchComparison) -> str:
    from ..report.plots import _figure, _svg
    d = c.data
    keys = [k for k in d["errors"] if ":" in k and k.rsplit(":", 1)[1].startswith(("output", "grad_output"))]
    if not keys:
        return ""
    grid = [[math.log10(v) if isinstance(v, (int, float)) and math.isfinite(v) and v > 0 else math.nan
             for v in d["errors"][k]] for k in keys]
    fig, axes = _figure(7, 0.6 + 0.18 * len(keys))
    ax = axes[0][0]
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis",
                      extent=(d["step_numbers"][0] - 0.5, d["step_numbers"][-1] + 0.5, len(keys) - 0.5, -0.5))
    ax.set_yticks(range(len(keys)), [k or "(model)" for k in keys], fontsize=6)
    ax.set_xlabel("step")
    fig.colorbar(image, ax=ax, label="log10 relative error (blank: bitwise equal)")
    return _svg(fig)


def render_html(c: WatchComparison) -> str:
    """One self-contained page: the text report, the loss curves and the step × layer heat map
    of the error (inline SVG; without matplotlib the text alone)."""
    from html import escape
    from ..report.plots import available
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>precisiondiff watch: {escape(c.a)} vs {escape(c.b)}</title></head><body>",
             f"<h1>precisiondiff watch: {escape(c.a)} vs {escape(c.b)}</h1>",
             f"<pre>{escape(render_text(c))}</pre>"]
    if available():
        parts += ["<h2>Loss curves and error</h2>", _loss_plot(c), "<h2>Error by step and layer</h2>", _heat_map(c)]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
