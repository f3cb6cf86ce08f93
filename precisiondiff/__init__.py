"""precisiondiff: find the operator whose arithmetic is wrong on an accelerator.

Public API::

    precisiondiff.capture(out, model=...)     # record a model's numerics into a dump
    precisiondiff.load(path)                  # read a dump
    precisiondiff.compare(a, b)               # align two dumps and measure every tensor
    precisiondiff.bisect(workload)            # localize the culprit kernel
    precisiondiff.watch(out, model=...)       # monitor a long training run, a few numbers per layer
    precisiondiff.Workload, precisiondiff.Target

Heavy parts (torch, the dump reader, comparisons, bisect, rich, h5py, matplotlib) load on first
use, so ``import precisiondiff`` stays cheap.
"""
from __future__ import annotations

import importlib
from typing import Any

from .errors import PrecisionDiffError

__version__ = "0.1.0"

__all__ = [
    "PrecisionDiffError",
    "Target",
    "Workload",
    "bisect",
    "bisect_dump",
    "capture",
    "compare",
    "load",
    "register_reference",
    "watch",
    "__version__",
]

# name -> (module, attribute), imported on first access (PEP 562)
_LAZY = {
    # torch loads with the first of these, not with ``import precisiondiff`` (the pytest plugin
    # is imported by every pytest run once precisiondiff is installed)
    "Target": (".runtime.targets", "Target"),
    "Workload": (".runtime.workload", "Workload"),
    "capture": (".capture", None),
    "load": (".store", "load"),
    # the packages of these three names are callable as their function (see _callable.py)
    "compare": (".compare", None),
    "bisect": (".bisect", None),
    "bisect_dump": (".bisect", "bisect_dump"),
    "register_reference": (".bisect", "register_reference"),
    "watch": (".watch", None),  # callable as its function, like capture
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        imported = importlib.import_module(module, __name__)
        value = imported if attr is None else getattr(imported, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'precisiondiff' has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
