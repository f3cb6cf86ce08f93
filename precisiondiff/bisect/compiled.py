"""Compiled-region bisection: which ``torch.compile`` region diverges from eager.

A *compiled region* is an ``OptimizedModule`` (``torch._dynamo.eval_frame``) in the model's
module tree: the root (``torch.compile(model)``) or a submodule compiled separately
(``model.block = torch.compile(model.block)``). Regions nested inside another region are
part of it (Dynamo inlines them) and are not checked on their own.

For each region call, in execution order, on the DUT's real (compiled) run:

- its inputs and compiled outputs ``C`` are captured by hooks on the wrapper;
- ``E``: the region's eager module (``_orig_mod``) on the same inputs, in the DUT dtype (its
  ops are recorded: what the compiler fused);
- ``G``: the golden: a copy of the eager module with the DUT's parameters upcast to the
  reference dtype, on the inputs upcast (as isolation does);
- errors are relative L2 against ``G`` over all floating outputs; the region *diverges* when
  ``err(C) > max(floor, k * err(E))`` with ``k`` from the comparators'
  :func:`~precisiondiff.comparators.peer_ratio_check` (Dynamo's ``same()``: 3 for
  fp16/bf16) and ``floor`` one unit roundoff of the DUT dtype.

The first diverging region is narrowed down by recompiling a copy with the ``aot_eager``
backend (Dynamo's graph through AOTAutograd, run eagerly), then ``eager`` (Dynamo's graph
alone): where the divergence appears says whether it is in the backend's code generation,
in AOTAutograd/decompositions, or in the captured graph.

The rest of the model is bisected eagerly as usual: :func:`eager_workload` replaces every
region with its eager module (scopes stay the wrapper's scopes, without ``._orig_mod``).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..capture.serialize import flatten_tensors
from ..runtime.targets import Target
from ..runtime.workload import Workload, run_workload
from ..store.schema import tensor_key
from .isolate import GoldenMode
from .judge import parity_bound, rel_l2, unit_roundoff
from .substitute import final_errors, replace_module_output

__all__ = ["find_regions", "strip_compiled", "eager_workload", "compiled_in_place", "RegionCall", "CompiledCheck",
           "check_regions", "merge_into", "backend_name", "region_first_seq", "FLOOR_UNITS"]

log = logging.getLogger(__name__)

FLOOR_UNITS = 1.0  # the floor of the divergence bound, in unit roundoffs of the DUT dtype (rel-L2)


def _optimized_module_type() -> Optional[type]:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except Exception:  # pragma: no cover - torch without dynamo
        return None
    return OptimizedModule


def is_compiled(module: Any) -> bool:
    """True for a ``torch.compile``d module wrapper (``OptimizedModule``)."""
    om = _optimized_module_type()
    return om is not None and isinstance(module, om)


def find_regions(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    """``(scope, wrapper)`` of each outermost compiled region, scopes as the eager model names
    them (``block``, not ``block._orig_mod``; the root is ``""``), in module-tree order."""
    found: List[Tuple[str, torch.nn.Module]] = []

    def walk(mod: torch.nn.Module, scope: str) -> None:
        if is_compiled(mod):
            found.append((scope, mod))
            return  # nested regions are inlined into this one
        for name, child in mod.named_children():
            walk(child, f"{scope}.{name}" if scope else name)
    walk(model, "")
    return found


def strip_compiled(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every compiled region replaced by its eager module, in place (the root
    is returned unwrapped)."""
    while is_compiled(model):
        model = model._orig_mod
    for name, child in list(model.named_children()):
        if is_compiled(child):
            setattr(model, name, strip_compiled(child))
        else:
            strip_compiled(child)
    return model


def compiled_in_place(model: torch.nn.Module) -> List[str]:
    """Scopes of modules compiled in place with ``nn.Module.compile()`` (no wrapper): not checked
    as regions; :func:`eager_workload` makes them eager."""
    return [name for name, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]


def eager_workload(wl: Workload) -> Workload:
    """A copy of ``wl`` whose model runs eagerly (every region unwrapped, ``Module.compile()``
    undone)."""
    model = strip_compiled(copy.deepcopy(wl.model))
    for m in model.modules():
        if getattr(m, "_compiled_call_impl", None) is not None:
            m._compiled_call_impl = None
    return dataclasses.replace(wl, model=model)


def backend_name(wrapper: torch.nn.Module) -> str:
    """Best-effort name of the backend a region was compiled with (``inductor``, a function's
    name...), ``?`` when torch does not say."""
    obj: Any = getattr(getattr(wrapper, "dynamo_ctx", None), "callback", None)
    for _ in range(8):
        if obj is None:
            break
        for attr in ("compiler_name", "_compiler_name"):
            name = getattr(obj, attr, None)
            if isinstance(name, str):
                return name
        inner = getattr(obj, "_torchdynamo_orig_backend", None)
        if inner is None:
            inner = getattr(obj, "compiler_fn", None)
        if inner is None:
            name = getattr(obj, "__name__", None)
            return name if isinstance(name, str) else type(obj).__name__
        obj = inner
    return "?"


class _OpRecorder(TorchDispatchMode):
    """Records the name of every op dispatched under it, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@dataclass
class RegionCall:
    """One call of a compiled region, as captured on the DUT's compiled run."""

    scope: str
    wrapper: torch.nn.Module
    call: int
    args: tuple
    kwargs: dict
    outputs: List[torch.Tensor] = field(default_factory=list)


@dataclass
class CompiledCheck:
    """What the compiled-region check measured.

    Attributes:
        regions: one JSON-ready dict per region call, in execution order.
        culprit: index into ``regions`` of the first diverging call, or None.
        final: the compiled run's final errors (:func:`final_errors`) or None.
        confirmation: substitution of the culprit's golden output into the compiled run.
        dut_runs: compiled-model runs made (cost).
        notes: sentences for the reader.
    """

    regions: List[Dict[str, Any]] = field(default_factory=list)
    culprit: Optional[int] = None
    final: Optional[Dict[str, float]] = None
    confirmation: Dict[str, Any] = field(default_factory=dict)
    dut_runs: int = 0
    notes: List[str] = field(default_factory=list)
    golden: Dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    inputs: List[torch.Tensor] = field(default_factory=list, repr=False)
    replays: int = 0


def _detach(value: Any) -> Any:
    return torch.utils._pytree.tree_map(
        lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, value)


def _upcast(value: Any, device: str, dtype: torch.dtype) -> Any:
    def up(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            v = v.detach()
            return v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device=device)
        return v
    return torch.utils._pytree.tree_map(up, value)


def _floats(value: Any) -> List[torch.Tensor]:
    return [t for t in flatten_tensors(value) if t.is_floating_point()]


def _error(actual: List[torch.Tensor], golden: List[torch.Tensor]) -> float:
    pairs = [(a, g) for a, g in zip(actual, golden) if a.shape == g.shape]
    if not pairs or len(actual) != len(golden):
        return float("nan")
    return rel_l2(torch.cat([a.detach().double().cpu().flatten() for a, _ in pairs]),
                  torch.cat([g.detach().double().cpu().flatten() for _, g in pairs]))


def _verdict(err_c: float, err_e: float, dtype: torch.dtype) -> Tuple[bool, Dict[str, Any]]:
    """(diverges, budget dict): err_c > max(floor, k * err_e)."""
    from ..comparators import peer_ratio_check
    floor = FLOOR_UNITS * unit_roundoff(dtype)
    within_peer = peer_ratio_check(err_c, err_e, dtype=dtype, floor=0.0)
    k = 2.0 if dtype in (torch.float32, torch.float64) else 3.0
    try:  # the comparators' own factor, when they expose it
        from ..comparators import tolerance as _tol
        k = _tol.PEER_FACTOR if dtype in (torch.float32, torch.float64) else _tol.PEER_FACTOR_LOW
    except (ImportError, AttributeError):
        pass
    bound = max(floor, k * err_e) if err_e == err_e else floor
    diverges = err_c != err_c or (not within_peer and err_c > floor)
    return diverges, {"rule": "peer-ratio vs eager: rel_l2(compiled) <= max(floor, k * rel_l2(eager))",
                      "k": k, "floor": floor, "bound": bound}


def _run_region_on(module: torch.nn.Module, rc: RegionCall, dut: Target) -> List[torch.Tensor]:
    with torch.no_grad(), dut.context():
        return _floats(module(*rc.args, **rc.kwargs))


def _narrow(rc: RegionCall, golden: List[torch.Tensor], err_e: float, dut: Target) -> Dict[str, Any]:
    """Recompile a copy of the region with aot_eager, then eager: where does it diverge?"""
    backend = backend_name(rc.wrapper)
    out: Dict[str, Any] = {"backend": backend}
    tried: Dict[str, Any] = {}
    for name in ("aot_eager", "eager"):
        if name == backend:
            continue
        try:
            module = torch.compile(copy.deepcopy(rc.wrapper._orig_mod), backend=name)
            outs = _run_region_on(module, rc, dut)
        except Exception as err:  # a region Dynamo or AOTAutograd cannot handle
            tried[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"}
            break
        err = _error(outs, golden)
        diverges, _ = _verdict(err, err_e, dut.dtype)
        tried[name] = {"rel_l2": err, "diverges": diverges}
        if not diverges:
            break
    out["backends"] = tried
    aot, eag = tried.get("aot_eager", {}), tried.get("eager", {})
    if aot.get("diverges") is False:
        out["stage"] = "codegen"
        out["diagnosis"] = (f"the same Dynamo graph through AOTAutograd run eagerly (aot_eager) matches "
                            f"eager: the divergence is in the {backend} backend's code generation")
    elif aot.get("diverges") and eag.get("diverges") is False:
        out["stage"] = "aot_autograd"
        out["diagnosis"] = ("Dynamo's graph run eagerly (backend eager) matches eager but aot_eager does "
                            "not: the divergence is in AOTAutograd (functionalization, decompositions)")
    elif aot.get("diverges") and eag.get("diverges"):
        out["stage"] = "graph"
        out["diagnosis"] = ("Dynamo's captured graph itself diverges when run eagerly (backend eager): "
                            "the graph Dynamo traced computes something else than the module")
    else:
        out["stage"] = "unknown"
        out["diagnosis"] = "could not narrow down further (see backends)"
    return out


def check_regions(wl: Workload, dut: Target, ref: Target, ref_result: Any,
                  narrow: bool = True) -> CompiledCheck:
    """Run the compiled workload once on the DUT with hooks on every region, then judge each
    region call against its eager module and the golden (module docstring). ``ref_result`` is
    the reference run (of the eager model) for the compiled run's final error."""
    check = CompiledCheck()
    model = dut.prepare_model(wl.model)
    model.train(wl.train)
    regions = find_regions(model)
    calls: List[RegionCall] = []
    counts: Dict[str, int] = {}
    pending: Dict[str, List[RegionCall]] = {}
    handles = []
    for scope, wrapper in regions:
        def pre(mod: Any, args: Any, kwargs: Any, _scope: str = scope) -> None:
            rc = RegionCall(_scope, mod, counts.get(_scope, 0), _detach(tuple(args)), _detach(dict(kwargs)))
            counts[_scope] = rc.call + 1
            calls.append(rc)
            pending.setdefault(_scope, []).append(rc)

        def post(mod: Any, args: Any, kwargs: Any, output: Any, _scope: str = scope) -> None:
            pending[_scope].pop().outputs = [t.detach().clone() for t in _floats(output)]
        handles.append(wrapper.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(wrapper.register_forward_hook(post, with_kwargs=True))
    try:
        result = run_workload(wl, dut, model=model)
    finally:
        for h in handles:
            h.remove()
    check.dut_runs = 1
    grads = {n: p.grad for n, p in result.model.named_parameters() if p.grad is not None}
    ref_grads = {n.replace("._orig_mod", ""): p.grad for n, p in ref_result.model.named_parameters()
                 if p.grad is not None}
    grads = {n.replace("._orig_mod", "").removeprefix("_orig_mod."): g for n, g in grads.items()}
    check.final = final_errors(result.output, result.loss, grads, ref_result.output, ref_result.loss, ref_grads)

    golden_cache: Dict[str, torch.nn.Module] = {}
    eager_cache: Dict[str, torch.nn.Module] = {}
    for rc in calls:
        orig = rc.wrapper._orig_mod
        if rc.scope not in golden_cache:
            golden_cache[rc.scope] = copy.deepcopy(orig).to(device=ref.device, dtype=ref.dtype)
            eager_cache[rc.scope] = copy.deepcopy(orig)  # the DUT's own params, never compiled
        gold_mod, eager_mod = golden_cache[rc.scope], eager_cache[rc.scope]
        with torch.no_grad(), GoldenMode(fallback=set()):
            golden = _floats(gold_mod(*_upcast(rc.args, ref.device, ref.dtype),
                                      **_upcast(rc.kwargs, ref.device, ref.dtype)))
        recorder = _OpRecorder()
        with torch.no_grad(), dut.context(), recorder:
            eager = _floats(eager_mod(*rc.args, **rc.kwargs))
        err_c, err_e = _error(rc.outputs, golden), _error(eager, golden)
        err_ce = _error(rc.outputs, eager)
        diverges, budget = _verdict(err_c, err_e, dut.dtype)
        entry = {"kind": "compiled_region", "scope": rc.scope, "name": type(orig).__name__,
                 "direction": "forward", "call": rc.call, "backend": backend_name(rc.wrapper),
                 "diverges": diverges,
                 "local": {"rel_l2_compiled": err_c, "rel_l2_eager": err_e,
                           "rel_l2_compiled_vs_eager": err_ce,
                           "ratio_to_eager": (err_c / err_e) if err_e > 0 else (0.0 if err_c == 0 else float("inf"))},
                 "budget": budget, "ops": recorder.ops}
        check.regions.append(entry)
        if diverges and check.culprit is None:
            check.culprit = len(check.regions) - 1
            check.golden = {f"output.{i}": g for i, g in enumerate(golden)}
            check.inputs = flatten_tensors((rc.args, rc.kwargs))
            if narrow:
                entry["narrowing"] = _narrow(rc, golden, err_e, dut)
                check.replays += len(entry["narrowing"]["backends"])
    if check.culprit is not None:
        c = check.regions[check.culprit]
        wrapper = dict(find_regions(model))[c["scope"]]
        check.confirmation = {"final_error_before": check.final["final"], "final_error_after_substitution": None}
        try:
            with replace_module_output(wrapper, "forward", c["call"], check.golden) as done:
                rerun = run_workload(wl, dut, model=model)
            check.dut_runs += 1
        except Exception as err:  # pragma: no cover - reported, not fatal
            check.notes.append(f"substitution into the compiled run failed: {type(err).__name__}: {err}")
            done = [False]
        if done[0]:
            rgrads = {n.replace("._orig_mod", "").removeprefix("_orig_mod."): p.grad
                      for n, p in rerun.model.named_parameters() if p.grad is not None}
            after = final_errors(rerun.output, rerun.loss, rgrads, ref_result.output, ref_result.loss, ref_grads)
            check.confirmation["final_error_after_substitution"] = after["final"]
            before = check.final["final"]
            if before > 0:
                check.confirmation["reduction"] = 1.0 - after["final"] / before
    return check


def region_first_seq(events: List[Any], scope: str) -> Optional[int]:
    """The seq of the first forward event of the eager capture inside ``scope``."""
    seqs = [e.seq for e in events if e.direction == "forward"
            and (scope == "" or e.scope == scope or e.scope.startswith(scope + "."))]
    return min(seqs) if seqs else None


def merge_into(result: Any, check: CompiledCheck, *, out: Any, events: List[Any],
               module_class_of: Callable[[str], Optional[str]],
               ref_tensor: Callable[[str], Optional[torch.Tensor]], run_cost: float,
               has_backward: bool) -> Any:
    """Fold the compiled check into an eager :class:`~precisiondiff.bisect.result.BisectResult`.

    ``out`` is the eager search's :class:`~precisiondiff.bisect.engine.EngineOutput`;
    ``ref_tensor`` the reference run's ``key -> tensor``; ``run_cost`` the forward-equivalents of
    one full run. The diverging region becomes the culprit (verdict ``kernel``) unless the eager
    search named a unit that runs earlier (forward before backward, then execution order)."""
    result.compiled = {"regions": check.regions,
                       "final_error": check.final["final"] if check.final else None,
                       "final_error_detail": check.final}
    result.cost["dut_runs"] = result.cost.get("dut_runs", 0) + check.dut_runs
    # each compiled run is a full run; the eager and golden replays of all region calls are at
    # most one forward each; each narrowing recompile runs its region once
    fe = run_cost * check.dut_runs + (2.0 if check.regions else 0.0) + check.replays
    result.cost["forward_equivalents"] = round(result.cost.get("forward_equivalents", 0.0) + fe, 2)
    result.cost["compiled_region_calls"] = len(check.regions)
    result.notes.extend(check.notes)
    if has_backward and check.regions:
        result.notes.append("compiled regions were checked forward only; their backward ran compiled "
                            "in the compiled run's final error, and eagerly in the search")
    if check.culprit is None:
        if check.regions:
            scopes = ", ".join(sorted({r["scope"] or "<root>" for r in check.regions}))
            result.notes.append(f"compiled regions ({scopes}) match eager: compiled error within "
                                f"max(floor, k x eager error) of the golden")
        if check.final and result.verdict == "parity" and check.final["final"] > parity_bound(_dtype(result.dut)):
            result.verdict = "accumulated"
            result.final_error = check.final["final"]
            result.notes.append("the compiled run's final error exceeds the parity bound, but no compiled "
                                "region diverges beyond eager and no unit is over budget")
        return result
    c = dict(check.regions[check.culprit])
    first = region_first_seq(events, c["scope"])
    ev = out.units[out.finding.culprit] if out.finding.culprit is not None else None
    eager_first = (ev is not None and ev.direction == "forward" and first is not None and ev.seq < first)
    narrowing = c.get("narrowing", {})
    culprit = {k: c[k] for k in ("kind", "scope", "name", "direction", "call", "local", "budget")}
    culprit.update(backend=c["backend"], ops=c["ops"])
    if narrowing.get("diagnosis"):
        culprit["diagnosis"] = narrowing["diagnosis"]
    culprit["message"] = (f"compiled ({c['backend']}) output rel-L2 {c['local']['rel_l2_compiled']:.3g} vs golden, "
                          f"eager {c['local']['rel_l2_eager']:.3g}: over max(floor {c['budget']['floor']:.3g}, "
                          f"{c['budget']['k']:g} x eager)")
    if eager_first:
        result.candidates.insert(0, culprit)
        result.notes.append(f"compiled region {c['scope'] or '<root>'} ({c['name']}) also diverges from eager; "
                            "the eager culprit runs before it")
        return result
    if result.culprit is not None:
        result.candidates.insert(0, result.culprit)
    result.verdict = "kernel"
    result.culprit = culprit
    result.final_error = max(result.final_error, check.final["final"] if check.final else 0.0)
    parts = c["scope"].split(".") if c["scope"] else []
    result.path = [{"kind": "module", "scope": ".".join(parts[:i]), "name": module_class_of(".".join(parts[:i])),
                    "local": {}} for i in range(len(parts))]
    result.confirmation = dict(check.confirmation, detail_before=check.final)
    result.evidence = _evidence(check, c, out, first, ref_tensor, _dtype(result.dut))
    return result


def _evidence(check: CompiledCheck, c: Dict[str, Any], out: Any, first: Optional[int],
              ref_tensor: Callable[[str], Optional[torch.Tensor]], dtype: torch.dtype) -> Dict[str, Any]:
    """Why the region's inputs can be trusted: eager units before it that passed isolation,
    region calls before it that matched eager, and its inputs against the reference run."""
    before = [u for u, d in out.details.items() if u in out.units and out.units[u].direction == "forward"
              and first is not None and out.units[u].seq < first]
    passed = [u for u in before if out.details[u].get("passed")]
    rows: List[Dict[str, Any]] = []
    for i, t in enumerate(check.inputs):
        if not t.is_floating_point():
            continue
        key = tensor_key(c["scope"], c["name"], c["call"], "forward", f"input.{i}")
        ref = ref_tensor(key)
        ok = ref is not None and tuple(ref.shape) == tuple(t.shape)
        rows.append({"slot": f"input.{i}", "key": key, "rel_l2": rel_l2(t, ref) if ok else None})
    bound = parity_bound(dtype)
    known = [r["rel_l2"] for r in rows if r["rel_l2"] is not None]
    return {"upstream_units": len(before) + check.culprit, "upstream_passed": len(passed) + check.culprit,
            "compiled_regions_before": check.culprit, "inputs": rows, "bound": bound,
            "inputs_fine": (all(x <= bound for x in known) if known else None)}


def _dtype(target: str) -> torch.dtype:
    return Target.parse(target).dtype
