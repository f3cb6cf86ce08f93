"""The module hooks of capture as they were before the 2026-12-03 module-capture speed pass (main
b9f0662, precisiondiff/capture/hooks.py): the oracle of ``test_hooks_equivalence.py``. Swapped
into a session in place of the current hooks (a subclass whose methods come first).

Frozen: do not optimise this file. A deliberate change of what capture records changes both.
"""
# flake8: noqa
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch import nn

from precisiondiff.errors import PrecisionDiffError
from precisiondiff.capture.dispatch import in_backward
from precisiondiff.capture.serialize import encode_call, flatten_tensors

__all__ = ["ModuleHooks", "SCOPE_TAG", "CURRENT_NODE"]


# Backward ops are attributed to modules through the autograd graph: when a module's forward
# returns, the graph nodes it created are tagged with its scope; in backward, the op's scope is
# the tag of the node the engine is running. Cheaper and more exact than module backward hooks
# (which also miss modules whose inputs need no gradient). Feature-detected: a PyTorch without
# torch._C._current_autograd_node attributes backward ops to the innermost module still open.
SCOPE_TAG = "precisiondiff_scope"
CURRENT_NODE = getattr(torch._C, "_current_autograd_node", None)
_ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad
_is_compiling = torch.compiler.is_compiling
_CLASS_NAMES: Dict[type, str] = {}


def class_name(module: nn.Module) -> str:
    """The module's class name as the user wrote it. FSDP2's ``fully_shard`` (and DDP's
    composable ``replicate``) swap a module's class for a generated ``type("FSDP" + name,
    (FSDPModule, cls), ...)``: recorded as ``FSDPLinear`` it would not align with the same model
    run without sharding, so such a generated class is named by the class it wraps."""
    cls = type(module)
    name = _CLASS_NAMES.get(cls)
    if name is None:
        name = cls.__name__
        bases = cls.__bases__
        if (len(bases) == 2 and bases[0].__module__.startswith("torch.distributed.")
                and name.endswith(bases[1].__name__) and name != bases[1].__name__):
            name = bases[1].__name__
        _CLASS_NAMES[cls] = name
    return name


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
        slot_of = self.slot_of
        if not slot_of:
            return None
        if id(node) in slot_of:
            return id(node)
        if type(node) is _ACCUMULATE_GRAD:  # a leaf input
            leaf = ("leaf", id(node.variable))
            if leaf in slot_of:
                return leaf
        return None


def _tag_graph(output: Any, scope: str, boundary: _Boundary, shortcuts: Dict[int, tuple]) -> list:
    """Tag the autograd nodes a module call created (between its inputs and its outputs) with
    its scope, and return the edges ``(node, index, boundary key)`` along which gradients leave
    the module towards its inputs.

    Inner modules return first, so a node keeps the innermost scope; an inner call's output
    node carries a shortcut to the inner call's input nodes and edges, so each node is walked
    once (reading ``next_functions`` is the expensive part)."""
    outputs = [t.grad_fn for t in flatten_tensors(output) if t.grad_fn is not None]
    inner = [node for node in outputs if boundary.key(node) is None]
    stack = list(inner)  # only nodes that are not boundaries are ever pushed
    seen: set = set()
    edges: list = []
    # an inner call with several outputs (a fused QKV projection's q, k, v) is reached once per
    # output, each time through the same shortcut: its edges are taken once, or grad_input
    # would sum the same gradient once per output
    have: set = set()
    boundary_key = boundary.key
    while stack:
        node = stack.pop()
        key = id(node)
        if key in seen:
            continue
        seen.add(key)
        jump = shortcuts.get(key)
        if jump is not None:  # an inner module's output: continue from that module's inputs
            inner_nodes, inner_edges = jump
            for n, j, k in inner_edges:
                target = boundary.key_of_id(k)
                if target is not None and (id(n), j) not in have:
                    have.add((id(n), j))
                    edges.append((n, j, target))
            stack.extend(n for n in inner_nodes if boundary_key(n) is None)
            continue
        metadata = node.metadata
        if SCOPE_TAG not in metadata:
            metadata[SCOPE_TAG] = scope
        for j, (nxt, _) in enumerate(node.next_functions):
            if nxt is None:
                continue
            target = boundary_key(nxt)
            if target is not None:
                if (key, j) not in have:
                    have.add((key, j))
                    edges.append((node, j, target))
            else:
                stack.append(nxt)
    # what an outer module needs to skip this call: its input nodes, and its edges with the
    # identity of the node each one reaches (to be matched against the outer call's inputs)
    # (a key, id(grad_fn) or ("leaf", id(tensor)), names the same input in every call's boundary)
    # An output that is one of the inputs (an identity module: Dropout in eval mode) created no
    # node: a shortcut there would hide, from an outer module, the nodes that produced it.
    for node in inner:
        shortcuts[id(node)] = (boundary.nodes, edges)
    return edges


class _NoGrad:
    """``torch.no_grad()`` for capture's hooks at a sixth of its cost (no decorator machinery)."""

    __slots__ = ("prev",)

    def __enter__(self) -> None:
        self.prev = _is_grad_enabled()
        _set_grad_enabled(False)

    def __exit__(self, *exc: Any) -> None:
        _set_grad_enabled(self.prev)


_is_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled


def _gradient(param: torch.Tensor) -> Optional[torch.Tensor]:
    """``param.grad``, or where a framework keeps it instead (DeepSpeed ZeRO-1/2: :mod:`.deepspeed`)."""
    grad = param.grad
    if grad is None and (getattr(param, "_hp_mapping", None) is not None or hasattr(param, "ds_id")):
        from precisiondiff.capture.deepspeed import zero_gradient
        grad = zero_gradient(param)
    return grad


def _without_orig_mod(name: str) -> str:
    """A module path with torch.compile's ``_orig_mod`` wrapper level left out."""
    if "_orig_mod" not in name:
        return name
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


class ModuleHooks:
    """Hook installation and the module-level events of a capture session (a mixin)."""

    _recomputing = 0  # depth of module calls re-run by activation checkpointing
    _updates: Any = None  # optimizer.Updates: the parameter updates in progress
    _in_step = False  # inside an optimizer.step() being recorded
    _grads_elsewhere = False  # a parameter gradient was read from a framework's buffers (_gradient)

    # -- installing hooks --------------------------------------------------------------------
    def _register_names(self, root: nn.Module, prefix: str) -> None:
        for name, module in root.named_modules():
            if module not in self._names:
                name = _without_orig_mod(name)
                self._names[module] = f"{prefix}.{name}" if prefix and name else (prefix or name)
        for module in root.modules():
            for pname, param in module.named_parameters(recurse=False):
                if param.requires_grad and id(param) not in self._param_owner:
                    self._param_owner[id(param)] = (self._names[module], class_name(module), pname)
                    self._handles.append(param.register_post_accumulate_grad_hook(self._on_grad))
        if type(root).__name__ == "DeepSpeedEngine":  # ZeRO keeps gradients out of p.grad (deepspeed.py)
            from precisiondiff.capture.deepspeed import zero_step_hook
            handle = zero_step_hook(root, self._take_param_grads, wanted=self._zero_gathers, quiet=self.suspended,
                                    on_error=self.capture_failed)
            if handle is not None:
                self._handles.append(handle)

    def _hook_model(self, model: nn.Module) -> None:
        self._register_names(model, "")
        for module in model.modules():
            self._handles.append(module.register_forward_pre_hook(self._fwd_pre, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._fwd_post, with_kwargs=True,
                                                              always_call=True))
        # optimizer.step(): parameter gradients are taken before it (zero_grad may follow before
        # cap.step()); its ops are recorded as the step's updates (optimizer.py)
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        self._handles.append(register_optimizer_step_pre_hook(self._optimizer_pre))
        self._handles.append(register_optimizer_step_post_hook(self._resume))
        self._hook_updates()

    def _hook_globally(self) -> None:
        from torch.nn.modules import module as nn_module
        self._handles.append(nn_module.register_module_forward_pre_hook(self._global_fwd_pre))
        self._handles.append(nn_module.register_module_forward_hook(self._global_fwd_post, always_call=True))
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        self._handles.append(register_optimizer_step_pre_hook(self._optimizer_pre))
        self._handles.append(register_optimizer_step_post_hook(self._optimizer_post))
        self._hook_updates()

    def _global_fwd_pre(self, module: nn.Module, args: Any) -> None:
        if _is_compiling():
            return
        if type(module).__name__ == "OptimizedModule" and not self.errors:
            # dynamo under capture's hooks and dispatch mode would not run what it compiles
            self.capture_failed(PrecisionDiffError(
                "the script calls a torch.compile'd module, which capture cannot record as compiled: "
                "capture it without torch.compile (e.g. TORCHDYNAMO_DISABLE=1)"))
        if module not in self._names:
            prefix = "" if self._roots == 0 else f"{class_name(module)}_{self._roots}"
            self._roots += 1
            self._register_names(module, prefix)
        self._fwd_pre(module, args, {})

    def _global_fwd_post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._fwd_post(module, args, {}, output)

    # -- parameter updates: optimizer.step(), GradScaler, clip_grad_norm_ (optimizer.py) -----
    def _hook_updates(self) -> None:
        from precisiondiff.capture.optimizer import Updates, patch_updates
        self._updates = Updates()
        self._handles.extend(patch_updates(self))

    def _param_names(self) -> Dict[int, str]:
        return {pid: f"{scope}.{pname}" if scope else pname for pid, (scope, _, pname) in self._param_owner.items()}

    def _zero_gathers(self) -> bool:
        """Whether ZeRO's gradients are gathered at this step: the same answer on every rank
        (its collectives), errors and ``--ranks`` aside."""
        rec = self.recorder
        return rec is not None and self.level != "op" and self.filter.want_step(rec.step)

    def _take_param_grads(self) -> None:
        """Parameter gradients now (before a framework's step moves or clips them); never raises."""
        try:
            self._emit_pending_backward()
            self._emit_param_grads(final=False)
        except Exception as err:  # noqa: BLE001
            self.capture_failed(err)

    def _enter_update(self, make: Any) -> bool:
        """Parameter gradients are taken first (an update may modify them: unscale_, clipping),
        then ``make(names)``'s update is current; False when nothing is being recorded."""
        try:
            self._emit_pending_backward()
            self._emit_param_grads(final=False)
            if self._updates is None or not self.recording or self.paused:
                return False
            self._updates.begin(make(self._param_names()))
            return True
        except Exception as err:  # noqa: BLE001
            self.capture_failed(err)
            return False

    @contextlib.contextmanager
    def updating(self, label: str, params: List[tuple]) -> Iterator[None]:
        """A GradScaler or clip_grad_norm_ call: its ops are events of direction ``optimizer``."""
        from precisiondiff.capture.optimizer import Update
        entered = self._enter_update(lambda names: Update(label, names, params))
        try:
            yield
        finally:
            if entered:
                self._updates.end()

    def _optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> Any:
        from precisiondiff.capture.closure import after_closure
        from precisiondiff.capture.optimizer import optimizer_update

        def enter() -> None:
            self._in_step = self._enter_update(lambda names: optimizer_update(self, optimizer, names))
        return after_closure(args, kwargs, enter)  # a closure's forward and backward come first

    def _resume(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._in_step and self._updates is not None:
            self._updates.end()
        self._in_step = False

    def _optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._resume(optimizer, args, kwargs)
        self.step()

    # -- module hooks ------------------------------------------------------------------------
    def _wants(self, module: nn.Module) -> bool:
        return (self.level in ("module", "all") and self.recording and not self.paused
                and self.filter.want_scope(self._names.get(module, "")))

    def _fwd_pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if _is_compiling():
            # Dynamo tracing a module call (a HOP's branch, dispatch.ignore_compile_internals):
            # no state touched, so no side effect for it to refuse; the HOP is the recorded unit
            return
        scope = self._names.get(module, "")
        self._stack.append(scope)
        # A forward during backward is activation checkpointing recomputing what the forward
        # already recorded: its graph is tagged (so its backward ops get their module's scope)
        # but neither it nor its ops are recorded again.
        recompute = self._recomputing > 0 or in_backward()
        if recompute:
            self._recomputing += 1
        if torch.is_grad_enabled() and (self.recording or recompute):
            inputs = flatten_tensors((args, kwargs))
            self._boundaries.setdefault(id(module), []).append((_Boundary(inputs), len(inputs)))
        if recompute or not self._wants(module):
            return
        self.paused = True
        try:
            self._record_inputs(module, scope, args, kwargs)
        except Exception as err:  # noqa: BLE001 - capture's error, not the workload's
            self.capture_failed(err)
        finally:
            self.paused = False

    def _record_inputs(self, module: nn.Module, scope: str, args: Any, kwargs: Any) -> None:
        rec = self.recorder
        event = rec.begin("module", scope, class_name(module), "forward")
        with _NoGrad():
            for i, t in enumerate(flatten_tensors((args, kwargs))):
                if id(t) not in event.slots:
                    rec.add(event, f"input.{i}", t)
            if rec.mode == "replay":
                for name, p in list(module.named_parameters()) + list(module.named_buffers()):
                    rec.add(event, f"param.{name}", p)
        encoded = None
        if rec.mode == "replay":
            slot = lambda t: rec.slot_of(event, t)  # noqa: E731
            encoded = {**encode_call(args, kwargs, slot), "training": module.training}
        self._fwd_inputs.setdefault(id(module), []).append((event, encoded))

    def _fwd_post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if _is_compiling():
            return
        scope = self._names.get(module, "")
        if scope in self._stack:
            del self._stack[len(self._stack) - 1 - self._stack[::-1].index(scope)]
        boundaries = self._boundaries.get(id(module))
        if boundaries:
            boundary, n_inputs = boundaries.pop()
            try:
                edges = _tag_graph(output, scope, boundary, self._shortcuts)
                if self._wants(module):
                    self._watch_backward(module, scope, output, boundary, edges, n_inputs)
            except Exception as err:  # noqa: BLE001
                self.capture_failed(err)
        if self._recomputing:
            self._recomputing -= 1
            return
        pending = self._fwd_inputs.get(id(module))
        if not pending:
            return
        event, encoded = pending.pop()
        if self.errors:
            return
        self.paused = True
        try:
            with _NoGrad():
                for i, t in enumerate(flatten_tensors(output)):
                    self.recorder.add(event, f"output.{i}", t)
            self.recorder.finish(event, args=encoded)
        except Exception as err:  # noqa: BLE001
            self.capture_failed(err)
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
        call = {"scope": scope, "name": class_name(module), "outputs": {}, "inputs": {},
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
                # capture's own arithmetic: not an op of the model's backward
                was_paused, self.paused = self.paused, True
                try:
                    with _NoGrad():
                        prev = call["inputs"].get(i)
                        call["inputs"][i] = grad if prev is None else prev + grad
                finally:
                    self.paused = was_paused
            self._arrived(call)
        return hook

    def _arrived(self, call: dict) -> None:
        call["remaining"] -= 1
        if call["remaining"] == 0:
            self._emit_backward(call)

    def _emit_backward(self, call: dict) -> None:
        """Record a module's backward call once its gradients have arrived (or at step end)."""
        if (call["done"] or self._closed or self.recorder is None or call["step"] != self.recorder.step
                or self.errors):
            return
        call["done"] = True
        was_paused, self.paused = self.paused, True
        try:
            event = self.recorder.begin("module", call["scope"], call["name"], "backward")
            with _NoGrad():
                for k, grad in sorted(call["outputs"].items()):
                    self.recorder.add(event, f"grad_output.{k}", grad)
                for i, grad in sorted(call["inputs"].items()):
                    self.recorder.add(event, f"grad_input.{i}", grad)
            self.recorder.finish(event)
        except Exception as err:  # noqa: BLE001
            self.capture_failed(err)
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

    def _emit_param_grads(self, final: bool = True) -> None:
        """One ``param`` event per module whose parameters received gradients this step. Not
        ``final`` (an update begins): a parameter whose gradient is not there yet stays pending
        until the step ends (a ZeRO optimizer sets each param group's gradients just before that
        group's update)."""
        if not self._touched or self.recorder is None:
            return
        by_module: Dict[tuple, list] = {}
        waiting: "weakref.WeakValueDictionary[int, nn.Parameter]" = weakref.WeakValueDictionary()
        for key, param in list(self._touched.items()):
            owner = self._param_owner.get(id(param))
            grad = _gradient(param) if owner is not None else None
            if grad is not None:
                by_module.setdefault(owner[:2], []).append((owner[2], grad))
                if grad is not param.grad and not self._grads_elsewhere:
                    from precisiondiff.capture.deepspeed import GRADIENT_SOURCE
                    self._grads_elsewhere = True
                    self.update_meta(param_grads_from=GRADIENT_SOURCE)
            elif not final:
                waiting[key] = param
        self._touched = waiting
        if self.level == "op":
            by_module = {}
        self.paused = True
        try:
            for (scope, cls), grads in by_module.items():
                if not self.filter.want_scope(scope):
                    continue
                event = self.recorder.begin("param", scope, cls, "backward")
                with _NoGrad():
                    for pname, grad in grads:
                        self.recorder.add(event, f"param_grad.{pname}", grad)
                self.recorder.finish(event)
        except Exception as err:  # noqa: BLE001
            self.capture_failed(err)
        finally:
            self.paused = False


