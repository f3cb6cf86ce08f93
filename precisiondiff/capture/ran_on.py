"""Which device an op really ran on: the target's, or the CPU through the backend's fallback.

Out-of-tree backends (torch_mlu, and any other PrivateUse1 device) register kernels for the ops
they implement and one boxed *fallback* for the rest, which copies the inputs to the CPU, runs the
CPU kernel and copies the results back. The results land on the device either way, so the output
tensor cannot tell; PyTorch's dispatcher can. An op runs through the fallback when its backend key
has no kernel of its own and no composite kernel that decomposes it on the device; a structured
functional op (``gelu``) runs through its ``.out`` overload, so that overload decides.
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch

__all__ = ["ran_on"]

# The overloads of an op never change; which ops a backend implements can (kernels registered at
# run time), so that is asked of the dispatcher on every call: a few lookups in C++.
_OUT_VARIANTS: Dict[str, List[str]] = {}


def _backend_key(device_type: str) -> "str | None":
    """The dispatch key of a device type's dense kernels; None for one without a CPU fallback."""
    if device_type == torch._C._get_privateuse1_backend_name():
        return "PrivateUse1"
    return None


def _falls_back(name: str, key: str) -> bool:
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    if has(name, key):
        return False
    if has(name, "CompositeExplicitAutogradNonFunctional"):
        # a structured op's functional and in-place variants call its out= variant
        return any(_falls_back(out, key) for out in _out_variants(name) if out != name)
    if has(name, "CompositeExplicitAutograd") or has(name, "CompositeImplicitAutograd"):
        return False
    has_fallback = getattr(torch._C, "_dispatch_has_backend_fallback", None)
    return has_fallback is None or bool(has_fallback(getattr(torch._C.DispatchKey, key)))


def _out_variants(name: str) -> List[str]:
    """``aten::gelu`` -> ``["aten::gelu.out"]``: the overloads of the op with out= arguments."""
    if name not in _OUT_VARIANTS:
        _OUT_VARIANTS[name] = _find_out_variants(name)
    return _OUT_VARIANTS[name]


def _find_out_variants(name: str) -> List[str]:
    qualified = name.partition(".")[0]
    namespace, _, base = qualified.partition("::")
    packet = getattr(getattr(torch.ops, namespace, None), base.rstrip("_"), None)
    if packet is None:
        return []
    outs = []
    for overload in packet.overloads():
        schema = getattr(packet, overload)._schema
        if any(arg.is_out for arg in schema.arguments):
            outs.append(f"{namespace}::{base.rstrip('_')}.{overload}")
    return outs


def ran_on(func: Any, device: str) -> str:
    """The device ``func`` (an ``OpOverload``) ran on when its outputs are on ``device``.

    ``"cpu"`` for an op an out-of-tree backend leaves to its CPU fallback, else ``device``.

    Example:
        >>> ran_on(torch.ops.aten.add.Tensor, "cpu")
        'cpu'
    """
    device_type = device.partition(":")[0]
    key = _backend_key(device_type)
    if key is None:
        return device
    name = func.name() if hasattr(func, "name") else str(func)
    try:
        fell_back = _falls_back(name, key)
    except Exception:  # not a dispatcher op (a higher-order op, say): it ran where its outputs are;
        fell_back = False  # and capture never raises into the user's workload
    return "cpu" if fell_back else device
