"""The capture session: module hooks, the op dispatch mode, steps and parameter gradients.

``with precisiondiff.capture("runs/dut", model=model) as cap: ...; cap.step()`` records every
module call (forward inputs/outputs, backward grad_output/grad_input), every op, and parameter
gradients after accumulation. With ``model=None`` it installs global module hooks instead, so an
unmodified script can be captured (``precisiondiff capture --script``).
"""
from __future__ import annotations

import logging
import os
import warnings
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

# Expected for the first layer (token ids need no gradient): the hook then reports grad_output
# only, which is what we record. Not worth a warning per step; silenced while a session is open.
_EXPECTED_WARNING = "Full backward hook is firing when gradients are computed"

# Backward ops are attributed to modules through the autograd graph: when a module's forward
# returns, the graph nodes it created are tagged with its scope; in backward, the op's scope is
# the tag of the node the engine is running. Cheaper and more exact than module backward hooks
# (which also miss modules whose inputs need no gradient). Feature-detected: older PyTorch
# falls back to the hooks.
_SCOPE_TAG = "precisiondiff_scope"
_CURRENT_NODE = getattr(torch._C, "_current_autograd_node", None)


def _rank_and_world() -> "tuple[int, int]":
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _tag_graph(output: Any, scope: str, boundary: list, shortcuts: Dict[int, list]) -> None:
    """Tag the autograd nodes a module call created (between its inputs and its outputs) with
    its scope. Inner modules return first, so a node keeps the innermost scope; an inner call's
    output node carries a shortcut to the inner call's input nodes, so each node is walked once
    (reading ``next_functions`` is the expensive part)."""
    outputs = [t.grad_fn for t in flatten_tensors(output) if t.grad_fn is not None]
    stop = {id(node) for node in boundary}
    stack = list(outputs)
    seen: set = set()
    while stack:
        node = stack.pop()
        key = id(node)
        if key in seen or key in stop:
            continue
        seen.add(key)
        jump = shortcuts.get(key)
        if jump is not None:  # an inner module's output: continue from that module's inputs
            stack.extend(jump)
            continue
        metadata = node.metadata
        if _SCOPE_TAG not in metadata:
            metadata[_SCOPE_TAG] = scope
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    for node in outputs:
        shortcuts[id(node)] = boundary


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
        self._bwd_pending: Dict[int, List[Any]] = {}
        # keyed by id(): tensors compare element-wise, so they cannot be dict keys themselves
        self._touched: "weakref.WeakValueDictionary[int, nn.Parameter]" = weakref.WeakValueDictionary()
        self._param_owner: Dict[int, tuple] = {}
        self._mode: Optional[OpCaptureMode] = None
        self._tag_nodes = _CURRENT_NODE is not None and level in ("op", "all")
        self._boundaries: Dict[int, List[list]] = {}
        self._shortcuts: Dict[int, list] = {}  # keyed by id(node); cleared every step
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
        if backward and self._tag_nodes:
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
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("ignore", message=_EXPECTED_WARNING)
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
            self._warnings.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        self._remove_hooks()
        self._warnings.__exit__(None, None, None)
        # Whatever stopped the run, what was recorded is written. When an error is already on
        # its way out (a script that raised, a full disk), a second one from the sink must not
        # replace it: it is logged instead.
        try:
            self._emit_param_grads()
            self.recorder.flush()
        except PrecisionDiffError as err:
            if exc_type is None:
                self._close_sink(complete=False, propagating=True)
                raise
            log.warning("could not write the last events: %s", err)
        self._close_sink(complete=exc_type is None, propagating=exc_type is not None)

    def _close_sink(self, *, complete: bool, propagating: bool) -> None:
        try:
            self._sink.close(complete=complete)
        except PrecisionDiffError as err:
            if not propagating:
                raise
            log.warning("could not close the dump: %s", err)

    def step(self) -> None:
        """End a training step: emit parameter gradients, then number events from step+1."""
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
            if self.level != "op" or not self._tag_nodes:  # module backward events, or scopes
                self._handles.append(module.register_full_backward_pre_hook(self._bwd_pre))
                self._handles.append(module.register_full_backward_hook(self._bwd_post))
        # optimizer.step(): parameter gradients are taken before it (zero_grad may follow before
        # cap.step()), and its updates are not the model's numerics
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        self._handles.append(register_optimizer_step_pre_hook(self._optimizer_pre))
        self._handles.append(register_optimizer_step_post_hook(self._resume))

    def _hook_globally(self) -> None:
        from torch.nn.modules import module as nn_module
        self._handles.append(nn_module.register_module_forward_pre_hook(self._global_fwd_pre))
        self._handles.append(nn_module.register_module_forward_hook(self._global_fwd_post, always_call=True))
        self._handles.append(nn_module.register_module_full_backward_pre_hook(self._bwd_pre))
        self._handles.append(nn_module.register_module_full_backward_hook(self._bwd_post))
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
        if self._tag_nodes and torch.is_grad_enabled() and self.recording:
            self._boundaries.setdefault(id(module), []).append(
                [t.grad_fn for t in flatten_tensors((args, kwargs)) if t.grad_fn is not None])
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
            _tag_graph(output, scope, boundaries.pop(), self._shortcuts)
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

    def _bwd_pre(self, module: nn.Module, grad_output: Any) -> None:
        scope = self._names.get(module, "")
        self._stack.append(scope)
        if self._wants(module):
            self._bwd_pending.setdefault(id(module), []).append(self.recorder.begin(
                "module", scope, type(module).__name__, "backward"))
            self._bwd_pending[id(module)][-1].grad_output = grad_output  # type: ignore[attr-defined]

    def _bwd_post(self, module: nn.Module, grad_input: Any, grad_output: Any) -> None:
        scope = self._names.get(module, "")
        if scope in self._stack:
            del self._stack[len(self._stack) - 1 - self._stack[::-1].index(scope)]
        pending = self._bwd_pending.get(id(module))
        if not pending:
            return
        event = pending.pop()
        self.paused = True
        try:
            with torch.no_grad():
                for i, t in enumerate(grad_output):
                    if isinstance(t, torch.Tensor):
                        self.recorder.add(event, f"grad_output.{i}", t)
                for i, t in enumerate(grad_input):
                    if isinstance(t, torch.Tensor):
                        self.recorder.add(event, f"grad_input.{i}", t)
            self.recorder.finish(event)
        finally:
            self.paused = False

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
