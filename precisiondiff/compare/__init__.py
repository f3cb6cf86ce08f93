"""Compare: align the events of two dumps and measure every tensor pair.

Stage 3 of capture -> store -> compare -> bisect. May import store/, comparators/ and runtime/;
and capture.filters (selection regexes); never bisect/, report/ or the faces (cli/, testing/). ``precisiondiff.compare(a, b)``
calls :func:`compare` (the package is callable, see ``_callable.py``).
"""
from .comparison import Comparison, Row
from .dumps import DEFAULT_SLOTS, NOISE_FACTOR, UNINITIALIZED, compare

__all__ = ["Row", "Comparison", "compare", "NOISE_FACTOR", "DEFAULT_SLOTS", "UNINITIALIZED"]

from .._callable import make_callable  # noqa: E402

make_callable(__name__, "compare")
