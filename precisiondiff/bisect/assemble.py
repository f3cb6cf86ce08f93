"""Turn the engine's finding into a :class:`BisectResult` (shared by live and offline bisect)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional


from ..runtime.targets import Target
from .engine import EngineOutput
from .isolate import UnitEvent
from .judge import parity_bound
from .result import BisectResult

__all__ = ["unit_json", "assemble"]


def unit_json(ev: UnitEvent, detail: Dict[str, Any]) -> Dict[str, Any]:
    """``{"kind", "scope", "name", "direction", "call", "local", "budget"}`` of a unit, and for an
    op its ``peer`` verdict (the rule that decided: docs/bisect.md)."""
    out = {"kind": ev.kind, "scope": ev.scope, "name": ev.name, "direction": ev.direction,
           "call": ev.call, "local": detail.get("local", {}), "budget": detail.get("budget", {})}
    if detail.get("peer"):
        out["peer"] = detail["peer"]
        if detail.get("slot"):
            out["slot"] = detail["slot"]  # the output the peer verdict is about
    return out


def assemble(out: EngineOutput, *, dut: Target, ref: Target, final: Optional[Dict[str, float]],
             confirmation: Dict[str, Any], cost: Dict[str, Any], notes: List[str],
             input_check: Optional[Dict[str, Any]] = None) -> BisectResult:
    """Verdict rules: ``kernel`` when a culprit was found; else ``accumulated`` when the final
    error exceeds the parity bound; else ``parity``."""
    finding = out.finding
    bound = parity_bound(dut.dtype)
    final_error = final.get("final") if final else None
    culprit = None
    path: List[Dict[str, Any]] = []
    candidates: List[Dict[str, Any]] = []
    evidence: Dict[str, Any] = {}
    growth: List[Dict[str, Any]] = []
    if finding.culprit is not None:
        ev = out.units[finding.culprit]
        detail = out.details.get(finding.culprit, {})
        culprit = unit_json(ev, detail)
        if detail.get("message"):
            culprit["message"] = detail["message"]
        if detail.get("holds_unreplayable"):
            held = detail["holds_unreplayable"]
            culprit["unreplayable_ops"] = held
            names = sorted({h["name"] for h in held})
            why = held[0].get("reason", "")
            notes.append(f"{', '.join(names)} could not be replayed on {ref}"
                         + (f" ({why})" if why else "") + f"; the fault is localized to its innermost "
                         f"replayable module {ev.scope or '<root>'} ({ev.name}), whose golden ran that op "
                         "in float32 (its own implementation). Register a reference with "
                         f"precisiondiff.register_reference({names[0]!r}, fn) to judge the op itself")
        if ev.kind == "module" and detail.get("over") and not detail.get("far"):
            culprit["reason"] = "over budget and contains ops that cannot be replayed on the reference"
        elif ev.kind == "module":
            culprit["reason"] = ("local error far beyond what correctly rounded execution of its "
                                 "ops explains, though its ops pass")
        path = [{"kind": "module", "scope": out.units[u].scope, "name": out.units[u].name,
                 "local": out.details.get(u, {}).get("local", {})} for u in finding.path]
        candidates = [unit_json(out.units[u], out.details.get(u, {})) for u in finding.candidates]
        for unit in [culprit] + candidates:
            _annotate(unit, dut)
        before = [u for u in out.details if u in out.units and _before(out.units[u], ev)]
        passed = [u for u in before if out.details[u].get("passed")]
        evidence = {"upstream_units": len(before), "upstream_passed": len(passed),
                    "upstream_unreplayable": sum(1 for u in before if not out.details[u].get("replayable", True))}
        if input_check is not None:
            evidence.update(input_check)
        verdict = "kernel"
    else:
        verdict = "accumulated" if final is not None and final_error > bound else "parity"
    if verdict != "kernel":
        mods = [(u, d) for u, d in out.details.items() if out.units[u].kind == "module"
                and isinstance(d.get("local", {}).get("rel_l2"), float)]
        mods.sort(key=lambda ud: -ud[1]["local"]["rel_l2"])
        growth = [{"scope": out.units[u].scope, "name": out.units[u].name,
                   "direction": out.units[u].direction, "local": d["local"]} for u, d in mods[:5]]
    unresolved = [out.units[u] for u in finding.unresolved]
    if unresolved:
        held = sorted({(e.scope or "<root>", e.name, e.direction) for e in out.units.values()
                       if e.kind == "op" and e.name in set(out.unreplayable_ops)})
        unresolved_names = sorted({f"{e.scope or '<root>'}/{e.name}" for e in unresolved})
        ops = ", ".join(f"{n} in {sc} ({d})" for sc, n, d in held[:4]) + (" ..." if len(held) > 4 else "")
        notes.append(f"not judged: ops that could not be replayed ({ops or 'none'}) inside modules that "
                     f"could not be replayed either ({', '.join(unresolved_names)}); pass --workload "
                     "(it imports the ops' library and replays their modules) or register a reference "
                     "with precisiondiff.register_reference")
        first_unjudged = min((e.seq for e in out.units.values() if e.kind == "op"
                              and e.name in set(out.unreplayable_ops)), default=None)
        if culprit is not None and first_unjudged is not None and first_unjudged < out.units[finding.culprit].seq:
            notes.insert(0, "WARNING: ops that could not be judged ran before this culprit: it may not "
                         "be the first faulty unit (see the note on ops not judged)")
    if final is None and verdict != "kernel":
        notes.append("final output not compared (no reference output available)")
    accepted = [_annotate(dict(unit_json(out.units[u], d), message=d.get("message", "")), dut)
                for u, d in sorted(out.details.items()) if d.get("accepted") and u in out.units]
    known = sorted({a["name"] for a in accepted if a.get("known")})
    if known:
        notes.append(f"documented stock finding(s) of {dut} passed over (listed in accepted, each with its "
                     f"measurement): {', '.join(known)}; --blame-known judges them as any other op")
    return BisectResult(verdict=verdict, dut=str(dut), ref=str(ref), culprit=culprit, path=path,
                        confirmation=confirmation, cost=cost, candidates=candidates, evidence=evidence,
                        growth=growth, unreplayable=list(out.unreplayable_ops),
                        final_error=final_error, parity_bound=bound, notes=notes,
                        culprits=([culprit] + candidates) if culprit is not None else [], accepted=accepted)


def _annotate(unit: Dict[str, Any], dut: Target) -> Dict[str, Any]:
    """Add ``known`` to an op unit that is a documented stock finding on the DUT's device/dtype."""
    from .findings import known_finding
    if unit.get("kind") == "op":
        found = known_finding(unit["name"], dut.device.split(":")[0], str(dut.dtype).replace("torch.", ""))
        if found:
            unit["known"] = found
    return unit


def _before(a: UnitEvent, b: UnitEvent) -> bool:
    order = {"forward": 0, "backward": 1}
    return (a.step, order.get(a.direction, 2), a.seq) < (b.step, order.get(b.direction, 2), b.seq)

