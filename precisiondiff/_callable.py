"""``precisiondiff.compare`` and ``precisiondiff.bisect`` are both a function (DESIGN.md's
public API) and a module of the same name (its layout). Importing a submodule rebinds the
package attribute to the module, so the module itself is made callable: either way
``precisiondiff.compare(a, b)`` calls the function."""
from __future__ import annotations

import sys
import types

__all__ = ["make_callable"]


def make_callable(module_name: str, function_name: str) -> None:
    """Make module ``module_name`` callable as its function ``function_name``."""
    module = sys.modules[module_name]
    function = getattr(module, function_name)

    class CallableModule(types.ModuleType):
        __doc__ = function.__doc__

        def __call__(self, *args, **kwargs):
            return getattr(self, function_name)(*args, **kwargs)

    module.__class__ = CallableModule
