"""Comparators: ULP arithmetic, streamed tensor metrics, and budgets that judge them.

Metrics (:func:`compare_tensors`) only measure; budgets (:class:`Budget`) judge; a
:class:`Verdict` holds the judgement and its one-format message. See docs/comparators.md.

The ruler: depends on tensors alone (torch, errors); every stage may import it.
"""
from __future__ import annotations

from .metrics import TensorMetrics, compare_tensors
from .tolerance import (
    END_TO_END_FACTOR,
    OP_CLASSES,
    Budget,
    Verdict,
    budget_for,
    condition_bound,
    end_to_end_bound,
    op_class,
    parse_budget_overrides,
    peer_ratio_check,
)
from .ulp import ComparatorError, UnsupportedDtypeError, ulp_distance, ulp_error, ulp_spacing

__all__ = [
    "ulp_distance",
    "ulp_error",
    "ulp_spacing",
    "compare_tensors",
    "TensorMetrics",
    "Budget",
    "Verdict",
    "budget_for",
    "op_class",
    "peer_ratio_check",
    "parse_budget_overrides",
    "condition_bound",
    "OP_CLASSES",
    "END_TO_END_FACTOR",
    "end_to_end_bound",
    "ComparatorError",
    "UnsupportedDtypeError",
]
