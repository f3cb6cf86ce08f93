"""Operator-level capture: every ATen and custom op through a ``TorchDispatchMode``.

Custom ops registered with ``torch.library`` (the way vendor fused kernels are exposed) reach the
mode as one op, so a fused kernel is recorded as itself, not as the ATen ops inside it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .distributed import collective, destinations, wait_collective
from .ran_on import ran_on
from .serialize import encode_args, flatten_tensors, is_replayable

if TYPE_CHECKING:
    from .session import CaptureSession

__all__ = ["OpCaptureMode", "in_backward"]

# Ops that only move metadata or read a value: never recorded.
_ALWAYS_SKIP = {"aten.detach.default", "aten.lift_fresh.default", "aten._local_scalar_dense.default",
                "aten.sym_size.int", "aten.sym_stride.int", "aten.sym_numel.default",
                "aten.is_same_size.default", "aten.set_.source_Storage_storage_offset",
                # uninitialized memory: recording it would only record noise
                "aten.empty.memory_format", "aten.empty_like.default", "aten.empty_strided.default",
                "aten.new_empty.default", "aten.new_empty_strided.default", "aten.empty.out",
                # a functional collective's wait and autograd wrapper: the collective is recorded
                "_c10d_functional.wait_tensor.default", "_c10d_functional._wrap_tensor_autograd.default"}


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


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread."""
    getter = getattr(torch._C, "_current_graph_task_id", None)
    return getter is not None and getter() != -1


class OpCaptureMode(TorchDispatchMode):
    """Records each op call, inputs before it runs (in-place ops mutate them) and outputs after."""

    def __init__(self, session: "CaptureSession") -> None:
        super().__init__()
        self.session = session
        self._names: Dict[Any, str] = {}

    def _name(self, func: Any) -> str:
        name = self._names.get(func)
        if name is None:
            name = str(func)
            if name in _ALWAYS_SKIP or (not self.session.filter.views and getattr(func, "is_view", False)):
                name = ""
            elif not self.session.filter.want_op(name):
                name = ""
            self._names[func] = name
        return name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        session = self.session
        if session.paused or not session.recording:
            return func(*args, **kwargs)
        name = self._name(func)
        backward = in_backward()
        scope = session.current_scope(backward)
        if not name or not session.filter.want_scope(scope):
            return func(*args, **kwargs)
        # A failure of capture itself (statistics, a full disk) never reaches the workload: the op
        # runs exactly once whatever happens here, and the session notes the error and stops.
        try:
            event = self._inputs(name, scope, backward, args, kwargs)
        except Exception as err:  # noqa: BLE001
            session.capture_failed(err)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        try:
            self._outputs(func, name, event, args, kwargs, out)
        except Exception as err:  # noqa: BLE001
            session.capture_failed(err)
        return out

    def _inputs(self, name: str, scope: str, backward: bool, args: tuple, kwargs: dict) -> Any:
        rec = self.session.recorder
        event = rec.begin("op", scope, name, "backward" if backward else "forward")
        inputs = flatten_tensors((args, kwargs))
        skip = _overwritten(name, args, kwargs)
        with torch.no_grad():
            for i, t in enumerate(inputs):
                if id(t) not in event.slots and id(t) not in skip:
                    rec.add(event, f"input.{i}", t)
        return event

    def _outputs(self, func: Any, name: str, event: Any, args: tuple, kwargs: dict, out: Any) -> None:
        rec = self.session.recorder
        group = collective(name, args, kwargs)
        if group is not None:
            event.extra = {"collective": group}
            # an async collective's output is read once its work is done (docs/distributed.md)
            try:
                wait_collective(name, out)
            except Exception as err:  # noqa: BLE001 - the job's failure (a peer died), not capture's:
                group["failed"] = str(err).splitlines()[0] if str(err) else type(err).__name__
                rec.finish(event)  # its inputs only; the workload's own wait raises the error
                return
        # An in-place op returns its mutated input; its version counter is bumped only after this
        # mode returns, so de-duplication would take it for the unmodified tensor. c10d ops write
        # their tensors without declaring it in their schema.
        mutated = func._schema.is_mutable or group is not None
        with torch.no_grad():
            for i, t in enumerate(flatten_tensors(out)):
                rec.add(event, f"output.{i}", t, fresh=mutated)
        encoded = None
        if rec.mode == "replay":
            encoded = {"args": encode_args(list(args), lambda t: rec.slot_of(event, t)),
                       "kwargs": encode_args(dict(kwargs), lambda t: rec.slot_of(event, t))}
            encoded["replayable"] = is_replayable(encoded)
        if event.device is not None and event.device != "cpu":
            event.device = ran_on(func, event.device)  # "cpu": the backend's CPU fallback ran it
        rec.finish(event, args=encoded)
