"""Confirmation by substitution: rerun the DUT with the culprit's output replaced by its golden
value (cast to the DUT dtype), and measure the final error again.

An op culprit is matched by its ordinal among the calls of the same op in the step (the same as
(scope, name, direction, call) in a deterministic rerun); a module culprit by its call number
through a forward hook (forward) or a full backward hook (backward, replacing ``grad_input``).
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Dict, Iterator, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..capture.serialize import flatten_tensors

__all__ = ["ReplaceOpMode", "replace_module_output", "final_errors"]


class ReplaceOpMode(TorchDispatchMode):
    """Replace the floating outputs of the ``ordinal``-th call of op ``name``."""

    def __init__(self, name: str, ordinal: int, golden: Dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.name, self.ordinal, self.golden = name, ordinal, golden
        self.seen = 0
        self.replaced = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if str(func) != self.name:
            return out
        index, self.seen = self.seen, self.seen + 1
        if index != self.ordinal:
            return out
        self.replaced = True
        inputs = {id(t) for t in flatten_tensors((args, kwargs))}
        position = [0]

        def swap(v: Any) -> Any:
            if not isinstance(v, torch.Tensor):
                return v
            i = position[0]
            position[0] += 1
            g = self.golden.get(i)
            if g is None or not v.is_floating_point() or tuple(g.shape) != tuple(v.shape):
                return v
            new = g.to(device=v.device, dtype=v.dtype)
            if id(v) in inputs:
                v.copy_(new)
                return v
            return new
        return torch.utils._pytree.tree_map(swap, out)


@contextlib.contextmanager
def replace_module_output(module: torch.nn.Module, direction: str, call: int,
                          golden: Dict[str, torch.Tensor]) -> Iterator[List[bool]]:
    """Hooks on ``module`` replacing its ``call``-th forward output (``output.N``) or backward
    ``grad_input.N`` with the golden values. Yields a one-element list set True on replacement."""
    state = {"calls": 0}
    done = [False]

    def cast(g: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return g.to(device=like.device, dtype=like.dtype)

    def fwd(mod: Any, args: Any, output: Any) -> Any:
        index, state["calls"] = state["calls"], state["calls"] + 1
        if index != call:
            return None
        done[0] = True
        if isinstance(output, torch.Tensor):
            g = golden.get("output.0")
            return cast(g, output) if g is not None else output
        if isinstance(output, tuple):
            return type(output)(cast(golden[f"output.{i}"], o) if isinstance(o, torch.Tensor)
                                and f"output.{i}" in golden else o for i, o in enumerate(output))
        return None

    def bwd(mod: Any, grad_input: Any, grad_output: Any) -> Any:
        index, state["calls"] = state["calls"], state["calls"] + 1
        if index != call:
            return None
        done[0] = True
        return tuple(cast(golden[f"grad_input.{i}"], g) if isinstance(g, torch.Tensor)
                     and f"grad_input.{i}" in golden else g for i, g in enumerate(grad_input))

    handle = (module.register_forward_hook(fwd) if direction == "forward"
              else module.register_full_backward_hook(bwd))
    try:
        with warnings.catch_warnings():
            # a module returning a ModelOutput (transformers) gets no backward hook call: torch
            # warns, the substitution is reported as not done (``done`` stays False)
            warnings.filterwarnings("ignore", message="For backward hooks to be called")
            yield done
    finally:
        handle.remove()


def final_errors(output: Any, loss: Any, grads: Dict[str, torch.Tensor], ref_output: Any,
                 ref_loss: Any, ref_grads: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """Relative L2 errors of the output, the loss and all parameter gradients (one vector),
    and ``final``: the worst of them (docs/bisect.md, "Final error")."""
    from .judge import rel_l2
    out: Dict[str, float] = {}
    a, b = flatten_tensors(output), flatten_tensors(ref_output)
    pairs = [(x, y) for x, y in zip(a, b) if x.is_floating_point() and x.shape == y.shape]
    if pairs:
        out["output"] = rel_l2(torch.cat([x.detach().flatten().double().cpu() for x, _ in pairs]),
                               torch.cat([y.detach().flatten().double().cpu() for _, y in pairs]))
    if loss is not None and ref_loss is not None:
        out["loss"] = rel_l2(loss.detach().reshape(1), ref_loss.detach().reshape(1))
    names = [n for n in grads if n in ref_grads and grads[n].shape == ref_grads[n].shape]
    if names:
        out["param_grads"] = rel_l2(torch.cat([grads[n].detach().flatten().double().cpu() for n in names]),
                                    torch.cat([ref_grads[n].detach().flatten().double().cpu() for n in names]))
    out["final"] = max(out.values()) if out else 0.0
    return out
