"""Budget overrides: ``{key: {field: value}}`` checked field by field, and the CLI spelling
``[KEY:]FIELD=VALUE`` parsed into it."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Dict, Mapping, Sequence, Union

import torch

from .ulp import ComparatorError, float_format

if TYPE_CHECKING:
    from .tolerance import Budget

__all__ = ["parse_budget_overrides", "apply_override", "dtype_of", "FIELDS"]


def dtype_of(dtype: Union[str, torch.dtype]) -> torch.dtype:
    """A torch dtype with a ULP definition from a dtype or its name."""
    if isinstance(dtype, torch.dtype):
        float_format(dtype)
        return dtype
    dt = getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise ComparatorError(f"unknown dtype {dtype!r}")
    float_format(dt)
    return dt


FIELDS = {"max_ulp", "rounding_ulps", "accum_factor", "accum_dtype"}


def apply_override(b: "Budget", key: str, changes: Mapping[str, Any]) -> "Budget":
    """``b`` with the fields of one override entry changed (each checked)."""
    if not isinstance(changes, Mapping):
        raise ComparatorError(f"budget override for {key!r} must be a dict, got {changes!r}")
    kw: Dict[str, Any] = {}
    for name, val in changes.items():
        if name not in FIELDS:
            raise ComparatorError(
                f"unknown budget field {name!r} for {key!r}; fields: {', '.join(sorted(FIELDS))}")
        if name == "accum_dtype":
            kw[name] = str(dtype_of(val)).replace("torch.", "")
            continue
        try:
            f = float(val)
        except (TypeError, ValueError):
            raise ComparatorError(f"budget {key!r}: {name} must be a number, got {val!r}") from None
        if not (f >= 0 and math.isfinite(f)):
            raise ComparatorError(f"budget {key!r}: {name} must be finite and >= 0, got {val!r}")
        kw[name] = f
    return replace(b, **kw)


def parse_budget_overrides(items: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    """Parse CLI overrides ``[KEY:]FIELD=VALUE`` into the dict :func:`budget_for` takes.

    SCOPE is an op name, op class or dtype name; without it the override applies to all.

    Raises:
        ComparatorError: An item is malformed or names an unknown field.

    Example:
        >>> parse_budget_overrides(["max_ulp=4", "aten.mm:accum_factor=2"])
        {'*': {'max_ulp': 4.0}, 'aten.mm': {'accum_factor': 2.0}}
    """
    out: Dict[str, Dict[str, Any]] = {}
    for item in items:
        left, eq, value = item.partition("=")
        if not eq or not value.strip() or not left.strip():
            raise ComparatorError(f"budget override {item!r} is not [KEY:]FIELD=VALUE")
        scope, colon, field = left.rpartition(":")
        if not colon:
            scope = "*"
        scope, field, value = scope.strip(), field.strip(), value.strip()
        if not scope:
            raise ComparatorError(f"budget override {item!r} has an empty scope")
        if field not in FIELDS:
            raise ComparatorError(
                f"budget override {item!r}: unknown field {field!r}; "
                f"fields: {', '.join(sorted(FIELDS))}")
        if field == "accum_dtype":
            val: Any = str(dtype_of(value)).replace("torch.", "")
        else:
            try:
                val = float(value)
            except ValueError:
                raise ComparatorError(f"budget override {item!r}: {value!r} is not a number") from None
            if not (val >= 0 and math.isfinite(val)):
                raise ComparatorError(f"budget override {item!r}: value must be finite and >= 0")
        out.setdefault(scope, {})[field] = val
    return out
