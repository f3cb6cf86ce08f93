"""What a bisect costs, in runs and replays of the workload (docs/bisect.md, "Cost")."""
from __future__ import annotations

from typing import Any, Dict

from .engine import EngineOutput

__all__ = ["step_cost", "cost_figures"]


def step_cost(has_backward: bool) -> float:
    """Forward-equivalents of one step of the workload: its forward, plus its backward (counted
    as two forwards) when it has a loss (docs/bisect.md, "Cost")."""
    return 3.0 if has_backward else 1.0


def cost_figures(runs: Dict[str, float], out: EngineOutput, step: float) -> Dict[str, Any]:
    """``forward_equivalents`` (every run and every replayed op, in forwards of the workload),
    ``steps`` (the same in steps of the workload) and ``breakdown`` (forward-equivalents per
    source: runs by name; replays by kind, ops replayed / ops per forward)."""
    breakdown = {k: round(v, 3) for k, v in runs.items() if v}
    for kind, n in sorted(out.breakdown.items()):
        if n:
            breakdown[kind] = round(n / out.forward_ops, 3)
    fe = sum(runs.values()) + out.replayed_ops / out.forward_ops
    return {"forward_equivalents": round(fe, 2), "steps": round(fe / step, 2), "breakdown": breakdown}
