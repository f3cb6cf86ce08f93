"""Copying a model for a target when ``copy.deepcopy`` cannot copy everything it holds:
:func:`copy_model`.

Framework layers keep objects that cannot be copied: Megatron's tensor-parallel layers and
DeepSpeed's engine hold ``ProcessGroup`` handles (``TypeError: cannot pickle
'torch._C._distributed_c10d.ProcessGroup' object``), others thread locks or C++ handles. Such an
object is a handle on something process-wide (a communicator, a lock), not state of the model: the
copy **shares** it with the original, and copies everything else (parameters, buffers, submodules,
plain attributes) as ``copy.deepcopy`` does, and the attributes frameworks set on parameters
(which ``Parameter.__deepcopy__`` drops). They are found by walking the model's attributes
(into containers and plain objects, never into tensors) and trying to copy each; the walk runs only
when the plain deep copy failed.
"""
from __future__ import annotations

import copy
import logging
import types
from typing import Any, Dict, List

import torch

from ..errors import WorkloadError

__all__ = ["copy_model"]

log = logging.getLogger(__name__)

_ATOMIC = (str, bytes, int, float, complex, bool, type(None), type, types.FunctionType,
           types.BuiltinFunctionType, types.ModuleType, torch.dtype, torch.device)
_MAX_DEPTH = 64


def copy_model(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model``, sharing with it the objects that cannot be copied (module
    docstring).

    Raises:
        WorkloadError: the model cannot be copied even so (one line, naming what failed).

    Example:
        >>> copy_model(torch.nn.Linear(2, 2)).weight.data_ptr() != 0
        True
    """
    memo: Dict[int, Any] = {}
    try:
        return _with_parameter_attributes(model, copy.deepcopy(model, memo), memo)
    except Exception as err:  # noqa: BLE001 - any failure of the plain copy: try sharing handles
        first = err
    shared = _uncopyable(model)
    memo = {id(obj): obj for obj in shared}
    try:
        moved = _with_parameter_attributes(model, copy.deepcopy(model, memo), memo)
    except Exception as err:  # noqa: BLE001 - reported in one line
        raise WorkloadError(f"cannot copy the model for the target: copy.deepcopy raised "
                            f"{type(first).__name__}: {first}; make the objects it holds copyable (or "
                            "give them a __deepcopy__), or capture the script with --script") from err
    names = sorted({type(obj).__name__ for obj in shared})
    log.info("the model's copy shares %d object(s) deepcopy cannot copy: %s", len(shared), ", ".join(names))
    return moved


def _with_parameter_attributes(model: torch.nn.Module, moved: torch.nn.Module, memo: Dict[int, Any]) -> torch.nn.Module:
    """``moved`` with the Python attributes of ``model``'s parameters (Megatron's
    ``tensor_model_parallel`` / ``partition_dim``, DeepSpeed's ``ds_*``): ``Parameter.__deepcopy__``
    drops them; one that cannot be copied is shared, as the model's handles are."""
    pairs = zip(model.named_parameters(remove_duplicate=False), moved.named_parameters(remove_duplicate=False))
    for (_, original), (_, copied) in pairs:
        if original.__dict__ and not copied.__dict__:
            for name, value in original.__dict__.items():
                try:
                    copied.__dict__[name] = copy.deepcopy(value, memo)
                except Exception:  # noqa: BLE001 - a handle (a bound method of an engine...): shared
                    copied.__dict__[name] = value
    return moved


def _copyable(obj: Any) -> bool:
    try:
        copy.deepcopy(obj)
    except Exception:  # noqa: BLE001 - what makes an object uncopyable is unbounded
        return False
    return True


def _children(obj: Any) -> List[Any]:
    if isinstance(obj, dict):
        return [*obj.keys(), *obj.values()]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    state = list(getattr(obj, "__dict__", {}).values())
    for cls in type(obj).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if isinstance(slot, str) and hasattr(obj, slot):
                state.append(getattr(obj, slot))
    return state


def _uncopyable(root: torch.nn.Module) -> List[Any]:
    """The objects reachable from ``root`` that deepcopy cannot copy while their children (if
    any) can: the ones to share."""
    found: List[Any] = []
    seen = set()
    stack = [(root, 0)]
    while stack:
        obj, depth = stack.pop()
        if id(obj) in seen or depth > _MAX_DEPTH or isinstance(obj, (torch.Tensor,) + _ATOMIC):
            continue
        seen.add(id(obj))
        # a module is never tried whole (that would copy its parameters again at every level)
        if not isinstance(obj, torch.nn.Module) and _copyable(obj):
            continue
        children = _children(obj)
        bad = [c for c in children if not isinstance(c, (torch.Tensor,) + _ATOMIC)
               and (isinstance(c, torch.nn.Module) or not _copyable(c))]
        if not bad and not isinstance(obj, (torch.nn.Module, dict, list, tuple, set, frozenset)):
            found.append(obj)  # its own fault: a handle
            continue
        stack.extend((c, depth + 1) for c in bad)
    return found
