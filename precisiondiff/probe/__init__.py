"""``precisiondiff.probe``: a numerics card of a device's kernels. A stage beside compare and
bisect: may import runtime (targets), comparators (ULP arithmetic) and errors; never the faces
(cli, testing), which import it.

Crafted inputs reveal how a device computes: accumulator precision, rounding and extra bits
(Fasi et al. 2021), summation order (FPRev), input rounding (TF32), casts, subnormals, signed
zeros, NaN payloads, transcendental accuracy in ULPs, determinism and batch invariance.
See docs/probe.md for every experiment::

    card = probe("cpu/bf16")                   # every family, PyTorch's own kernels
    card.get("gemm", "accumulator_bits")       # 24
    print(render_table(card))
    explain(card, "gemm", "bf16", 4096)        # a sentence for a bisect finding
"""
from __future__ import annotations

from .card import Card, Finding, load_card
from .explain import explain
from .kernels import ALL_FAMILIES, Kernels
from .registry import ProbeOp, register_op, registered_ops, unregister_op
from .render import (diff_rows, render_diff_html, render_diff_table, render_html, render_json,
                     render_table)
from .runner import probe

__all__ = [
    "ALL_FAMILIES",
    "Card",
    "Finding",
    "Kernels",
    "ProbeOp",
    "diff_rows",
    "explain",
    "load_card",
    "probe",
    "register_op",
    "registered_ops",
    "render_diff_html",
    "render_diff_table",
    "render_html",
    "render_json",
    "render_table",
    "unregister_op",
]
