"""Parity checks: run a workload (or one op) on a DUT and a reference and judge the difference.

This is the library behind the pytest ``parity`` fixture and :func:`precisiondiff.testing.assert_parity`.

Rules (the same final-output rule bisect uses for its ``parity`` verdict):

* **Workloads**: every floating output, the loss and the parameter gradients (all gradients as
  one vector) are judged by their relative L2 error ``||dut - ref||_2 / ||ref||_2`` (in float64)
  against ``rel_l2`` (default ``PARITY_FACTOR * u``, ``u`` the unit roundoff of the DUT dtype:
  bf16 ``8 * 2**-8 = 0.031``). ``max_ulp`` adds a per-element bound in ULPs of the DUT dtype,
  ``min_cosine`` a bound on cosine similarity. A NaN/Inf where the reference is finite fails.
* **Ops** (:func:`check_op`): the reference runs on the DUT's own inputs upcast to the reference
  dtype, so only the op's arithmetic is measured. Each floating output is judged by the
  comparators' budget for its dtype and op class (condition-aware for matmuls and sums, whose
  magnitude is the op applied to ``|inputs|``), or by ``max_ulp`` when given: the ULP distance
  in the DUT dtype between the DUT's result and the reference rounded to that dtype.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..comparators.tolerance import END_TO_END_FACTOR, end_to_end_bound

from ..errors import PrecisionDiffError
from ..runtime.targets import Target, default_dut, default_ref, dtype_name, move_inputs
from ..runtime.workload import Workload, load_workload, run_workload
from .results import ParityResult, TensorCheck, _fmt

__all__ = ["PARITY_FACTOR", "BUDGET_KEYS", "TensorCheck", "ParityResult", "check", "check_op",
           "as_workload"]

log = logging.getLogger(__name__)

PARITY_FACTOR = END_TO_END_FACTOR  # final relative L2 error allowed, in unit roundoffs (comparators)
BUDGET_KEYS = ("rel_l2", "max_ulp", "min_cosine")


# ---- measuring and judging: the comparators do both ------------------------------------------
def _metrics(actual: torch.Tensor, expected: torch.Tensor) -> Dict[str, Any]:
    """``compare_tensors`` as a plain dict; ``rel_l2`` is its ``diff2`` (relative L2 error)."""
    import dataclasses
    from ..comparators import compare_tensors
    m = compare_tensors(actual.detach(), expected.detach())
    raw = m.to_dict() if hasattr(m, "to_dict") else dataclasses.asdict(m)
    out = {k: v for k, v in raw.items() if isinstance(v, (int, float, str, bool)) or v is None}
    out["rel_l2"] = out.get("diff2")
    return out


def _budget(name: str, dtype: torch.dtype, max_ulp: Optional[float] = None) -> Any:
    from ..comparators import budget_for
    overrides = {"*": {"max_ulp": max_ulp}} if max_ulp is not None else None
    return budget_for(dtype, name, overrides=overrides)


def _budget_dict(budget: Any) -> Dict[str, Any]:
    return {"op_class": budget.op_class, "max_ulp": budget.max_ulp, "rounding_ulps": budget.rounding_ulps,
            "accum_factor": budget.accum_factor, "accum_dtype": budget.accum_dtype}


# ---- judging -------------------------------------------------------------------------------
def _bounds(dtype: torch.dtype, budgets: Dict[str, Any]) -> Dict[str, Any]:
    unknown = set(budgets) - set(BUDGET_KEYS)
    if unknown:
        raise PrecisionDiffError(f"unknown budget {', '.join(sorted(unknown))}: use "
                                 f"{', '.join(BUDGET_KEYS)}")
    bound = {k: float(v) for k, v in budgets.items() if v is not None}
    return bound


def _judge(key: str, actual: torch.Tensor, expected: torch.Tensor, bound: Dict[str, Any]) -> TensorCheck:
    """End-to-end judgement of one tensor: ``rel_l2``, and ``max_ulp``/``min_cosine`` if given.

    The per-element part (worst element, ULP error, the message) is the comparators' verdict.
    """
    m = _metrics(actual, expected)
    verdict = _budget("unknown", actual.dtype, bound.get("max_ulp", 1e300)).check(
        actual.detach(), expected.detach(), what=key)
    problems = []
    if m.get("nan_mismatch") or m.get("inf_mismatch"):
        problems.append(f"{m.get('nan_mismatch')} NaN and {m.get('inf_mismatch')} Inf mismatches")
    rel = m.get("rel_l2")
    if "rel_l2" in bound and rel is not None and not rel <= bound["rel_l2"]:
        problems.append(f"relative L2 error {_fmt(rel)} exceeds rel_l2 {_fmt(bound['rel_l2'])}")
    if "max_ulp" in bound and not verdict.passed:
        problems.append(f"{verdict.n_over} elements exceed max_ulp {_fmt(bound['max_ulp'])}")
    cos = m.get("cosine_similarity")
    if "min_cosine" in bound and cos is not None and not cos >= bound["min_cosine"]:
        problems.append(f"cosine similarity {cos:.6g} is below min_cosine {_fmt(bound['min_cosine'])}")
    if not problems:
        return TensorCheck(key, True, m, bound)
    worst = verdict.message.splitlines()[1] if len(verdict.message.splitlines()) > 1 else ""
    where = f"Worst at index {verdict.worst_index}" if verdict.worst_index is not None else "Worst"
    if "max_ulp" not in bound:  # the verdict judged nothing: only its worst element is shown
        worst = (f"{where}: actual {verdict.worst_actual!r}, golden {verdict.worst_golden!r}: abs err "
                 f"{verdict.worst_abs_err:.3g}, rel err {verdict.worst_rel_err:.3g}, "
                 f"{verdict.worst_ulp_error:.3g} ULP.")
    over = int((_ulp_errors(actual, expected) > 1).sum())
    n = m.get("numel", actual.numel())
    message = (f"{key}: {over} of {n} elements ({100.0 * over / max(n, 1):.3g}%) are more than 1 ULP of "
               f"{dtype_name(actual.dtype)} off; " + "; ".join(problems) + ".\n" + worst +
               "\nHint: run `precisiondiff bisect` on this workload to find the op whose own "
               "arithmetic is wrong (or the check's kernels=True), or widen the budget if this error "
               "is expected for the dtype.")
    return TensorCheck(key, False, m, bound, message)


def _ulp_errors(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    from ..comparators import ulp_error
    if actual.numel() == 0:
        return torch.zeros(0, dtype=torch.float64)
    err = ulp_error(actual.detach(), expected.detach().to(actual.device), actual.dtype).abs()
    return torch.nan_to_num(err, nan=0.0)


def _strided(value: torch.Tensor, key: str) -> torch.Tensor:
    """A sparse (or other non-strided) output as the dense tensor it stands for; refused in one
    line when it has none."""
    if value.layout == torch.strided:
        return value
    try:
        return value.to_dense()
    except Exception as err:  # nested or other layouts without a dense form
        raise PrecisionDiffError(f"{key}: a {value.layout} output has no dense form to compare "
                                 f"({type(err).__name__}); return a strided tensor") from None


def _flatten(value: Any, prefix: str) -> Iterator[Tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield prefix, _strided(value, prefix)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _flatten(v, f"{prefix}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _flatten(v, f"{prefix}.{i}")
    elif hasattr(value, "logits") and isinstance(value.logits, torch.Tensor):
        yield from _flatten(value.logits, f"{prefix}.logits")


def _keyed_outputs(value: Any) -> List[Tuple[str, torch.Tensor]]:
    pairs = list(_flatten(value, "output"))
    if len(pairs) == 1 and pairs[0][0] in ("output.0",):
        return [("output", pairs[0][1])]
    return pairs


def as_workload(workload: Any, inputs: Any = None, *, loss: Optional[Callable] = None, seed: int = 0) -> Workload:
    """A :class:`Workload` from a Workload, a factory, a spec string, ``(model, inputs)`` or a model.

    Raises:
        WorkloadError: the factory fails or returns the wrong thing.
    """
    if isinstance(workload, torch.nn.Module):
        if inputs is None:
            raise PrecisionDiffError("check(model, inputs): pass the model's inputs too")
        return Workload(workload, inputs, loss=loss, name=type(workload).__name__)
    if isinstance(workload, tuple) and len(workload) == 2 and not isinstance(workload, Workload):
        model, ins = workload
        return Workload(model, ins, loss=loss, name=type(model).__name__)
    built = load_workload(workload, seed=seed)
    if loss is not None:
        built.loss = loss
    return built


def _run(workload: Workload, target: Target) -> Dict[str, torch.Tensor]:
    run = run_workload(workload, target)
    tensors = dict(_keyed_outputs(run.output))
    if run.loss is not None:
        tensors["loss"] = run.loss.detach()
        grads = [p.grad.detach().flatten() for _, p in sorted(run.model.named_parameters())
                 if p.grad is not None]
        if grads:
            tensors["grad (all params)"] = torch.cat([g.to(torch.float64) for g in grads]).to(target.dtype
                                                                                              if not target.autocast else torch.float32)
    return {k: v.detach() for k, v in tensors.items()}


def _capture_pair(workload: Workload, dut: Target, ref: Target, out: str) -> Dict[str, str]:
    """Rerun both targets under capture into ``out/dut`` and ``out/ref`` (tensors mode)."""
    from ..capture import capture
    dirs = {}
    for side, target in (("dut", dut), ("ref", ref)):
        path = os.path.join(out, side)
        model = target.prepare_model(workload.model)
        model.train(workload.train)
        with capture(path, model=model, mode="tensors", overwrite=True,
                     meta={"target": str(target), "workload": workload.name}):
            run_workload(workload, target, model=model)
        dirs[side] = path
    return dirs


def _kernel_check(bisect: Dict[str, Any], direction: Optional[str]) -> TensorCheck:
    """The ``kernels`` row: fails on a ``kernel`` verdict, with the culprit's local error."""
    culprit = bisect.get("culprit") or {}
    key = f"kernels ({direction})" if direction else "kernels"
    if bisect.get("verdict") != "kernel":
        return TensorCheck(key, True, {}, {"verdict": "no op over its own budget"})
    local = {k: v for k, v in (culprit.get("local") or {}).items() if isinstance(v, (int, float))}
    peer = culprit.get("peer") or {}
    if peer:  # the verdict is the peer rule's; the ULP figures are reported beside it
        local["rel_l2"] = peer.get("error")
        slack = peer.get("factor"), peer.get("peer_max_error")
        budget = {"rel_l2": peer.get("bound"), "rule": "peer"}
        if all(isinstance(v, (int, float)) for v in slack):  # the max rule, in per-element units
            budget["worst_elem"] = slack[0] * slack[1] + 1
    else:
        budget = {k: v for k, v in (culprit.get("budget") or {}).items() if k in ("op_class", "max_ulp")}
    message = culprit.get("message") or (
        f"Op {culprit.get('name')!r} in scope {culprit.get('scope')!r} ({culprit.get('direction')}) exceeds "
        f"its own budget on the DUT's inputs: max ULP {_fmt(local.get('max_ulp'))}, max rel "
        f"{_fmt(local.get('max_rel'))} (allowed: {_fmt(budget.get('max_ulp'))} ULP).")
    if "Hint:" not in message:
        message += ("\nHint: `precisiondiff bisect WORKLOAD --format json` shows the evidence; check "
                    "the kernel's accumulation precision for this dtype.")
    return TensorCheck(key, False, local, budget, message)


def _run_bisect(workload: Workload, dut: Target, ref: Target, direction: Optional[str] = None,
                accept: Optional[List[str]] = None,
                repro: Optional[str] = None) -> Tuple[Optional[Dict[str, Any]], str]:
    try:
        from ..bisect import bisect as run_bisect  # type: ignore[attr-defined]
    except ImportError:
        return None, "bisect is not available in this build"
    try:
        result = run_bisect(workload, target=str(dut), ref=str(ref), direction=direction, accept=accept,
                            repro=repro)
    except PrecisionDiffError as err:
        return None, f"bisect could not run: {err}"
    data = result.to_json() if hasattr(result, "to_json") else result
    if isinstance(data, str):
        data = json.loads(data)
    return data, ""


def check(workload: Any, inputs: Any = None, *, target: "str | Target | None" = None,
          ref: "str | Target | None" = None, loss: Optional[Callable] = None, seed: int = 0,
          bisect: bool = True, kernels: bool = False, direction: Optional[str] = None,
          dump_dir: Optional[str] = None, accept: Optional[List[str]] = None, **budgets: Any) -> ParityResult:
    """Run a workload on the DUT and the reference; judge outputs, loss and gradients.

    Args:
        workload: a :class:`Workload`, a factory returning one (or ``(model, inputs)``), a spec
            string ``file.py:fn``, a ``(model, inputs)`` tuple, or a model (then pass ``inputs``).
        inputs: the model's inputs when ``workload`` is a model.
        target: the DUT (default: first available of mlu, cuda, cpu in bf16).
        ref: the reference (default ``cpu/float64``).
        loss: a loss on the output, enabling the backward pass (overrides the workload's).
        seed: the seed applied before a factory runs.
        bisect: on failure, bisect to the culprit op (when bisect is available).
        kernels: also require every op to be within its own budget: bisect always runs and a
            ``kernel`` verdict fails the check even when the final output is within budget
            (a small model can hide a kernel bug that a large one amplifies).
        direction: with ``kernels``, search ``"forward"`` or ``"backward"`` units only.
        dump_dir: on failure, keep dumps of both runs under this directory, and the bisect
            culprit's standalone repro in ``dump_dir/repro`` (docs/bisect.md, "Repro").
        accept: findings accepted in the bisect, ``["OP[@SCOPE]", ...]`` (:func:`precisiondiff.bisect.bisect`).
        **budgets: ``rel_l2`` (default ``PARITY_FACTOR * u``), ``max_ulp``, ``min_cosine``.

    Returns:
        The :class:`ParityResult` (falsy on failure); it never raises for a divergence.

    Raises:
        PrecisionDiffError: bad targets, budgets or workloads; an unavailable device.

    Example:
        >>> result = check("examples/tiny_transformer.py:build", target="cpu/bf16")
        >>> result.passed
        True
    """
    dut = Target.parse(target) if target is not None else default_dut()
    golden = Target.parse(ref) if ref is not None else default_ref()
    dut.check_available()
    golden.check_available()
    built = as_workload(workload, inputs, loss=loss, seed=seed)
    bound = _bounds(dut.dtype, budgets)
    bound.setdefault("rel_l2", end_to_end_bound(dut.dtype))
    actual, expected = _run(built, dut), _run(built, golden)
    result = ParityResult(built.name, str(dut), str(golden))
    for key, tensor in actual.items():
        if key in expected:
            result.checks.append(_judge(key, tensor, expected[key], bound))
    repro = os.path.join(dump_dir, "repro") if dump_dir is not None else None
    if kernels:
        result.bisect, result.bisect_error = _run_bisect(built, dut, golden, direction=direction, accept=accept,
                                                         repro=repro)
        if result.bisect is None:
            raise PrecisionDiffError(f"kernels=True needs bisect: {result.bisect_error}")
        result.checks.append(_kernel_check(result.bisect, direction))
    elif not result.passed:
        if bisect:
            result.bisect, result.bisect_error = _run_bisect(built, dut, golden, accept=accept, repro=repro)
        else:
            result.bisect_error = "bisect disabled (--no-parity-bisect)"
        if dump_dir is not None:
            result.dumps = _capture_pair(built, dut, golden, dump_dir)
    if repro is not None and ((result.bisect or {}).get("culprit") or {}).get("repro"):
        result.dumps["repro"] = repro
    return result


# ---- one op --------------------------------------------------------------------------------
def _op_name(fn: Any) -> str:
    if hasattr(fn, "_schema") or hasattr(fn, "overloadpacket"):
        return str(fn)
    module = getattr(fn, "__module__", None) or ""
    base = getattr(fn, "__name__", type(fn).__name__)
    if module.startswith("torch") or module == "":  # torch.exp, F.gelu: the ATen base name
        return base
    return f"{module}.{base}"


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _abs_inputs(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.abs() if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_abs_inputs(v) for v in value)
    if isinstance(value, dict):
        return {k: _abs_inputs(v) for k, v in value.items()}
    if isinstance(value, float):
        return abs(value)
    return value


def check_op(fn: Callable[..., Any], *inputs: Any, target: "str | Target | None" = None,
             ref: "str | Target | None" = None, name: Optional[str] = None,
             kwargs: Optional[Dict[str, Any]] = None, dump_dir: Optional[str] = None,
             peer: "str | Target | None" = None, rule: str = "peer", **budgets: Any) -> ParityResult:
    """Run one function or op on the DUT and on the reference (the DUT's inputs, upcast).

    With no budget given, each floating output is judged by the peer rule, as bisect judges a
    kernel (docs/comparators.md, "The peer rule"): its error against the reference compared
    with that of correct implementations in the DUT dtype on the same inputs (float32 compute
    rounded once; PyTorch's ``torch._decomp`` semantics in the DUT dtype), with K and the
    magnitude from the schema of the op ``fn`` dispatches. With ``max_ulp`` alone, the
    comparators' ULP budget (condition-aware for matmuls and sums) judges instead.

    Args:
        fn: an ATen overload (``torch.ops.aten.gelu.default``), a torch function or any callable.
        *inputs: its positional arguments; floating tensors are cast to the DUT dtype first.
        target, ref: as in :func:`check`.
        name: the op name used to pick its budget class (default: derived from ``fn``).
        kwargs: keyword arguments for ``fn``.
        dump_dir: when the peer rule fails an ATen overload ``fn``, write its standalone repro
            into ``dump_dir/repro`` (docs/bisect.md, "Repro").
        peer: ``DEVICE[/DTYPE]``, a real second implementation in the DUT dtype: where the
            peers are computed, ``fn`` also runs there on the DUT's inputs and its error joins
            theirs (docs/bisect.md, "A real peer").
        rule: ``"peer"`` (default) or ``"mlu-ops"``: Cambricon mlu-ops' acceptance rule, its
            baseline ``peer`` or, without one, the emulated peers (docs/comparators.md, "The mlu-ops
            rule"); each check's ``bound["rule"]`` says which decided.
        **budgets: ``max_ulp`` (per element, ULPs of the DUT dtype), ``rel_l2``, ``min_cosine``;
            with none, the peer rule judges. A function of several ops that fails it as a whole is
            then judged op by op as bisect judges it: a wrong op is named (``bound["culprit"]``);
            with every op correct and the same ops on the reference, the whole passes when rounding
            each op's outputs as the DUT did explains its error (``bound["rule"] == "composite"``).

    Returns:
        The :class:`ParityResult`, one check per floating output.

    Example:
        >>> check_op(torch.ops.aten.gelu.default, torch.randn(8), target="cpu/bf16").passed
        True
    """
    from ..comparators import op_class
    from ..comparators.accumulation import LastOp, magnitude_op, rounds_partial_sums
    from ..comparators.peers import compute_dtype, judge_against_peers
    from ..comparators.mlu_ops import RULES
    if rule not in RULES:
        raise ValueError(f"check_op: unknown rule {rule!r}; use one of {', '.join(RULES)}")
    dut = Target.parse(target) if target is not None else default_dut()
    golden = Target.parse(ref) if ref is not None else default_ref()
    dut.check_available()
    golden.check_available()
    kwargs = dict(kwargs or {})
    name = name or _op_name(fn)
    real_peer = None
    if peer is not None:
        from ..bisect.live import peer_of
        real_peer = peer_of(peer, dut)
    bound = _bounds(dut.dtype, budgets)
    dut_in = dut.prepare_inputs((inputs, kwargs))
    ref_in = move_inputs(dut_in, golden.device, golden.dtype)
    with torch.no_grad():
        with dut.context(), LastOp() as dut_op:
            actual = fn(*dut_in[0], **dut_in[1])
        with LastOp() as last:
            expected = fn(*ref_in[0], **ref_in[1])
        op = last.op if last.op is not None else name
        magnitude = None
        if magnitude_op(op) or (op_class(name) in ("matmul", "reduction") and bound):
            abs_in = _abs_inputs(ref_in)
            magnitude = fn(*abs_in[0], **abs_in[1])
    result = ParityResult(name, str(dut), str(golden), kind="op")
    mags = dict(_keyed_outputs(magnitude)) if magnitude is not None else {}
    expected_by_key = dict(_keyed_outputs(expected))
    outs = _keyed_outputs(actual)
    in_dtypes = [t.dtype for t in _tensors(dut_in) if t.is_floating_point()]
    peers: Optional[Dict[str, List[Optional[torch.Tensor]]]] = None
    peers_box: List[Any] = []  # the mlu-ops rule's peers, computed once when first needed
    failed: Dict[int, Any] = {}  # output index -> (peer verdict, magnitude, k, compute dtype)
    for index, (key, out) in enumerate(outs):
        exp = expected_by_key[key]
        if bound and set(bound) != {"max_ulp"}:
            result.checks.append(_judge(key, out, exp, bound))
            continue
        k = last.ks[index] if index < len(last.ks) else None
        mag = mags.get(key) if k is not None else None
        if bound:  # max_ulp: the user's ULP budget
            budget = _budget(name, out.dtype, bound.get("max_ulp"))
            verdict = budget.check(out.detach(), exp.detach(), magnitude=mag, k=k if mag is not None else None,
                                   what=key)
            shown = {"max_ulp": budget.max_ulp} if mag is None else {
                "rounding_ulps": budget.rounding_ulps, "accum_factor": budget.accum_factor, "k": k}
            result.checks.append(TensorCheck(key, verdict.passed, _metrics(out, exp),
                                             {**shown, "op_class": budget.op_class},
                                             "" if verdict.passed else verdict.message))
            continue
        cdt = compute_dtype(out.dtype, in_dtypes)
        if rule == "mlu-ops":
            rule_op = str(last.op) if last.count == 1 and last.op is not None else name
            result.checks.append(_check_mlu_ops(key, out, exp, index, rule_op, fn, dut_in, golden, outs, dut_op, real_peer,
                                                peers_box))
            continue
        scatter = rounds_partial_sums(op)
        pv = judge_against_peers(out.detach(), exp.detach(), {}, magnitude=mag, k=k, dtype=cdt, what=key,
                                 partial_sums=scatter)
        if not pv.passed:
            if peers is None:
                peers = _op_peers(fn, dut_in, golden, [o.dtype for _, o in outs], dut_op, real_peer)
            pv = judge_against_peers(out.detach(), exp.detach(),
                                     {n: (p[index] if index < len(p) else None) for n, p in peers.items()},
                                     magnitude=mag, k=k, dtype=cdt, what=key, partial_sums=scatter)
        shown = {"rule": "peer", "factor": pv.factor, "bound_rel_l2": pv.bound, "peer_rel_l2": pv.peer_error,
                 "max_error": pv.max_error, "peer_max_error": pv.peer_max_error, "stats": pv.stats}
        if pv.notes:
            shown["notes"] = list(pv.notes)
        if k is not None:
            shown["k"] = k
        result.checks.append(TensorCheck(key, pv.passed, _metrics(out, exp), shown, pv.message))
        if not pv.passed:
            failed[index] = (pv, mag, k, cdt)
    if failed and dump_dir is not None and isinstance(fn, torch._ops.OpOverload):
        result.dumps["repro"] = _write_op_repro(fn, dut_in, outs, expected_by_key, failed, dut, golden,
                                                os.path.join(dump_dir, "repro"))
    if failed and dut_op.count > 1 and not isinstance(fn, torch._ops.OpOverload):
        _judge_composite(result, fn, inputs, kwargs, dut, golden, peer, dut_in, ref_in, dict(outs), expected_by_key,
                         dump_dir)
    return result


class _Composite(torch.nn.Module):
    """A function of several ops as a module, so that bisect can judge each op it runs."""

    def __init__(self, fn: Callable[..., Any], kwargs: Dict[str, Any]):
        super().__init__()
        self.fn, self.fn_kwargs = fn, kwargs

    def forward(self, *xs: Any) -> Any:  # noqa: D102
        return self.fn(*xs, **self.fn_kwargs)


class _OpSequence(TorchDispatchMode):
    """Records the ops a function runs and their floating outputs' dtypes; given the DUT's record,
    rounds each op's floating outputs to the dtypes the DUT's op gave instead (the emulation of a
    correct DUT: every op correct, rounded as the DUT's was), while the two runs run the same ops."""

    def __init__(self, dut_ops: Optional[List[Tuple[str, List[torch.dtype]]]] = None):
        super().__init__()
        self.ops: List[Tuple[str, List[torch.dtype]]] = []
        self.dut_ops = dut_ops
        self.same = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        out = func(*args, **(kwargs or {}))
        floats = [t.dtype for t in torch.utils._pytree.tree_leaves(out)
                  if isinstance(t, torch.Tensor) and t.is_floating_point()]
        index = len(self.ops)
        self.ops.append((str(func), floats))
        if self.dut_ops is None or not self.same:
            return out
        if index >= len(self.dut_ops) or self.dut_ops[index][0] != str(func) or len(self.dut_ops[index][1]) != len(floats):
            self.same = False
            return out
        want = iter(self.dut_ops[index][1])
        return torch.utils._pytree.tree_map(
            lambda t: t.to(next(want)).to(t.dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, out)


def _judge_composite(result: ParityResult, fn: Callable[..., Any], inputs: Any, kwargs: Dict[str, Any], dut: Target,
                     golden: Target, peer: Any, dut_in: Any, ref_in: Any, outs: Dict[str, torch.Tensor],
                     expected: Dict[str, torch.Tensor], dump_dir: Optional[str]) -> None:
    """A function of several ops that fails the peer rule as a whole. When the reference runs the
    same ops, the whole passes if rounding every op's outputs as the DUT did explains its error
    (bisect's module rule, ``MODULE_OVER``): a function of correctly rounded stock ops. If it does
    not, each op is judged as bisect does (a forward bisect of the function, on the DUT's own inputs
    to each op) and a wrong one is named. A function whose low-precision path runs other ops (a
    dtype branch: a kernel written in Python) keeps the peer rule's verdict on the whole."""
    from ..bisect import bisect as run_bisect
    from ..bisect.judge import MODULE_OVER, judge_module
    with torch.no_grad():
        with dut.context(), _OpSequence() as recorded:
            fn(*dut_in[0], **dut_in[1])
        with _OpSequence(recorded.ops) as emulation:
            emulated = dict(_keyed_outputs(fn(*ref_in[0], **ref_in[1])))
    if not emulation.same or len(emulation.ops) != len(recorded.ops):
        return
    unexplained = []
    for check in result.checks:
        if check.passed or check.key not in emulated:
            continue
        mod = judge_module([(outs[check.key], expected[check.key], emulated[check.key])], outs[check.key].dtype)
        check.bound["composite"] = {"ops": len(recorded.ops), **mod.local, "over_factor": MODULE_OVER}
        if mod.over:
            unexplained.append(check)
        else:
            check.passed, check.message = True, ""
            check.bound["rule"] = "composite"
    if not unexplained:
        return
    repro = os.path.join(dump_dir, "repro") if dump_dir is not None else None
    try:
        found = run_bisect(Workload(_Composite(fn, kwargs), tuple(inputs), name=result.name), target=str(dut),
                           ref=str(golden), direction="forward", peer=peer, repro=repro)
    except PrecisionDiffError as err:  # the function cannot be bisected: the whole's verdict stands
        log.info("check_op: %s not bisected: %s", result.name, err)
        return
    culprit = found.culprit if found.verdict == "kernel" and (found.culprit or {}).get("kind") == "op" else None
    if culprit is None:
        return
    first = (culprit.get("message") or "").splitlines()[0] if culprit.get("message") else ""
    for check in unexplained:
        check.bound["culprit"] = {k: culprit.get(k) for k in ("name", "scope", "call", "peer") if k in culprit}
        check.message = (f"{check.key}: {result.name} runs op {culprit['name']} (call {culprit.get('call')}), "
                         f"whose own arithmetic is wrong: {first}\n{check.message}")
    if culprit.get("repro"):
        result.dumps["repro"] = culprit["repro"]["dir"]


def _check_mlu_ops(key: str, out: torch.Tensor, exp: torch.Tensor, index: int, op: str, fn: Callable[..., Any],
                   dut_in: Any, golden: Target, outs: List[Tuple[str, torch.Tensor]], dut_op: Any,
                   real_peer: Optional[Tuple[Optional[str], str]], peers_box: List[Any]) -> TensorCheck:
    """One output of ``check_op(..., rule="mlu-ops")``: the static thresholds first, then the
    dynamic one against the baseline (the real peer, or the emulated peers)."""
    from ..comparators.mlu_ops import judge_mlu_ops
    real = real_peer[1] if real_peer is not None and real_peer[0] is not None else None
    verdict = judge_mlu_ops(out, exp, {}, op=op, real_peer=real, what=key)
    if not verdict.passed:
        if not peers_box:
            peers_box.append(_op_peers(fn, dut_in, golden, [o.dtype for _, o in outs], dut_op, real_peer))
        found = {n: (p[index] if index < len(p) else None) for n, p in peers_box[0].items()}
        verdict = judge_mlu_ops(out, exp, found, op=op, real_peer=real, what=key)
    shown = verdict.as_dict()
    return TensorCheck(key, verdict.passed, _metrics(out, exp), shown, verdict.message)


def _write_op_repro(fn: Any, dut_in: Any, outs: List[Tuple[str, torch.Tensor]], expected: Dict[str, torch.Tensor],
                    failed: Dict[int, Any], dut: Target, golden: Target, out_dir: str) -> str:
    """The repro of a failing ``check_op`` (precisiondiff.bisect.repro)."""
    from ..bisect.repro import case_from_call, write_repro
    verdicts = {i: pv.as_dict() for i, (pv, _, _, _) in failed.items()}
    n = len(outs)
    mags = [failed[i][1] if i in failed else None for i in range(n)]
    ks = [failed[i][2] if i in failed else None for i in range(n)]
    dtype = next(iter(failed.values()))[3]
    case = case_from_call(fn, dut_in[0], dut_in[1], [t for _, t in outs], [expected[k] for k, _ in outs], verdicts,
                          mags, ks, target=str(dut), ref=str(golden), dtype=dtype)
    write_repro(case, out_dir)
    return out_dir


def _op_peers(fn: Callable[..., Any], dut_in: Any, golden: Target, out_dtypes: List[torch.dtype],
              dut_op: Any, real_peer: Optional[Tuple[Optional[str], str]] = None) -> Dict[str, List[Optional[torch.Tensor]]]:
    """The emulated peers of ``fn`` on the DUT's inputs: per peer, its outputs in the order of
    :func:`_keyed_outputs` (None where it could not run). The decomposition peer only when
    ``fn`` dispatched one op (``dut_op``, a :class:`LastOp`): Python code around it would run
    in the DUT dtype, its dtype-dependent branches included."""
    from ..comparators.peers import decomposition_peer, float32_peer, peer_dtype
    floating = [d for d in out_dtypes if d.is_floating_point]
    wide = max(floating, key=lambda d: torch.finfo(d).bits, default=torch.float32)
    up = move_inputs(dut_in, golden.device, peer_dtype(wide))
    same = move_inputs(dut_in, golden.device, None)
    found: Dict[str, List[Optional[torch.Tensor]]] = {}
    single = None
    if dut_op.count == 1 and dut_op.op is not None:
        op_in = move_inputs((list(dut_op.args), dict(dut_op.kwargs)), golden.device, None)
        single = decomposition_peer(dut_op.op, op_in[0], op_in[1], out_dtypes)
    for label, outs in (("float32", float32_peer(fn, up[0], up[1], out_dtypes)), ("decomposition", single)):
        if outs is not None:
            found[label] = outs
    if real_peer is not None and real_peer[0] is not None:  # the same inputs, on the peer's device
        on = move_inputs(dut_in, real_peer[0], None)
        with torch.no_grad():
            found[real_peer[1]] = [t.cpu() for _, t in _keyed_outputs(fn(*on[0], **on[1]))]
    return found
