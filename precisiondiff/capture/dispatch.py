"""Operator-level capture: every ATen and custom op through a ``TorchDispatchMode``.

Custom ops registered with ``torch.library`` (the way vendor fused kernels are exposed) reach the
mode as one op, so a fused kernel is recorded as itself, not as the ATen ops inside it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .distributed import COLLECTIVE_NAMESPACES, Deferred, collective, collective_outputs, destinations
from .ran_on import ran_on
from .serialize import encode_call, flatten_tensors

if TYPE_CHECKING:
    from .session import CaptureSession

__all__ = ["OpCaptureMode", "in_backward"]

# Ops that only move metadata or read a value: never recorded.
_ALWAYS_SKIP = {"aten.detach.default", "aten.lift_fresh.default", "aten._local_scalar_dense.default",
                "aten.sym_size.int", "aten.sym_stride.int", "aten.sym_numel.default",
                "aten.is_same_size.default", "aten.set_.source_Storage_storage_offset",
                # uninitialized memory: recording it would only record noise
                "aten.empty.memory_format", "aten.empty_like.default", "aten.empty_strided.default",
                "aten.new_empty.default", "aten.new_empty_strided.default", "aten.empty.out"}


# In-place ops whose first argument is overwritten without being read: its old contents (often
# uninitialized memory) are not an input.
_OVERWRITES_SELF = {"aten.copy_.default", "aten.fill_.Scalar", "aten.fill_.Tensor", "aten.zero_.default",
                    "aten.normal_.default", "aten.uniform_.default", "aten.bernoulli_.float"}


def _storage(t: torch.Tensor) -> Any:
    try:
        return (t.device, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # tensors without storage (fakes, some subclasses)
        return id(t)


def _overwritten(name: str, args: tuple, kwargs: dict) -> set:
    """Tensors the op writes without reading: an ``out=`` destination (unless it is also an
    input, as in ``torch.add(h, x, out=h)``: then it is read first and recorded as one)."""
    read = {_storage(t) for t in flatten_tensors((args, {k: v for k, v in kwargs.items() if k != "out"}))}
    ids = {id(v) for v in flatten_tensors(kwargs.get("out")) if _storage(v) not in read}
    if name in _OVERWRITES_SELF and args and isinstance(args[0], torch.Tensor):
        ids.add(id(args[0]))
    ids.update(id(t) for t in destinations(name, args))
    return ids


_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)
try:  # what torch._disable_dynamo around __torch_dispatch__ does, without its Python wrapper
    from torch._C._dynamo.eval_frame import set_eval_frame as _set_eval_frame
    from torch._dynamo.eval_frame import skip_code as _skip_code
except ImportError:  # pragma: no cover - a PyTorch without dynamo: TorchDispatchMode's own wrapper
    _set_eval_frame = _skip_code = None
_set_grad_enabled = torch._C._set_grad_enabled
_Tensor = torch.Tensor


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread."""
    return _GRAPH_TASK_ID is not None and _GRAPH_TASK_ID() != -1


class _OpInfo:
    """What the mode needs to know about an op, worked out once per op overload."""

    __slots__ = ("name", "mutable", "overwrites_self", "collective")

    def __init__(self, name: str, mutable: bool, overwrites_self: bool, collective: bool = False) -> None:
        self.name, self.mutable, self.overwrites_self = name, mutable, overwrites_self
        self.collective = collective


_SKIPPED = _OpInfo("", False, False)
_INPUT_SLOTS = tuple(f"input.{i}" for i in range(16))
_OUTPUT_SLOTS = tuple(f"output.{i}" for i in range(16))


def _flat_inputs(args: tuple, kwargs: dict) -> list:
    # most ops take tensors and scalars only: no nested walk
    for a in args:
        if type(a) in (list, tuple, dict):
            return flatten_tensors((args, kwargs))
    inputs = [a for a in args if isinstance(a, _Tensor)]
    if kwargs:
        inputs.extend(flatten_tensors(kwargs))
    return inputs


class OpCaptureMode(TorchDispatchMode):
    """Records each op call, inputs before it runs (in-place ops mutate them) and outputs after."""

    def __init__(self, session: "CaptureSession") -> None:
        super().__init__()
        self.session = session
        self._info: Dict[Any, _OpInfo] = {}
        self._scopes: Dict[str, bool] = {}
        self.deferred = Deferred()  # collectives recorded once their result is ready

    def _describe(self, func: Any) -> _OpInfo:
        name = str(func)
        if name in _ALWAYS_SKIP or (not self.session.filter.views and getattr(func, "is_view", False)) \
                or not self.session.filter.want_op(name):
            info = _SKIPPED
        else:
            info = _OpInfo(name, bool(func._schema.is_mutable), name in _OVERWRITES_SELF,
                           name.startswith(COLLECTIVE_NAMESPACES))
        self._info[func] = info
        return info

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps __torch_dispatch__ in torch._disable_dynamo (1-4 us of Python
        # per op). The mode does the same itself: Dynamo neither compiles nor inlines its frame
        # (skip_code, _torchdynamo_disable below) and the frame turns the eval-frame callback off
        # while it runs, so a compiled region calling an op never compiles capture's code.
        return _set_eval_frame is None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        if _set_eval_frame is None:
            return self._dispatch(func, args, kwargs)
        prior = _set_eval_frame(None)
        try:
            return self._dispatch(func, args, kwargs)
        finally:
            _set_eval_frame(prior)

    if _set_eval_frame is not None:
        __torch_dispatch__._torchdynamo_disable = True  # type: ignore[attr-defined]
        _skip_code(__torch_dispatch__.__code__)

    def _dispatch(self, func, args, kwargs):
        info = self._info.get(func)
        if info is None:
            info = self._describe(func)
        session = self.session
        if self.deferred.items and info.name and not session.paused:
            try:  # a collective's result this op touches is ready now (distributed.Deferred)
                self.deferred.settle_touching(_flat_inputs(args, kwargs or {}))
            except Exception as err:  # noqa: BLE001
                session.capture_failed(err)
        if not info.name or session.paused or not session.recording:
            return func(*args, **(kwargs or {}))
        backward = _GRAPH_TASK_ID is not None and _GRAPH_TASK_ID() != -1
        if backward:
            scope = session.current_scope(True)
        else:
            stack = session._stack
            scope = stack[-1] if stack else ""
        wanted = self._scopes.get(scope)
        if wanted is None:
            wanted = self._scopes[scope] = session.filter.want_scope(scope)
        if not wanted:
            return func(*args, **(kwargs or {}))
        if kwargs is None:
            kwargs = {}
        # A failure of capture itself (statistics, a full disk) never reaches the workload: the op
        # runs exactly once whatever happens here, and the session notes the error and stops.
        grad = torch.is_grad_enabled()
        if grad:
            _set_grad_enabled(False)
        try:
            event = self._inputs(info, scope, backward, args, kwargs)
        except Exception as err:  # noqa: BLE001
            session.capture_failed(err)
            return func(*args, **kwargs)
        finally:
            if grad:
                _set_grad_enabled(True)
        out = func(*args, **kwargs)
        if grad:
            _set_grad_enabled(False)
        try:
            self._outputs(func, info, event, args, kwargs, out)
        except Exception as err:  # noqa: BLE001
            session.capture_failed(err)
        finally:
            if grad:
                _set_grad_enabled(True)
        return out

    def _inputs(self, info: _OpInfo, scope: str, backward: bool, args: tuple, kwargs: dict) -> Any:
        rec = self.session.recorder
        event = rec.begin("op", scope, info.name, "backward" if backward else "forward")
        inputs = _flat_inputs(args, kwargs)
        # what the op writes without reading (in-place fills, out= destinations, a collective's
        # output buffers) is not an input
        skip = _overwritten(info.name, args, kwargs) \
            if info.overwrites_self or info.collective or "out" in kwargs else ()
        slots = event.slots
        for i, t in enumerate(inputs):
            if id(t) not in slots and id(t) not in skip:
                rec.add(event, _INPUT_SLOTS[i] if i < 16 else f"input.{i}", t)
        return event

    def _outputs(self, func: Any, info: _OpInfo, event: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if info.collective:
            group = collective(info.name, args, kwargs)
            if group is not None:
                event.extra = {"collective": group}
                # recorded when its result is ready, without waiting here (distributed.Deferred)
                written = collective_outputs(info.name, args, out)
                self.deferred.defer(info.name, out, lambda ready, note: self._settle(
                    func, info, event, args, kwargs, written, group, ready, note), written)
                return
        self._record_outputs(func, info, event, args, kwargs, out, info.mutable)

    def _settle(self, func: Any, info: _OpInfo, event: Any, args: tuple, kwargs: dict, out: Any,
                group: dict, ready: bool, note: dict) -> None:
        if ready:  # c10d ops write their tensors without declaring it in their schema
            self._record_outputs(func, info, event, args, kwargs, out, True)
            return
        group.update(note)
        self.session.recorder.finish(event)  # its inputs only (a failed work raises in the workload)

    def _record_outputs(self, func: Any, info: _OpInfo, event: Any, args: tuple, kwargs: dict, out: Any,
                        mutated: bool) -> None:
        rec = self.session.recorder
        # An in-place op returns its mutated input; its version counter is bumped only after this
        # mode returns, so de-duplication would take it for the unmodified tensor.
        if isinstance(out, _Tensor):
            rec.add(event, "output.0", out, fresh=mutated)
        else:
            for i, t in enumerate(flatten_tensors(out)):
                rec.add(event, _OUTPUT_SLOTS[i] if i < 16 else f"output.{i}", t, fresh=mutated)
        encoded = None
        if rec.mode == "replay":
            encoded = encode_call(args, kwargs, lambda t: rec.slot_of(event, t))
        if event.device is not None and event.device != "cpu":
            event.device = ran_on(func, event.device)  # "cpu": the backend's CPU fallback ran it
        rec.finish(event, args=encoded)
