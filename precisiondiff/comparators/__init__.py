"""Comparators: ULP arithmetic, streamed tensor metrics, and budgets that judge them.

Metrics (:func:`compare_tensors`) only measure; budgets (:class:`Budget`) judge; a
:class:`Verdict` holds the judgement and its one-format message. See docs/comparators.md.
"""
from __future__ import annotations

from .ulp import ulp_distance, ulp_error, ulp_spacing

__all__ = [
    "ulp_distance",
    "ulp_error",
    "ulp_spacing",
]
