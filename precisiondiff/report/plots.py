"""Plots of a comparison as inline SVG strings (matplotlib, imported lazily; optional).

Every function returns an ``<svg ...>`` string, or raises ImportError when matplotlib is not
installed (:func:`available` tells beforehand). No pyplot: figures are built with
``matplotlib.figure.Figure`` so the caller's backend and global state are never touched.
"""
from __future__ import annotations

import io
import math
import re
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["available", "error_along_order", "layer_growth_plot", "ulp_histograms", "rank_overview"]

_COLORS = {"forward": "#1f77b4", "backward": "#d62728"}


def available() -> bool:
    """True when matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _figure(w: float, h: float, rows: int = 1, cols: int = 1):
    from matplotlib.figure import Figure
    fig = Figure(figsize=(w, h), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    return fig, axes


def _svg(fig: Any) -> str:
    import matplotlib
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": "precisiondiff", "svg.fonttype": "none"}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _pos(v: Optional[float]) -> Optional[float]:
    """Values a log axis can draw: exact (0), NaN and infinite errors are left out."""
    if v is None or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        return None
    return float(v)


def error_along_order(rows: Sequence[Any], first_seq: Optional[int] = None) -> str:
    """Relative error and max ULP of every compared tensor along execution order, fwd vs bwd."""
    fig, axes = _figure(10, 5.2, 2, 1)
    for ax, attr, label in ((axes[0][0], "error", "relative error (normwise)"),
                            (axes[1][0], "ulp", "max ULP")):
        for direction, color in _COLORS.items():
            pts = [(r.seq, _pos(getattr(r, attr))) for r in rows
                   if r.direction == direction and r.verdict != "unmatched"]
            pts = [(x, y) for x, y in pts if y is not None]
            if pts:
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=6, color=color, label=direction)
            bad = [(r.seq, _pos(getattr(r, attr))) for r in rows
                   if r.direction == direction and r.verdict == "fail"]
            bad = [(x, y) for x, y in bad if y is not None]
            if bad:
                ax.scatter([p[0] for p in bad], [p[1] for p in bad], s=14, facecolors="none",
                           edgecolors="black", linewidths=0.6)
        if first_seq is not None:
            ax.axvline(first_seq, color="black", linestyle="--", linewidth=0.8, label="first divergence")
        ax.set_yscale("log")
        ax.set_ylabel(label)
        ax.grid(True, which="major", alpha=0.3)
    axes[1][0].set_xlabel("execution order (seq); circled: failing; exact (0) and NaN errors not drawn")
    axes[0][0].legend(loc="upper left", fontsize=8)
    return _svg(fig)


def layer_growth_plot(curves: Dict[str, List[Dict[str, Any]]]) -> str:
    """The per-layer error growth curve (module outputs of repeated layers), fwd and bwd."""
    fig, axes = _figure(10, 3.2, 1, 2)
    for ax, direction in zip(axes[0], ("forward", "backward")):
        series = curves.get(direction, [])
        ys = [_pos(g["error"]) for g in series]
        pts = [(i, y) for i, y in enumerate(ys) if y is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=_COLORS[direction])
        else:
            ax.set_title(f"{direction} (execution order)", fontsize=9)
            ax.text(0.5, 0.5, f"no {direction} layer outputs recorded", ha="center", va="center",
                    transform=ax.transAxes, fontsize=9, color="gray")
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        step = max(1, len(series) // 24)
        ax.set_xticks(range(0, len(series), step))
        ax.set_xticklabels([g["scope"] for g in series][::step], rotation=45, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set_title(f"{direction} (execution order)", fontsize=9)
        ax.grid(True, alpha=0.3)
    ax = axes[0][0]
    ax.set_ylabel("relative error of the layer's output")
    return _svg(fig)


def ulp_histograms(hists: List[Dict[str, Any]]) -> str:
    """ULP-distance histograms of the worst tensors: ``hists`` items have ``key``, ``edges``
    (log2 bins of ``1 + ulp``) and ``counts``."""
    n = len(hists)
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = _figure(10, 2.4 * rows, rows, cols)
    for k, h in enumerate(hists):
        ax = axes[k // cols][k % cols]
        edges, counts = h["edges"], h["counts"]
        ax.bar(edges[:-1], counts, width=[b - a for a, b in zip(edges[:-1], edges[1:])],
               align="edge", color="#555555")
        ax.set_yscale("log")
        label = h["key"] if len(h["key"]) < 48 else "..." + h["key"][-45:]
        ax.set_title(label, fontsize=7)
        ax.set_xlabel("log2(1 + ULP distance)", fontsize=7)
        ax.tick_params(labelsize=7)
    for k in range(n, rows * cols):
        axes[k // cols][k % cols].set_visible(False)
    return _svg(fig)


def rank_overview(ranks: Dict[int, Dict[str, Any]]) -> str:
    """Failed tensors per rank (bars) and the first divergence's seq per rank."""
    fig, axes = _figure(10, 2.6)
    ax = axes[0][0]
    rs = sorted(ranks)
    ax.bar([str(r) for r in rs], [ranks[r]["failed"] for r in rs], color="#d62728", label="failed")
    ax.bar([str(r) for r in rs], [ranks[r]["passed"] for r in rs],
           bottom=[ranks[r]["failed"] for r in rs], color="#2ca02c", label="passed")
    ax.set_xlabel("rank")
    ax.set_ylabel("tensors")
    ax.legend(fontsize=8)
    return _svg(fig)


def sanitize_id(text: str) -> str:
    """An HTML id from any text."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", text)
