"""``precisiondiff.strategies``: the public name of :mod:`precisiondiff.testing.strategies`."""
from .testing.strategies import *  # noqa: F401,F403
from .testing.strategies import __all__  # noqa: F401
