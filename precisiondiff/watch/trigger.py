"""Decide in the running job that a watched step crossed a threshold (``watch --ref``, ``--on-anomaly``).

Each step record is judged as it is written (:meth:`Triggers.judge`); the first step that
crosses makes the monitor capture the next step in replay mode (docs/watch.md says why the next).

- ``--ref WATCH_REF`` (optionally ``--ref-noise WATCH_C``): the step against the reference log's
  same step, by :class:`~precisiondiff.watch.compare.StepJudge`, the rule ``compare`` of two
  watch logs uses (the same errors, thresholds and noise band).
- ``--on-anomaly``: the run alone, by :data:`ANOMALY` rules: NaN/Inf, a loss spike, a gradient
  norm jump.
"""
from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Optional

from ..errors import PrecisionDiffError
from .compare import StepJudge, _quantities, _spiked
from .layouts import global_log, names_signature
from .log import FIELDS, WatchLog, read_logs

__all__ = ["ANOMALY", "AnomalyRule", "RefRule", "Triggers"]

ANOMALY = {
    # Megatron's RerunStateMachine.is_unexpectedly_large (check_for_spiky_loss, SPIKY_LOSS_FACTOR
    # = 10; grads checked by the same helper): a value above 10x the largest |value| of the first
    # 100 samples
    "spike_factor_of_max": 10.0,
    "spike_samples": 100,
    # compare's spike rule (DEFAULTS["spike_factor"]): more than 10x the previous watched step's
}
_NAN, _INF = FIELDS.index("nan"), FIELDS.index("inf")


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


class RefRule:
    """Each step against the reference log's same step (``watch --ref``).

    Args:
        ref: the reference log directory (``precisiondiff watch -o``).
        noise: a noise run's log (its error against ``ref`` is the band), or None.
        rank, world: this process's rank and the job's rank count: the reference's ``rank{N}/``
            log of that rank is used when it has as many ranks; a single process judged against a
            multi-rank reference uses its global statistics (:mod:`.layouts`).

    Raises:
        PrecisionDiffError: not a watch log, or a reference of another rank count.
    """

    def __init__(self, ref: "str | os.PathLike", noise: "str | os.PathLike | None", rank: int, world: int = 1) -> None:
        self.by_names = False  # the model is then identified by its parameters' names (shards' shapes differ)
        self.ref = self._rank_log(ref, rank, world, "--ref")
        self.noise = self._rank_log(noise, rank, world, "--ref-noise") if noise is not None else None
        if self.noise is not None and self._identity(self.noise) != self._identity(self.ref):
            raise PrecisionDiffError(f"{self.noise.path} and {self.ref.path} are watch logs of different models")
        self._ref_steps = self.ref.by_step()
        self._noise_steps = self.noise.by_step() if self.noise is not None else {}
        self._judge: Optional[StepJudge] = None

    def _rank_log(self, path: "str | os.PathLike", rank: int, world: int, option: str) -> WatchLog:
        logs = read_logs(path)
        if len(logs) == 1 and world == 1:
            return next(iter(logs.values()))
        if len(logs) == world and rank in logs:
            return logs[rank]
        if world == 1:
            self.by_names = True
            return global_log(logs)
        raise PrecisionDiffError(f"{option} {os.fspath(path)} has {len(logs)} rank(s) and this job {world}: a rank "
                                 "sees only its shard, so judge it against a reference of the same rank count "
                                 "(or compare the finished logs, on global statistics)")

    def _identity(self, log: WatchLog) -> str:
        return names_signature(log.header) if self.by_names else log.signature

    def check_model(self, model: Dict[str, Any]) -> None:
        """Refuse a reference of another model (its parameters' names or shapes differ); ``model``
        is a log header's ``model`` field."""
        signature = names_signature({"model": model}) if self.by_names else model.get("signature")
        if signature != self._identity(self.ref):
            raise PrecisionDiffError(f"--ref {self.ref.path} is a watch log of another model (its parameters' "
                                     "names or shapes differ from this run's)")

    def judge(self, header: Dict[str, Any], record: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        s = int(record["step"])
        rb = self._ref_steps.get(s)
        if rb is None:
            return None
        if self._judge is None:
            here = WatchLog(path="(this run)", header=header, steps=[record])
            self._judge = StepJudge(_quantities(here, self.ref, [s]), noise=self.noise is not None, keep=False)
        _, first = self._judge.judge(s, record, rb, self._noise_steps.get(s))
        if first is None:
            return None
        spike = first.pop("reason") == "spike"
        return {"rule": "ref", **first, "spike": spike,
                "reason": f"{first['key']}: relative error {first['error']:.4g} > threshold {first['threshold']:.4g} "
                          f"against {self.ref.path}" + (" (a spike in one run only)" if spike else "")}


class AnomalyRule:
    """The run alone (``watch --on-anomaly``), in this order:

    - ``nan``: the loss, or a parameter's weight or gradient norm, is NaN or infinite; or a watched
      tensor holds NaN where it held none at the previous watched step, or more infinities;
    - ``loss_spike``: the loss is above 10x the largest |loss| of the first 100 watched steps
      (Megatron's spiky-loss check), or above 10x the previous watched step's (compare's spike rule);
    - ``grad_norm_jump``: the same two rules on the global gradient norm (the square root of the
      sum of the parameters' squared gradient norms).
    """

    def __init__(self) -> None:
        self._history: Dict[str, List[float]] = {"loss": [], "grad_norm": []}
        self._prev: Dict[str, Optional[float]] = {}
        self._counts: Dict[str, tuple] = {}

    def _nan(self, record: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        loss = record.get("loss")
        if loss is not None and not _finite(loss):
            return {"key": "loss", "value": loss, "reason": f"the loss is {loss}"}
        for name, values in record.get("params", {}).items():
            for what in ("grad", "weight"):
                v = values.get(what)
                if v is not None and not _finite(v):
                    return {"key": f"{name}:{what}", "value": v, "reason": f"the {what} norm of {name} is {v}"}
        hit = None
        for key, stats in record.get("tensors", {}).items():
            nan, inf = stats[_NAN] or 0, stats[_INF] or 0
            before = self._counts.get(key)  # infinities at a tensor's first step may be the model's (a mask)
            if hit is None and ((nan and not (before and before[0])) or (before is not None and inf > before[1])):
                hit = {"key": key, "value": nan or inf, "reason": f"{key} holds {nan} NaN and {inf} Inf"}
            self._counts[key] = (nan, inf)
        return hit

    def _spike(self, what: str, value: Optional[float]) -> Optional[Dict[str, Any]]:
        if value is None or not _finite(value):
            return None
        history, prev = self._history[what], self._prev.get(what)
        self._prev[what] = value
        largest = max((abs(v) for v in history), default=None)
        if len(history) < ANOMALY["spike_samples"]:
            history.append(value)
        if largest is not None and abs(value) > ANOMALY["spike_factor_of_max"] * largest:
            return {"value": value, "threshold": ANOMALY["spike_factor_of_max"] * largest,
                    "reason": f"{what} {value:.4g} > 10x the largest of the first {len(history)} watched steps "
                              f"({largest:.4g})"}
        if _spiked(prev, value):
            return {"value": value, "reason": f"{what} {value:.4g} > 10x the previous watched step's ({prev:.4g})"}
        return None

    def judge(self, header: Dict[str, Any], record: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        s = int(record["step"])
        hit = self._nan(record)
        if hit is not None:
            return {"rule": "nan", "step": s, **hit}
        grads = [v["grad"] for v in record.get("params", {}).values() if _finite(v.get("grad"))]
        norm = math.sqrt(sum(g * g for g in grads)) if grads else None
        for what, value, rule in (("loss", record.get("loss"), "loss_spike"), ("grad_norm", norm, "grad_norm_jump")):
            hit = self._spike(what, value)
            if hit is not None:
                return {"rule": rule, "step": s, "key": what, **hit}
        return None


class Triggers:
    """The rules a watch judges each step by; the first hit decides.

    Args:
        ref, ref_noise: ``--ref`` and ``--ref-noise`` log directories (or None).
        on_anomaly: also the :class:`AnomalyRule`.
        rank, world: this process's rank and the job's rank count.
    """

    def __init__(self, *, ref: "str | os.PathLike | None", ref_noise: "str | os.PathLike | None",
                 on_anomaly: bool, rank: int, world: int = 1) -> None:
        if ref_noise is not None and ref is None:
            raise PrecisionDiffError("--ref-noise goes with --ref WATCH_REF")
        self.ref = RefRule(ref, ref_noise, rank, world) if ref is not None else None
        self.rules: List[Any] = ([self.ref] if self.ref is not None else []) + ([AnomalyRule()] if on_anomaly else [])
        self.hit: Optional[Dict[str, Any]] = None

    def judge(self, header: Dict[str, Any], record: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        """The first rule that ``record`` crosses (once per run: later steps are not judged)."""
        if self.hit is not None:
            return None
        for rule in self.rules:
            hit = rule.judge(header, record)
            if hit is not None:
                self.hit = hit
                return hit
        return None
