"""Operator-level capture: every ATen and custom op through a ``TorchDispatchMode``.

Custom ops registered with ``torch.library`` (the way vendor fused kernels are exposed) reach the
mode as one op, so a fused kernel is recorded as itself, not as the ATen ops inside it. A
higher-order operator (``flex_attention``, ``cond``, ``while_loop``, ``invoke_subgraph``...) is
recorded as one unit too, ``higher_order.NAME``: its tensors in and out, not the ops of its
subgraphs (which are code, not data: the unit is not replayable op by op).

What an op writes is read from its schema: an ``out=`` argument (``is_out``) is written without
being read, so it is an output, never an input; every argument marked written (``Tensor(a!)``)
makes capture forget what it recorded of that memory, so a later read is measured afresh even
when the write bumped no version counter (through ``.data``, by a collective). Memory an op
returns uninitialized (``empty*``) is not an input of the op that fills it, declared or not.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List

import torch
from torch._ops import HigherOrderOperator
from torch.multiprocessing.reductions import StorageWeakRef
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
# ... whose outputs stay uninitialized until an op writes them (_Uninitialized)
_UNINITIALIZED = {"aten.empty.memory_format", "aten.empty_like.default", "aten.empty_strided.default",
                  "aten.new_empty.default", "aten.new_empty_strided.default"}
UNINITIALIZED_NOTE = "an uninitialized buffer the op writes without its schema declaring it"
HOP_PREFIX = "higher_order."
HOP_NOTE = ("recorded as one unit (its tensors in and out); the ops of its subgraphs are not recorded "
            "one by one and it is not replayable op by op: bisect judges it through its module")


# In-place ops whose first argument is overwritten without being read: its old contents (often
# uninitialized memory) are not an input.
_OVERWRITES_SELF = {"aten.copy_.default", "aten.fill_.Scalar", "aten.fill_.Tensor", "aten.zero_.default",
                    "aten.normal_.default", "aten.uniform_.default", "aten.bernoulli_.float"}


def _storage(t: torch.Tensor) -> Any:
    try:
        return (t.device, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # tensors without storage (fakes, some subclasses)
        return id(t)


def _overwritten(name: str, outs: tuple, args: tuple, kwargs: dict) -> set:
    """Tensors the op writes without reading: its ``out=`` destinations (the schema's ``is_out``
    arguments: ``out``, ``values``/``indices``...), unless also an input, as in
    ``torch.add(h, x, out=h)``: then it is read first and recorded as one."""
    read = {_storage(t) for t in flatten_tensors((args, {k: v for k, v in kwargs.items() if k not in outs}))}
    ids = {id(v) for v in flatten_tensors([kwargs.get(k) for k in outs]) if _storage(v) not in read}
    if name in _OVERWRITES_SELF and args and isinstance(args[0], torch.Tensor):
        ids.add(id(args[0]))
    ids.update(id(t) for t in destinations(name, args))
    return ids


def _written(info: "_OpInfo", args: tuple, kwargs: dict) -> List[torch.Tensor]:
    """The tensors an op writes in place: its schema's ``Tensor(a!)`` arguments; a c10d
    collective's first argument (c10d schemas do not declare their writes)."""
    found: List[Any] = []
    for index, name in info.writes:
        found.append(args[index] if index < len(args) else kwargs.get(name))
    if info.collective and info.name.startswith("c10d.") and args:
        found.append(args[0])
    return flatten_tensors(found)


def _storage_ref(t: torch.Tensor) -> Any:
    try:
        return StorageWeakRef(t.untyped_storage())
    except (RuntimeError, NotImplementedError, TypeError):  # no storage (fakes, some subclasses)
        return None


class _Uninitialized:
    """Storages an ``empty*`` op returned that no op has written since (weakly held, by the
    storage itself: freed memory reused by another tensor is never mistaken for them).

    An op reading such memory reads noise: it is a buffer the op fills (an ``out=`` argument
    its schema may not declare, as ``fsdp.all_gather_copy_in`` fills FSDP2's all-gather buffer),
    so capture records it after the op, never as an input with garbage statistics."""

    def __init__(self) -> None:
        self.refs: Dict[int, Any] = {}

    def add(self, value: Any) -> None:
        refs = self.refs
        if len(refs) > 64:  # buffers freed without ever being written (pruned in place: the
            for k in [k for k, r in refs.items() if r.expired()]:  # mode holds this dict)
                del refs[k]
        for t in flatten_tensors(value):
            ref = _storage_ref(t)
            if ref is not None:
                self.refs[ref.cdata] = ref

    def holds(self, t: torch.Tensor) -> bool:
        ref = _storage_ref(t)
        if ref is None:
            return False
        kept = self.refs.get(ref.cdata)
        if kept is None:
            return False
        if kept.expired():
            del self.refs[ref.cdata]
            return False
        return True

    def written(self, tensors: List[torch.Tensor]) -> None:
        for t in tensors:
            ref = _storage_ref(t)
            if ref is not None:
                self.refs.pop(ref.cdata, None)

    def clear(self) -> None:
        self.refs.clear()


try:  # torch compiles a higher-order operator's eager wrapper (flex_attention, cond) inside this
    from torch._higher_order_ops.utils import _hop_compile_tls

    def _in_hop_compile() -> bool:
        """torch's ``_in_hop_compile``, read from the thread's dict: its ``getattr`` of a missing
        thread-local attribute raises and catches an AttributeError (1.8 us; asked for every op)."""
        return _hop_compile_tls.__dict__.get("in_hop_compile", False)
except ImportError:  # pragma: no cover - an older PyTorch: its HOPs run eagerly under the mode
    try:
        from torch._higher_order_ops.utils import _in_hop_compile
    except ImportError:
        def _in_hop_compile() -> bool:
            return False
_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)
try:  # what torch._disable_dynamo around __torch_dispatch__ does, without its Python wrapper
    from torch._C._dynamo.eval_frame import set_eval_frame as _set_eval_frame
except ImportError:  # pragma: no cover - a PyTorch without dynamo: TorchDispatchMode's own wrapper
    _set_eval_frame = None


def _skip_code(code: Any) -> None:
    """Dynamo's ``skip_code``, through its C module: importing ``torch._dynamo`` costs ~2 s, which
    every ``precisiondiff`` command would pay at start-up (the strategy lives on the code object,
    so it holds for a Dynamo imported later)."""
    try:
        from torch._C._dynamo import eval_frame as frames
        frames.set_code_exec_strategy(code, frames._FrameExecStrategy(frames._FrameAction.SKIP,
                                                                     frames._FrameAction.DEFAULT))
    except (ImportError, AttributeError):  # pragma: no cover - an older PyTorch: its Python helper
        from torch._dynamo.eval_frame import skip_code
        skip_code(code)
_set_grad_enabled = torch._C._set_grad_enabled
_OpOverload = torch._ops.OpOverload
_is_grad_enabled = torch.is_grad_enabled
_Tensor = torch.Tensor


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread."""
    return _GRAPH_TASK_ID is not None and _GRAPH_TASK_ID() != -1


class _OpInfo:
    """What the mode needs to know about an op, worked out once per op overload.

    ``name`` is empty for an op that is not recorded (it may still write memory: ``writes``).
    ``outs`` names the schema's ``out=`` arguments, ``writes`` the ``(position, name)`` of every
    argument it marks written; ``hop``: a higher-order operator; ``uninitialized``: an ``empty*``
    op (its output is noise until written)."""

    __slots__ = ("name", "mutable", "overwrites_self", "collective", "outs", "writes", "hop", "uninitialized",
                 "is_view")

    def __init__(self, name: str, mutable: bool, overwrites_self: bool, collective: bool = False, *,
                 outs: tuple = (), writes: tuple = (), hop: bool = False, uninitialized: bool = False,
                 is_view: bool = False) -> None:
        self.name, self.mutable, self.overwrites_self = name, mutable, overwrites_self
        self.collective = collective
        self.outs, self.writes, self.hop, self.uninitialized = outs, writes, hop, uninitialized
        self.is_view = is_view


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

    # Higher-order operators reach __torch_dispatch__ (recorded as units) instead of raising
    # "no rule registered for HigherOrderOperator" into the workload.
    supports_higher_order_operators = True

    def __init__(self, session: "CaptureSession") -> None:
        super().__init__()
        self.session = session
        self._info: Dict[Any, _OpInfo] = {}
        self._scopes: Dict[str, bool] = {}
        self.deferred = Deferred()  # collectives recorded once their result is ready
        self.uninitialized = _Uninitialized()
        self._pending = self.uninitialized.refs  # non-empty while an uninitialized buffer is live
        self.hops_seen: Dict[str, int] = {}  # higher-order operators recorded, by name
        self.compiled: Any = None  # compiled.CompiledOps: the C++ hook in front of this mode

    def __enter__(self):  # noqa: D105
        out = super().__enter__()
        if self.compiled is not None:
            self.compiled.enable(True)
        return out

    def __exit__(self, *exc: Any):  # noqa: D105
        if self.compiled is not None:
            self.compiled.enable(False)
        return super().__exit__(*exc)

    def _describe(self, func: Any) -> _OpInfo:
        if isinstance(func, HigherOrderOperator):
            name = HOP_PREFIX + func.name()
            info = _OpInfo(name if self.session.filter.want_op(name) else "", True, False, hop=True)
            self._info[func] = info
            return info
        name = str(func)
        schema = func._schema
        writes = tuple((i, a.name) for i, a in enumerate(schema.arguments)
                       if a.alias_info is not None and a.alias_info.is_write)
        is_view = bool(getattr(func, "is_view", False))
        if name in _ALWAYS_SKIP or (not self.session.filter.views and is_view) \
                or not self.session.filter.want_op(name):
            info = _OpInfo("", False, False, writes=writes, uninitialized=name in _UNINITIALIZED,
                           is_view=is_view) if writes or name in _UNINITIALIZED else _SKIPPED
        else:
            info = _OpInfo(name, bool(schema.is_mutable), name in _OVERWRITES_SELF,
                           name.startswith(COLLECTIVE_NAMESPACES),
                           outs=tuple(a.name for a in schema.arguments if a.is_out), writes=writes,
                           is_view=is_view)
        self._info[func] = info
        return info

    def _wrote(self, info: _OpInfo, args: tuple, kwargs: dict, out: Any) -> None:
        """After an op: forget what capture recorded of the memory it wrote (a write through
        ``.data`` or by a collective bumps no version counter), and which buffers are no longer
        uninitialized (what it wrote, and what it returned unless it is a view)."""
        try:
            written = _written(info, args, kwargs) if info.writes or info.collective else []
            rec = self.session.recorder
            if written and rec is not None:
                rec.forget(written)
            if self.uninitialized.refs:
                self.uninitialized.written(written if info.is_view else written + flatten_tensors(out))
        except Exception as err:  # noqa: BLE001 - capture's own error: never the workload's
            self.session.capture_failed(err)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Dynamo refuses to compile a frame under a dispatch mode. Eager flex_attention, cond,
        # while_loop... compile a one-call wrapper of their HOP (fullgraph=True). Skipped, that
        # fails: flex_attention raises "found no compiled frames", and Dynamo remembers the skip,
        # so the same call without capture later fails too. For those wrappers only (torch marks
        # them: _in_hop_compile), capture lets Dynamo compile; their graph calls the HOP, which
        # reaches __torch_dispatch__ and is recorded as one unit. Module hooks do nothing while
        # Dynamo traces (hooks.py), so a branch calling a module has no side effect to refuse.
        return _in_hop_compile()

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps __torch_dispatch__ in torch._disable_dynamo (1-4 us of Python
        # per op). The mode does the same itself: Dynamo neither compiles nor inlines its frame
        # (skip_code, _torchdynamo_disable below) and the frame turns the eval-frame callback off
        # while it runs, so a compiled region calling an op never compiles capture's code.
        return _set_eval_frame is None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        # a higher-order operator never passes the compiled hook: the ops of its subgraphs must
        # not reach it either (this mode records the operator as one unit)
        unhook = self.compiled is not None and type(func) is not _OpOverload
        if unhook:
            self.compiled.enable(False)
        try:
            if _set_eval_frame is None:
                return self._dispatch(func, args, kwargs)
            prior = _set_eval_frame(None)
            try:
                return self._dispatch(func, args, kwargs)
            finally:
                _set_eval_frame(prior)
        finally:
            if unhook:
                self.compiled.enable(True)

    def scope_now(self) -> "tuple[str, bool, bool]":
        """The running call's module scope, whether it runs in a backward, and whether the
        session's filter wants that scope (cached per scope)."""
        session = self.session
        backward = _GRAPH_TASK_ID is not None and _GRAPH_TASK_ID() != -1
        if backward:
            scope = session.current_scope(True)
        else:
            stack = session._stack
            scope = stack[-1] if stack else ""
        wanted = self._scopes.get(scope)
        if wanted is None:
            wanted = self._scopes[scope] = session.filter.want_scope(scope)
        return scope, backward, wanted

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
            out = func(*args, **(kwargs or {}))
            if info.uninitialized:
                self.uninitialized.add(out)
            elif info.writes or info.collective or (self._pending and not info.is_view):
                self._wrote(info, args, kwargs or {}, out)
            return out
        updates = session._updates
        if updates is not None and updates.stack:  # inside optimizer.step() & co (optimizer.py)
            out = updates.dispatch(self, func, info, args, kwargs or {})
            if info.writes or info.collective or self._pending:
                try:  # what the update wrote is not what capture recorded of that memory before
                    self._wrote(info, args, kwargs or {}, out)
                except Exception as err:  # noqa: BLE001
                    session.capture_failed(err)
            return out
        scope, backward, wanted = self.scope_now()
        if not wanted:
            out = func(*args, **(kwargs or {}))
            if info.writes or info.collective or self._pending:
                self._wrote(info, args, kwargs or {}, out)
            return out
        if kwargs is None:
            kwargs = {}
        # A failure of capture itself (statistics, a full disk) never reaches the workload: the op
        # runs exactly once whatever happens here, and the session notes the error and stops.
        grad = _is_grad_enabled()
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
            if info.writes or info.collective or self._pending:
                self._wrote(info, args, kwargs, out)
            if info.collective:
                self._outputs(func, info, event, args, kwargs, out)
            else:
                self._record_outputs(func, info, event, args, kwargs, out, info.mutable)
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
        skip = _overwritten(info.name, info.outs, args, kwargs) \
            if info.overwrites_self or info.collective or (info.outs and kwargs) else ()
        uninitialized = self.uninitialized if self._pending else None
        slots = event.slots
        for i, t in enumerate(inputs):
            if id(t) in slots or id(t) in skip:
                continue
            if uninitialized is not None and uninitialized.holds(t):
                if event.unread is None:
                    event.unread = set()
                event.unread.add(id(t))  # a buffer the op fills: recorded after it, if declared
                continue
            rec.add(event, _INPUT_SLOTS[i] if i < 16 else f"input.{i}", t)
        if info.hop:
            self.hops_seen[info.name] = self.hops_seen.get(info.name, 0) + 1
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
        unread = event.unread
        if isinstance(out, _Tensor) and unread is None:
            rec.add(event, "output.0", out, fresh=mutated)
        else:
            declared = _overwritten(info.name, info.outs, args, kwargs) if unread else ()
            for i, t in enumerate(flatten_tensors(out)):
                slot = _OUTPUT_SLOTS[i] if i < 16 else f"output.{i}"
                if unread is not None and id(t) in unread and id(t) not in declared:
                    # uninitialized memory the op wrote without its schema saying so: how much
                    # of it is still noise is unknown (FSDP2 fills one rank's slice of its
                    # all-gather buffer), so it is named, not measured, and replay allocates it
                    rec.add_unmeasured(event, slot, t, {"skipped": UNINITIALIZED_NOTE}, name_slot=False)
                else:
                    rec.add(event, slot, t, fresh=mutated)
        encoded = None
        if rec.mode == "replay":
            encoded = encode_call(args, kwargs, lambda t: rec.slot_of(event, t))
        if event.device is not None and event.device != "cpu":
            event.device = ran_on(func, event.device)  # "cpu": the backend's CPU fallback ran it
        rec.finish(event, args=encoded)
