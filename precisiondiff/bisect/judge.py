"""Judging one isolated unit, and the final output: the rules bisect applies to error numbers.

* **Ops** are judged by the comparators' budgets (:func:`precisiondiff.comparators.budget_for`
  per dtype and op class, condition-aware): the DUT's output against the golden output computed
  from the DUT's own inputs. Matmul-like and sum-like ops get their *magnitude* (the same op
  applied to the absolute values of its inputs, in float64: ``|A|@|B|`` for a matmul), so the
  bound follows the magnitudes that went into each element, not only the result.
* **Modules** are judged against *emulation*: the module replayed in float64 with every op's
  output rounded to the DUT dtype is what correctly rounded execution of its own ops gives,
  cancellation and conditioning included. With ``e_dut = ||dut - golden||_2`` and
  ``e_emu = ||emulated - golden||_2`` and ``floor = u * ||golden||_2`` (``u`` the unit roundoff
  of the DUT dtype), the module is ``over`` when ``e_dut > MODULE_OVER * max(e_emu, floor)``
  and ``far`` when ``e_dut > MODULE_FAR * max(e_emu, floor)``.
* **Final output**: ``final error`` is the relative L2 error ``||dut - ref||_2 / ||ref||_2`` of
  the model output against the reference run; with a loss it is the worst of the output, the
  loss and the parameter gradients (all gradients as one vector). Parity when it is at most
  ``PARITY_FACTOR * u``.
* **Run-to-run noise** (live ``noise=True``): an op whose outputs differ between two DUT runs is
  nondeterministic; when it is over its budget but its max abs error against the golden is at
  most ``NOISE_FACTOR`` times its run-to-run max abs difference (both over all its floating
  outputs), it is judged within noise, not over (compare's ``--noise`` rule).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Sequence

import torch

from ..comparators.tolerance import END_TO_END_FACTOR
# An over-budget nondeterministic op is within noise when its max abs error is at most this many
# times its run-to-run max abs difference: compare --noise's factor.
from ..compare.dumps import NOISE_FACTOR

__all__ = ["MODULE_OVER", "MODULE_FAR", "PARITY_FACTOR", "OpJudgement", "judge_op_outputs", "judge_tensor",
           "judge_module", "judge_standin", "StandInJudgement", "rel_l2", "unit_roundoff", "parity_bound", "OpOutput",
           "NOISE_FACTOR", "max_abs_error"]

# Module rule factors (see the module docstring and docs/bisect.md).
MODULE_OVER = 3.0   # beyond what correctly rounded execution of its ops explains
MODULE_FAR = 10.0   # far beyond it: the module itself is blamed even when all its ops pass
PARITY_FACTOR = END_TO_END_FACTOR  # final relative L2 error allowed, in unit roundoffs (comparators)

def unit_roundoff(dtype: torch.dtype) -> float:
    """``2**-p`` for a floating dtype with ``p`` significand bits (bf16: 2**-8)."""
    from ..comparators.ulp import float_format
    return float_format(dtype).unit_roundoff


def parity_bound(dtype: torch.dtype) -> float:
    """The final relative L2 error at or under which the run is at parity (the comparators'
    end-to-end bound)."""
    from ..comparators import end_to_end_bound
    return end_to_end_bound(dtype)


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected||_2 / ||expected||_2`` in float64 (``inf`` on a NaN mismatch)."""
    a = actual.detach().to(torch.float64).flatten()
    e = expected.detach().to(device=a.device, dtype=torch.float64).flatten()
    if a.shape != e.shape:
        raise ValueError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    if a.numel() == 0:
        return 0.0
    both_nan = torch.isnan(a) & torch.isnan(e)
    if bool((torch.isnan(a) ^ torch.isnan(e)).any()):
        return math.inf
    a, e = a[~both_nan], e[~both_nan]
    same_inf = torch.isinf(a) & (a == e)
    a, e = a[~same_inf], e[~same_inf]
    if bool(torch.isinf(a).any() | torch.isinf(e).any()):
        return math.inf
    denom = float(torch.linalg.vector_norm(e))
    num = float(torch.linalg.vector_norm(a - e))
    if denom == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / denom


def max_abs_error(pairs: Sequence[tuple]) -> float:
    """The largest ``|a - b|`` over ``[(a, b), ...]`` in float64; ``inf`` when NaN/Inf differ
    (positions where both are NaN, or both the same Inf, count as equal)."""
    worst = 0.0
    for a, b in pairs:
        x = a.detach().to(torch.float64).flatten()
        y = b.detach().to(device=x.device, dtype=torch.float64).flatten()
        if x.numel() == 0:
            continue
        same = (x == y) | (torch.isnan(x) & torch.isnan(y))
        if bool((~same & ~(torch.isfinite(x) & torch.isfinite(y))).any()):
            return math.inf
        worst = max(worst, float(torch.where(same, torch.zeros_like(x), (x - y).abs()).max()))
    return worst


@dataclass
class OpOutput:
    """One floating output of an op call to judge: the DUT's tensor, the golden, and the
    magnitude and accumulation length K that go with it (from the op's schema)."""

    slot: str
    index: int
    dut: torch.Tensor
    golden: torch.Tensor
    magnitude: Optional[torch.Tensor] = None
    k: Optional[int] = None
    compute_dtype: Optional[torch.dtype] = None


@dataclass
class OpJudgement:
    """An op's local error: the peer rule's verdict, and the per-op budget figures reported with it.

    Attributes:
        passed: every floating output passes the peer rule.
        local: the worst output's metrics (comparators' TensorMetrics as a dict).
        budget: that output's ULP budget (as a dict) with ``ulp_passed``: reported, not the verdict.
        slot: the worst output's slot.
        message: why it failed (the peer rule's line, then the budget's mismatch message).
        peer: that output's peer verdict (:meth:`PeerVerdict.as_dict`).
    """

    passed: bool
    local: Dict[str, Any] = field(default_factory=dict)
    budget: Dict[str, Any] = field(default_factory=dict)
    slot: str = "output.0"
    message: str = ""
    peer: Dict[str, Any] = field(default_factory=dict)


def _as_float(value: Any) -> float:
    """A metric as a number: JSON-safe metrics spell inf/nan as strings (NaN ranks highest)."""
    if isinstance(value, str):
        value = float(value)
    if value is None:
        return 0.0
    return math.inf if math.isnan(value) else float(value)


def judge_tensor(rule: str, name: str, out: OpOutput, peers: Dict[str, Any], real_peer: Optional[str] = None) -> Any:
    """One output judged by ``rule``: ``"peer"`` (:func:`~precisiondiff.comparators.peers.judge_against_peers`)
    or ``"mlu-ops"`` (:func:`~precisiondiff.comparators.mlu_ops.judge_mlu_ops`, ``real_peer`` its baseline).
    Both verdicts have ``passed``, ``ratio``, ``message`` and ``as_dict()`` (whose ``rule`` says which decided)."""
    if rule == "mlu-ops":
        from ..comparators.mlu_ops import judge_mlu_ops
        return judge_mlu_ops(out.dut, out.golden, peers, op=name, real_peer=real_peer, what=out.slot)
    from ..comparators.accumulation import rounds_partial_sums
    from ..comparators.peers import judge_against_peers
    return judge_against_peers(out.dut, out.golden, peers, magnitude=out.magnitude, k=out.k,
                               dtype=out.compute_dtype, what=out.slot, partial_sums=rounds_partial_sums(name))


def judge_op_outputs(name: str, outputs: Sequence[OpOutput], peers: Callable[[], Dict[str, Any]], *,
                     module_class: Optional[str] = None,
                     overrides: Optional[Dict[str, Dict[str, Any]]] = None, rule: str = "peer",
                     real_peer: Optional[str] = None) -> OpJudgement:
    """Judge an op's outputs by the peer rule (:mod:`precisiondiff.comparators.peers`), or by
    ``rule="mlu-ops"`` (:mod:`precisiondiff.comparators.mlu_ops`, ``real_peer`` the name of a
    real second implementation among the peers: its baseline).

    ``peers()`` computes the emulated peers (``{"float32": [...], "decomposition": [...]}``,
    indexed like the op's outputs); it is called only when some output fails without them, so
    most ops cost one replay. The comparators' per-op ULP budget is measured too and reported
    (``budget.ulp_passed``), but it does not decide.
    """
    from . import _compat
    worst: Optional[OpJudgement] = None
    computed: Optional[Dict[str, Any]] = None
    for out in outputs:
        budget = _compat.budget_for_op(name, out.dut.dtype, module_class, overrides)
        k = out.k if out.magnitude is not None and out.k else None
        ulp = _compat.check(budget, out.dut, out.golden, out.magnitude if k else None, k, out.slot)
        metrics = _compat.metrics(out.dut, out.golden)
        verdict = judge_tensor(rule, name, out, {}, real_peer)
        if not verdict.passed and not _overridden(name, budget, overrides):
            if computed is None:
                computed = peers()
            found = {n: (p[out.index] if p is not None and out.index < len(p) else None) for n, p in computed.items()}
            verdict = judge_tensor(rule, name, out, found, real_peer)
        elif not verdict.passed:  # a budget override for this op: the user's budget decides
            verdict = dataclasses.replace(verdict, passed=ulp.passed)
        bud = dict(_compat.as_dict(budget), ulp_passed=bool(ulp.passed))
        if k:
            bud["k"] = k
        message = "" if verdict.passed else "\n".join(
            m for m in (verdict.message, _compat.message(ulp, out.slot)) if m)
        current = OpJudgement(passed=verdict.passed, local=metrics, budget=bud, slot=out.slot,
                              message=message, peer=verdict.as_dict())
        score = verdict.ratio
        if (worst is None or (not current.passed and worst.passed)
                or (current.passed == worst.passed and score > _as_float(worst.peer.get("ratio")))):
            worst = current
    return worst if worst is not None else OpJudgement(passed=True)


def _overridden(name: str, budget: Any, overrides: Optional[Dict[str, Dict[str, Any]]]) -> bool:
    """Whether a ``--budget`` override applies to this op (``*``, its dtype, its class or its
    name): then the overridden ULP budget may accept what the peer rule does not."""
    from . import _compat
    if not overrides:
        return False
    plain = (_compat.as_dict(budget).get("dtype"), _compat.as_dict(budget).get("op_class"), "*")
    return any(key in plain or ("." in key and (name == key or name.startswith(key + "."))) for key in overrides)


@dataclass
class ModuleJudgement:
    """A module's local error against what correct rounding through its ops explains."""

    over: bool
    far: bool
    local: Dict[str, Any]
    budget: Dict[str, Any]


def judge_module(pairs: Sequence[tuple], dtype: torch.dtype) -> ModuleJudgement:
    """``pairs`` is ``[(dut, golden, emulated), ...]`` for every output the module gives;
    ``emulated`` is one tensor, a tuple of emulations (the larger error counts: rounding every
    op's output, and PyTorch's reference semantics in the DUT dtype), or None ("not computed":
    the DUT error was already below the floor, so it cannot be over).

    Errors are summed over outputs (squared L2).
    """
    u = unit_roundoff(dtype)
    e_dut2 = g2 = 0.0
    e_emu2: list = []
    for dut, golden, emulated in pairs:
        g = golden.detach().to(torch.float64)
        d = dut.detach().to(device=g.device, dtype=torch.float64)
        if bool((torch.isnan(d) ^ torch.isnan(g)).any()):
            e_dut2 = math.inf
        g2 += float(torch.nan_to_num(g).pow(2).sum())
        e_dut2 += float(torch.nan_to_num(d - g, nan=0.0, posinf=math.inf, neginf=math.inf).pow(2).sum())
        ems = emulated if isinstance(emulated, (tuple, list)) else (emulated,)
        for j, em in enumerate(ems):
            if em is None:
                continue
            em = em.detach().to(device=g.device, dtype=torch.float64)
            while len(e_emu2) <= j:
                e_emu2.append(0.0)
            if em.shape == g.shape:
                e_emu2[j] += float(torch.nan_to_num(em - g, nan=0.0).pow(2).sum())
    e_dut, e_emu, gnorm = math.sqrt(e_dut2), math.sqrt(max(e_emu2, default=0.0)), math.sqrt(g2)
    explained = max(e_emu, u * gnorm)
    ratio = e_dut / explained if explained > 0 else (0.0 if e_dut == 0 else math.inf)
    local = {"rel_l2": e_dut / gnorm if gnorm else (0.0 if e_dut == 0 else math.inf),
             "rel_l2_emulated": e_emu / gnorm if gnorm else 0.0, "ratio_to_rounding": ratio}
    if len(e_emu2) > 1 and gnorm:
        local["rel_l2_emulations"] = [math.sqrt(e) / gnorm for e in e_emu2]
    budget = {"rule": "emulated-rounding", "over_factor": MODULE_OVER, "far_factor": MODULE_FAR,
              "unit_roundoff": u}
    return ModuleJudgement(over=ratio > MODULE_OVER, far=ratio > MODULE_FAR, local=local, budget=budget)


@dataclass
class StandInJudgement:
    """A module judged in place of an op it holds that could not be replayed.

    Attributes:
        over: enough elements exceed their bound (``TAIL_COUNT``), or one far beyond it.
        local: ``max_ulp_error`` (worst element, in ULPs of the DUT dtype), ``n_over``, ``numel``,
            ``worst_ratio`` (error / bound at the worst element).
        budget: the op budget used (as a dict) and the rule.
        message: a one-line mismatch message when over.
    """

    over: bool
    local: Dict[str, Any]
    budget: Dict[str, Any]
    message: str = ""


def judge_standin(pairs: Sequence[tuple], budget: Any) -> StandInJudgement:
    """Judge a module that holds an op with no reference implementation, per element.

    The module's golden output is what its ops give on the reference; its *emulated* output is
    that with every op output rounded to the DUT dtype. The module is over when, at some
    element ``i``, ``|dut_i - golden_i| > max(max_ulp * spacing(golden_i),
    MODULE_OVER * |emulated_i - golden_i|)`` where ``max_ulp`` is the budget of the op the
    module stands in for, with ``spacing`` taken at ``max(|golden_i|, SIGNIFICANCE * rms(golden))``
    (the op rule's small-value floor). For a module that is just the op this is the op's own budget; around
    other ops, the emulated error lets correct rounding through them pass. As the op rule's tail
    (docs/comparators.md, "Error statistics"), fewer than ``TAIL_COUNT`` elements (or
    ``TAIL_SHARE`` of them) over their bound make it over only when one is ``MODULE_FAR`` times
    over. ``pairs`` is
    ``[(slot, dut, golden, emulated), ...]``.
    """
    from ..comparators import ulp_spacing
    from ..comparators.error_stats import TAIL_COUNT, TAIL_SHARE, element_ulp
    from ..comparators.peers import SIGNIFICANCE
    from . import _compat
    worst_ratio, worst_ulp, n_over, numel, message = 0.0, 0.0, 0, 0, ""
    for slot, dut, golden, emulated in pairs:
        g = golden.detach().to(torch.float64)
        d = dut.detach().to(device=g.device, dtype=torch.float64)
        em = emulated.detach().to(device=g.device, dtype=torch.float64)
        spacing = ulp_spacing(g, dut.dtype)
        # the op rule's small-value floor: elements far below the tensor's size (cancellation)
        # are judged at the significance threshold's ULP, not their own
        floor = element_ulp(torch.where(torch.isfinite(g), g, torch.zeros_like(g)), dut.dtype, SIGNIFICANCE)
        bound = torch.maximum(budget.max_ulp * floor, MODULE_OVER * (em - g).abs())
        err = (d - g).abs()
        bad = (torch.isnan(d) ^ torch.isnan(g)) | (torch.isfinite(g) & ~(err <= bound))
        numel += d.numel()
        if d.numel() == 0:
            continue
        n_bad = int(bad.sum())
        n_over += n_bad
        finite = torch.isfinite(g) & torch.isfinite(d)
        ratio = torch.where(finite, err / bound.clamp_min(1e-300), torch.zeros_like(err))
        flat = int(ratio.flatten().argmax())
        r = float(ratio.flatten()[flat])
        ulp = float((err[finite] / spacing[finite]).max()) if bool(finite.any()) else 0.0
        worst_ulp = max(worst_ulp, ulp)
        if n_bad and (not message or r > worst_ratio):
            message = (f"{slot}: {n_bad} of {d.numel()} elements exceed max({budget.max_ulp:g} ULP of "
                       f"{budget.dtype} ({budget.op_class} budget), {MODULE_OVER:g}x the emulated "
                       f"rounding error); worst: actual {float(d.flatten()[flat])!r}, golden "
                       f"{float(g.flatten()[flat])!r}, {r:.3g}x its bound")
        worst_ratio = max(worst_ratio, r)
    local = {"max_ulp_error": worst_ulp, "n_over": n_over, "numel": numel, "worst_ratio": worst_ratio}
    bud = dict(_compat.as_dict(budget), rule="stand-in: max(op budget, emulated rounding x over_factor)",
               over_factor=MODULE_OVER)
    # as the op rule's tail: a few elements over their bound are evidence only far over it
    over = (n_over >= TAIL_COUNT and n_over >= TAIL_SHARE * numel) or worst_ratio > MODULE_FAR
    return StandInJudgement(over=over, local=local, budget=bud, message=message if over else "")
