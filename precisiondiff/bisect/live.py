"""Live bisect: run the workload on the DUT (captured) and on the reference, then search."""
from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import BisectError, PrecisionDiffError, WorkloadError
from ..capture import MemorySink, capture
from ..runtime.float32_switches import float32_switches, tf32_notes
from ..runtime.targets import Target, checked_held, default_dut, dtype_name
from ..runtime.workload import RunResult, Workload, call_model, load_workload, run_workload
from . import compiled
from .assemble import assemble
from ..store.schema import tensor_key
from .engine import DEFAULT_MAX_REPLAY_BYTES, EngineInput, EngineOutput, random_outputs_in_order, run_search
from .evidence import input_evidence, param_grads_of
from .findings import known_accepts, resolve_accepts
from .isolate import UnitEvent, replay_module_backward, replay_module_forward, replay_op, GoldenMode, Unreplayable
from .repro import write_culprit_repro
from .result import BisectResult
from .cost import cost_figures, step_cost
from .judge import parity_bound
from .spill import DEFAULT_BUDGET, SpillSink
from .substitute import ReplaceOpMode, final_errors, replace_module_output

__all__ = ["bisect", "events_from_sink", "confirm", "confirm_by_substitution", "check_options", "run_reference", "run_to_run_noise",
           "noise_report"]

log = logging.getLogger(__name__)

Progress = Callable[[int, int, str], None]


def events_from_sink(sink: MemorySink) -> List[UnitEvent]:
    """The captured events of a :class:`MemorySink` as :class:`UnitEvent`."""
    out = []
    for e in sink.events:
        records = {r["slot"]: r for r in e["tensors"]}
        slots = {s: (r["dtype"], tuple(r["shape"]), r["data_key"] is not None) for s, r in records.items()}

        def load(slot: str, _records: Dict[str, dict] = records) -> torch.Tensor:
            return sink.tensor(_records[slot])
        out.append(UnitEvent(e["seq"], e["kind"], e["scope"], e["name"], e["direction"], e["call"],
                             slots, e.get("args"), load, step=e.get("step", 0)))
    return out


def peer_of(peer: "str | Target | None", dut: Target) -> "tuple[Optional[str], str]":
    """``--peer DEVICE[/DTYPE]``: the device of a real second implementation and its name; it runs
    in the DUT's dtype (DTYPE, when given, must be the DUT's).

    Raises:
        BisectError: an autocast peer or another dtype; TargetError: an absent device.
    """
    if peer is None:
        return None, ""
    spec = str(peer)
    target = Target.parse(spec if "/" in spec else f"{spec}/{dtype_name(dut.dtype)}")
    if target.autocast or target.dtype != dut.dtype:
        raise BisectError(f"--peer {spec}: a peer replays the DUT's ops in the DUT's dtype; use "
                          f"{target.device}/{dtype_name(dut.dtype)}")
    target.check_available()
    return target.device, str(target)


def self_peer_notes(dut: Target, ref: Target) -> List[str]:
    """The warning for a DUT whose float32 peer is its own kernel: a float32 (or float64) DUT on the
    reference's device type. The emulated float32 peer replays each op in float32 on the reference
    device: there it is the DUT's kernel itself, so no op can err more than its peers and the verdict
    is blind (a custom op wrong in float32 on cpu/float32 is not named; on one GPU, TF32 against
    itself). Not changed in the judging: a note, until the peer runs elsewhere (docs/bisect.md)."""
    if dut.autocast or dut.dtype not in (torch.float32, torch.float64):
        return []
    if dut.device.split(":")[0] != ref.device.split(":")[0]:
        return []
    return [f"WARNING: the emulated float32 peer of a {dut} DUT runs on the reference's device ({ref.device}) in "
            "the DUT's own dtype, so it is the DUT's own kernel: an op wrong in that dtype cannot exceed its "
            "peer and is not named. Put the reference on another device (e.g. --ref cpu/float64 for a GPU or "
            "MLU DUT) or register a reference implementation (precisiondiff.register_reference)"]


def rule_of(rule: str, peer_device: Optional[str]) -> List[str]:
    """Check ``--rule``; the notes the report carries for it (mlu-ops without a real peer).

    Raises:
        BisectError: an unknown rule.
    """
    from ..comparators.mlu_ops import RULES
    if rule not in RULES:
        raise BisectError(f"--rule {rule}: unknown rule; use one of {', '.join(RULES)}")
    if rule == "mlu-ops" and peer_device is None:
        return ["--rule mlu-ops without --peer: the baseline of its dynamic threshold (10 x the GPU's error in "
                "mlu-ops) is the emulated peers, correct implementations in the DUT dtype"]
    return []


def known_accepts_of(dut: Target) -> list:
    """The documented stock findings of ``dut``'s device and dtype, as accepts."""
    return known_accepts(dut.device.split(":")[0], str(dut.dtype).replace("torch.", ""))


def check_options(direction: Optional[str], budgets: Any) -> Optional[Dict[str, Dict[str, Any]]]:
    """Validate ``direction``; turn ``budgets`` (``{key: {field: value}}`` or a list of
    ``[KEY:]FIELD=VALUE`` strings, as ``--budget``) into checked overrides.

    Raises:
        BisectError: a bad direction or budget override.
    """
    from ..comparators import budget_for, parse_budget_overrides
    from ..comparators.ulp import ComparatorError
    if direction not in (None, "forward", "backward", "optimizer"):
        raise BisectError(f"--direction must be forward, backward or optimizer, not {direction!r}")
    if budgets is None or budgets == {} or budgets == []:
        return None
    try:
        if isinstance(budgets, (list, tuple)):
            overrides = parse_budget_overrides(list(budgets))
        elif isinstance(budgets, dict):
            overrides = {str(k): dict(v) for k, v in budgets.items()}
            budget_for(torch.bfloat16, "unknown", overrides={"*": {}, **{k: v for k, v in overrides.items()}})
            for v in overrides.values():
                budget_for(torch.bfloat16, "unknown", overrides={"*": v})
        else:
            raise BisectError(f"budgets must be a dict {{key: {{field: value}}}} or a list of "
                              f"'[KEY:]FIELD=VALUE' strings, not {type(budgets).__name__}")
    except (ComparatorError, TypeError, ValueError) as err:
        raise BisectError(str(err)) from err
    return overrides


_ALL = object()


def run_reference(wl: Workload, ref: Target, dut_events: Optional[List[UnitEvent]] = None,
                  evidence_for: Any = _ALL, skip_backward: Optional[Callable[[Any, Any], bool]] = None,
                  ) -> "tuple[Any, Callable[[str], Optional[torch.Tensor]], List[str]]":
    """Run the workload on the reference: the final outputs, a ``key -> tensor`` lookup for the
    evidence on the culprit's inputs, and notes (ops that had no reference-dtype kernel and ran
    in float32).

    ``dut_events``: the DUT's recorded events; its random ops' outputs (dropout masks) are
    reused, in order, so both runs see the same draws (random ops are data).
    ``evidence_for``: the culprit's event: only its scope is captured (tensors in memory), so
    the host memory of the reference run is the model's and that unit's, not every activation;
    None: nothing is captured; by default every op and module (level ``all``).
    ``skip_backward``: called as ``skip_backward(output, loss)`` after the reference forward (and
    loss); when it returns True the backward is not run (the result then has no gradients): the
    forward's final error already decides the verdict.
    """
    sink = MemorySink()
    model = ref.prepare_model(wl.model)
    model.train(wl.train)
    randoms = random_outputs_in_order(dut_events or [])
    recording = contextlib.nullcontext()
    if evidence_for is _ALL:
        recording = capture(model=model, level="all", mode="tensors", sink=sink)
    elif evidence_for is not None:
        recording = capture(model=model, level="all", mode="tensors", sink=sink,
                            scope=f"^{re.escape(evidence_for.scope)}$")
    with GoldenMode(fallback=set(), random_outputs=randoms) as mode, recording:
        if skip_backward is None or wl.loss is None:
            result = run_workload(wl, ref, model=model)
        else:
            result = _forward_first(wl, ref, model, skip_backward)
    records = {tensor_key(e["scope"], e["name"], e["call"], e["direction"], r["slot"]): r
               for e in sink.events for r in e["tensors"] if r["data_key"] is not None}
    notes = ([f"the reference run computed {', '.join(sorted(mode.fallback))} in float32: no "
              f"{str(ref.dtype).removeprefix('torch.')} kernel"] if mode.fallback else [])
    return result, (lambda key: sink.tensor(records[key]) if key in records else None), notes


def _forward_first(wl: Workload, ref: Target, model: torch.nn.Module,
                   skip_backward: Callable[[Any, Any], bool]) -> RunResult:
    """One step of ``wl`` on ``ref`` whose backward runs only if ``skip_backward(output, loss)``
    says it is needed (run_workload's step, split after the loss)."""
    inputs = ref.prepare_inputs(wl.inputs)
    try:
        fwd = run_workload(wl, ref, model=model, inputs=inputs, backward=False)
        with ref.context():
            loss = wl.loss(fwd.output)
        if not skip_backward(fwd.output, loss):
            loss.backward()
    except PrecisionDiffError:
        raise
    except Exception as err:  # the user's loss (or its backward) failed on the reference
        raise WorkloadError(f"{wl.name}: the loss or backward on {ref} raised {type(err).__name__}: "
                            f"{str(err).splitlines()[0] if str(err) else ''}") from err
    return RunResult(model, inputs, fwd.output, loss)


NoiseKey = Tuple[str, str, str, int]


def run_to_run_noise(wl: Workload, dut: Target, events: List[UnitEvent]) -> "tuple[Dict[NoiseKey, float], int]":
    """Run the workload a second time on the DUT (a fresh prepared copy, same inputs), captured
    at op level with tensors, and compare every op call of ``events`` with its match (scope,
    name, direction, call) in the second run.

    Returns ``(floors, propagated)``: ``floors`` maps each op call whose inputs were bitwise
    equal in both runs to the max abs difference of its floating outputs (0.0: deterministic,
    ``inf`` where NaN/Inf differ): its own run-to-run noise. ``propagated`` counts the op calls
    whose inputs already differed (noise from upstream; isolation judges an op on the first
    run's own inputs, so they get no floor). Calls missing from either run are left out."""
    from .judge import max_abs_error
    sink = MemorySink()
    model = dut.prepare_model(wl.model)
    model.train(wl.train)
    with capture(model=model, level="op", mode="tensors", sink=sink):
        run_workload(wl, dut, model=model, inputs=dut.prepare_inputs(wl.inputs))
    dut.synchronize()
    second = {(e.scope, e.name, e.direction, e.call): e for e in events_from_sink(sink) if e.kind == "op"}
    floors: Dict[NoiseKey, float] = {}
    propagated = 0
    for ev in events:
        if ev.kind != "op":
            continue
        key = (ev.scope, ev.name, ev.direction, ev.call)
        other = second.get(key)
        if other is None:
            continue
        outs, same_inputs = [], True
        for slot, (dtype, shape, has) in ev.slots.items():
            o = other.slots.get(slot)
            if not has or o is None or not o[2] or o[1] != shape or o[0] != dtype:
                continue
            a, b = ev.load(slot), other.load(slot)
            if slot.startswith("output.") and a.is_floating_point():
                outs.append((a, b))
            elif slot.startswith("input.") and same_inputs:
                same_inputs = (max_abs_error([(a, b)]) == 0.0 if a.is_floating_point()
                               else bool(torch.equal(a.cpu(), b.cpu())))
        if not outs:
            continue
        if same_inputs:
            floors[key] = max_abs_error(outs)
        elif max_abs_error(outs) > 0:
            propagated += 1
    return floors, propagated


def noise_report(noise: Dict[NoiseKey, float], propagated: int,
                 out: EngineOutput) -> "tuple[Dict[str, Any], List[str]]":
    """The ``noise`` JSON object and its note: how many op calls are nondeterministic on the
    DUT, and which over-budget ops were judged within their run-to-run noise."""
    nondet = sorted(k for k, v in noise.items() if v > 0)
    within = []
    for uid in sorted(out.details):
        d = out.details[uid]
        if d.get("within_noise"):
            ev = out.units[uid]
            within.append({"scope": ev.scope, "name": ev.name, "direction": ev.direction, "call": ev.call,
                           "max_abs_error": d.get("noise_error"), "noise": d.get("noise"),
                           "local": d.get("local", {}), "budget": d.get("budget", {})})
    from .judge import NOISE_FACTOR
    report = {"nondeterministic_ops": len(nondet), "ops_compared": len(noise) + propagated,
              "differ_from_upstream": propagated,
              "nondeterministic": [{"scope": s, "name": n, "direction": d, "call": c, "noise": noise[(s, n, d, c)]}
                                   for s, n, d, c in nondet[:50]],
              "within_noise": within, "factor": NOISE_FACTOR, "rule": "max abs error vs golden <= factor x "
              "run-to-run max abs difference (over all floating outputs of the op call)"}
    names = ", ".join(f"{w['scope'] or '<root>'}/{w['name']} ({w['direction']}, call {w['call']})" for w in within[:4])
    note = (f"{len(nondet)} op call(s) nondeterministic on the DUT; {len(within)} judged within their run-to-run "
            f"noise" + (f": {names}" + (" ..." if len(within) > 4 else "") if within else "")
            + f" (over budget, but max abs error <= {NOISE_FACTOR:g}x the run-to-run max abs difference)"
            + (f"; {propagated} more differ between runs only through their inputs (judged as usual)"
               if propagated else ""))
    return report, [note]


def _grads(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _timed_forward(workload: Workload, dut: Target, model: torch.nn.Module, inputs: Any) -> float:
    with torch.no_grad(), dut.context():
        call_model(model, inputs)  # warm-up
        dut.synchronize()
        start = time.perf_counter()
        call_model(model, inputs)
        dut.synchronize()
    return time.perf_counter() - start


def golden_of_culprit(ev: UnitEvent, events: List[UnitEvent], module_of: Callable[[str], Any],
                      ref: Target, dut_dtype: torch.dtype, unreplayable: List[str]) -> Dict[str, torch.Tensor]:
    """The culprit's golden outputs (``output.N`` / ``grad_input.N``) for substitution."""
    if ev.kind == "op":
        golden = replay_op(ev, device=ref.device, dtype=ref.dtype).golden
        return {f"output.{i}": g for i, g in enumerate(golden)}
    template = module_of(ev.scope)
    mode = GoldenMode(fallback=set(unreplayable))
    if ev.direction == "forward":
        return replay_module_forward(template, ev, device=ref.device, dtype=ref.dtype, mode=mode)
    calls = sorted((e for e in events if e.kind == "module" and e.direction == "forward"
                    and e.scope == ev.scope and e.name == ev.name), key=lambda e: e.call)
    fwd = calls[len(calls) - 1 - ev.call]
    return replay_module_backward(template, fwd, ev, device=ref.device, dtype=ref.dtype, mode=mode)


def confirm_by_substitution(workload: Workload, dut: Target, ev: UnitEvent, events: List[UnitEvent],
                            golden: Dict[str, torch.Tensor]) -> Optional[Dict[str, Any]]:
    """Rerun the DUT with the culprit's output replaced; returns output/loss/grads or None."""
    model = dut.prepare_model(workload.model)
    model.train(workload.train)
    inputs = dut.prepare_inputs(workload.inputs)
    if ev.kind == "op":
        same = sorted((e for e in events if e.kind == "op" and e.name == ev.name), key=lambda e: e.seq)
        ordinal = [e.seq for e in same].index(ev.seq)
        gold = {int(k.split(".")[1]): v for k, v in golden.items() if k.startswith("output.")}
        mode = ReplaceOpMode(ev.name, ordinal, gold)
        with mode:
            result = run_workload(workload, dut, model=model, inputs=inputs)
        done = mode.replaced
    else:
        module = model.get_submodule(ev.scope) if ev.scope else model
        with replace_module_output(module, ev.direction, ev.call, golden) as flag:
            result = run_workload(workload, dut, model=model, inputs=inputs)
        done = flag[0]
    if not done:
        return None
    return {"output": result.output, "loss": result.loss, "grads": _grads(result.model)}


confirm = confirm_by_substitution  # the earlier public name


def substitution_notes(confirmation: Dict[str, Any], candidates: List[dict]) -> List[str]:
    """Say so when substitution removes little of the final error."""
    before = confirmation.get("final_error_before")
    after = confirmation.get("final_error_after_substitution")
    if not isinstance(before, float) or not isinstance(after, float) or before <= 0:
        return []
    reduction = 1.0 - after / before
    confirmation["reduction"] = reduction
    if reduction < 0.5:
        names = ", ".join(f"{c['scope'] or '<root>'}/{c['name']} ({c['direction']})" for c in candidates)
        return [f"substituting the culprit removes only {reduction:.0%} of the final error: other "
                f"causes remain" + (f"; next candidates: {names}" if names else
                                    " (rounding accumulated elsewhere)")]
    return []


def bisect(workload: "str | Workload | Callable[[], Any]", *, target: "str | Target | None" = None,
           ref: "str | Target" = "cpu/float64", direction: Optional[str] = None,
           budgets: Any = None, seed: int = 0, progress: Optional[Progress] = None,
           max_candidates: int = 3, noise: bool = False, confirm: bool = False,
           time_step: bool = False, max_host_memory: Optional[int] = None,
           accept: Optional[Sequence[str]] = None,
           allow_narrowed: bool = False, repro: "str | os.PathLike | None" = None,
           max_elements: Optional[int] = None, peer: "str | Target | None" = None,
           max_replay_bytes: Optional[int] = DEFAULT_MAX_REPLAY_BYTES, rule: str = "peer",
           blame_known: bool = False) -> BisectResult:
    """Find the first unit (op, fused kernel or module) whose own arithmetic is wrong on the DUT.

    Runs the workload once on the DUT under capture (forward, and backward when it has a loss)
    and isolates every op and module call on the reference with the DUT's own inputs and
    parameters. The reference runs the whole workload only when the verdict needs its final
    error (no culprit) or ``confirm`` asks; ``confirm`` also reruns the DUT with the culprit's
    output replaced by its golden (substitution). A training workload (``optimizer=``, or
    ``steps`` > 1) runs its steps and is searched step by step, its optimizer updates included
    (:func:`precisiondiff.bisect.training.bisect_training`; docs/bisect.md, "Training steps").

    Args:
        workload: ``file.py:fn``, ``package.module:fn``, a factory, or a :class:`Workload`.
        target: the device under test (default: the first of mlu, cuda, cpu in bf16).
        ref: the reference target (default ``cpu/float64``).
        direction: ``"forward"`` or ``"backward"`` to search one direction only.
        budgets: op budget overrides: ``{KEY: {FIELD: VALUE}}`` or ``["[KEY:]FIELD=VALUE", ...]``
            (KEY: ``*``, a dtype, an op class or an op name; FIELD: max_ulp, rounding_ulps,
            accum_factor, accum_dtype), as :func:`precisiondiff.comparators.budget_for` applies them.
        seed: the seed applied before the workload is built.
        progress: called as ``progress(done, total, label)`` while units are isolated.
        max_candidates: offending units to report after the culprit.
        noise: run the DUT a second time and take each op call's run-to-run difference as its
            noise floor: a nondeterministic op over its budget whose max abs error is within
            ``NOISE_FACTOR`` x that difference is not a culprit (docs/bisect.md, "Run-to-run noise").
        confirm: with a culprit, also run the reference (final error, and the culprit's inputs
            against it: ``evidence.inputs``) and confirm by substitution (one more DUT run).
        time_step: time one plain forward first (two uncaptured forwards: warm-up and timed)
            for ``cost.plain_forward_s`` and ``cost.wall_over_forward``.
        max_host_memory: bytes of the captured step's tensors held in memory (default 2 GiB);
            the rest is spilled to a temporary directory and read back when a unit needs it
            (``cost.host_memory``; docs/bisect.md, "Host memory").
        accept: findings read and accepted, ``["OP", "OP@SCOPE", ...]``: such an offending op is
            listed in ``accepted`` and the search goes on to the next culprit; the project's
            ``[tool.precisiondiff] accept`` (pyproject.toml or precisiondiff.toml) is added
            (:mod:`precisiondiff.bisect.findings`). The documented stock findings of the DUT's
            device and dtype are accepted too, unless ``blame_known``.
        blame_known: judge the documented stock findings (``KNOWN_FINDINGS``) as offenders, as
            any other op, instead of accepting them.
        allow_narrowed: run a float64 target or reference on a device that holds float64 as
            float32 as the float32 target it is (a note), instead of refusing it.
        repro, max_elements: write an op culprit's standalone repro into this directory
            (docs/bisect.md, "Repro"), slicing tensors beyond ``max_elements``.
        peer: ``DEVICE[/DTYPE]``, a real second implementation in the DUT's dtype (docs/bisect.md,
            "A real peer").
        max_replay_bytes: block-wise replay: a module larger than this in the reference dtype is
            not replayed whole; its blocks are (docs/bisect.md, "Host memory"). None: every
            module whole.
        rule: how an op is judged: ``"peer"`` (default) or ``"mlu-ops"`` (Cambricon's acceptance
            rule, its baseline ``peer`` or the emulated peers: docs/comparators.md, "The mlu-ops rule").

    Returns:
        A :class:`BisectResult`.

    Raises:
        BisectError: bad direction or options; TargetError, WorkloadError as raised by those.

    Example:
        >>> r = bisect("examples/tiny_transformer.py:build_with_bug", target="cpu/bf16")
        >>> r.culprit["name"]
        'pdexample.fused_rms_norm.default'
    """
    overrides = check_options(direction, budgets)
    accepts = resolve_accepts(accept)
    started = time.perf_counter()
    dut, dut_note = checked_held(Target.parse(target) if target is not None else default_dut(),
                                 allow_narrowed=allow_narrowed)
    accepts = accepts if blame_known else accepts + known_accepts_of(dut)
    ref_t, ref_note = checked_held(Target.parse(ref), allow_narrowed=allow_narrowed)
    peer_device, peer_name = peer_of(peer, dut)
    rule_notes = rule_of(rule, peer_device) + self_peer_notes(dut, ref_t) + tf32_notes(dut, float32_switches())
    if ref_t.autocast:
        raise BisectError(f"reference {ref_t}: a reference cannot use autocast; use e.g. cpu/float64")
    wl = load_workload(workload, seed=seed)
    compiled_wl = wl if compiled.find_regions(wl.model) else None
    in_place = compiled.compiled_in_place(wl.model)
    if compiled_wl is not None or in_place:  # bisect the eager model; regions are checked below
        wl = compiled.eager_workload(wl)
    if wl.optimizer is not None or wl.steps > 1:  # every training step judged (training.py)
        if rule != "peer":
            raise BisectError(f"--rule {rule} judges single-step workloads and dumps; a training workload "
                              "(optimizer= or steps > 1) is judged by the peer rule")
        from .training import bisect_training
        found = bisect_training(wl, dut, ref_t, overrides=overrides, direction=direction, progress=progress,
                                max_candidates=max_candidates, max_host_memory=max_host_memory,
                                confirm=confirm, noise=noise, started=started, events_of=events_from_sink,
                                accept=accepts)
        if compiled_wl is not None or in_place:
            found.notes.append("torch.compile regions are not checked in a training bisect: its steps ran eagerly")
        return found
    has_backward = wl.loss is not None
    fwd_cost = step_cost(has_backward)

    model = dut.prepare_model(wl.model)
    model.train(wl.train)
    inputs = dut.prepare_inputs(wl.inputs)
    plain_forward_s = None
    if time_step:
        # timed on a copy, with the RNG state restored after: in training mode the timing forwards
        # must not update BatchNorm statistics or consume dropout randomness of the bisected run
        timing_model = dut.prepare_model(wl.model)
        timing_model.train(wl.train)
        with torch.random.fork_rng(devices=[]):
            plain_forward_s = _timed_forward(wl, dut, timing_model, inputs)
        del timing_model
    sink = SpillSink(DEFAULT_BUDGET if max_host_memory is None else max_host_memory)
    t0 = time.perf_counter()
    with capture(model=model, level="all", mode="replay", sink=sink):
        result = run_workload(wl, dut, model=model, inputs=inputs)
    dut.synchronize()
    capture_s = time.perf_counter() - t0
    events = events_from_sink(sink)

    noise_floor: Optional[Dict[NoiseKey, float]] = None
    noise_s = 0.0
    if noise:
        if progress is not None:
            progress(0, 1, "second DUT run (run-to-run noise)")
        t2 = time.perf_counter()
        noise_floor, noise_propagated = run_to_run_noise(wl, dut, events)
        noise_s = time.perf_counter() - t2
    modules = {name: m for name, m in model.named_modules()}
    t1 = time.perf_counter()
    out: EngineOutput = run_search(EngineInput(
        events=events, dut_dtype=dut.dtype, ref_device=ref_t.device, ref_dtype=ref_t.dtype,
        module_of=modules.get, module_class_of=lambda sc: type(modules[sc]).__name__ if sc in modules else None,
        param_grad=param_grads_of(events), direction=direction,
        max_candidates=max_candidates, progress=progress, overrides=overrides, noise=noise_floor,
        accept=accepts, peer_device=peer_device, peer_name=peer_name, max_replay_bytes=max_replay_bytes,
        rule=rule))
    search_s = time.perf_counter() - t1

    # The reference run only when something needs it: the verdict (parity or accumulated: no
    # culprit), the confirmation (evidence and substitution), or the compiled regions' check.
    culprit_ev = out.units[out.finding.culprit] if out.finding.culprit is not None else None
    ref_result = None
    ref_tensor: Callable[[str], Optional[torch.Tensor]] = lambda key: None
    notes: List[str] = []
    forward_only = [False]
    if culprit_ev is None or confirm or compiled_wl is not None:
        skip = None
        if culprit_ev is None and not confirm and compiled_wl is None:
            def skip(ref_output: Any, ref_loss: Any) -> bool:
                # accumulated already: the final error is the worst of output, loss and gradients
                fwd = final_errors(result.output, result.loss, {}, ref_output, ref_loss, {})
                forward_only[0] = fwd["final"] > parity_bound(dut.dtype)
                return forward_only[0]
        ref_result, ref_tensor, notes = run_reference(
            wl, ref_t, events, evidence_for=_ALL if compiled_wl is not None else culprit_ev if confirm else None,
            skip_backward=skip)
    final = None
    if ref_result is not None:
        final = final_errors(result.output, result.loss, _grads(model), ref_result.output,
                             ref_result.loss, _grads(ref_result.model) if not forward_only[0] else {})
        if forward_only[0]:
            notes.append("the reference ran forward only: the output's (or the loss's) error already "
                         "exceeds the parity bound, so the verdict is accumulated whatever the gradients' "
                         "error; the final error is that of the forward (a lower bound of the step's); "
                         "confirm=True (--confirm) runs the reference's backward too")

    dut_runs = 1
    noise_json = None
    if noise_floor is not None:
        noise_json, noise_notes = noise_report(noise_floor, noise_propagated, out)
        notes += noise_notes
        dut_runs += 1
    confirmation: Dict[str, Any] = {"final_error_before": final["final"] if final else None,
                                    "final_error_after_substitution": None}
    input_check = None
    substituted = 0
    if culprit_ev is not None and confirm:
        ev = culprit_ev
        input_check = input_evidence(ev, ref_tensor, dut.dtype)
        try:
            golden = golden_of_culprit(ev, events, modules.get, ref_t, dut.dtype, out.unreplayable_ops)
            rerun = confirm_by_substitution(wl, dut, ev, events, golden)
            dut_runs += 1
            substituted = 1
        except Unreplayable as err:
            rerun = None
            notes.append(f"substitution not possible: {err}")
        if rerun is not None:
            after = final_errors(rerun["output"], rerun["loss"], rerun["grads"], ref_result.output,
                                 ref_result.loss, _grads(ref_result.model))
            confirmation["final_error_after_substitution"] = after["final"]
            confirmation["detail_before"] = final
            confirmation["detail_after"] = after
            cands = [{"scope": out.units[u].scope, "name": out.units[u].name,
                      "direction": out.units[u].direction} for u in out.finding.candidates]
            notes += substitution_notes(confirmation, cands)
    elif culprit_ev is not None:
        notes.append("not confirmed: the verdict needs only the captured step and the replays; "
                     "confirm=True (--confirm) runs the reference for the final error and the "
                     "evidence on the culprit's inputs, and reruns the DUT with the culprit's golden output")
        if final is not None:
            confirmation["detail_before"] = final
    else:
        confirmation["detail_before"] = final
    wall_s = time.perf_counter() - started
    runs = {"dut_capture": fwd_cost, "timing": 2.0 if time_step else 0.0,
            "reference": (1.0 if forward_only[0] else fwd_cost) if ref_result is not None else 0.0,
            "substitution": fwd_cost * substituted, "noise": fwd_cost if noise_floor is not None else 0.0}
    cost = {"dut_runs": dut_runs, "ref_runs": 1 if ref_result is not None else 0,
            **cost_figures(runs, out, fwd_cost),
            "units_isolated": out.finding.queries, "units_not_isolated": len(out.skipped),
            "ops_replayed": out.replayed_ops, "ops_reused": out.reused_ops,
            "ops_per_forward": out.forward_ops, "wall_s": round(wall_s, 3),
            "capture_s": round(capture_s, 3), "search_s": round(search_s, 3),
            **({"noise_s": round(noise_s, 3)} if noise else {}),
            **({"plain_forward_s": round(plain_forward_s, 6),
                "wall_over_forward": round(wall_s / plain_forward_s, 1) if plain_forward_s > 0 else None}
               if plain_forward_s is not None else {}),
            "host_memory": {"budget": sink.budget, "held_bytes": sink.held_bytes,
                            "spilled_bytes": sink.spilled_bytes},
            **({"block_wise": {"max_replay_bytes": max_replay_bytes, "not_replayed_whole": out.block_wise}}
               if out.block_wise else {})}
    result = assemble(out, dut=dut, ref=ref_t, final=final, confirmation=confirmation, cost=cost, notes=notes,
                      input_check=input_check)
    result.noise = noise_json
    result.notes[:0] = [n for n in (dut_note, ref_note) if n] + rule_notes
    if compiled_wl is not None:
        if progress is not None:
            progress(0, 1, "compiled regions vs eager")
        try:
            check = compiled.check_regions(compiled_wl, dut, ref_t, ref_result)
        except Exception as err:  # the user's compiled model fails: the eager finding stands
            check = compiled.CompiledCheck(notes=[f"compiled regions not checked: the compiled model failed: "
                                                  f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"])
        compiled.merge_into(result, check, out=out, events=events, ref_tensor=ref_tensor,
                            module_class_of=lambda sc: type(modules[sc]).__name__ if sc in modules else None,
                            run_cost=fwd_cost, has_backward=has_backward)
        result.cost["wall_s"] = round(time.perf_counter() - started, 3)
        result.cost["steps"] = round(result.cost["forward_equivalents"] / fwd_cost, 2)
    if in_place:
        result.notes.append(f"modules compiled in place with Module.compile() ({', '.join(s or '<root>' for s in in_place)}) "
                            "were bisected eagerly, not checked as compiled regions: wrap them with "
                            "torch.compile(module) instead")
    if repro is not None and culprit_ev is not None and result.culprit is not None:
        write_culprit_repro(result, culprit_ev, repro, ref_t, max_elements)
    sink.cleanup()
    return result
