"""Anomaly scan of one dump: where NaN/Inf first appear, and exploding or vanishing gradients.

Uses only the statistics every dump holds (any ``--mode``), streaming the index once.

Rules (documented in docs/compare.md):

* **nonfinite**: an event whose outputs (``output.*``, ``grad_input.*``) hold a NaN while its
  inputs (``input.*``, ``grad_output.*``) hold none, or an Inf while its inputs are all
  finite. Ops that write infinities on purpose (``masked_fill``, ``fill``, ``full``,
  ``where``, ``index_put``, creation ops without tensor inputs: attention masks) are not
  anomalies for Inf, only for NaN. The first such event in execution order is the origin;
  module events finish after their ops, so the origin is the innermost op when ops were
  captured.
* **explode / vanish** (layer gradients): along the backward pass, the norms of the
  ``grad_input.0`` of repeated layers (scopes ending in ``.N``: ``blocks.3``), or of top-level
  modules when there are none. A ratio of consecutive norms above ``explode`` (default 100)
  or below ``vanish`` (default 0.01) is an anomaly; per-layer ratios of healthy networks
  stay within a few units.
* **explode / vanish** (parameter gradients): a ``param_grad.*`` whose norm is non-finite or
  zero, or more than ``explode**2`` (1e4) times above / ``vanish**2`` below the median
  parameter-gradient norm of the step.
"""
from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from .dumps import UNINITIALIZED

__all__ = ["ScanResult", "scan", "EXPLODE", "VANISH", "INF_WRITERS"]

EXPLODE = 100.0
VANISH = 0.01
# ops that legitimately write +-inf (attention masks)
INF_WRITERS = re.compile(r"(masked_fill|fill|full|where|index_put|scalar_tensor|masked_scatter)")
_OUT = ("output", "grad_input")
_IN = ("input", "grad_output")


@dataclass
class ScanResult:
    """What :func:`scan` found.

    Attributes:
        path: the dump.
        anomalies: dicts with ``type`` (``nonfinite``, ``explode``, ``vanish``), ``seq``,
            ``rank``, ``kind``, ``scope``, ``name``, ``direction``, ``slot``, ``detail``.
        notes: remarks (deliberate infinities skipped, partial dump...).
        events: events scanned.
    """

    path: str
    anomalies: List[Dict[str, Any]] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    events: int = 0

    def first(self, kind: str) -> Optional[Dict[str, Any]]:
        """The first anomaly of this type, or None."""
        return next((a for a in self.anomalies if a["type"] == kind), None)

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready dict."""
        return {"path": self.path, "events": self.events, "anomalies": self.anomalies,
                "first_nonfinite": self.first("nonfinite"), "first_explode": self.first("explode"),
                "first_vanish": self.first("vanish"), "notes": self.notes}

    def lines(self) -> List[str]:
        """Human-readable lines, most important first."""
        out = [f"{self.path}: scanned {self.events} events"]
        for kind, title in (("nonfinite", "first NaN/Inf from finite inputs"),
                            ("explode", "first exploding gradient"), ("vanish", "first vanishing gradient")):
            a = self.first(kind)
            if a:
                out.append(f"{title}: seq {a['seq']} {a['direction']} {a['kind']} "
                           f"{a['scope'] or '(root)'} {a['name']} {a['slot']}"
                           + (f" (rank {a['rank']})" if a.get("rank") else "") + f": {a['detail']}")
        if not self.anomalies:
            out.append("no anomaly: no NaN/Inf from finite inputs, no exploding or vanishing gradient")
        else:
            out.append(f"{len(self.anomalies)} anomalies in all; `--format json` lists them")
        out.extend(f"note: {n}" for n in self.notes)
        return out


def _count(recs: List[Any], slots: tuple, what: tuple) -> int:
    return sum(int(t.stats.get(w) or 0) for t in recs if t.slot.startswith(slots) for w in what)


def _anomaly(kind: str, ev: Any, slot: str, detail: str) -> Dict[str, Any]:
    return {"type": kind, "seq": ev.seq, "rank": ev.rank, "step": ev.step, "kind": ev.kind,
            "scope": ev.scope, "name": ev.name, "direction": ev.direction, "slot": slot,
            "detail": detail}


def scan(path: Union[str, Path], *, explode: float = EXPLODE, vanish: float = VANISH) -> ScanResult:
    """Scan a dump for NaN/Inf origins and exploding or vanishing gradients.

    Args:
        path: the dump directory.
        explode: consecutive-layer gradient norm ratio above which gradients explode.
        vanish: ratio below which they vanish.

    Returns:
        The :class:`ScanResult`; ``anomalies`` is empty for a healthy dump.

    Raises:
        DumpError: the dump is missing or damaged.
        PrecisionDiffError: ``explode <= 1`` or ``vanish >= 1``.

    Example:
        >>> scan("runs/dut").first("nonfinite")  # doctest: +SKIP
    """
    from ..errors import PrecisionDiffError
    from ..store import load
    if not explode > 1 or not 0 < vanish < 1:
        raise PrecisionDiffError(f"scan needs explode > 1 and 0 < vanish < 1 (got {explode}, {vanish})")
    dump = load(path)
    result = ScanResult(str(path))
    if not dump.complete:
        result.notes.append("partial dump: the capture did not finish")
    deliberate = 0
    layers: Dict[tuple, List[tuple]] = {}
    params: Dict[tuple, List[tuple]] = {}
    for ev in dump.events():
        result.events += 1
        if UNINITIALIZED.search(ev.name):
            continue  # uninitialized memory
        outs = [t for t in ev.tensors if t.slot.startswith(_OUT)]
        ins = [t for t in ev.tensors if t.slot.startswith(_IN)]
        nan_out, inf_out = _count(outs, _OUT, ("nan",)), _count(outs, _OUT, ("inf",))
        nan_in, inf_in = _count(ins, _IN, ("nan",)), _count(ins, _IN, ("inf",))
        bad = next((t for t in outs if t.stats.get("nan") or t.stats.get("inf")), None)
        if nan_out and not nan_in:
            result.anomalies.append(_anomaly("nonfinite", ev, bad.slot, f"{nan_out} NaN in the outputs, "
                                             f"inputs hold no NaN ({inf_in} Inf)"))
        elif inf_out and not (nan_in or inf_in):
            if INF_WRITERS.search(ev.name) or (not ins and ev.kind == "op"):
                deliberate += 1
            else:
                result.anomalies.append(_anomaly("nonfinite", ev, bad.slot, f"{inf_out} Inf in the outputs "
                                                 f"(max {bad.stats.get('max')}), inputs all finite"))
        if ev.direction == "backward":
            for t in ev.tensors:
                norm = t.stats.get("norm")
                if ev.kind == "param" and t.slot.startswith("param_grad"):
                    params.setdefault((ev.rank, ev.step), []).append((ev, t.slot, norm))
                elif ev.kind == "module" and t.slot == "grad_input.0":
                    layers.setdefault((ev.rank, ev.step), []).append((ev, t.slot, norm))
    dump.close()
    if deliberate:
        result.notes.append(f"{deliberate} events write +-inf deliberately (masks: masked_fill, "
                            "full, where...) and are not anomalies")
    for series in layers.values():
        _layer_ratios(series, explode, vanish, result)
    for series in params.values():
        _param_outliers(series, explode, vanish, result)
    result.anomalies.sort(key=lambda a: (a["rank"], a["step"], a["seq"]))
    return result


def _layer_ratios(series: List[tuple], explode: float, vanish: float, result: ScanResult) -> None:
    picked = [s for s in series if s[0].scope.rpartition(".")[2].isdigit()]
    if len(picked) < 2:
        picked = [s for s in series if s[0].scope and "." not in s[0].scope]
    prev = None
    for ev, slot, norm in picked:
        if not isinstance(norm, (int, float)) or not math.isfinite(norm):
            prev = None
            continue
        if prev is not None and prev[2] > 0:
            ratio = norm / prev[2]
            where = f"grad norm {norm:.3g} after {prev[0].scope}'s {prev[2]:.3g} (x{ratio:.3g})"
            if ratio > explode:
                result.anomalies.append(_anomaly("explode", ev, slot, f"{where} > x{explode:g}"))
            elif ratio < vanish:
                result.anomalies.append(_anomaly("vanish", ev, slot, f"{where} < x{vanish:g}"))
        prev = (ev, slot, norm)


def _param_outliers(series: List[tuple], explode: float, vanish: float, result: ScanResult) -> None:
    finite = [n for _, _, n in series if isinstance(n, (int, float)) and math.isfinite(n) and n > 0]
    median = statistics.median(finite) if finite else None
    for ev, slot, norm in series:
        if not isinstance(norm, (int, float)):
            continue
        if not math.isfinite(norm):
            result.anomalies.append(_anomaly("explode", ev, slot, f"gradient norm is {norm}"))
        elif norm == 0:
            result.anomalies.append(_anomaly("vanish", ev, slot, "gradient is exactly zero"))
        elif median and norm > explode ** 2 * median:
            result.anomalies.append(_anomaly("explode", ev, slot, f"gradient norm {norm:.3g} > "
                                             f"{explode ** 2:g} x the median {median:.3g}"))
        elif median and norm < vanish ** 2 * median:
            result.anomalies.append(_anomaly("vanish", ev, slot, f"gradient norm {norm:.3g} < "
                                             f"{vanish ** 2:g} x the median {median:.3g}"))
