"""A watch comparison as text (the terminal table) and as standard JSON."""
from __future__ import annotations

import json
import math
from typing import Any, List, Optional

from .compare import WatchComparison

__all__ = ["render_text", "to_json"]


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
