"""What bisect found: :class:`BisectResult` and its JSON form (DESIGN.md, "Bisect output")."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

__all__ = ["BisectResult", "VERDICTS"]

VERDICTS = ("kernel", "accumulated", "parity")


def _clean(value: Any) -> Any:
    """JSON-safe: non-finite floats become strings ("inf", "nan")."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


@dataclass
class BisectResult:
    """The answer of a bisect.

    Attributes:
        verdict: ``kernel``, ``accumulated`` or ``parity``.
        dut, ref: the target strings.
        culprit: ``{"kind", "scope", "name", "direction", "call", "local", "budget"}`` or None.
        path: the modules enclosing the culprit, outermost first: ``{"kind", "scope", "local"}``.
        confirmation: ``final_error_before``, ``final_error_after_substitution`` (relative L2,
            see docs/bisect.md), ``reduction`` (the fraction of the final error removed).
        cost: ``dut_runs``, ``ref_runs``, ``forward_equivalents``, plus wall-time figures.
        candidates: further offending units after the culprit, in execution order.
        culprits: every offending unit found, in execution order, the culprit first (``[culprit]
            + candidates``), each with its figures and, for a documented stock finding, ``known``.
        accepted: offending ops the user accepted (``accept=``, ``--accept OP[@SCOPE]``, the
            project's ``[tool.precisiondiff] accept``), in execution order: judged, not culprits.
        evidence: why the culprit's inputs can be trusted (units before it that passed).
        growth: for ``accumulated``: modules with the largest local error, largest first.
        unreplayable: op names that could not be replayed on the reference.
        final_error, parity_bound: the DUT's final error and the bound for parity; the final
            error is None when the reference did not run (a culprit found, not confirmed).
        notes: sentences for the reader (substitution too weak, unresolved ops...).
        compiled: for a model with ``torch.compile`` regions: ``{"regions": [...], "final_error"}``
            (docs/bisect.md, "torch.compile regions"); None otherwise (and absent from the JSON).
        noise: with ``noise=True`` (live bisect, ``--noise``): ``{"nondeterministic_ops": N,
            "within_noise": [...], ...}`` (docs/bisect.md, "Run-to-run noise"); None otherwise
            (and absent from the JSON).
        steps: for a bisect over several training steps: one ``{"step", "units_isolated",
            "culprit"}`` per step searched, in order (docs/bisect.md, "Training steps"); None
            otherwise (and absent from the JSON).

    Example:
        >>> BisectResult("parity", "cpu/bf16", "cpu/float64").to_json()["verdict"]
        'parity'
    """

    verdict: str
    dut: str
    ref: str
    culprit: Optional[Dict[str, Any]] = None
    path: List[Dict[str, Any]] = field(default_factory=list)
    confirmation: Dict[str, Any] = field(default_factory=dict)
    cost: Dict[str, Any] = field(default_factory=dict)
    candidates: List[Dict[str, Any]] = field(default_factory=list)
    evidence: Dict[str, Any] = field(default_factory=dict)
    growth: List[Dict[str, Any]] = field(default_factory=list)
    unreplayable: List[str] = field(default_factory=list)
    final_error: Optional[float] = 0.0
    parity_bound: float = 0.0
    notes: List[str] = field(default_factory=list)
    compiled: Optional[Dict[str, Any]] = None
    noise: Optional[Dict[str, Any]] = None
    steps: Optional[List[Dict[str, Any]]] = None
    culprits: List[Dict[str, Any]] = field(default_factory=list)
    accepted: List[Dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, not {self.verdict!r}")

    @property
    def exit_code(self) -> int:
        """0 for parity, 1 otherwise (DESIGN.md, "Exit codes")."""
        return 0 if self.verdict == "parity" else 1

    def to_json(self) -> Dict[str, Any]:
        """The JSON object of DESIGN.md, its fields first, extensions after."""
        out = {"verdict": self.verdict, "dut": self.dut, "ref": self.ref,
               "culprit": self.culprit, "path": self.path, "confirmation": self.confirmation,
               "cost": self.cost, "candidates": self.candidates, "evidence": self.evidence,
               "growth": self.growth, "unreplayable": self.unreplayable,
               "final_error": self.final_error, "parity_bound": self.parity_bound,
               "notes": self.notes}
        out["culprits"] = self.culprits
        out["accepted"] = self.accepted
        if self.compiled is not None:
            out["compiled"] = self.compiled
        if self.noise is not None:
            out["noise"] = self.noise
        if self.steps is not None:
            out["steps"] = self.steps
        return _clean(out)

    def to_pandas(self) -> Any:
        """The culprit, candidates, path and growth units as a ``pandas.DataFrame``, one row per
        unit (optional extra ``pandas``; see :func:`precisiondiff.report.frames.bisect_frame`)."""
        from ..report.frames import bisect_frame  # the one call-time import of report/
        return bisect_frame(self)

    def dumps(self) -> str:
        """``to_json()`` as indented text."""
        return json.dumps(self.to_json(), indent=2)
