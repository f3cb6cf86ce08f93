"""The testing face: assertion helpers, the ``parity`` fixture machinery, the pytest plugin and
hypothesis strategies.

It sits on top of the library (may import every stage and ``cli.options``); nothing below imports it.
Names load on first use, so the pytest plugin (``testing.plugin``) starts without importing torch.
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["assert_ulp_close", "assert_parity", "assert_op_parity"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        value = getattr(importlib.import_module(".assertions", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
