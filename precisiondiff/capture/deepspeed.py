"""DeepSpeed ZeRO: where the engine keeps a parameter's gradient and its slice of the flat fp32
partition, for capture's ``param`` events, its optimizer events and watch (docs/frameworks.md).

**Gradients.** ZeRO moves each parameter's gradient out of ``p.grad`` as soon as autograd
accumulates it (into its reduction buckets) and keeps, between the backward and its ``step()``,
the reduced gradients of the rank's partition, in the engine's gradient accumulation dtype (bf16
in a bf16 job unless ``data_types.grad_accum_dtype`` says otherwise); its ``step()`` then
flattens them into the fp32 partition's ``.grad``, **clips them in place**
(``gradient_clipping``) and calls the wrapped ``torch.optim`` optimizer. Capture takes them in
between: :func:`zero_step_hook` wraps the engine optimizer's ``step`` on the instance (DeepSpeed's
class is not changed) so that capture's parameter gradients are taken first, reduced and not yet
clipped:

- ZeRO-1/2, a parameter inside this rank's partition: read through the parameter's link to the
  partition (``p._hp_mapping.get_lp_grad_fragment(p._index_in_param_group)``), no collective;
- ZeRO-1/2, a parameter split between two ranks' partitions (at most one per partition
  boundary): assembled with DeepSpeed's own ``p.get_full_hp_grad()`` (what
  ``deepspeed.utils.safe_get_full_grad`` calls: one all-reduce of the parameter's size in
  float32 on every rank) and recorded by the lowest rank holding a piece of it. Which parameters
  are split is agreed once, at the first captured step (two all-reduces of one integer per
  parameter);
- ZeRO-3 (every rank holds 1/world of every parameter): one rank alone holds them whole and
  reads them with no collective (``get_local_fp32_grad_for_param``); on several ranks each
  parameter is gathered with ``get_fp32_grad_for_param`` (``safe_get_full_grad``: one
  all-gather of the parameter's size in float32 per parameter and captured step, on every rank;
  peak extra memory: the largest parameter, in float32) and recorded by rank 0 of its partition
  group.

The gathered values are rounded back to the engine's accumulation dtype, which is exact (a sum of
one fragment and zeros, or a concatenation). The collectives run on every rank at the same point
of the engine's step, whether or not this rank records (``--ranks``, an earlier capture error),
at every step the capture's ``--steps`` selects, with capture suspended (they are not recorded).

**Fragments.** :func:`zero_fragments` links the wrapped ``torch.optim`` optimizer's flat fp32
partitions (its only parameters under ZeRO) to the model parameters they hold: for each, its
slice ``[start, start + numel)`` of the flat partition, which the optimizer's state tensors
share. Capture's optimizer events slice element-wise ops on a flat partition per parameter
(:func:`fragment_slices`), and watch measures each parameter's fragment (watch/zero.py).

Nothing here imports DeepSpeed: the engine's objects are read by their attributes.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

__all__ = ["zero_gradient", "zero_step_hook", "zero_fragments", "fragment_slices", "Fragment", "GRADIENT_SOURCE",
           "FLAT_PARTITION"]

log = logging.getLogger(__name__)

#: the ``param_grads_from`` note of meta.json when a gradient came from here
GRADIENT_SOURCE = ("DeepSpeed ZeRO: the reduced gradients the engine holds between the backward and its optimizer's "
                   "step(), before clipping (ZeRO-1/2: through p._hp_mapping; a parameter split between ranks' "
                   "partitions and ZeRO-3 parameters on several ranks: gathered, docs/frameworks.md)")

#: the parameter name of a ZeRO flat partition itself (an optimizer op on the whole partition)
FLAT_PARTITION = "flat_partition"

# id(parameter) -> its gradient gathered for this step's capture (None: another rank records it);
# filled only while the step hook's before() runs (tensors compare by value: keyed by id)
_GATHERED: Dict[int, Optional[torch.Tensor]] = {}
# the wrapped torch optimizer -> the ZeRO optimizer around it (from the engines capture met)
_WRAPPERS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def zero_gradient(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The reduced gradient a ZeRO optimizer holds for ``param`` between the backward and its
    ``step()``, in ``param``'s shape, or None (not a ZeRO parameter, outside that window, or one
    another rank records).

    Example:
        >>> zero_gradient(torch.nn.Parameter(torch.ones(2))) is None
        True
    """
    if id(param) in _GATHERED:
        return _GATHERED[id(param)]
    mapping = getattr(param, "_hp_mapping", None)
    index = getattr(param, "_index_in_param_group", None)
    if mapping is None or index is None:
        return None
    try:
        if int(mapping.lp_fragment_address.numel) != param.numel():
            return None  # split between ranks' partitions: gathered at the step hook, or not recorded
        grad = mapping.get_lp_grad_fragment(index)
    except (AttributeError, ValueError, KeyError, IndexError, TypeError):
        return None  # "Gradients are only available immediately after backward and before engine step"
    if isinstance(grad, torch.Tensor) and grad.numel() == param.numel():
        return grad.view(param.shape)
    return None


# -- the stages --------------------------------------------------------------------------------
def _stage3_params(zero: Any) -> List[torch.Tensor]:
    return [p for group in getattr(zero, "fp16_groups", None) or [] for p in group if hasattr(p, "ds_id")]


def _stage12_groups(zero: Any) -> List[List[torch.Tensor]]:
    groups = getattr(zero, "bit16_groups", None) or []
    if any(getattr(p, "_hp_mapping", None) is not None for group in groups for p in group):
        return [list(group) for group in groups]
    return []


def _world(group: Any) -> Tuple[int, int]:
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group=group), dist.get_world_size(group=group)


class _Gatherer:
    """The collectives that assemble gradients no rank holds whole (module docstring)."""

    def __init__(self, zero: Any) -> None:
        self.zero = zero
        self._split: Optional[List[Tuple[torch.Tensor, bool]]] = None  # ZeRO-1/2: (param, this rank records)

    def gather(self) -> Dict[int, Optional[torch.Tensor]]:
        """``id(param) -> gradient`` (None where another rank records it), on every rank."""
        z3 = _stage3_params(self.zero)
        if z3:
            return self._stage3(z3)
        return self._stage12()

    def _stage3(self, params: List[torch.Tensor]) -> Dict[int, Optional[torch.Tensor]]:
        dtype = getattr(self.zero, "gradient_accumulation_dtype", None) or torch.float32
        out: Dict[int, Optional[torch.Tensor]] = {}
        for p in params:
            if not p.requires_grad:
                continue
            rank, world = _world(getattr(p, "ds_process_group", None))
            if world == 1:  # the local partition is the whole parameter (padded to its partition size)
                local = self.zero.get_local_fp32_grad_for_param(p)
                full = local.flatten()[: p.ds_numel].view(p.ds_shape)
            else:
                full = self.zero.get_fp32_grad_for_param(p).view(p.ds_shape)  # an all-gather, every rank
            out[id(p)] = full.to(dtype) if rank == 0 else None
        return out

    def _agree(self) -> List[Tuple[torch.Tensor, bool]]:
        """The parameters held by more than one rank's partition, and whether this rank is the
        lowest holder (two all-reduces of one integer per parameter, once)."""
        dist = torch.distributed
        split: List[Tuple[torch.Tensor, bool]] = []
        groups = _stage12_groups(self.zero)
        dp_groups = getattr(self.zero, "real_dp_process_group", None) or [None] * len(groups)
        for params, group in zip(groups, dp_groups):
            rank, world = _world(group)
            if world == 1 or not params:
                continue
            held = torch.tensor([getattr(p, "_hp_mapping", None) is not None for p in params], dtype=torch.int64)
            counts = held.clone()
            dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
            lowest = torch.where(held.bool(), torch.full_like(held, rank), torch.full_like(held, world))
            dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=group)
            split.extend((p, int(lowest[i]) == rank) for i, p in enumerate(params) if int(counts[i]) > 1)
        return split

    def _stage12(self) -> Dict[int, Optional[torch.Tensor]]:
        if self._split is None:
            self._split = self._agree()
        out: Dict[int, Optional[torch.Tensor]] = {}
        for p, mine in self._split:
            full = p.get_full_hp_grad()  # DeepSpeed's own: an all-reduce of the parameter's size, every rank
            if not mine:
                out[id(p)] = None
                continue
            mapping = p._hp_mapping
            dtype = mapping.get_lp_grad_fragment(p._index_in_param_group).dtype
            out[id(p)] = full.to(dtype).view(p.shape)
        return out


class _StepHook:
    """``engine.optimizer.step`` wrapped (on the instance, DeepSpeed's class untouched) so that
    the gradients no rank holds whole are gathered (when ``wanted()``) and ``before()`` runs
    first; ``remove()`` restores it."""

    def __init__(self, optimizer: Any, before: Callable[[], None], wanted: Optional[Callable[[], bool]],
                 quiet: Optional[Callable[[], Any]], on_error: Optional[Callable[[BaseException], None]]) -> None:
        self.optimizer = optimizer
        self.gatherer = _Gatherer(optimizer)
        original = optimizer.step  # the bound method

        def step(*args: Any, **kwargs: Any) -> Any:
            if self.active:
                self._take(before, wanted, quiet, on_error)
            return original(*args, **kwargs)

        self.active = True
        self.wrapper = step
        optimizer.step = step

    def _take(self, before: Callable[[], None], wanted: Optional[Callable[[], bool]],
              quiet: Optional[Callable[[], Any]], on_error: Optional[Callable[[BaseException], None]]) -> None:
        gathered: Dict[int, Optional[torch.Tensor]] = {}
        try:
            if wanted is None or wanted():
                import contextlib
                with (quiet() if quiet is not None else contextlib.nullcontext()), torch.no_grad():
                    gathered = self.gatherer.gather()
        except Exception as err:  # noqa: BLE001 - capture's error, never the training's
            if on_error is not None:
                on_error(err)
            else:
                log.error("gathering ZeRO gradients failed: %s", err)
        _GATHERED.update(gathered)
        try:
            before()
        finally:
            for key in gathered:
                _GATHERED.pop(key, None)

    def remove(self) -> None:
        self.active = False
        if self.optimizer.__dict__.get("step") is self.wrapper:
            del self.optimizer.step


def zero_step_hook(engine: Any, before: Callable[[], None], *, wanted: Optional[Callable[[], bool]] = None,
                   quiet: Optional[Callable[[], Any]] = None,
                   on_error: Optional[Callable[[BaseException], None]] = None) -> Optional[_StepHook]:
    """Run ``before()`` at the start of a ZeRO engine's optimizer ``step()`` (where capture takes
    the parameter gradients: reduced, not yet clipped), after gathering, when ``wanted()``, the
    gradients no rank holds whole; None for another engine or stage.

    Args:
        engine: a ``DeepSpeedEngine`` (anything with a ZeRO ``optimizer``).
        before: what reads the gradients (:func:`zero_gradient` answers during it).
        wanted: whether this step is captured; the same on every rank (its collectives).
        quiet: a context manager under which the collectives run (capture suspended).
        on_error: where a gathering error goes (capture's error, never the training's).

    Example:
        >>> zero_step_hook(torch.nn.Linear(1, 1), lambda: None) is None
        True
    """
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None or not callable(getattr(optimizer, "step", None)):
        return None
    if not _stage12_groups(optimizer) and not _stage3_params(optimizer):
        return None
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None:
        try:
            _WRAPPERS[inner] = optimizer
        except TypeError:
            pass
    return _StepHook(optimizer, before, wanted, quiet, on_error)


# -- fragments of the flat partitions ------------------------------------------------------------
class Fragment:
    """One model parameter's slice of a flat fp32 partition on this rank.

    Attributes:
        name: the parameter's name; param: the model (low-precision) parameter.
        flat: the flat partition (a parameter of the wrapped torch optimizer).
        start, numel: the slice ``flat[start:start + numel]``.
        offset: where the slice begins in the flattened parameter; shape: the parameter's full shape.
    """

    __slots__ = ("name", "param", "flat", "start", "numel", "offset", "shape")

    def __init__(self, name: str, param: torch.Tensor, flat: torch.Tensor, start: int, numel: int, offset: int,
                 shape: Sequence[int]) -> None:
        self.name, self.param, self.flat, self.start, self.numel, self.offset, self.shape = \
            name, param, flat, int(start), int(numel), int(offset), tuple(shape)

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """The slice of ``t`` (the flat partition, its gradient or a state tensor of its shape)."""
        return t.narrow(0, self.start, self.numel)

    @property
    def whole(self) -> bool:
        """Whether this rank holds the whole parameter."""
        n = 1
        for s in self.shape:
            n *= int(s)
        return self.numel == n


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except (RuntimeError, AttributeError):
        return False


def zero_fragments(optimizer: Any, named: Iterable[Tuple[str, torch.Tensor]]) -> Optional[List[Fragment]]:
    """The fragments of the model parameters ``named`` held in the flat partitions that
    ``optimizer`` (the ``torch.optim`` optimizer a ZeRO optimizer wraps) steps, in flat order;
    None when ``optimizer`` steps no ZeRO partition.

    ZeRO-1/2 parameters are linked by ``p._hp_mapping`` (``hp_fragment`` is their slice of the
    partition); ZeRO-3 ones by their optimizer's ``grad_position`` (their partition's offset in
    ``fp32_partitioned_groups_flat``); padding beyond a parameter's end is left out.

    Example:
        >>> zero_fragments(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1), []) is None
        True
    """
    flats = [p for group in getattr(optimizer, "param_groups", []) or [] for p in group.get("params", [])]
    out: List[Fragment] = []
    for name, p in named:
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is not None:
            hp = getattr(mapping, "hp_fragment", None)
            if hp is None:
                continue
            flat = next((f for f in flats if _same_storage(f, hp)), None)
            if flat is None:
                continue
            out.append(Fragment(name, p, flat, mapping.hp_fragment_address.start, mapping.hp_fragment_address.numel,
                                mapping.lp_fragment_address.start, p.shape))
            continue
        z3 = getattr(p, "_z3_optimizer", None)
        if z3 is None or getattr(z3, "optimizer", None) is not optimizer or not p.requires_grad:
            continue
        try:
            group, start, numel = z3.grad_position[z3.get_param_id(p)]
            flat = z3.fp32_partitioned_groups_flat[group]
        except (AttributeError, KeyError, IndexError, TypeError):
            continue
        if not any(flat is f for f in flats):
            continue  # another sub-group: ZeRO-3 steps one sub-group at a time
        rank, _ = _world(getattr(p, "ds_process_group", None))
        offset = rank * int(numel)
        valid = max(0, min(int(numel), int(p.ds_numel) - offset))  # the last rank's partition is padded
        if valid:
            out.append(Fragment(name, p, flat, start, valid, offset, p.ds_shape))
    if not out:
        return None
    order = {id(f): i for i, f in enumerate(flats)}
    out.sort(key=lambda f: (order.get(id(f.flat), 0), f.start))
    return out


def wrapped_by_zero(optimizer: Any) -> Optional[Any]:
    """The ZeRO optimizer that wraps ``optimizer`` (one of an engine capture met), or None."""
    try:
        return _WRAPPERS.get(optimizer)
    except TypeError:
        return None


def zero_lp_params(zero: Any) -> List[torch.Tensor]:
    """The model parameters a ZeRO optimizer partitions (ZeRO-1/2 or 3)."""
    return [p for group in _stage12_groups(zero) for p in group] or _stage3_params(zero)


# -- optimizer events per parameter ---------------------------------------------------------------
# element-wise ATen ops besides those tagged pointwise: copies and fills of a partition
_ELEMENTWISE = frozenset({"aten._to_copy.default", "aten.copy_.default", "aten.clone.default", "aten.zero_.default",
                          "aten.fill_.Scalar", "aten.fill_.Tensor", "aten.detach.default", "aten.alias.default"})
_NOT_KERNELS = ("aten", "prims", "c10d", "_c10d_functional", "profiler")


def _elementwise(func: Any, name: str) -> bool:
    if name in _ELEMENTWISE:
        return True
    namespace = name.split(".", 1)[0]
    if namespace not in _NOT_KERNELS:
        return True  # a vendor (custom) op on a flat partition: element-wise (docs/frameworks.md)
    try:
        return torch.Tag.pointwise in func.tags
    except AttributeError:
        return False


def fragment_slices(fragments: Dict[int, Tuple[Any, List[Tuple[Any, int, int]]]], func: Any, name: str,
                    args: Sequence[Any], kwargs: Dict[str, Any],
                    tensors: Sequence[torch.Tensor]) -> Optional[List[Tuple[Any, tuple, dict, int, int]]]:
    """``[(owner, args, kwargs, start, numel), ...]``: an element-wise op on a flat partition cut
    into one call per parameter fragment (every tensor argument of the partition's length narrowed
    to the fragment; scalars and one-element tensors as they are), or None (the op is not
    element-wise, or touches no partition of the length of its tensors).

    Args:
        fragments: ``id(flat) -> (weakref to the flat partition, [(owner, start, numel), ...])``.
        func, name: the op and its name; args, kwargs: its arguments; tensors: its tensor inputs.
    """
    flat_n = None
    for t in tensors:
        entry = fragments.get(id(t))
        if entry is not None and entry[0]() is t:
            flat_n, cuts = t.numel(), entry[1]
            break
    if flat_n is None:
        # an op on tensors of a partition's length not among them (the partition's gradient, a
        # state tensor, an intermediate): the partition of that length, if one alone has it
        sizes = {e[0]().numel(): e[1] for e in fragments.values() if e[0]() is not None}
        lengths = {t.numel() for t in tensors if t.dim() == 1 and t.numel() > 1}
        if len(lengths) != 1 or next(iter(lengths)) not in sizes:
            return None
        flat_n = next(iter(lengths))
        cuts = sizes[flat_n]
    if not _elementwise(func, name):
        return None
    for t in tensors:
        if t.numel() > 1 and not (t.dim() == 1 and t.numel() == flat_n):
            return None  # another shape: not a partition-wise op

    def cut(value: Any, start: int, numel: int) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == flat_n:
            return value.narrow(0, start, numel)
        if isinstance(value, (list, tuple)):
            return type(value)(cut(v, start, numel) for v in value)
        return value

    return [(owner, tuple(cut(a, start, numel) for a in args), {k: cut(v, start, numel) for k, v in kwargs.items()},
             start, numel) for owner, start, numel in cuts]
