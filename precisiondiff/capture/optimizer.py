"""Parameter updates as events: every op inside ``optimizer.step()``, ``GradScaler.unscale_``,
``.step`` and ``.update``, and ``torch.nn.utils.clip_grad_norm_``, recorded with direction
``optimizer`` (docs/capture.md, "Optimizers").

An *update* is one of those calls in progress. Its ops are recorded like any op, with a scope that
names the update and, per tensor, the parameter it belongs to: ``optimizer.param_groups.0/fc1.weight``
(the first optimizer of the session is ``optimizer``, the next ``optimizer_1``...; a GradScaler's
ops are ``grad_scaler/fc1.weight``, ``clip_grad_norm_``'s ``clip_grad_norm_/fc1.weight``; an op
that touches several parameters at once, or none, has the update's name alone). A tensor belongs
to a parameter when it is the parameter, its gradient, its optimizer state, or an output of an op
of the update whose tensors all belong to that parameter.

List ops (``_foreach_*``, ``_fused_adamw_``, ``_amp_foreach_non_finite_check_and_unscale_``, any
op, vendor custom ops included, that writes a list of tensors) are recorded as one event per list
element: the op called on that element alone (its list arguments cut to one element, scalar lists
too), so each parameter's slice of the update is an event that replays by itself. An op's
outputs are the tensors it writes (``Tensor(a!)`` arguments of its schema) after it ran, in
argument order; an op that writes nothing has its returned tensors.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch

from .dispatch import _flat_inputs, _overwritten
from .serialize import encode_args, flatten_tensors, is_replayable

if TYPE_CHECKING:
    from .dispatch import OpCaptureMode
    from .session import CaptureSession

__all__ = ["OPTIMIZER", "Update", "Updates", "written_tensors", "list_slices"]

OPTIMIZER = "optimizer"  # the direction of update events
_SLICED_ELEMENTS = ("Tensor", "Optional[Tensor]", "number", "Scalar", "float")  # per-element arguments
_Tensor = torch.Tensor
Owner = Tuple[Optional[int], str]  # (param group or None, parameter name)


class _Arg:
    """What the slicing needs to know of one schema argument, worked out once per op."""

    __slots__ = ("name", "kwarg_only", "writes", "listed")

    def __init__(self, a: Any) -> None:
        self.name, self.kwarg_only = a.name, a.kwarg_only
        self.writes = a.alias_info is not None and a.alias_info.is_write
        # a list of per-element arguments (tensors, scalars): cut to one element per slice
        self.listed = isinstance(a.type, torch.ListType) and str(a.type.getElementType()) in _SLICED_ELEMENTS


_SCHEMAS: Dict[Any, List[_Arg]] = {}


def _arg_values(func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> List[Tuple[_Arg, Any, bool]]:
    """``(argument, value, positional)`` for every argument given to the op."""
    schema = _SCHEMAS.get(func)
    if schema is None:
        schema = _SCHEMAS[func] = [_Arg(a) for a in func._schema.arguments]
    found = []
    for j, a in enumerate(schema):
        if j < len(args) and not a.kwarg_only:
            found.append((a, args[j], True))
        elif a.name in kwargs:
            found.append((a, kwargs[a.name], False))
    return found


def written_tensors(func: Any, args: Sequence[Any], kwargs: Dict[str, Any], out: Any) -> List[torch.Tensor]:
    """The tensors an op call writes (its ``Tensor(a!)`` arguments, flattened in argument
    order), or, when it writes none, the tensors it returns: what an update event records as
    ``output.N``, and what its replay compares."""
    found: List[torch.Tensor] = []
    for a, value, _ in _arg_values(func, args, kwargs):
        if a.writes:
            found.extend(flatten_tensors(value))
    return found if found else flatten_tensors(out)


def _is_list(a: _Arg, value: Any) -> bool:
    return a.listed and isinstance(value, (list, tuple))


def list_slices(func: Any, name: str, args: Sequence[Any],
                kwargs: Dict[str, Any]) -> Optional[List[Tuple[tuple, dict]]]:
    """``[(args, kwargs), ...]``, one call per list element, for a list op (``_foreach_*``, or
    an op that writes a list of tensors); None for any other op (``stack`` takes a list but each
    output depends on all of it). List arguments of the op's length are cut to one element."""
    values = _arg_values(func, args, kwargs)
    writes_list = any(a.writes and _is_list(a, v) for a, v, _ in values)
    if "_foreach_" not in name and not writes_list:
        return None
    n = next((len(v) for a, v, _ in values if _is_list(a, v) and v and isinstance(v[0], _Tensor)), 0)
    if not n:
        return None
    cut = [(j, a, v, positional) for j, (a, v, positional) in enumerate(values) if _is_list(a, v) and len(v) == n]
    out = []
    for i in range(n):
        s_args, s_kwargs = list(args), dict(kwargs)
        for j, a, v, positional in cut:  # positional arguments come first: j is their position
            if positional:
                s_args[j] = [v[i]]
            else:
                s_kwargs[a.name] = [v[i]]
        out.append((tuple(s_args), s_kwargs))
    return out


def _hyper(group: Dict[str, Any]) -> Dict[str, Any]:
    """A param group's numeric hyperparameters (lr, betas, eps, weight_decay...); flags and
    tensors are left out (reading a tensor would synchronize: its value is an input of the ops)."""
    out: Dict[str, Any] = {}
    for k, v in group.items():
        if k == "params":
            continue
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = v
        elif isinstance(v, (tuple, list)) and v and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
            out[k] = list(v)
    return out


class Update:
    """One update call in progress: its name and which parameter each tensor belongs to.

    Args:
        label: ``optimizer`` (``optimizer_1``...), ``grad_scaler`` or ``clip_grad_norm_``.
        names: ``id(param) -> full parameter name`` of the parameters the session knows.
        params: the parameters it updates: ``[(group, param), ...]`` (group None outside an optimizer).
        optimizer: the optimizer (its state tensors belong to their parameters), if any.
    """

    def __init__(self, label: str, names: Dict[int, str], params: Sequence[Tuple[Optional[int], torch.Tensor]],
                 optimizer: Any = None, cls: Optional[str] = None) -> None:
        self.label = label
        self.cls = cls
        self.optimizer = optimizer
        # ZeRO: id(flat partition) -> (weakref, [(owner, start, numel)]): its parameters' slices (deepspeed.py)
        self.fragments: Dict[int, Tuple[Any, List[Tuple[Owner, int, int]]]] = {}
        self._owners: Dict[int, Tuple[Any, Owner]] = {}
        self._scanned = -1
        self._params: List[Tuple[Owner, torch.Tensor]] = []
        self._by_owner: Dict[Owner, torch.Tensor] = {}
        # the groups' hyperparameters as this update began (a scheduler changes them between steps)
        self._hypers = [_hyper(g) for g in getattr(optimizer, "param_groups", []) or []]
        counts: Dict[Optional[int], int] = {}
        for group, p in params:
            index = counts.get(group, 0)
            counts[group] = index + 1
            owner = (group, names.get(id(p), f"param{index}"))
            self._params.append((owner, p))
            self._by_owner[owner] = p
            self._own(p, owner)
            if p.grad is not None:
                self._own(p.grad, owner)
        self._scan_state()

    def _own(self, t: Any, owner: Owner) -> None:
        if isinstance(t, _Tensor):
            self._owners[id(t)] = (weakref.ref(t), owner)

    def _scan_state(self) -> None:
        """The optimizer's state tensors (created lazily by its first step) to their parameters."""
        state = getattr(self.optimizer, "state", None)
        self._scanned = self._state_size()
        if not state:
            return
        for owner, p in self._params:
            for v in (state.get(p) or {}).values():
                self._own(v, owner)

    def _lookup(self, tensors: Sequence[torch.Tensor]) -> Tuple[Optional[Owner], bool]:
        found: Optional[Owner] = None
        unknown = False
        for t in tensors:
            entry = self._owners.get(id(t))
            if entry is None or entry[0]() is not t:
                unknown = True
            elif found is None:
                found = entry[1]
            elif entry[1] != found:
                return None, False
        return found, unknown

    def _state_size(self) -> int:
        state = getattr(self.optimizer, "state", None) or {}
        return sum(len(v) for v in state.values())

    def owner_of(self, tensors: Sequence[torch.Tensor]) -> Optional[Owner]:
        """The one parameter all the op's known tensors belong to (None: several, or none)."""
        found, unknown = self._lookup(tensors)
        if unknown and self.optimizer is not None and self._state_size() != self._scanned:
            self._scan_state()  # state created since the update began (by the first step)
            found, _ = self._lookup(tensors)
        return found

    def _step_of(self, owner: Owner) -> Optional[float]:
        """The parameter's step counter as the op begins, when reading it costs no device sync
        (a number, or a tensor on the CPU)."""
        state = getattr(self.optimizer, "state", None)
        param = self._by_owner.get(owner)
        if not state or param is None:
            return None
        step = (state.get(param) or {}).get("step")
        if type(step) is _Tensor and step.device.type == "cpu" and step.numel() == 1:
            return float(step)
        return float(step) if isinstance(step, (int, float)) and not isinstance(step, bool) else None

    def adopt(self, tensors: Sequence[torch.Tensor], owner: Optional[Owner]) -> None:
        """Outputs of an op of one parameter belong to it (``denom`` of that parameter's step)."""
        if owner is not None:
            for t in tensors:
                entry = self._owners.get(id(t))
                if entry is None or entry[0]() is not t:  # new, or an id a freed tensor had
                    self._own(t, owner)

    def scope(self, owner: Optional[Owner]) -> str:
        """``optimizer.param_groups.0/fc1.weight``, ``grad_scaler/fc1.weight``, or the label."""
        if owner is None:
            return self.label
        group, name = owner
        return f"{self.label}.param_groups.{group}/{name}" if group is not None else f"{self.label}/{name}"

    def describe(self, owner: Optional[Owner], index: Optional[int], n: Optional[int]) -> Dict[str, Any]:
        """The event's ``optimizer`` field."""
        info: Dict[str, Any] = {"update": self.label}
        if self.cls:
            info["class"] = self.cls
        if owner is not None:
            info["param"] = owner[1]
            if owner[0] is not None:
                info["group"] = owner[0]
                if owner[0] < len(self._hypers):
                    info["hyper"] = self._hypers[owner[0]]
                step = self._step_of(owner)
                if step is not None:
                    info["step"] = step
        if index is not None:
            info["slice"] = [index, n]
        return info


class Updates:
    """The updates of one capture session: the stack of those in progress, the optimizers'
    names, and the patches that reach GradScaler and ``clip_grad_norm_``."""

    def __init__(self) -> None:
        self.stack: List[Update] = []
        self._names: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()

    def optimizer_name(self, optimizer: Any) -> str:
        """``optimizer`` for the first optimizer seen, ``optimizer_1`` for the next..."""
        name = self._names.get(optimizer)
        if name is None:
            n = len(self._names)
            name = self._names[optimizer] = OPTIMIZER if n == 0 else f"{OPTIMIZER}_{n}"
        return name

    def begin(self, update: Update) -> None:
        self.stack.append(update)

    def end(self) -> None:
        if self.stack:
            self.stack.pop()

    def dispatch(self, mode: "OpCaptureMode", func: Any, info: Any, args: tuple, kwargs: dict) -> Any:
        """Run and record one op of the current update (one event per list element); the op
        runs exactly once whatever capture does, and capture's errors never reach the workload."""
        session = mode.session
        update = self.stack[-1]
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        pending: Optional[list] = None
        cuts = None
        try:
            calls = list_slices(func, info.name, args, kwargs)
            if calls is None and update.fragments:
                cuts = _fragment_cuts(update, func, info.name, args, kwargs)
            n = len(calls) if calls is not None else None
            if cuts is not None:
                pending = [self._begin_event(session, update, info, a, k, None, None, owner=owner,
                                             fragment=(start, numel)) for owner, a, k, start, numel in cuts]
            else:
                pending = [self._begin_event(session, update, info, a, k, i if n is not None else None, n)
                           for i, (a, k) in enumerate(calls if calls is not None else [(args, kwargs)])]
        except Exception as err:  # noqa: BLE001 - capture's own error
            session.capture_failed(err)
        finally:
            torch._C._set_grad_enabled(grad)
        out = func(*args, **kwargs)  # with the workload's own grad mode, exactly once
        if pending is None:
            return out
        torch._C._set_grad_enabled(False)
        try:
            returned = list(out) if n is not None and isinstance(out, (list, tuple)) and len(out) == n else None
            for i, item in enumerate(pending):
                if item is None:
                    continue
                if cuts is not None:  # a fragment's slice of what the op returned
                    self._finish_event(session, update, func, item, _narrow(out, cuts[i][3], cuts[i][4], args))
                    continue
                self._finish_event(session, update, func, item, out if n is None else
                                   ([returned[i]] if returned is not None else None))
        except Exception as err:  # noqa: BLE001
            session.capture_failed(err)
        finally:
            torch._C._set_grad_enabled(grad)
        return out

    @staticmethod
    def _begin_event(session: "CaptureSession", update: Update, info: Any, args: tuple, kwargs: dict,
                     index: Optional[int], n: Optional[int], owner: Optional[Owner] = None,
                     fragment: Optional[Tuple[int, int]] = None) -> Optional[tuple]:
        inputs = _flat_inputs(args, kwargs)
        if fragment is None:
            owner = update.owner_of(inputs)
        scope = update.scope(owner)
        if not session.filter.want_scope(scope):
            return None
        rec = session.recorder
        event = rec.begin("op", scope, info.name, OPTIMIZER)
        skip = _overwritten(info.name, args, kwargs) if info.overwrites_self or "out" in kwargs else ()
        for j, t in enumerate(inputs):
            if id(t) not in event.slots and id(t) not in skip:
                rec.add(event, f"input.{j}", t)
        event.extra = {"optimizer": update.describe(owner, index, n)}
        if fragment is not None:  # this parameter's slice of a ZeRO flat partition
            event.extra["optimizer"]["fragment"] = {"start": fragment[0], "numel": fragment[1]}
        return event, args, kwargs, owner

    @staticmethod
    def _finish_event(session: "CaptureSession", update: Update, func: Any, item: tuple, out: Any) -> None:
        event, args, kwargs, owner = item
        rec = session.recorder
        written = written_tensors(func, args, kwargs, out)
        for j, t in enumerate(written):
            rec.add(event, f"output.{j}", t, fresh=True)  # in place: the version bumps only later
        update.adopt(written, owner)
        encoded = None
        if rec.mode == "replay":
            slot = lambda t: rec.slot_of(event, t)  # noqa: E731
            encoded = {"args": encode_args(list(args), slot), "kwargs": encode_args(dict(kwargs), slot)}
            encoded["replayable"] = is_replayable(encoded)
        rec.finish(event, args=encoded)


class _Patch:
    """A wrapper put in place of ``owner.attr`` while a session runs; ``remove`` restores it
    (or, when something else patched over it meanwhile, makes the wrapper pass through)."""

    def __init__(self, owner: Any, attr: str, make: Any) -> None:
        self.owner, self.attr = owner, attr
        self.original = getattr(owner, attr)
        self.active = True
        self.wrapper = make(self.original, self)
        setattr(owner, attr, self.wrapper)

    def remove(self) -> None:
        self.active = False
        if getattr(self.owner, self.attr, None) is self.wrapper:
            setattr(self.owner, self.attr, self.original)


def _optimizer_params(optimizer: Any) -> List[Tuple[Optional[int], torch.Tensor]]:
    return [(g, p) for g, group in enumerate(getattr(optimizer, "param_groups", []) or [])
            for p in group.get("params", [])]


def patch_updates(session: "CaptureSession") -> List[_Patch]:
    """Patches that make ``clip_grad_norm_`` (looked up through ``torch.nn.utils`` at call time)
    and every ``GradScaler``'s ``unscale_``, ``step`` and ``update`` updates of ``session``."""
    ref = weakref.ref(session)
    patches: List[_Patch] = []

    def around(label: str, params_of: Any) -> Any:
        def make(original: Any, patch: _Patch) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                s = ref()
                if s is None or not patch.active:
                    return original(*args, **kwargs)
                params, args, kwargs = params_of(args, kwargs)
                with s.updating(label, params):
                    return original(*args, **kwargs)
            wrapper.__wrapped__ = original  # type: ignore[attr-defined]
            wrapper.__name__ = getattr(original, "__name__", label)
            wrapper.__doc__ = getattr(original, "__doc__", None)
            return wrapper
        return make

    def clip_params(args: tuple, kwargs: dict) -> tuple:
        # a generator of parameters is read once here, so the original gets the list
        if args:
            params = [args[0]] if isinstance(args[0], _Tensor) else list(args[0])
            args = (params, *args[1:])
        else:
            given = kwargs.get("parameters", [])
            params = [given] if isinstance(given, _Tensor) else list(given)
            kwargs = {**kwargs, "parameters": params}
        return [(None, p) for p in params], args, kwargs

    def scaler_params(args: tuple, kwargs: dict) -> tuple:
        optimizer = args[1] if len(args) > 1 else kwargs.get("optimizer")
        params = [(None, p) for _, p in _optimizer_params(optimizer)] if optimizer is not None else []
        return params, args, kwargs

    try:
        from torch.nn import utils as nn_utils
        from torch.nn.utils import clip_grad
        make = around("clip_grad_norm_", clip_params)
        for owner in (nn_utils, clip_grad):
            if hasattr(owner, "clip_grad_norm_"):
                patches.append(_Patch(owner, "clip_grad_norm_", make))
        from torch.amp.grad_scaler import GradScaler
        for attr in ("unscale_", "step", "update"):
            patches.append(_Patch(GradScaler, attr, around("grad_scaler", scaler_params)))
    except (ImportError, AttributeError):  # an older PyTorch: optimizer.step() is still recorded
        pass
    return patches


def _fragment_cuts(update: Update, func: Any, name: str, args: tuple, kwargs: dict) -> Optional[list]:
    from .deepspeed import fragment_slices
    return fragment_slices(update.fragments, func, name, args, kwargs, _flat_inputs(args, kwargs))


def _narrow(out: Any, start: int, numel: int, args: tuple) -> Any:
    """A fragment's slice ``[start, start + numel)`` of the partition-length tensors an op returned."""
    full = {id(a) for a in flatten_tensors(args)}
    def cut(t: Any) -> Any:
        if isinstance(t, _Tensor) and t.dim() == 1 and t.numel() > 1 and id(t) not in full:
            return t.narrow(0, start, numel)
        return t
    if isinstance(out, (list, tuple)):
        return type(out)(cut(t) for t in out)
    if isinstance(out, _Tensor) and id(out) in full:  # an in-place op returns its (whole) argument
        return None
    return cut(out)


def optimizer_update(session: "CaptureSession", optimizer: Any, names: Dict[int, str]) -> Update:
    """The update of one ``optimizer.step()`` (under a ZeRO engine: each element-wise op on a
    flat partition recorded per model parameter, capture/deepspeed.py)."""
    from .deepspeed import FLAT_PARTITION, wrapped_by_zero, zero_fragments, zero_lp_params
    zero = wrapped_by_zero(optimizer)
    fragments = None
    if zero is not None:
        fragments = zero_fragments(optimizer, [(names[id(p)], p) for p in zero_lp_params(zero) if id(p) in names])
        if fragments:
            names = {**names, **{id(f.flat): FLAT_PARTITION for f in fragments}}
    update = Update(session._updates.optimizer_name(optimizer), names, _optimizer_params(optimizer),
                    optimizer=optimizer, cls=type(optimizer).__name__)
    for f in fragments or ():
        group = next((g for g, p in _optimizer_params(optimizer) if p is f.flat), None)
        entry = update.fragments.setdefault(id(f.flat), (weakref.ref(f.flat), []))
        entry[1].append(((group, f.name), f.start, f.numel))
    return update

