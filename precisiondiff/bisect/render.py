"""The terminal summary of a bisect: read in ten seconds."""
from __future__ import annotations

from typing import List

from .result import BisectResult

__all__ = ["summary_lines"]


def _num(x) -> str:
    return f"{x:.3g}" if isinstance(x, (int, float)) else str(x)


def _mlu_ops_lines(peer: dict) -> List[str]:
    """An op culprit judged by ``--rule mlu-ops``: the DUT's diffs beside its baseline's, each judged
    criterion against max(10 x the baseline's, static)."""
    d, b = peer.get("diffs") or {}, peer.get("baseline_diffs") or {}
    shown = " | ".join(f"{k} DUT {_num(d.get(k))} vs {peer.get('baseline')} {_num(b.get(k))}"
                       for k in ("diff1", "diff2", "diff3"))
    judged = "; ".join(f"{k} {_num(c.get('value'))} <= max({_num(peer.get('factor'))} x {_num(c.get('baseline'))}, "
                       f"static {_num(c.get('static'))}) = {_num(c.get('threshold'))}: "
                       f"{'ok' if c.get('passed') else 'FAILS'}" for k, c in (peer.get("criteria") or {}).items())
    return [f"  mlu-ops rule decided ({peer.get('op_class')} op): {shown}", f"  judged: {judged}"]


def summary_lines(r: BisectResult) -> List[str]:
    """The culprit, its local error vs budget, evidence, substitution, cost."""
    lines = [f"bisect {r.dut} vs {r.ref}: {r.verdict.upper()}"]
    c = r.culprit
    if c:
        where = c["scope"] or "<root>"
        step = f", step {c['step']}" if "step" in c else ""
        lines.append(f"culprit: {c['kind']} {c['name']} in {where} ({c['direction']}, call {c['call']}{step})")
        loc, bud = c.get("local", {}), c.get("budget", {})
        if c["kind"] == "compiled_region":
            lines.extend(_region_lines(c))
        elif c["kind"] == "op":
            peer = c.get("peer") or {}
            real = peer.get("real_peer")
            if peer.get("rule") == "mlu-ops":
                lines.extend(_mlu_ops_lines(peer))
            elif real:
                found = peer.get("peers") or {}
                emulated = ", ".join(f"{n} {_num(v)}" for n, v in found.items() if n != real) or "none ran"
                lenient = max(((n, v) for n, v in found.items() if isinstance(v, (int, float))),
                              key=lambda nv: nv[1], default=(None, None))[0]
                lines.append(f"  errors (rel-L2): DUT {_num(peer.get('error'))} | real peer {real} {_num(found.get(real))} "
                             f"| emulated peers {emulated}; bound {_num(peer.get('bound'))} = x{_num(peer.get('factor'))} "
                             f"the most lenient peer ({lenient}) + floor {_num(peer.get('floor'))}: the peer rule decided")
            if peer and peer.get("rule") != "mlu-ops":
                peers = ", ".join(f"{n} {_num(v)}" for n, v in (peer.get("peers") or {}).items()) or "none ran"
                lines.append(f"  peer rule: rel-L2 {_num(peer.get('error'))} vs correct peers in its dtype ({peers}), "
                             f"bound {_num(peer.get('bound'))}; worst element {_num(peer.get('max_error'))} vs "
                             f"peers' {_num(peer.get('peer_max_error'))} (x{_num(peer.get('factor'))} + 1)")
            lines.append(f"  reported: max {_num(loc.get('max_ulp_error', loc.get('max_ulp')))} ULP, "
                         f"max rel {_num(loc.get('max_rel_err', loc.get('max_rel')))}; ULP budget "
                         f"{bud.get('op_class', '?')} {bud.get('dtype', '')} max_ulp={_num(bud.get('max_ulp', bud.get('rounding_ulps')))}")
        else:
            lines.append(f"  local error {_num(loc.get('rel_l2'))} rel-L2 = {_num(loc.get('ratio_to_rounding'))}x "
                         f"what correct rounding of its ops gives ({_num(loc.get('rel_l2_emulated'))})")
        if c.get("message") and c["kind"] != "compiled_region":  # its lines say it already
            lines.append(f"  {c['message'].splitlines()[0]}")
        if c.get("repro"):
            files = ", ".join(f"{n} {s} B" for n, s in c["repro"]["files"].items())
            lines.append(f"  repro: {c['repro']['dir']} ({files}); python {c['repro']['dir']}/repro.py exits 1 "
                         "while the kernel is wrong")
        ev = r.evidence
        upstream = ev.get("upstream_units", 0)
        if upstream:
            lines.append(f"  upstream: {ev.get('upstream_passed', 0)} of {upstream} units before it "
                         "passed in isolation")
        else:
            lines.append("  upstream: no unit that computes anything runs before it")
        known = [i for i in ev.get("inputs", []) if isinstance(i.get("rel_l2"), (int, float))]
        if known:
            fine = {True: "fine", False: "ALREADY OFF", None: "?"}[ev.get("inputs_fine")]
            lines.append("  inputs vs reference run: " + ", ".join(f"{i['slot']} rel-L2 {_num(i['rel_l2'])}"
                                                                for i in known)
                         + f" (bound {_num(ev.get('bound'))}: {fine})")
        if r.path:
            lines.append("  path: " + " > ".join(p["scope"] or "<root>" for p in r.path))
        if c.get("known"):
            lines.append(f"  {c['known']}")
        if len(r.culprits) > 1:
            lines.extend(_offender_lines(r.culprits))
        conf = r.confirmation
        if conf.get("final_error_after_substitution") is not None:
            lines.append(f"substitution: final error {_num(conf['final_error_before'])} -> "
                         f"{_num(conf['final_error_after_substitution'])}")
    else:
        final = "not compared" if r.final_error is None else _num(r.final_error)
        lines.append(f"final error {final} (parity bound {_num(r.parity_bound)}); no unit over budget")
        for g in r.growth[:3]:
            lines.append(f"  error grows in {g['scope'] or '<root>'} ({g['direction']}): local rel-L2 "
                         f"{_num(g['local'].get('rel_l2'))}")
    if r.compiled is not None and (not c or c["kind"] != "compiled_region"):
        regs = r.compiled.get("regions", [])
        bad = [g for g in regs if g.get("diverges")]
        lines.append(f"compiled regions: {len(regs)} call(s) checked against eager, "
                     + (f"{len(bad)} diverge" if bad else "none diverges"))
    if r.noise is not None:
        within = r.noise.get("within_noise", [])
        lines.append(f"run-to-run noise: {r.noise.get('nondeterministic_ops', 0)} of "
                     f"{r.noise.get('ops_compared', 0)} op calls nondeterministic on the DUT "
                     f"({r.noise.get('differ_from_upstream', 0)} more differ through their inputs); "
                     f"{len(within)} over budget but within {_num(r.noise.get('factor'))}x their noise"
                     + (": " + ", ".join(f"{w['scope'] or '<root>'}/{w['name']}" for w in within[:3])
                        + (" ..." if len(within) > 3 else "") if within else ""))
    lines.extend(_accepted_lines(r.accepted))
    for n in r.notes:
        lines.append(f"note: {n}")
    cost = r.cost
    steps = f"{_num(cost.get('steps'))} steps of the workload = " if cost.get("steps") is not None else ""
    lines.append(f"cost: {cost.get('dut_runs')} DUT runs, {cost.get('ref_runs')} reference runs, "
                 f"{steps}{_num(cost.get('forward_equivalents'))} forward-equivalents, {_num(cost.get('wall_s'))} s")
    return lines


def _accepted_lines(accepted: List[dict]) -> List[str]:
    """The accepted units: each one the user accepted; the documented stock findings grouped by op
    (one line per op, with the number of calls and the first scopes)."""
    lines, known = [], {}
    for a in accepted:
        where = f" on rank {a['rank']}" if a.get("rank") is not None else ""
        if a.get("known"):
            known.setdefault(a["name"], []).append(f"{a['scope'] or '<root>'}{where} ({a['direction']})")
            continue
        lines.append(f"accepted: {a['kind']} {a['name']} in {a['scope'] or '<root>'}{where} ({a['direction']}, call "
                     f"{a['call']})")
    for name, places in known.items():
        finding = next(a["known"] for a in accepted if a["name"] == name and a.get("known")).split(" (")[0]
        shown = ", ".join(places[:3]) + (f" and {len(places) - 3} more" if len(places) > 3 else "")
        lines.append(f"passed over, {len(places)} call(s) of {name} [{finding}]: {shown}")
    return lines


def _offender_lines(culprits: List[dict]) -> List[str]:
    """Every offending unit found, in execution order: where, its figures, known findings."""
    lines = [f"offending units ({len(culprits)}, in execution order; --accept OP[@SCOPE] to pass one):"]
    for i, u in enumerate(culprits, 1):
        peer, loc = u.get("peer") or {}, u.get("local") or {}
        if peer:
            figures = (f"rel-L2 {_num(peer.get('error'))} vs peers {_num(peer.get('peer_error'))}, "
                       f"worst {_num(peer.get('max_error'))} vs {_num(peer.get('peer_max_error'))}")
        else:
            figures = f"rel-L2 {_num(loc.get('rel_l2'))} = {_num(loc.get('ratio_to_rounding'))}x rounding"
        where = f" on rank {u['rank']}" if u.get("rank") is not None else ""
        lines.append(f"  {i}. {u['kind']} {u['name']} in {u['scope'] or '<root>'}{where} ({u['direction']}, call "
                     f"{u['call']}): {figures}" + (f" [{u['known'].split(' (')[0]}]" if u.get("known") else ""))
    return lines


def _region_lines(c: dict) -> List[str]:
    """A compiled region culprit: its error vs eager's, its ops, where the divergence arises."""
    loc, bud = c.get("local", {}), c.get("budget", {})
    ops = [o for o in c.get("ops", [])]
    shown = ", ".join(dict.fromkeys(ops))
    lines = [f"  compiled ({c.get('backend', '?')}) rel-L2 {_num(loc.get('rel_l2_compiled'))} vs golden; eager "
             f"{_num(loc.get('rel_l2_eager'))} ({_num(loc.get('ratio_to_eager'))}x); bound "
             f"max({_num(bud.get('floor'))}, {_num(bud.get('k'))} x eager) = {_num(bud.get('bound'))}",
             f"  ops ({len(ops)} calls, eager): {shown[:300]}"]
    if c.get("diagnosis"):
        lines.append(f"  {c['diagnosis']}")
    return lines
