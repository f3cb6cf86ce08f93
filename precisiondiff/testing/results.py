"""The result of a parity check and its report: :class:`TensorCheck`, :class:`ParityResult`.

The report is compact and the same shape for both kinds of check: a table of the judged tensors,
the first divergence, the culprit (bisect's verdict), then one mismatch message in the project's
format: what, how many elements and what fraction, the worst absolute / relative / ULP error with
its index and values, the bound, then a ``Hint:`` with the next step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

__all__ = ["TensorCheck", "ParityResult"]


@dataclass
class TensorCheck:
    """One judged tensor: the metrics, the bound applied and, on failure, the mismatch message."""

    key: str
    passed: bool
    metrics: Dict[str, Any]
    bound: Dict[str, Any]
    message: str = ""


@dataclass
class ParityResult:
    """The outcome of a parity check.

    Attributes:
        name: the workload or op checked.
        target, ref: the DUT and reference targets, as strings.
        checks: one :class:`TensorCheck` per judged tensor (outputs, loss, gradients).
        bisect: the bisect result on failure (``to_json()`` dict), when bisect ran.
        dumps: directories of the kept dumps (``{"dut": ..., "ref": ...}``), when kept.
    """

    name: str
    target: str
    ref: str
    checks: List[TensorCheck] = field(default_factory=list)
    bisect: Optional[Dict[str, Any]] = None
    bisect_error: str = ""
    dumps: Dict[str, str] = field(default_factory=dict)
    kind: str = "workload"  # or "op": the op itself is what was judged, nothing to bisect

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def __bool__(self) -> bool:
        return self.passed

    @property
    def failures(self) -> List[TensorCheck]:
        return [c for c in self.checks if not c.passed]

    def __getitem__(self, key: str) -> TensorCheck:
        for c in self.checks:
            if c.key == key:
                return c
        raise KeyError(key)

    def to_json(self) -> Dict[str, Any]:
        return {"name": self.name, "target": self.target, "ref": self.ref, "passed": self.passed,
                "checks": [{"key": c.key, "passed": c.passed, "metrics": c.metrics, "bound": c.bound}
                           for c in self.checks],
                "bisect": self.bisect, "dumps": self.dumps}

    def report(self) -> str:
        """A compact failure report: the table, the first divergence, the culprit, the hint."""
        head = f"parity {'passed' if self.passed else 'FAILED'}: {self.name} on {self.target} vs {self.ref}"
        lines = [head, f"  {'tensor':<20} {'rel_l2':>9} {'max ULP':>9}  {'bound':<40} verdict"]
        for c in self.checks:
            m = c.metrics
            bound = ", ".join(f"{k}<={_fmt(v)}" if k != "min_cosine" else f"cos>={_fmt(v)}"
                              for k, v in c.bound.items() if isinstance(v, (int, float)))
            ulp = m.get("max_ulp_error", m.get("max_ulp"))
            lines.append(f"  {c.key:<20} {_fmt(m.get('rel_l2')):>9} {_fmt(ulp):>9}  {bound:<40} "
                         f"{'ok' if c.passed else 'FAIL'}")
        failures = self.failures
        if failures:
            lines.append(f"first divergence: {failures[0].key}")
            if failures[0].key.startswith("kernels"):
                lines.extend(_kernel_lines(self, failures[0]))
            else:
                if self.kind == "workload":
                    lines.extend(_culprit_lines(self.bisect, self.bisect_error))
                lines.append(failures[0].message)
        if self.dumps.get("dut"):
            lines.append(f"dumps kept: precisiondiff report {self.dumps.get('dut')} {self.dumps.get('ref')} "
                         "-o report.html")
        if self.dumps.get("repro"):
            lines.append(f"repro of the failing op: python {self.dumps['repro']}/repro.py (exits 1 while it is wrong)")
        return "\n".join(lines)


def _fmt(value: Any) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or float(value).is_integer() and abs(value) < 1e6:
        return str(int(value))
    return f"{value:.3g}"


def _culprit_lines(bisect: Optional[Dict[str, Any]], error: str) -> List[str]:
    if bisect is None:
        return [f"culprit: not searched ({error})" if error else
                "culprit: not searched (run with --parity-bisect, or `precisiondiff bisect`)"]
    verdict, culprit = bisect.get("verdict"), bisect.get("culprit")
    if not culprit:
        return [f"culprit: none (bisect verdict: {verdict}: no single op exceeds its budget; "
                "rounding error accumulates)"]
    lines = [f"culprit ({verdict}): {culprit.get('kind')} {culprit.get('name')} in scope "
             f"{culprit.get('scope') or '<root>'!r} ({culprit.get('direction')})"]
    local, budget = culprit.get("local") or {}, culprit.get("budget") or {}
    shown = {k: local[k] for k in ("max_ulp", "mean_ulp", "max_rel", "rel_l2", "fraction_over")
             if isinstance(local.get(k), (int, float))}
    lines.append("  local error: " + (", ".join(f"{k} {_fmt(v)}" for k, v in shown.items()) or "-")
                 + "  vs budget: " + (", ".join(f"{k} {_fmt(v)}" for k, v in budget.items()
                                                 if isinstance(v, (int, float)) and not isinstance(v, bool)) or "-"))
    conf = bisect.get("confirmation") or {}
    if conf.get("final_error_before") is not None:
        lines.append(f"  substitution: final error {_fmt(conf.get('final_error_before'))} -> "
                     f"{_fmt(conf.get('final_error_after_substitution'))} with its golden output")
    return lines


def _kernel_lines(result: ParityResult, failed: TensorCheck) -> List[str]:
    """The kernels row's failure, as compact as an end-to-end one: the culprit in one line, its
    mismatch message (what now names the op) and one ``Hint:`` with the bisect command that
    shows the evidence. The judge's own hint (written for a bare tensor) is left out."""
    bisect = result.bisect or {}
    culprit = bisect.get("culprit") or {}
    lines = _culprit_lines(result.bisect, result.bisect_error)
    lines = [line for line in lines if not line.lstrip().startswith("local error:")]
    body = [line for line in failed.message.splitlines() if line.strip() and not line.startswith("Hint:")]
    name = culprit.get("name")
    if body and name and not body[0].startswith(str(name)):
        body[0] = f"{name} {body[0]}"
    direction = culprit.get("direction")
    workload = result.name if ":" in result.name else "WORKLOAD"
    command = (f"precisiondiff bisect {workload} --target {result.target} --ref {result.ref}"
               + (f" --direction {direction}" if direction else "") + " --format json")
    return lines + body + [f"Hint: `{command}` shows the op's inputs and its local error; check the "
                           "kernel's accumulation and rounding for this dtype."]
