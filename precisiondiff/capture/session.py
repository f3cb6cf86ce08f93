"""The capture session: module hooks, the op dispatch mode, steps and parameter gradients.

``with precisiondiff.capture("runs/dut", model=model) as cap: ...; cap.step()`` records every
module call (forward inputs/outputs, backward grad_output/grad_input), every op, and parameter
gradients after accumulation. With ``model=None`` it installs global module hooks instead, so an
unmodified script can be captured (``precisiondiff capture --script``).
"""
from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from ..errors import PrecisionDiffError
from .dispatch import OpCaptureMode
from .filters import CaptureFilter, parse_selection
from .recorder import MODES, Recorder, Sink
from .serialize import encode_args, flatten_tensors, is_replayable

__all__ = ["CaptureSession", "capture", "LEVELS"]

LEVELS = ("module", "op", "all")
log = logging.getLogger(__name__)


# Backward ops are attributed to modules through the autograd graph: when a module's forward
# returns, the graph nodes it created are tagged with its scope; in backward, the op's scope is
# the tag of the node the engine is running. Cheaper and more exact than module backward hooks
# (which also miss modules whose inputs need no gradient). Feature-detected: a PyTorch without
# torch._C._current_autograd_node attributes backward ops to the innermost module still open.
_SCOPE_TAG = "precisiondiff_scope"
_CURRENT_NODE = getattr(torch._C, "_current_autograd_node", None)


def _rank_and_world() -> "tuple[int, int]":
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class _Boundary:
    """A module call's inputs as the autograd graph sees them: the nodes that produced them
    (where tagging stops) and, per input slot, how an edge into the module is recognized."""

    __slots__ = ("nodes", "slot_of")

    def __init__(self, inputs: List[torch.Tensor]) -> None:
        self.nodes: list = []
        self.slot_of: Dict[Any, int] = {}  # id(grad_fn) or ("leaf", id(tensor)) -> input index
        for i, t in enumerate(inputs):
            if not t.requires_grad:
                continue
            if t.grad_fn is not None:
                self.nodes.append(t.grad_fn)
                self.slot_of.setdefault(id(t.grad_fn), i)
            else:
                self.slot_of.setdefault(("leaf", id(t)), i)

    def key_of_id(self, identity: Any) -> Any:
        """``identity`` (another call's boundary key) if it is one of this call's inputs too."""
        return identity if identity in self.slot_of else None

    def key(self, node: Any) -> Any:
        """The boundary key of ``node`` if it is one of the inputs' producers, else None."""
        if id(node) in self.slot_of:
            return id(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad of a leaf input
        if variable is not None and ("leaf", id(variable)) in self.slot_of:
            return ("leaf", id(variable))
        return None


def _tag_graph(output: Any, scope: str, boundary: _Boundary, shortcuts: Dict[int, tuple]) -> list:
    """Tag the autograd nodes a module call created (between its inputs and its outputs) with
    its scope, and return the edges ``(node, index, boundary key)`` along which gradients leave
    the module towards its inputs.

    Inner modules return first, so a node keeps the innermost scope; an inner call's output
    node carries a shortcut to the inner call's input nodes and edges, so each node is walked
    once (reading ``next_functions`` is the expensive part)."""
    outputs = [t.grad_fn for t in flatten_tensors(output) if t.grad_fn is not None]
    stack = list(outputs)
    seen: set = set()
    edges: list = []
    while stack:
        node = stack.pop()
        key = id(node)
        if key in seen or boundary.key(node) is not None:
            continue
        seen.add(key)
        jump = shortcuts.get(key)
        if jump is not None:  # an inner module's output: continue from that module's inputs
            inner_nodes, inner_edges = jump
            edges.extend((n, j, boundary.key_of_id(k)) for n, j, k in inner_edges
                         if boundary.key_of_id(k) is not None)
            stack.extend(inner_nodes)
            continue
        metadata = node.metadata
        if _SCOPE_TAG not in metadata:
            metadata[_SCOPE_TAG] = scope
        for j, (nxt, _) in enumerate(node.next_functions):
            if nxt is None:
                continue
            target = boundary.key(nxt)
            if target is not None:
                edges.append((node, j, target))
            else:
                stack.append(nxt)
    # what an outer module needs to skip this call: its input nodes, and its edges with the
    # identity of the node each one reaches (to be matched against the outer call's inputs)
    # (a key, id(grad_fn) or ("leaf", id(tensor)), names the same input in every call's boundary)
    # An output that is one of the inputs (an identity module: Dropout in eval mode) created no
    # node: a shortcut there would hide, from an outer module, the nodes that produced it.
    for node in outputs:
        if boundary.key(node) is None:
            shortcuts[id(node)] = (boundary.nodes, edges)
    return edges


class CaptureSession:
    """Context manager that owns every hook handle it installs and removes them on exit.

    Args:
        out: the dump directory (ignored when ``sink`` is given).
        model: hook this model only; ``None`` installs global module hooks (script capture).
        level: ``module``, ``op`` or ``all``.
        mode: ``stats``, ``tensors`` or ``replay``.
        format: ``safetensors`` or ``h5``.
        filter: a :class:`CaptureFilter` (scopes, ops, steps, ranks).
        meta: extra fields for meta.json (target, seed, workload...).
        sink: where events go instead of a dump (e.g. :class:`MemorySink`).
        overwrite: replace an existing dump in ``out``.

    Example:
        >>> with CaptureSession("runs/dut", model=model, mode="tensors") as cap:
        ...     model(x).sum().backward()
        ...     cap.step()
    """

    def __init__(self, out: "str | os.PathLike | None" = None, *, model: Optional[nn.Module] = None,
                 level: str = "all", mode: str = "stats", format: str = "safetensors",
                 filter: Optional[CaptureFilter] = None, meta: Optional[dict] = None,
                 sink: Optional[Sink] = None, overwrite: bool = False) -> None:
        if level not in LEVELS:
            raise PrecisionDiffError(f"unknown level {level!r}: use one of {', '.join(LEVELS)}")
        if mode not in MODES:
            raise PrecisionDiffError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
        if format not in ("safetensors", "h5"):
            raise PrecisionDiffError(f"unknown format {format!r}: use safetensors or h5")
        if sink is None and out is None:
            raise PrecisionDiffError("capture needs an output directory")
        self.out, self.level, self.mode, self.format = out, level, mode, format
        self.filter = filter or CaptureFilter()
        self.meta = dict(meta or {})
        self.overwrite = overwrite
        self._model = weakref.ref(model) if model is not None else None
        self._sink = sink
        self.rank, self.world_size = _rank_and_world()
        self.paused = False
        self._handles: List[Any] = []
        self._names: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()
        self._roots = 0
        self._stack: List[str] = []
        self._fwd_inputs: Dict[int, List[Any]] = {}
        # keyed by id(): tensors compare element-wise, so they cannot be dict keys themselves
        self._touched: "weakref.WeakValueDictionary[int, nn.Parameter]" = weakref.WeakValueDictionary()
        self._param_owner: Dict[int, tuple] = {}
        self._mode: Optional[OpCaptureMode] = None
        self._tag_nodes = True
        self._boundaries: Dict[int, List[tuple]] = {}
        self._shortcuts: Dict[int, tuple] = {}  # keyed by id(node); cleared every step
        self._backward_calls: List[dict] = []  # module backward calls waiting for gradients
        self._closed = False
        self.recorder: Optional[Recorder] = None

    # -- state -------------------------------------------------------------------------------
    @property
    def step_index(self) -> int:
        return self.recorder.step if self.recorder else 0

    @property
    def recording(self) -> bool:
        """Whether events of the current step and rank are being recorded."""
        return (self.recorder is not None and self.filter.want_rank(self.rank)
                and self.filter.want_step(self.recorder.step))

    def current_scope(self, backward: bool = False) -> str:
        """The module path the running op belongs to (``backward``: from the autograd node)."""
        if backward and _CURRENT_NODE is not None:
            node = _CURRENT_NODE()
            if node is not None:
                scope = node.metadata.get(_SCOPE_TAG)
                if scope is not None:
                    return scope
        return self._stack[-1] if self._stack else ""

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> "CaptureSession":
        # A script runs a training loop: every key carries its step. The Python API's first step
        # stays plain until .step() is called (docs/capture.md); an explicit selection decides.
        if self.filter.steps is not None:
            multi_step: Optional[bool] = len(self.filter.steps) > 1
        else:
            multi_step = True if self._model is None else None
        if self._sink is None:
            from .sinks import DumpSink
            meta = {"level": self.level, "mode": self.mode, "rank": self.rank,
                    "world_size": self.world_size, "multi_step": multi_step, **self.meta}
            self._sink = DumpSink(self.out, format=self.format, meta=meta, overwrite=self.overwrite)
        self.recorder = Recorder(self._sink, mode=self.mode, multi_step=multi_step, rank=self.rank)
        try:
            model = self._model() if self._model is not None else None
            if model is not None:
                self._hook_model(model)
            else:
                self._hook_globally()
            if self.level in ("op", "all"):
                self._mode = OpCaptureMode(self)
                self._mode.__enter__()
        except BaseException:
            self._remove_hooks()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        self._remove_hooks()
        # Whatever stopped the run, what was recorded is written. When an error is already on
        # its way out (a script that raised, a full disk), a second one from the sink must not
        # replace it: it is logged instead.
        try:
            self._emit_pending_backward()
            self._emit_param_grads()
            self.recorder.flush()
        except PrecisionDiffError as err:
            if exc_type is None:
                self._close_sink(complete=False, propagating=True)
                raise
            log.warning("could not write the last events: %s", err)
        self._close_sink(complete=exc_type is None, propagating=exc_type is not None)
        self._closed = True  # graph hooks still attached to live tensors fire into nothing

    def _close_sink(self, *, complete: bool, propagating: bool) -> None:
        try:
            self._sink.close(complete=complete)
        except PrecisionDiffError as err:
            if not propagating:
                raise
            log.warning("could not close the dump: %s", err)

    def step(self) -> None:
        """End a training step: emit parameter gradients, then number events from step+1."""
        self._emit_pending_backward()
        self._emit_param_grads()
        self.paused = True  # the sink may run tensor ops: they must not be recorded
        try:
            self.recorder.end_step()
        finally:
            self.paused = False
        self._stack.clear()
        self._shortcuts.clear()
        self._boundaries.clear()

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- installing hooks --------------------------------------------------------------------
    def _register_names(self, root: nn.Module, prefix: str) -> None:
        for name, module in root.named_modules():
            if module not in self._names:
                self._names[module] = f"{prefix}.{name}" if prefix and name else (prefix or name)
        for module in root.modules():
            for pname, param in module.named_parameters(recurse=False):
                if param.requires_grad and id(param) not in self._param_owner:
                    self._param_owner[id(param)] = (self._names[module], type(module).__name__, pname)
                    self._handles.append(param.register_post_accumulate_grad_hook(self._on_grad))

    def _hook_model(self, model: nn.Module) -> None:
        self._register_names(model, "")
        for module in model.modules():
            self._handles.append(module.register_forward_pre_hook(self._fwd_pre, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._fwd_post, with_kwargs=True,
                                                              always_call=True))
        # optimizer.step(): parameter gradients are taken before it (zero_grad may follow before
        # cap.step()), and its updates are not the model's numerics
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        self._handles.append(register_optimizer_step_pre_hook(self._optimizer_pre))
        self._handles.append(register_optimizer_step_post_hook(self._resume))

    def _hook_globally(self) -> None:
        from torch.nn.modules import module as nn_module
        self._handles.append(nn_module.register_module_forward_pre_hook(self._global_fwd_pre))
        self._handles.append(nn_module.register_module_forward_hook(self._global_fwd_post, always_call=True))
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        self._handles.append(register_optimizer_step_pre_hook(self._optimizer_pre))
        self._handles.append(register_optimizer_step_post_hook(self._optimizer_post))

    def _global_fwd_pre(self, module: nn.Module, args: Any) -> None:
        if module not in self._names:
            prefix = "" if self._roots == 0 else f"{type(module).__name__}_{self._roots}"
            self._roots += 1
            self._register_names(module, prefix)
        self._fwd_pre(module, args, {})

    def _global_fwd_post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._fwd_post(module, args, {}, output)

    def _optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._emit_pending_backward()
        self._emit_param_grads()
        self.paused = True  # the update itself is not part of the model's numerics

    def _resume(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.paused = False

    def _optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.paused = False
        self.step()

    # -- module hooks ------------------------------------------------------------------------
    def _wants(self, module: nn.Module) -> bool:
        return (self.level in ("module", "all") and self.recording and not self.paused
                and self.filter.want_scope(self._names.get(module, "")))

    def _fwd_pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        scope = self._names.get(module, "")
        self._stack.append(scope)
        if torch.is_grad_enabled() and self.recording:
            inputs = flatten_tensors((args, kwargs))
            self._boundaries.setdefault(id(module), []).append((_Boundary(inputs), len(inputs)))
        if not self._wants(module):
            return
        self.paused = True
        try:
            rec = self.recorder
            event = rec.begin("module", scope, type(module).__name__, "forward")
            with torch.no_grad():
                for i, t in enumerate(flatten_tensors((args, kwargs))):
                    if id(t) not in event.slots:
                        rec.add(event, f"input.{i}", t)
                if rec.mode == "replay":
                    for name, p in list(module.named_parameters()) + list(module.named_buffers()):
                        rec.add(event, f"param.{name}", p)
            encoded = None
            if rec.mode == "replay":
                slot = lambda t: rec.slot_of(event, t)  # noqa: E731
                encoded = {"args": encode_args(list(args), slot), "kwargs": encode_args(dict(kwargs), slot),
                           "training": module.training}
                encoded["replayable"] = is_replayable(encoded)
            self._fwd_inputs.setdefault(id(module), []).append((event, encoded))
        finally:
            self.paused = False

    def _fwd_post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        scope = self._names.get(module, "")
        if scope in self._stack:
            del self._stack[len(self._stack) - 1 - self._stack[::-1].index(scope)]
        boundaries = self._boundaries.get(id(module))
        if boundaries:
            boundary, n_inputs = boundaries.pop()
            edges = _tag_graph(output, scope, boundary, self._shortcuts)
            if self._wants(module):
                self._watch_backward(module, scope, output, boundary, edges, n_inputs)
        pending = self._fwd_inputs.get(id(module))
        if not pending:
            return
        event, encoded = pending.pop()
        self.paused = True
        try:
            with torch.no_grad():
                for i, t in enumerate(flatten_tensors(output)):
                    self.recorder.add(event, f"output.{i}", t)
            self.recorder.finish(event, args=encoded)
        finally:
            self.paused = False

    # -- module backward: hooks on the autograd graph, not on the module ----------------------
    # Module backward hooks wrap a module's outputs in views, and PyTorch forbids modifying those
    # in place (nn.ReLU(inplace=True) after a BatchNorm, `out += x` in a ResNet block). Instead
    # grad_output comes from pre-hooks on the nodes that produced the outputs (they see the
    # gradient of the value the module returned, even if it is modified in place afterwards), and
    # grad_input from post-hooks on the module's nodes whose edges lead to its inputs: exactly
    # the module's own contribution, as the module hooks gave.
    def _watch_backward(self, module: nn.Module, scope: str, output: Any, boundary: "_Boundary",
                        edges: list, n_inputs: int) -> None:
        outputs = flatten_tensors(output)
        call = {"scope": scope, "name": type(module).__name__, "outputs": {}, "inputs": {},
                "remaining": 0, "step": self.recorder.step, "done": False}
        for k, t in enumerate(outputs):
            if not t.requires_grad:
                continue
            if t.grad_fn is not None:
                t.grad_fn.register_prehook(self._grad_output_hook(call, k, t.output_nr))
            else:
                t.register_hook(self._grad_output_hook(call, k, None))
            call["remaining"] += 1
        for node, j, key in edges:
            node.register_hook(self._grad_input_hook(call, boundary.slot_of[key], j))
            call["remaining"] += 1
        if call["remaining"]:
            self._backward_calls.append(call)

    def _grad_output_hook(self, call: dict, k: int, output_nr: Optional[int]) -> Any:
        def hook(grads: Any) -> None:
            grad = grads if output_nr is None else grads[output_nr]
            if isinstance(grad, torch.Tensor):
                call["outputs"][k] = grad
            self._arrived(call)
        return hook

    def _grad_input_hook(self, call: dict, i: int, j: int) -> Any:
        def hook(grad_inputs: Any, grad_outputs: Any) -> None:
            grad = grad_inputs[j]
            if isinstance(grad, torch.Tensor):
                with torch.no_grad():
                    prev = call["inputs"].get(i)
                    call["inputs"][i] = grad if prev is None else prev + grad
            self._arrived(call)
        return hook

    def _arrived(self, call: dict) -> None:
        call["remaining"] -= 1
        if call["remaining"] == 0:
            self._emit_backward(call)

    def _emit_backward(self, call: dict) -> None:
        """Record a module's backward call once its gradients have arrived (or at step end)."""
        if call["done"] or self._closed or self.recorder is None or call["step"] != self.recorder.step:
            return
        call["done"] = True
        was_paused, self.paused = self.paused, True
        try:
            event = self.recorder.begin("module", call["scope"], call["name"], "backward")
            with torch.no_grad():
                for k, grad in sorted(call["outputs"].items()):
                    self.recorder.add(event, f"grad_output.{k}", grad)
                for i, grad in sorted(call["inputs"].items()):
                    self.recorder.add(event, f"grad_input.{i}", grad)
            self.recorder.finish(event)
        finally:
            self.paused = was_paused

    def _emit_pending_backward(self) -> None:
        """Backward calls whose gradients did not all arrive (a branch not in the loss)."""
        for call in self._backward_calls:
            if not call["done"] and (call["outputs"] or call["inputs"]):
                self._emit_backward(call)
        self._backward_calls.clear()

    # -- parameter gradients -----------------------------------------------------------------
    def _on_grad(self, param: nn.Parameter) -> None:
        if self.recording:
            self._touched[id(param)] = param

    def _emit_param_grads(self) -> None:
        """One ``param`` event per module whose parameters received gradients this step."""
        if not self._touched or self.recorder is None:
            return
        by_module: Dict[tuple, list] = {}
        for param in list(self._touched.values()):
            owner = self._param_owner.get(id(param))
            if owner is not None and param.grad is not None:
                by_module.setdefault(owner[:2], []).append((owner[2], param.grad))
        self._touched = weakref.WeakValueDictionary()
        if self.level == "op":
            by_module = {}
        self.paused = True
        try:
            for (scope, cls), grads in by_module.items():
                if not self.filter.want_scope(scope):
                    continue
                event = self.recorder.begin("param", scope, cls, "backward")
                with torch.no_grad():
                    for pname, grad in grads:
                        self.recorder.add(event, f"param_grad.{pname}", grad)
                self.recorder.finish(event)
        finally:
            self.paused = False


def capture(out: "str | os.PathLike | None" = None, *, model: Optional[nn.Module] = None,
            level: str = "all", mode: str = "stats", format: str = "safetensors",
            scope: Optional[str] = None, scope_exclude: Optional[str] = None,
            op: Optional[str] = None, op_exclude: Optional[str] = None,
            steps: "str | None" = None, ranks: "str | None" = None, views: bool = False,
            meta: Optional[dict] = None, sink: Optional[Sink] = None,
            overwrite: bool = False) -> CaptureSession:
    """Capture a model's (or, with ``model=None``, a whole program's) numerics into a dump.

    Args:
        out: dump directory.
        model: the model to hook; ``None`` hooks every module (script capture).
        level: ``module``, ``op`` or ``all``.
        mode: ``stats``, ``tensors`` or ``replay``.
        format: ``safetensors`` (default) or ``h5``.
        scope, scope_exclude, op, op_exclude: regexes (``re.search``) selecting events.
        steps, ranks: selections like ``"0,2-4"``; default all.
        views: also record view/alias ops (no arithmetic; off by default).
        meta: extra fields for meta.json.
        sink: send events to this sink instead of a dump directory.
        overwrite: replace an existing dump.

    Returns:
        A :class:`CaptureSession` to use as a context manager; call ``.step()`` between steps.

    Example:
        >>> with precisiondiff.capture("runs/dut", model=model, mode="tensors") as cap:
        ...     loss = model(x).sum(); loss.backward(); cap.step()
    """
    filt = CaptureFilter(scope=scope, scope_exclude=scope_exclude, op=op, op_exclude=op_exclude,
                         steps=parse_selection(steps), ranks=parse_selection(ranks), views=views)
    return CaptureSession(out, model=model, level=level, mode=mode, format=format, filter=filt,
                          meta=meta, sink=sink, overwrite=overwrite)
