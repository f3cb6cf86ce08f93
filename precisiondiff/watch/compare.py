"""Two watch logs side by side: per step, the relative error of the loss and of every statistic,
and the first step, layer and tensor at which the runs part by more than rounding explains.

Errors (A is the run under test, B the reference), per step:

- a module tensor's error is the largest of ``|norm_a − norm_b| / norm_b``,
  ``|amax_a − amax_b| / amax_b`` (``amax = max(|min|, |max|)``) and
  ``|mean_a − mean_b| / abs_mean_b``; 0 when the fingerprints are equal (bitwise equal
  tensors); infinite when the NaN or Inf counts differ;
- a parameter's error per quantity (weight, grad, state): ``|a − b| / |b|``; its update/weight
  ratio's: ``|ratio_a − ratio_b|`` (already relative to ‖w‖; low-precision weights quantize an
  update to their own rounding, about eps·‖w‖);
- the loss: ``|loss_a − loss_b| / |loss_b|``.

Thresholds, without a noise run (the defaults, :data:`DEFAULTS`):

- the loss: 1% (msprobe's training-debug guide: loss "misaligned" above 1% relative error);
- a module's forward output at depth l of L watched layers: ``k·C^l·eps``; its output
  gradient: ``k·C^(L+1−l)·eps``; parameters: ``k·C^(L+1)·eps`` (Megatron/TTrace's
  depth-aware gradient bound, k = 4, C = 1.03, eps = ``finfo(dtype).eps`` of the lower
  precision of the two runs);
- a parameter's quantity (its gradient, weight, update ratio, each optimizer state) is judged
  at the eps of the dtype its tensor is held in (the log's ``param_dtypes``: float32 moments and
  master weights of bf16 parameters at float32's) while what it is computed from agrees bitwise
  in both runs: for a gradient, every module tensor of the step; for the others, the
  parameter's gradient at every compared step so far. Once that differs, the quantity inherits
  its inputs' rounding and is judged as before, at the eps of the lower precision of the two
  runs' parameter dtypes (or its own, if coarser). Logs without ``param_dtypes`` are judged
  that way throughout;
- a spike: a loss or gradient norm that grows more than 10x from one watched step to the next
  in one run but not in the other (Megatron's spike factor).

With a noise run C (the reference's run again with another seed or data order, or a second
correct implementation), each quantity's band at step s is the largest error of C against B at
steps up to s (rounding differences never un-happen), and the threshold is
``max(10 · band, 8·u)`` (the mlu-ops dynamic rule "10x the baseline's error"; u the unit
roundoff of the lower precision). A quantity diverges at the first step its error exceeds its
threshold; the first such step, and in it the first tensor in execution order (forward outputs,
the loss, output gradients in backward order, parameters), is the first divergence.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..comparators.ulp import float_format
from ..errors import PrecisionDiffError
from .layouts import global_log
from .log import FIELDS, WatchLog, read_logs

__all__ = ["DEFAULTS", "StepJudge", "WatchComparison", "compare_logs", "tensor_error"]

DEFAULTS = {
    "loss_rel": 0.01,        # msprobe train_debug_guide: loss misaligned above 1% relative error
    "depth_k": 4.0,          # Megatron test_optimizer_grads_match.py (TTrace): k * C^(L+1-l) * eps
    "depth_c": 1.03,
    "spike_factor": 10.0,    # Megatron's spike factor: a 10x jump from one step to the next
    "noise_margin": 10.0,    # mlu-ops dynamic rule: within 10x the baseline's (noise run's) error
    "noise_floor_u": 8.0,    # with a noise run, never below 8 unit roundoffs (compare's rel-l2 default)
}
_I = {name: i for i, name in enumerate(FIELDS)}
_TINY = 1e-30


def _rel(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None:
        return None
    if isinstance(a, str) or isinstance(b, str):
        a, b = float(a), float(b)
    if math.isnan(a) and math.isnan(b):
        return 0.0
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), _TINY)


def tensor_error(a: List[Any], b: List[Any]) -> float:
    """The relative error of one tensor's statistics ``a`` against ``b`` (lists in FIELDS order)."""
    if a[_I["fingerprint"]] == b[_I["fingerprint"]]:
        return 0.0
    if a[_I["nan"]] != b[_I["nan"]] or a[_I["inf"]] != b[_I["inf"]]:
        return math.inf
    def amax(v):
        lo, hi = v[_I["min"]], v[_I["max"]]
        return None if lo is None else max(abs(lo), abs(hi))
    errors = [_rel(a[_I["norm"]], b[_I["norm"]]), _rel(amax(a), amax(b))]
    ma, mb, scale = a[_I["mean"]], b[_I["mean"]], b[_I["abs_mean"]]
    if ma is not None and mb is not None and scale is not None:
        errors.append(0.0 if ma == mb else abs(ma - mb) / max(abs(scale), _TINY))
    errors = [e for e in errors if e is not None and not math.isnan(e)]
    return max(errors) if errors else 0.0


def _eps(*dtypes: Optional[str]) -> float:
    """finfo(dtype).eps of the lowest precision among ``dtypes`` (float32 when none is known)."""
    best = None
    for name in dtypes:
        dt = getattr(torch, name, None) if name else None
        if isinstance(dt, torch.dtype) and dt.is_floating_point:
            eps = 2 * float_format(dt).unit_roundoff
            best = eps if best is None else max(best, eps)
    return best if best is not None else 2.0 ** -23


@dataclass
class _Quantity:
    """One compared quantity: where it is in execution order and its per-step errors."""

    key: str
    scope: str
    tensor: str
    order: int
    depth: Optional[int]
    static: float
    eps: float = 0.0
    # a parameter's quantity judged at its own dtype's eps while its inputs agree (module
    # docstring): that threshold and eps; ``static``/``eps`` are then the inherited (coarse) ones
    fine: Optional[float] = None
    fine_eps: Optional[float] = None
    errors: Dict[int, float] = field(default_factory=dict)
    band: Dict[int, float] = field(default_factory=dict)


@dataclass
class WatchComparison:
    """The comparison of two watch logs; :meth:`to_dict` is the JSON report (docs/watch.md)."""

    a: str
    b: str
    noise: Optional[str]
    data: Dict[str, Any]

    @property
    def first_divergence(self) -> Optional[Dict[str, Any]]:
        return self.data["first_divergence"]

    @property
    def exit_code(self) -> int:
        return 1 if self.first_divergence is not None else 0

    def to_dict(self) -> Dict[str, Any]:
        return {"kind": "watch", "a": self.a, "b": self.b, "noise": self.noise, **self.data}


def _split(key: str) -> Tuple[str, str]:
    scope, _, tensor = key.rpartition(":")
    return scope, tensor


def _quantities(la: WatchLog, lb: WatchLog, steps: List[int]) -> List[_Quantity]:
    """Every quantity both logs hold, in execution order, with its static threshold."""
    a0 = la.by_step()[steps[0]]
    dtypes_a, held_a = la.held_dtypes()
    dtypes_b, held_b = lb.held_dtypes()
    keys_b = set(lb.by_step()[steps[0]]["tensors"])
    forward = [k for k in a0["tensors"] if k in keys_b and not _split(k)[1].startswith("grad_")]
    backward = [k for k in a0["tensors"] if k in keys_b and _split(k)[1].startswith("grad_")]
    depth_of: Dict[str, int] = {}
    for k in forward:
        depth_of.setdefault(_split(k)[0].split("#")[0], len(depth_of) + 1)
    layers = max(len(depth_of), 1)
    k_, c_ = DEFAULTS["depth_k"], DEFAULTS["depth_c"]
    param_dtypes = la.header.get("model", {}).get("param_dtypes", []) + lb.header.get("model", {}).get("param_dtypes", [])
    out: List[_Quantity] = []
    for k in forward:
        scope, tensor = _split(k)
        l = depth_of[scope.split("#")[0]]
        eps = _eps(dtypes_a.get(k), dtypes_b.get(k))
        out.append(_Quantity(k, scope, tensor, len(out), l, k_ * c_ ** l * eps, eps))
    out.append(_Quantity("loss", "", "loss", len(out), None, DEFAULTS["loss_rel"]))
    for k in backward:
        scope, tensor = _split(k)
        l = depth_of.get(scope.split("#")[0], 1)
        eps = _eps(dtypes_a.get(k), dtypes_b.get(k))
        out.append(_Quantity(k, scope, tensor, len(out), l, k_ * c_ ** (layers + 1 - l) * eps, eps))
    pb = lb.by_step()[steps[0]]["params"]
    inherited = _eps(*param_dtypes)  # the lowest precision of the runs' parameters (the rule of old logs)
    bound = k_ * c_ ** (layers + 1)
    for name, values in a0["params"].items():
        for what in values:
            if what in pb.get(name, {}):
                own_a, own_b = held_a.get(name, {}).get(what), held_b.get(name, {}).get(what)
                q = _Quantity(f"{name}:{what}", name, what, len(out), None, bound * inherited, inherited)
                if own_a is not None and own_b is not None:
                    own = _eps(own_a, own_b)
                    q.eps = max(own, inherited)
                    q.static = bound * q.eps
                    q.fine, q.fine_eps = bound * own, own
                out.append(q)
    return out


def _value_errors(q: _Quantity, ra: Dict[str, Any], rb: Dict[str, Any]) -> Optional[float]:
    if q.key == "loss":
        return _rel(ra.get("loss"), rb.get("loss"))
    if q.key in ra["tensors"] and q.key in rb["tensors"]:
        return tensor_error(ra["tensors"][q.key], rb["tensors"][q.key])
    va, vb = ra["params"].get(q.scope, {}).get(q.tensor), rb["params"].get(q.scope, {}).get(q.tensor)
    if q.tensor == "update_ratio" and va is not None and vb is not None:
        # already relative to the weight's norm, and low-precision weights quantize the update to
        # their own rounding (eps·‖w‖): an absolute difference, judged against eps
        return 0.0 if va == vb else (abs(va - vb) if math.isfinite(va) and math.isfinite(vb) else math.inf)
    return _rel(va, vb)


def _scalar(q: _Quantity, r: Dict[str, Any]) -> Optional[float]:
    """The quantity's own value in one run (for spikes): the loss, a norm, a gradient norm."""
    if q.key == "loss":
        return r.get("loss")
    if q.tensor == "grad":
        return r["params"].get(q.scope, {}).get("grad")
    return None


def _spiked(prev: Optional[float], cur: Optional[float]) -> bool:
    if prev is None or cur is None or not math.isfinite(prev):
        return False
    return not math.isfinite(cur) or abs(cur) > DEFAULTS["spike_factor"] * max(abs(prev), _TINY)


class StepJudge:
    """Judges two runs one step at a time by the rules above (errors, thresholds, spikes).

    Shared by :func:`compare_logs` (over two finished logs) and ``watch --ref`` (each step of the
    running job against the reference's same step, as it completes).

    Args:
        quantities: what is compared (:func:`_quantities`), in execution order.
        noise: whether a noise run gives the band (else the static thresholds apply).
        keep: keep every step's error and band per quantity (the report's heat map); a running
            job keeps only the band's running maximum.
    """

    def __init__(self, quantities: List[_Quantity], *, noise: bool, keep: bool = True) -> None:
        self.quantities, self.noise, self.keep = quantities, noise, keep
        self.floor = DEFAULTS["noise_floor_u"] * max((q.eps for q in quantities), default=2.0 ** -23) / 2
        self._band: Dict[str, float] = {}
        self._prev_a: Dict[str, Optional[float]] = {}
        self._prev_b: Dict[str, Optional[float]] = {}
        self._grad_differed: set = set()  # parameters whose gradients differed at a judged step
        self._fine: set = set()  # the quantities judged at their own dtype at the last judged step

    def threshold(self, q: _Quantity) -> float:
        """The quantity's threshold at the last judged step."""
        fine = q.key in self._fine
        if self.noise:
            floor = DEFAULTS["noise_floor_u"] * q.fine_eps / 2 if fine else self.floor
            return max(DEFAULTS["noise_margin"] * self._band.get(q.key, 0.0), floor)
        return q.fine if fine else q.static

    def _inputs_agree(self, errors: List[Tuple[_Quantity, Optional[float]]]) -> set:
        """The keys of the parameter quantities whose inputs are bitwise equal in both runs at this
        step (module docstring), from the step's errors; updates the parameters' gradient history."""
        modules_equal = all(err == 0.0 for q, err in errors if err is not None and (q.depth is not None or q.key == "loss"))
        before = set(self._grad_differed)
        for q, err in errors:
            if q.tensor == "grad" and q.depth is None and err is not None and err != 0.0:
                self._grad_differed.add(q.scope)
        return {q.key for q, _ in errors if q.fine is not None and (
            q.scope not in self._grad_differed if q.tensor != "grad" else modules_equal and q.scope not in before)}

    def judge(self, s: int, ra: Dict[str, Any], rb: Dict[str, Any], rc: Optional[Dict[str, Any]] = None
              ) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
        """Step ``s``: A's record ``ra`` against B's ``rb`` (``rc``: the noise run's, if any).

        Returns:
            The step's summary (``step``, both losses, ``loss_error``, ``max_error``, ``worst``,
            ``diverged``: how many quantities crossed, ``bitwise``) and, when one crossed, the
            first in execution order (``step``, ``key``, ``scope``, ``tensor``, ``error``,
            ``threshold``, ``reason``: ``error`` or ``spike``, ``depth``, ``crossed``), else None.
        """
        crossed = []
        worst, worst_key, bitwise = 0.0, None, True
        errors = [(q, _value_errors(q, ra, rb)) for q in self.quantities]
        self._fine = self._inputs_agree(errors)
        for q, err in errors:
            if err is None:
                continue
            if self.keep:
                q.errors[s] = err
            bitwise = bitwise and err == 0.0
            if self.noise:
                noise = _value_errors(q, rc, rb) if rc is not None else None
                band = max(self._band.get(q.key, 0.0), noise if noise is not None and not math.isnan(noise) else 0.0)
                self._band[q.key] = band
                if self.keep:
                    q.band[s] = band
            threshold = self.threshold(q)
            reason = "error" if err > threshold else None
            va, vb = _scalar(q, ra), _scalar(q, rb)
            if reason is None and _spiked(self._prev_a.get(q.key), va) != _spiked(self._prev_b.get(q.key), vb):
                reason = "spike"
            self._prev_a[q.key], self._prev_b[q.key] = va, vb
            if err > worst or worst_key is None:
                worst, worst_key = err, q.key
            if reason is not None:
                crossed.append((q, err, threshold, reason))
        entry = {"step": s, "loss_a": ra.get("loss"), "loss_b": rb.get("loss"),
                 "loss_error": next((_value_errors(q, ra, rb) for q in self.quantities if q.key == "loss"), None),
                 "max_error": worst, "worst": worst_key, "diverged": len(crossed), "bitwise": bitwise}
        if not crossed:
            return entry, None
        crossed.sort(key=lambda c: c[0].order)
        q, err, threshold, reason = crossed[0]
        return entry, {"step": s, "key": q.key, "scope": q.scope, "tensor": q.tensor, "error": err,
                       "threshold": threshold, "reason": reason, "depth": q.depth,
                       "eps": q.fine_eps if q.key in self._fine else q.eps,
                       "crossed": [c[0].key for c in crossed][:20]}


def _compare_pair(la: WatchLog, lb: WatchLog, lc: Optional[WatchLog]) -> Dict[str, Any]:
    sa, sb = la.by_step(), lb.by_step()
    steps = sorted(set(sa) & set(sb))
    notes: List[str] = []
    if not steps:
        raise PrecisionDiffError(f"{la.path} and {lb.path} share no watched step: watch both runs with the same --every")
    quantities = _quantities(la, lb, steps)
    sc = lc.by_step() if lc is not None else {}
    judge = StepJudge(quantities, noise=lc is not None)
    floor = judge.floor
    first: Optional[Dict[str, Any]] = None
    per_step = []
    for s in steps:
        entry, crossed = judge.judge(s, sa[s], sb[s], sc.get(s))
        per_step.append(entry)
        if crossed is not None and first is None:
            first = crossed
    growth = []
    at = first["step"] if first is not None else (steps[-1] if steps else None)
    for q in quantities:
        if q.depth is not None and at in q.errors:
            growth.append({"key": q.key, "scope": q.scope, "tensor": q.tensor, "depth": q.depth,
                           "error": q.errors[at], "threshold": (max(DEFAULTS["noise_margin"] * q.band.get(at, 0.0), floor)
                                                                if lc is not None else q.static)})
    for name, lg in (("A", la), ("B", lb)) + ((("noise", lc),) if lc is not None else ()):
        if not lg.complete:
            notes.append(f"{name} ({lg.path}) is partial: the run stopped after {len(lg.steps)} watched steps "
                         "(no end line); compared as far as it goes")
        if lg.torn_lines:
            notes.append(f"{name} ({lg.path}): {lg.torn_lines} damaged or torn line(s) skipped")
    only_a, only_b = sorted(set(sa) - set(sb)), sorted(set(sb) - set(sa))
    if only_a or only_b:
        notes.append(f"steps only in A: {len(only_a)}, only in B: {len(only_b)}; compared {len(steps)} common steps")
    if lc is not None and set(steps) - set(sc):
        notes.append(f"the noise run lacks {len(set(steps) - set(sc))} of the compared steps: "
                     "the band stays at its last value there")
    return {"rank": la.rank, "steps": len(steps), "partial": {"a": not la.complete, "b": not lb.complete},
            "first_divergence": first, "per_step": per_step, "growth": growth, "notes": notes,
            "errors": {q.key: [q.errors.get(s) for s in steps] for q in quantities if q.key != "loss"},
            "step_numbers": steps}


def _same_layout(x: Dict[int, WatchLog], y: Dict[int, WatchLog]) -> bool:
    """Same ranks, and each rank's model the same (shapes included): compared rank by rank. Two
    single-process logs always are (their models must match shapes and all)."""
    if len(x) == 1 and len(y) == 1:
        return True
    return set(x) == set(y) and all(x[r].signature == y[r].signature for r in x)


def compare_logs(a: "str | os.PathLike", b: "str | os.PathLike", *,
                 noise: "str | os.PathLike | None" = None) -> WatchComparison:
    """Compare watch log A (the run under test) with B (the reference), optionally with a noise run.

    Args:
        a, b: watch log directories (``precisiondiff watch -o``).
        noise: a third log (C) whose error against B is the band a correct run stays in.

    Returns:
        A :class:`WatchComparison`: ``first_divergence`` (step, key, scope, tensor, error,
        threshold), ``per_step``, ``growth`` (error by depth at that step), ``errors``, notes.

    Logs of different rank counts or layouts are compared on global statistics (:mod:`.layouts`).

    Raises:
        PrecisionDiffError: not watch logs, or logs of different models.

    Example:
        >>> c = compare_logs("runs/w-bf16", "runs/w-fp64", noise="runs/w-bf16-seed1")
        >>> c.first_divergence["step"], c.first_divergence["key"]
    """
    logs_a, logs_b = read_logs(a), read_logs(b)
    logs_c = read_logs(noise) if noise is not None else None
    sides = [logs_a, logs_b] + ([logs_c] if logs_c is not None else [])
    layout_notes: List[str] = []
    if not all(_same_layout(logs_a, logs) for logs in sides[1:]):
        # other rank counts or layouts: each job's ranks as one log of global statistics (layouts.py)
        sides = [{0: global_log(logs)} for logs in sides]
        layout_notes.append("the runs' layouts differ (ranks " + " / ".join(str(len(x)) for x in
                            ([logs_a, logs_b] + ([logs_c] if logs_c else []))) + "): compared on global "
                            "statistics, the ranks' shards combined (norms by root sum of squares, means by "
                            "element count); parameter shapes are per shard and not compared")
    logs_a, logs_b = sides[0], sides[1]
    logs_c = sides[2] if logs_c is not None else None
    for other, logs in (("B", logs_b), ("the noise run", logs_c)):
        if logs is None:
            continue
        for rank, lg in logs.items():
            if lg.signature != logs_a[rank].signature:
                raise PrecisionDiffError(f"{logs_a[rank].path} and {lg.path} are watch logs of different models "
                                         "(their parameters' names or shapes differ)")
    ranks = [_compare_pair(logs_a[r], logs_b[r], logs_c[r] if logs_c else None) for r in sorted(logs_a)]
    ranks[0]["notes"] = layout_notes + ranks[0]["notes"]
    firsts = [r["first_divergence"] | {"rank": r["rank"]} for r in ranks if r["first_divergence"]]
    first = min(firsts, key=lambda f: (f["step"], f["rank"])) if firsts else None
    top = dict(ranks[0])
    top["first_divergence"] = first
    if len(ranks) > 1:
        top["ranks"] = [{"rank": r["rank"], "first_divergence": r["first_divergence"], "steps": r["steps"]}
                        for r in ranks]
        top["notes"] = [n for r in ranks for n in r["notes"]]
    top["notes"] = [n for lg in logs_a.values() if lg.header.get("combined_from") for n in lg.notes] + top["notes"]
    top["thresholds"] = {**DEFAULTS, "mode": "noise" if noise is not None else "default"}
    return WatchComparison(os.fspath(a), os.fspath(b), os.fspath(noise) if noise is not None else None, top)
