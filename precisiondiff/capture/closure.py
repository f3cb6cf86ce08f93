"""Optimizer steps given a closure: :func:`after_closure`, for step pre-hooks.

``optimizer.step(closure)`` runs the closure (zero_grad, forward, backward) inside ``step()``,
after the step's pre-hooks: Lightning's automatic optimization does (``optimizer.step(closure=...)``,
with its ``on_before_optimizer_step`` and gradient clipping inside the closure), and LBFGS. A
pre-hook that reads the gradients, or marks where the update begins, would run before there are
any, and the forward and backward would fall inside the update. torch lets a pre-hook return new
``(args, kwargs)`` for the step: the closure is wrapped, and the hook's work runs when the
closure first returns. A step without a closure is left as it is.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

__all__ = ["after_closure"]


def after_closure(args: tuple, kwargs: dict, work: Callable[[], None]) -> Optional[Tuple[tuple, dict]]:
    """Run ``work()`` now, or, when the step was given a closure, once the closure first returns.

    Args:
        args: the step's positional arguments as a pre-hook receives them (the optimizer first).
        kwargs: its keyword arguments.
        work: what the pre-hook does before the update.

    Returns:
        ``None`` (``work`` has run), or the ``(args, kwargs)`` the pre-hook returns to torch: the
        same, with the closure wrapped.

    Example:
        >>> after_closure((None,), {}, lambda: print("now"))
        now
    """
    closure = kwargs.get("closure")
    positional = closure is None and len(args) > 1 and callable(args[1])
    if positional:
        closure = args[1]
    if not callable(closure):
        work()
        return None
    done = False

    def wrapped():
        nonlocal done
        out = closure()
        if not done:
            done = True
            work()
        return out

    if positional:
        return (args[0], wrapped, *args[2:]), kwargs
    return args, {**kwargs, "closure": wrapped}
