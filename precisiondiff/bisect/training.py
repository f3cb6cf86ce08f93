"""Bisect over training steps: every captured step judged in order, optimizer updates included.

A training workload (``Workload(..., optimizer=..., steps=N)``) is bisected live by capturing N
full steps (forward, backward, the optimizer's step) and searching each step's events in turn
(:func:`search_steps`): the culprit is the first offending unit by (step, execution order),
forward before backward before the optimizer's update within a step. A dump holding several
steps is searched the same way offline (:func:`precisiondiff.bisect.offline.bisect_dump`).
The final error, when the verdict needs it, compares the last step's output, loss and gradients
and the parameters after the last update with a reference run of the same N steps.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..capture import capture
from ..runtime.targets import Target
from ..runtime.training import Trainer, train_step
from ..runtime.workload import Workload
from .assemble import assemble
from .cost import cost_figures, step_cost
from .engine import EngineInput, EngineOutput, run_search
from .evidence import param_grads_of
from .isolate import GoldenMode, UnitEvent
from .judge import rel_l2
from .result import BisectResult
from .search import Finding
from .spill import DEFAULT_BUDGET, SpillSink
from .substitute import final_errors

__all__ = ["search_steps", "bisect_training", "train_reference", "mark_steps"]


def _merge(outs: List[EngineOutput]) -> EngineOutput:
    """One engine output for several steps' searches: the last search's finding (the culprit's
    step, or the last step), every unit and detail, the replays summed."""
    last = outs[-1]
    units: Dict[int, UnitEvent] = {}
    details: Dict[int, dict] = {}
    breakdown: Dict[str, int] = {}
    unreplayable: List[str] = []
    for o in outs:
        units.update(o.units)
        details.update(o.details)
        for k, v in o.breakdown.items():
            breakdown[k] = breakdown.get(k, 0) + v
        unreplayable += [n for n in o.unreplayable_ops if n not in unreplayable]
    f = last.finding
    finding = Finding(culprit=f.culprit, candidates=f.candidates, path=f.path, unresolved=f.unresolved,
                      queries=sum(o.finding.queries for o in outs))
    return EngineOutput(finding, units, details, sum(o.replayed_ops for o in outs),
                        max(o.forward_ops for o in outs), unreplayable, breakdown=breakdown,
                        skipped=[u for o in outs for u in o.skipped], reused_ops=sum(o.reused_ops for o in outs),
                        block_wise=[m for o in outs for m in o.block_wise])


def search_steps(events: List[UnitEvent], make_input: Callable[[List[UnitEvent]], EngineInput]
                 ) -> Tuple[EngineOutput, List[Dict[str, Any]]]:
    """Search each step's events in step order until a step names a culprit.

    Returns the merged :class:`EngineOutput` and one summary per step searched:
    ``{"step", "units_isolated", "culprit"}`` (``culprit``: whether that step named one).
    """
    by_step: Dict[int, List[UnitEvent]] = {}
    for e in events:
        by_step.setdefault(e.step, []).append(e)
    outs: List[EngineOutput] = []
    summary: List[Dict[str, Any]] = []
    for step in sorted(by_step):
        out = run_search(make_input(by_step[step]))
        outs.append(out)
        summary.append({"step": step, "units_isolated": out.finding.queries,
                        "culprit": out.finding.culprit is not None})
        if out.finding.culprit is not None:
            break
    if not outs:
        outs.append(run_search(make_input([])))
    return _merge(outs), summary


def mark_steps(result: BisectResult, out: EngineOutput, summary: List[Dict[str, Any]]) -> None:
    """The culprit's and candidates' ``step`` and the per-step summary (``steps``) in the result."""
    finding = out.finding
    if result.culprit is not None and finding.culprit is not None:
        result.culprit["step"] = out.units[finding.culprit].step
    for cand, uid in zip(result.candidates, finding.candidates):
        cand["step"] = out.units[uid].step
    result.steps = summary


def train_reference(wl: Workload, ref: Target, steps: int) -> Tuple[Any, torch.nn.Module]:
    """The workload's ``steps`` training steps on the reference (ops without a reference-dtype
    kernel in float32, as :func:`~precisiondiff.bisect.live.run_reference`): the last step's
    :class:`RunResult` (its gradients kept) and the model after the last update."""
    model = ref.prepare_model(wl.model)
    model.train(wl.train)
    inputs = ref.prepare_inputs(wl.inputs)
    trainer = Trainer(wl, model)
    result = None
    with GoldenMode(fallback=set()):
        for i in range(steps):
            if i:
                trainer.zero_grad(model)
            result = train_step(wl, ref, model, inputs, trainer)
    return result, model


def _trained_errors(result: Any, model: torch.nn.Module, ref_result: Any, ref_model: torch.nn.Module) -> Dict[str, float]:
    """:func:`final_errors` of the last step, with ``params``: the parameters after the last
    update (one vector) against the reference's."""
    grads = lambda m: {n: p.grad for n, p in m.named_parameters() if p.grad is not None}  # noqa: E731
    final = final_errors(result.output, result.loss, grads(model), ref_result.output, ref_result.loss,
                         grads(ref_model))
    ref_params = dict(ref_model.named_parameters())
    names = [n for n, p in model.named_parameters() if n in ref_params and p.shape == ref_params[n].shape]
    if names:
        own = dict(model.named_parameters())
        final["params"] = rel_l2(torch.cat([own[n].detach().flatten().double().cpu() for n in names]),
                                 torch.cat([ref_params[n].detach().flatten().double().cpu() for n in names]))
        final["final"] = max(final["final"], final["params"])
    return final


def bisect_training(wl: Workload, dut: Target, ref: Target, *, overrides: Any = None, direction: Optional[str] = None,
                    progress: Any = None, max_candidates: int = 3, max_host_memory: Optional[int] = None,
                    confirm: bool = False, noise: bool = False, started: Optional[float] = None,
                    events_of: Callable[[SpillSink], List[UnitEvent]],
                    accept: Optional[List[Any]] = None) -> BisectResult:
    """Live bisect of a training workload (:func:`precisiondiff.bisect.bisect` hands it over):
    ``wl.steps`` steps captured, each step searched in turn (:func:`search_steps`).
    ``events_of`` turns the capture's sink into events (live bisect's ``events_from_sink``)."""
    started = time.perf_counter() if started is None else started
    model = dut.prepare_model(wl.model)
    model.train(wl.train)
    inputs = dut.prepare_inputs(wl.inputs)
    trainer = Trainer(wl, model)
    sink = SpillSink(DEFAULT_BUDGET if max_host_memory is None else max_host_memory)
    n = wl.steps
    t0 = time.perf_counter()
    with capture(model=model, level="all", mode="replay", sink=sink, steps=f"0-{n - 1}") as cap:
        for i in range(n):
            if i:
                trainer.zero_grad(model)  # the last step's gradients stay for the final error
            result = train_step(wl, dut, model, inputs, trainer)
            dut.synchronize()
            cap.step()
    capture_s = time.perf_counter() - t0
    events = events_of(sink)
    modules = dict(model.named_modules())

    def make_input(step_events: List[UnitEvent]) -> EngineInput:
        return EngineInput(events=step_events, dut_dtype=dut.dtype, ref_device=ref.device, ref_dtype=ref.dtype,
                           module_of=modules.get,
                           module_class_of=lambda sc: type(modules[sc]).__name__ if sc in modules else None,
                           param_grad=param_grads_of(step_events), direction=direction,
                           max_candidates=max_candidates, progress=progress, overrides=overrides,
                           accept=accept or ())
    t1 = time.perf_counter()
    out, summary = search_steps(events, make_input)
    search_s = time.perf_counter() - t1
    notes: List[str] = []
    if confirm or noise:
        notes.append("--confirm and --noise are not available for training workloads yet: the verdict comes "
                     "from the captured steps' replays alone")
    final = None
    if out.finding.culprit is None or confirm:
        ref_result, ref_model = train_reference(wl, ref, n)
        final = _trained_errors(result, model, ref_result, ref_model)
    else:
        notes.append("not confirmed: the verdict needs only the captured steps and the replays; the reference "
                     "training runs only when no unit offends")
    fwd = step_cost(True)
    runs = {"dut_capture": fwd * n, "reference": fwd * n if final is not None else 0.0}
    cost = {"dut_runs": 1, "ref_runs": 1 if final is not None else 0, **cost_figures(runs, out, fwd),
            "training_steps": n, "units_isolated": out.finding.queries, "units_not_isolated": len(out.skipped),
            "ops_replayed": out.replayed_ops, "ops_reused": out.reused_ops, "ops_per_forward": out.forward_ops,
            "wall_s": round(time.perf_counter() - started, 3), "capture_s": round(capture_s, 3),
            "search_s": round(search_s, 3),
            "host_memory": {"budget": sink.budget, "held_bytes": sink.held_bytes, "spilled_bytes": sink.spilled_bytes}}
    confirmation: Dict[str, Any] = {"final_error_before": final["final"] if final else None,
                                    "final_error_after_substitution": None, "detail_before": final}
    res = assemble(out, dut=dut, ref=ref, final=final, confirmation=confirmation, cost=cost, notes=notes)
    mark_steps(res, out, summary)
    sink.cleanup()
    return res
