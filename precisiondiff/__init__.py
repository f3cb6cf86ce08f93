"""precisiondiff: find the operator whose arithmetic is wrong on an accelerator.

Public API: :func:`load`, :func:`capture`, :func:`compare`, :func:`bisect`,
:class:`Workload`, :class:`Target`.
"""
from __future__ import annotations

from .errors import PrecisionDiffError
from .targets import Target
from .workload import Workload

__version__ = "0.1.0"

__all__ = [
    "PrecisionDiffError",
    "Target",
    "Workload",
    "__version__",
]
