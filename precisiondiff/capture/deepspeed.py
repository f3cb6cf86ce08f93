"""DeepSpeed ZeRO: where the engine keeps a parameter's gradient, for capture's ``param`` events.

Under ZeRO stage 1 and 2, DeepSpeed's own gradient hook moves each parameter's gradient out of
``p.grad`` as soon as autograd accumulates it (into its reduction buckets), and at the end of the
backward keeps the reduced gradients of the rank's partition in ``averaged_gradients``, one
tensor per parameter; its ``step()`` then flattens them into the fp32 partition's ``.grad``,
**clips them in place** (``gradient_clipping``, 1.0 by default) and calls the wrapped
``torch.optim`` optimizer. So ``p.grad`` is ``None`` by the time the optimizer runs, and the
flat partition holds the clipped gradient, not the backward's.

Capture takes them in between: :func:`zero_step_hook` wraps the engine optimizer's ``step`` on
the instance (DeepSpeed's class is not changed) so capture's parameter gradients are taken
first, and :func:`zero_gradient` reads each one through the parameter's link to its partition
(``p._hp_mapping.get_lp_grad_fragment(p._index_in_param_group)``, what DeepSpeed's own
``safe_get_full_grad`` reads), in the parameter's shape. That is the gradient reduced across the
data-parallel ranks, in the engine's gradient accumulation dtype (bf16 in a bf16 ZeRO-1/2 job unless
``data_types.grad_accum_dtype`` says otherwise), before clipping.

Only a parameter the rank holds whole (one rank, or one inside this rank's partition) is
recorded: a parameter split between two ranks' partitions, or held by another rank, has no whole
gradient here, and assembling one would need a collective inside the engine's step. Nothing here
imports DeepSpeed: the engine's objects are read by their attributes.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

__all__ = ["zero_gradient", "zero_step_hook", "GRADIENT_SOURCE"]

#: the ``param_grads_from`` note of meta.json when a gradient came from here
GRADIENT_SOURCE = ("DeepSpeed ZeRO-1/2: the reduced gradient partition, read per whole parameter through "
                   "p._hp_mapping at the start of the engine optimizer's step(), before clipping")


def zero_gradient(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The reduced gradient a ZeRO-1/2 optimizer holds for ``param`` between the backward and
    its ``step()``, in ``param``'s shape, or None (not a ZeRO parameter, outside that window, or
    only part of the parameter on this rank).

    Example:
        >>> zero_gradient(torch.nn.Parameter(torch.ones(2))) is None
        True
    """
    mapping = getattr(param, "_hp_mapping", None)
    index = getattr(param, "_index_in_param_group", None)
    if mapping is None or index is None:
        return None
    try:
        if int(mapping.lp_fragment_address.numel) != param.numel():
            return None  # split between ranks' partitions: no whole gradient on this rank
        grad = mapping.get_lp_grad_fragment(index)
    except (AttributeError, ValueError, KeyError, IndexError, TypeError):
        return None  # "Gradients are only available immediately after backward and before engine step"
    if isinstance(grad, torch.Tensor) and grad.numel() == param.numel():
        return grad.view(param.shape)
    return None


class _StepHook:
    """``engine.optimizer.step`` wrapped (on the instance, DeepSpeed's class untouched) so that
    ``before()`` runs first; ``remove()`` restores it."""

    def __init__(self, optimizer: Any, before: Callable[[], None]) -> None:
        self.optimizer = optimizer
        original = optimizer.step  # the bound method

        def step(*args: Any, **kwargs: Any) -> Any:
            if self.active:
                before()
            return original(*args, **kwargs)

        self.active = True
        self.wrapper = step
        optimizer.step = step

    def remove(self) -> None:
        self.active = False
        if self.optimizer.__dict__.get("step") is self.wrapper:
            del self.optimizer.step


def zero_step_hook(engine: Any, before: Callable[[], None]) -> Optional[_StepHook]:
    """Run ``before()`` at the start of a ZeRO-1/2 engine's optimizer ``step()`` (where capture
    takes the parameter gradients: reduced, not yet clipped); None for another engine or stage.

    Example:
        >>> zero_step_hook(torch.nn.Linear(1, 1), lambda: None) is None
        True
    """
    optimizer = getattr(engine, "optimizer", None)
    groups = getattr(optimizer, "bit16_groups", None)
    if optimizer is None or not groups or not callable(getattr(optimizer, "step", None)):
        return None
    if not any(getattr(p, "_hp_mapping", None) is not None for group in groups for p in group):
        return None
    return _StepHook(optimizer, before)
