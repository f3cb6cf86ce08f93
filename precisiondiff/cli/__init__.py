"""The ``precisiondiff`` command line: thin commands over the library, one module per command group
and one option table (``options.py``) shared with the pytest plugin. A face: may import every
stage; nothing below imports it.

Exit codes: 0 ran, parity; 1 ran, divergence (or a damaged dump for ``verify``); 2 bad input.

The group lives in ``app.py`` and loads on first use, so the option table (``options.py``) is
importable without click: the pytest plugin reads it at start-up.
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["main", "cli"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        value = getattr(importlib.import_module(".app", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
