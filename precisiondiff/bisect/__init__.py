"""Bisect: localize the op, fused kernel or module whose own arithmetic is wrong on the DUT.

See docs/bisect.md. :func:`bisect` runs a workload live; :func:`bisect_dump` works from a dump
captured with ``--mode replay``, :func:`bisect_ranks` from the per-rank dumps of a multi-rank job,
:func:`bisect_script` from a script it captures first (in every process of a torchrun job)
(docs/distributed.md); :func:`register_reference` gives ops without a golden-dtype
implementation a reference.

Stage 4. May import runtime/, capture/, store/, comparators/ and compare/; never the faces.
"""
from .live import bisect
from .offline import bisect_dump
from .ranks import bisect_ranks
from .script import bisect_script
from .references import register_reference
from .result import BisectResult

__all__ = ["bisect", "bisect_dump", "bisect_ranks", "bisect_script", "register_reference", "BisectResult"]

from .._callable import make_callable  # noqa: E402

make_callable(__name__, "bisect")
