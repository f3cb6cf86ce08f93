"""A comparison as TensorBoard event files (optional extra ``tensorboard``).

For a dump of several training steps (``precisiondiff capture --steps 0-999`` or a captured
training script), the error of every layer of the DUT against the reference is written as a
scalar over the steps, so a loss drift can be watched layer by layer::

    precisiondiff report runs/dut runs/ref --tensorboard runs/tb
    tensorboard --logdir runs/tb

Tags (one chart per layer, grouped by the part before the first ``/``):

- ``error/forward/<scope>`` and ``error/backward/<scope>``: the normwise relative error
  ``||a - b|| / ||b||`` of the layer's output (forward: ``output.0``; backward: the gradient
  with respect to its input, ``grad_input.0``) — the same rows as the report's growth curve.
- ``max_ulp/forward/<scope>``...: the largest ULP distance of that tensor (tensors mode).
- ``ulp/forward/<scope>``...: a histogram of the element-wise ULP distances (in the DUT's
  dtype) of that tensor, per step (tensors mode; ``ulp_histograms=False`` leaves them out).
- ``summary/failed``, ``summary/max_error``, ``summary/first_divergence_seq``: per step.

The root module's scope ``""`` is spelled ``<root>``. Steps are the dump's training steps.
"""
from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..errors import PrecisionDiffError

__all__ = ["write_tensorboard", "write_watch_tensorboard", "layer_rows"]

_OUTPUT_SLOT = {"forward": "output.0", "backward": "grad_input.0"}


def _require_writer() -> Any:
    try:
        import tensorboard  # noqa: F401  (torch's writer needs it; say so in our words)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise PrecisionDiffError("--tensorboard needs tensorboard: pip install 'precisiondiff[tensorboard]' "
                                 "(or pip install tensorboard)") from err
    return SummaryWriter


def layer_rows(comparison: Any) -> List[Any]:
    """The rows charted per layer: module outputs (forward) and input gradients (backward)."""
    return [r for r in comparison.rows
            if r.kind == "module" and r.verdict != "unmatched" and r.slot == _OUTPUT_SLOT.get(r.direction)]


def _tag(metric: str, row: Any) -> str:
    prefix = f"rank{row.rank}/" if row.rank else ""
    return f"{metric}/{row.direction}/{prefix}{row.scope or '<root>'}"


def _finite(v: Optional[float]) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _ulp_values(dump_a: Any, dump_b: Any, row: Any) -> Any:
    from ..comparators import ulp_distance
    a = dump_a.ranks[row.rank].tensor(row.key)
    b = dump_b.ranks[row.rank].tensor(row.key_b or row.key)
    d = ulp_distance(a, b).flatten()
    return d[~d.isnan()].clamp(max=2.0 ** 62).numpy()


def write_tensorboard(comparison: Any, logdir: "str | Path", *, ulp_histograms: bool = True) -> Dict[str, int]:
    """Write the per-layer error of ``comparison`` over training steps to TensorBoard files.

    Args:
        comparison: a :class:`~precisiondiff.compare.comparison.Comparison` (A: the DUT).
        logdir: the TensorBoard log directory (created; one run per call, files appended).
        ulp_histograms: also write the element-wise ULP distance histograms (reads the two
            tensors of each layer row again; tensors-mode dumps only).

    Returns:
        ``{"steps", "layers", "scalars", "histograms"}``: what was written.

    Raises:
        PrecisionDiffError: tensorboard is not installed, or ``logdir`` cannot be written.

    Example:
        >>> write_tensorboard(precisiondiff.compare("runs/dut", "runs/ref"), "runs/tb")  # doctest: +SKIP
        {'steps': 1000, 'layers': 12, 'scalars': 36000, 'histograms': 24000}
    """
    SummaryWriter = _require_writer()
    rows = layer_rows(comparison)
    by_step: Dict[int, List[Any]] = defaultdict(list)
    for r in comparison.rows:
        by_step[r.step].append(r)
    counts = {"steps": len(by_step), "layers": len({(r.rank, r.direction, r.scope) for r in rows}),
              "scalars": 0, "histograms": 0}
    try:
        Path(logdir).mkdir(parents=True, exist_ok=True)
        writer = SummaryWriter(log_dir=str(logdir))
    except OSError as err:
        raise PrecisionDiffError(f"cannot write TensorBoard files to {logdir}: {err.strerror or err}") from err
    dumps: Optional[Tuple[Any, Any]] = None
    try:
        for r in rows:
            for metric, value in (("error", r.error), ("max_ulp", r.ulp)):
                if _finite(value):
                    writer.add_scalar(_tag(metric, r), float(value), global_step=r.step)
                    counts["scalars"] += 1
            if ulp_histograms and r.mode == "tensors" and r.ulp is not None:
                if dumps is None:
                    from ..store import load
                    dumps = (load(comparison.a), load(comparison.b))
                values = _ulp_values(*dumps, r)
                if values.size:
                    writer.add_histogram(_tag("ulp", r), values, global_step=r.step)
                    counts["histograms"] += 1
        for step in sorted(by_step):
            step_rows = [r for r in by_step[step] if r.verdict != "unmatched"]
            errors = [r.error for r in step_rows if _finite(r.error)]
            writer.add_scalar("summary/failed", sum(r.verdict == "fail" for r in step_rows), global_step=step)
            counts["scalars"] += 1
            if errors:
                writer.add_scalar("summary/max_error", max(errors), global_step=step)
                counts["scalars"] += 1
            first = next((r for r in step_rows if r.verdict == "fail"), None)
            if first is not None:
                writer.add_scalar("summary/first_divergence_seq", first.seq, global_step=step)
                counts["scalars"] += 1
    finally:
        writer.close()
        if dumps is not None:
            for d in dumps:
                d.close()
    return counts


def _watch_tag(key: str) -> str:
    scope, _, tensor = key.rpartition(":")
    return f"error/{tensor}/{scope or '<root>'}"


def write_watch_tensorboard(comparison: Dict[str, Any], logdir: "str | Path") -> Dict[str, int]:
    """Write a comparison of two watch logs (its JSON report: ``WatchComparison.to_dict()``) as
    TensorBoard scalars over the runs' steps.

    Tags: ``loss/A`` and ``loss/B`` (the two loss curves), ``loss/relative_error``;
    ``error/output/<scope>``, ``error/grad_output/<scope>``... (each watched layer's relative
    error: the step × layer heat map); ``summary/max_error``, ``summary/over_threshold`` per step
    and ``summary/first_divergence_step`` once.

    Returns:
        ``{"steps", "layers", "scalars"}``: what was written.

    Raises:
        PrecisionDiffError: tensorboard is not installed, or ``logdir`` cannot be written.
    """
    SummaryWriter = _require_writer()
    try:
        Path(logdir).mkdir(parents=True, exist_ok=True)
        writer = SummaryWriter(log_dir=str(logdir))
    except OSError as err:
        raise PrecisionDiffError(f"cannot write TensorBoard files to {logdir}: {err.strerror or err}") from err
    layers = [k for k in comparison["errors"] if ":" in k and k.rpartition(":")[2].startswith(("output", "grad_"))]
    counts = {"steps": len(comparison["per_step"]), "layers": len(layers), "scalars": 0}

    def add(tag: str, value: Any, step: int) -> None:
        if _finite(value):
            writer.add_scalar(tag, float(value), global_step=step)
            counts["scalars"] += 1

    try:
        for e in comparison["per_step"]:
            s = e["step"]
            add("loss/A", e["loss_a"], s)
            add("loss/B", e["loss_b"], s)
            add("loss/relative_error", e["loss_error"], s)
            add("summary/max_error", e["max_error"], s)
            add("summary/over_threshold", e["diverged"], s)
        for key in layers:
            for s, value in zip(comparison["step_numbers"], comparison["errors"][key]):
                add(_watch_tag(key), value, s)
        first = comparison.get("first_divergence")
        if first is not None:
            add("summary/first_divergence_step", first["step"], first["step"])
    finally:
        writer.close()
    return counts
