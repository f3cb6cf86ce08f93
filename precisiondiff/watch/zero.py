"""Watch under a DeepSpeed ZeRO engine: per-parameter numbers from each rank's fragments.

A ZeRO optimizer hands the ``torch.optim`` optimizer it wraps one flat fp32 partition per param
group (this rank's slice of the concatenated parameters; ZeRO-3: this rank's partition of every
parameter), and the optimizer's state tensors have the partition's shape. Watch's optimizer hooks
see that optimizer; here each model parameter's fragment of the partition is found
(:func:`precisiondiff.capture.deepspeed.zero_fragments`: ``p._hp_mapping`` under ZeRO-1/2, the
ZeRO-3 optimizer's ``grad_position``) and measured as a parameter of its own, under the model's
parameter name:

- ``grad``: the norm of the fragment of the partition's ``.grad`` as the wrapped optimizer's step
  begins (the gradient it steps with: reduced, and clipped by DeepSpeed's ``gradient_clipping``);
- ``weight``: the fp32 master fragment after the step; ``update_ratio`` ``‖Δw‖ / ‖w‖`` of the
  fragment; ``state.KEY``: the fragment of each state tensor of the partition's shape.

No collective and no copy beyond the update ratio's (the fragments of the partition, once every
``param_every``-th watched step, as for any optimizer): a few views and one ``_foreach_norm``.
Each rank logs the parameters it holds a piece of; the header's ``model.shards`` marks them
``ZeRO`` (placements ``["ZeRO"]``, mesh: the job's ranks), and :func:`.shards.combine_ranks`
combines a parameter's numbers over the ranks that logged it by root sum of squares (the
fragments partition the parameter). Padding in the partition belongs to no parameter.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..capture.deepspeed import Fragment, zero_fragments
from .tensors import _norms, snapshot, unwrapped, update_norms

__all__ = ["zero_before", "zero_after", "zero_shards", "zero_shape", "ZERO_PLACEMENT"]

#: the placement of a parameter a rank holds a ZeRO fragment of (watch header ``model.shards``)
ZERO_PLACEMENT = "ZeRO"


def _named(w: Any) -> List[Tuple[str, torch.Tensor]]:
    """The watched model's parameters with their names (the roots a script ran, or ``model``)."""
    model = w._model() if w._model is not None else None
    roots = [(unwrapped(model), "")] if model is not None else [(ref(), prefix) for ref, prefix in w._root_refs]
    return [(f"{prefix}.{name}" if prefix else name, p) for root, prefix in roots if root is not None
            for name, p in root.named_parameters()]


def _fragments(w: Any, optimizer: Any) -> Optional[List[Fragment]]:
    """This rank's fragments of the partitions ``optimizer`` steps now (cached per partition set:
    ZeRO-3 steps its sub-groups one at a time); None for an optimizer of no ZeRO engine."""
    # optimizers of no ZeRO engine (the common case: one lookup a step), held weakly: by id(), an
    # optimizer created later at a freed one's address would inherit its verdict
    plain: "weakref.WeakSet[Any]" = w.__dict__.setdefault("_zero_plain", weakref.WeakSet())
    try:
        if optimizer in plain:
            return None
    except TypeError:  # an optimizer that takes no weak reference: looked at every step
        pass
    cache: Dict[tuple, Optional[List[Fragment]]] = w.__dict__.setdefault("_zero_fragments", {})
    flats = tuple(id(p) for group in getattr(optimizer, "param_groups", []) or [] for p in group.get("params", []))
    key = (id(optimizer), flats)
    if key not in cache:
        found = zero_fragments(optimizer, _named(w))
        if found is None and not any(k[0] == id(optimizer) for k in cache):
            try:
                plain.add(optimizer)
            except TypeError:
                pass
            return None
        cache[key] = found
        if found:
            held: Dict[str, Fragment] = w.__dict__.setdefault("_zero_held", {})
            for f in found:
                held.setdefault(f.name, f)
    return cache[key]


def zero_before(w: Any, optimizer: Any) -> bool:
    """At the wrapped optimizer's step pre-hook: each fragment's gradient norm, and the copies
    the update ratio needs; False (nothing done) when ``optimizer`` steps no ZeRO partition."""
    fragments = _fragments(w, optimizer)
    if not fragments:
        return False
    with torch.no_grad():
        grads = [(f.name, f.of(f.flat.grad)) for f in fragments if f.flat.grad is not None]
        w._scalars([(name, "grad") for name, _ in grads], _norms([g for _, g in grads]), [g for _, g in grads])
        w._grads_done.update(id(f.flat) for f in fragments)
        if w._params_full:
            w._before[id(optimizer)] = snapshot([f.of(f.flat) for f in fragments], w._snapshot_memory(optimizer))
    return True


def zero_after(w: Any, optimizer: Any) -> bool:
    """At the wrapped optimizer's step post-hook: each fragment's weight norm, update ratio and
    (every ``param_every``-th watched step) state norms; False when not a ZeRO partition."""
    fragments = _fragments(w, optimizer)
    if not fragments:
        return False
    views = [f.of(f.flat) for f in fragments]
    before = w._before.pop(id(optimizer), None)
    if before is not None and len(before) == len(views):
        weights, updates = update_norms(views, before)  # one pass over both (tensors.update_norms)
        del before
        w._scalars([(f.name, "weight") for f in fragments], weights, views)
        w._scalars([(f.name, "update_ratio") for f in fragments], torch._foreach_div(updates, weights), views)
    else:
        w._scalars([(f.name, "weight") for f in fragments], _norms(views), views)
    if w._params_full:
        names, tensors = [], []
        for f in fragments:
            for what, value in (getattr(optimizer, "state", {}).get(f.flat) or {}).items():
                if isinstance(value, torch.Tensor) and value.shape == f.flat.shape and value.numel() > 1:
                    names.append((f.name, f"state.{what}"))
                    tensors.append(f.of(value))
        w._scalars(names, _norms(tensors), tensors)
    return True


def zero_shards(w: Any) -> Dict[str, Dict[str, Any]]:
    """``model.shards`` entries of the parameters this rank holds ZeRO fragments of."""
    held: Dict[str, Fragment] = w.__dict__.get("_zero_held", {})
    if not held:
        return {}
    mesh = list(range(max(1, int(w.world_size))))
    return {name: {"placements": [ZERO_PLACEMENT], "mesh": mesh, "fragment": [f.offset, f.numel]}
            for name, f in held.items()}


def zero_shape(p: torch.Tensor) -> List[int]:
    """A parameter's full shape (a ZeRO-3 parameter's tensor is empty outside its module's call)."""
    shape = getattr(p, "ds_shape", None)
    return list(shape) if shape is not None else list(p.shape)
