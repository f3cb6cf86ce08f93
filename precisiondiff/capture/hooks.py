"""Module hooks of a capture session: forward pre/post hooks, module backward through the
autograd graph, parameter gradients, and the optimizer hooks that end a step.

:class:`ModuleHooks` is a part of :class:`~precisiondiff.capture.session.CaptureSession` (its
lifecycle, filters and recorder live there); it installs its hooks into ``self._handles``.
Every hook guards its own work: an error of capture becomes ``capture_failed``, never an
exception in the user's forward or backward.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..errors import PrecisionDiffError
from .dispatch import in_backward
from .serialize import encode_call, flatten_tensors

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

    __slots__ = ("nodes", "slot_of", "leaves")

    def __init__(self, inputs: List[torch.Tensor]) -> None:
        self.nodes: list = []
        self.slot_of: Dict[Any, int] = {}  # id(grad_fn) or ("leaf", id(tensor)) -> input index
        self.leaves = False  # whether an input is a leaf that requires gradients
        for i, t in enumerate(inputs):
            if not t.requires_grad:
                continue
            node = t.grad_fn
            if node is not None:
                self.nodes.append(node)
                self.slot_of.setdefault(id(node), i)
            else:
                self.slot_of.setdefault(("leaf", id(t)), i)
                self.leaves = True

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


def _tag_graph(outputs: List[torch.Tensor], scope: str, boundary: _Boundary, shortcuts: Dict[int, tuple],
               tag: bool = True) -> list:
    """Tag the autograd nodes a module call created (between its inputs and its outputs) with
    its scope, and return the edges ``(node, index, boundary key)`` along which gradients leave
    the module towards its inputs. ``outputs``: the call's output tensors. ``tag=False`` (no op is
    recorded, so no backward op asks for its scope): only the edges.

    Inner modules return first, so a node keeps the innermost scope; an inner call's output
    node carries a shortcut to the inner call's input nodes and edges, so each node is walked
    once (reading ``next_functions`` is the expensive part)."""
    slot_of = boundary.slot_of
    boundary_key = boundary.key
    inner = []
    for t in outputs:
        node = t.grad_fn
        if node is not None and (not slot_of or boundary_key(node) is None):
            inner.append(node)
    stack = list(inner)  # only nodes that are not boundaries are ever pushed
    seen: set = set()
    edges: list = []
    # an inner call with several outputs (a fused QKV projection's q, k, v) is reached once per
    # output, each time through the same shortcut: its edges are taken once, or grad_input
    # would sum the same gradient once per output
    have: set = set()
    leaves = boundary.leaves
    while stack:
        node = stack.pop()
        key = id(node)
        if key in seen:
            continue
        seen.add(key)
        jump = shortcuts.get(key)
        if jump is not None and jump[0] is node:  # an inner module's output: continue from its inputs
            _, inner_nodes, inner_edges = jump
            for n, j, k in inner_edges:
                if k in slot_of and (id(n), j) not in have:
                    have.add((id(n), j))
                    edges.append((n, j, k))
            stack.extend(n for n in inner_nodes if not slot_of or boundary_key(n) is None)
            continue
        if tag:
            metadata = node.metadata
            if SCOPE_TAG not in metadata:
                metadata[SCOPE_TAG] = scope
        j = -1
        for nxt, _ in node.next_functions:
            j += 1
            if nxt is None:
                continue
            # boundary.key(nxt), inline: this runs for every node of the graph
            if id(nxt) in slot_of:
                target: Any = id(nxt)
            elif type(nxt) is _ACCUMULATE_GRAD:
                target = ("leaf", id(nxt.variable)) if leaves else None
                if target is None or target not in slot_of:
                    if tag:  # a parameter's: tagged, nothing behind it
                        stack.append(nxt)
                    continue
            else:
                stack.append(nxt)
                continue
            if (key, j) not in have:
                have.add((key, j))
                edges.append((node, j, target))
    # what an outer module needs to skip this call: its input nodes, and its edges with the
    # identity of the node each one reaches (to be matched against the outer call's inputs)
    # (a key, id(grad_fn) or ("leaf", id(tensor)), names the same input in every call's boundary)
    # An output that is one of the inputs (an identity module: Dropout in eval mode) created no
    # node: a shortcut there would hide, from an outer module, the nodes that produced it.
    # The entry holds the node: a node's Python wrapper lives only while referenced, and a new
    # graph's wrapper may take a dead one's address (the step's earlier forwards), which would
    # jump over the new call's nodes and leave them without a scope.
    for node in inner:
        shortcuts[id(node)] = (node, boundary.nodes, edges)
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
        from .deepspeed import zero_gradient
        grad = zero_gradient(param)
    return grad


def _without_orig_mod(name: str) -> str:
    """A module path with torch.compile's ``_orig_mod`` wrapper level left out."""
    if "_orig_mod" not in name:
        return name
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


_TREE_METHODS = ("named_modules", "modules", "named_parameters", "_named_members")
_PLAIN_TREE: Dict[type, bool] = {}


def _module_tree(root: nn.Module) -> List[tuple]:
    """``(name, module, [(parameter name, parameter)...])`` in the order of
    ``root.named_modules()``, with each module's ``named_parameters(recurse=False)``: read from
    ``_modules`` and ``_parameters`` directly (a fifth of the generators' cost), unless a class
    in the tree overrides one of those methods (then the methods themselves)."""
    tree: List[tuple] = []
    memo: set = set()
    stack = [("", root)]
    while stack:
        name, module = stack.pop()
        if module in memo:
            continue
        memo.add(module)
        cls = type(module)
        plain = _PLAIN_TREE.get(cls)
        if plain is None:
            plain = _PLAIN_TREE[cls] = all(getattr(cls, m, None) is getattr(nn.Module, m) for m in _TREE_METHODS)
        if not plain:
            return [(n, m, list(m.named_parameters(recurse=False))) for n, m in root.named_modules()]
        tree.append((name, module, [(k, v) for k, v in module._parameters.items() if v is not None]))
        dot = name + "." if name else ""
        stack.extend(reversed([(dot + k, m) for k, m in module._modules.items() if m is not None]))
    return tree


_MODULE_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                      "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
_DIRECT = all(isinstance(getattr(nn.Module(), d, None), dict) for d in _MODULE_HOOK_DICTS)
_PLAIN_PARAMS = (nn.Parameter, torch.Tensor)


class _DirectHooks:
    """Module forward hooks and parameter gradient hooks put into their hook dicts as
    ``register_forward_pre_hook(with_kwargs=True)``, ``register_forward_hook(with_kwargs=True,
    always_call=True)`` and ``register_post_accumulate_grad_hook`` put them (ids from the same
    counter), and taken out by one :meth:`remove`: without a ``RemovableHandle`` and its weak
    references each, a third of the cost of entering and closing a session on a model of 112
    modules. A parameter without a hook dict yet, or a subclass, gets its hook the public way."""

    __slots__ = ("modules", "params", "handles")

    def __init__(self) -> None:
        self.modules: List[tuple] = []
        self.params: List[tuple] = []
        self.handles: List[Any] = []

    def module(self, module: nn.Module, pre: Any, post: Any) -> None:
        if not _DIRECT:
            self.handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            self.handles.append(module.register_forward_hook(post, with_kwargs=True, always_call=True))
            return
        i = RemovableHandle.next_id
        RemovableHandle.next_id = i + 2
        module._forward_pre_hooks[i] = pre
        module._forward_pre_hooks_with_kwargs[i] = True
        module._forward_hooks[i + 1] = post
        module._forward_hooks_with_kwargs[i + 1] = True
        module._forward_hooks_always_called[i + 1] = True
        self.modules.append((module, i))

    def param(self, param: torch.Tensor, hook: Any) -> None:
        hooks = param._post_accumulate_grad_hooks if type(param) in _PLAIN_PARAMS else None
        if hooks is None or not param.is_leaf:
            self.handles.append(param.register_post_accumulate_grad_hook(hook))
            return
        i = RemovableHandle.next_id
        RemovableHandle.next_id = i + 1
        hooks[i] = hook
        self.params.append((hooks, i))

    def remove(self) -> None:
        for module, i in self.modules:
            module._forward_pre_hooks.pop(i, None)
            module._forward_pre_hooks_with_kwargs.pop(i, None)
            module._forward_hooks.pop(i + 1, None)
            module._forward_hooks_with_kwargs.pop(i + 1, None)
            module._forward_hooks_always_called.pop(i + 1, None)
        for hooks, i in self.params:
            hooks.pop(i, None)
        for handle in self.handles:
            handle.remove()
        self.modules.clear()
        self.params.clear()
        self.handles.clear()


def _call_tensors(args: tuple, kwargs: dict) -> List[torch.Tensor]:
    """``flatten_tensors((args, kwargs))``; one positional tensor without a walk."""
    if not kwargs and len(args) == 1 and isinstance(args[0], _TensorBase):
        return [args[0]]
    return flatten_tensors((args, kwargs) if kwargs else args)


_TensorBase = torch._C.TensorBase
# slot names of a call's tensors, made once
_INPUT_SLOTS = tuple(f"input.{i}" for i in range(32))
_OUTPUT_SLOTS = tuple(f"output.{i}" for i in range(32))
_GRAD_INPUT_SLOTS = tuple(f"grad_input.{i}" for i in range(32))
_GRAD_OUTPUT_SLOTS = tuple(f"grad_output.{i}" for i in range(32))


class ModuleHooks:
    """Hook installation and the module-level events of a capture session (a mixin).

    A model's module hooks are ``functools.partial`` objects that carry the module's scope, so a
    call looks nothing up; global hooks (script capture) look the scope up by module."""

    _recomputing = 0  # depth of module calls re-run by activation checkpointing
    _updates: Any = None  # optimizer.Updates: the parameter updates in progress
    _in_step = False  # inside an optimizer.step() being recorded
    _grads_elsewhere = False  # a parameter gradient was read from a framework's buffers (_gradient)
    _direct: Optional[_DirectHooks] = None  # hooks put into their dicts directly (in _handles)

    # -- installing hooks --------------------------------------------------------------------
    def _register_names(self, root: nn.Module, prefix: str) -> List[tuple]:
        """Name ``root``'s modules (those not named yet) and hook its parameters' gradients;
        returns :func:`_module_tree`'s ``(name, module, parameters)`` of ``root``."""
        tree = _module_tree(root)
        names = self._names
        for name, module, _ in tree:
            if module not in names:
                name = _without_orig_mod(name)
                names[module] = f"{prefix}.{name}" if prefix and name else (prefix or name)
        owner, hooks, on_grad = self._param_owner, self._direct_hooks(), self._on_grad
        for _, module, params in tree:
            for pname, param in params:
                if param.requires_grad and id(param) not in owner:
                    owner[id(param)] = (names[module], class_name(module), pname)
                    hooks.param(param, on_grad)
        if type(root).__name__ == "DeepSpeedEngine":  # ZeRO keeps gradients out of p.grad (deepspeed.py)
            from .deepspeed import zero_step_hook
            handle = zero_step_hook(root, self._take_param_grads, wanted=self._zero_gathers, quiet=self.suspended,
                                    on_error=self.capture_failed)
            if handle is not None:
                self._handles.append(handle)
        return tree

    def _direct_hooks(self) -> _DirectHooks:
        """This session's :class:`_DirectHooks` (among its handles, so that they go with them)."""
        hooks = self._direct
        if hooks is None:
            hooks = self._direct = _DirectHooks()
            self._handles.append(hooks)
        return hooks

    def _hook_model(self, model: nn.Module) -> None:
        tree = self._register_names(model, "")
        names, hooks, partial = self._names, self._direct_hooks(), functools.partial
        for _, module, _ in tree:
            scope = names[module]
            hooks.module(module, partial(self._pre, scope), partial(self._post, scope))
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
        from .optimizer import Updates, patch_updates
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
        from .optimizer import Update
        entered = self._enter_update(lambda names: Update(label, names, params))
        try:
            yield
        finally:
            if entered:
                self._updates.end()

    def _optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> Any:
        from .closure import after_closure
        from .optimizer import optimizer_update

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
    def _wants(self, scope: str) -> bool:
        """Whether the module call of ``scope`` running now is recorded (the scope filter asked
        once per scope)."""
        if not (self.level != "op" and self.recording and not self.paused):
            return False
        wanted = self._scopes_wanted.get(scope)
        if wanted is None:
            wanted = self._scopes_wanted[scope] = self.filter.want_scope(scope)
        return wanted

    def _fwd_pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        self._pre(self._names.get(module, ""), module, args, kwargs)

    def _fwd_post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        self._post(self._names.get(module, ""), module, args, kwargs, output)

    def _pre(self, scope: str, module: nn.Module, args: Any, kwargs: Any) -> None:
        if _is_compiling():
            # Dynamo tracing a module call (a HOP's branch, dispatch.ignore_compile_internals):
            # no state touched, so no side effect for it to refuse; the HOP is the recorded unit
            return
        self._stack.append(scope)
        # A forward during backward is activation checkpointing recomputing what the forward
        # already recorded: its graph is tagged (so its backward ops get their module's scope)
        # but neither it nor its ops are recorded again.
        recompute = self._recomputing > 0 or in_backward()
        if recompute:
            self._recomputing += 1
        elif not self.recording:
            return
        inputs = None
        if _is_grad_enabled():
            inputs = _call_tensors(args, kwargs)
            self._boundaries.setdefault(id(module), []).append((_Boundary(inputs), len(inputs)))
        if recompute or not self._wants(scope):
            return
        self.paused = True
        try:
            self._record_inputs(module, scope, args, kwargs, inputs)
        except Exception as err:  # noqa: BLE001 - capture's error, not the workload's
            self.capture_failed(err)
        finally:
            self.paused = False

    def _record_inputs(self, module: nn.Module, scope: str, args: Any, kwargs: Any,
                       inputs: Optional[List[torch.Tensor]]) -> None:
        rec = self.recorder
        event = rec.begin("module", scope, class_name(module), "forward")
        if inputs is None:
            inputs = _call_tensors(args, kwargs)
        add, slots = rec.add, event.slots
        grad = _is_grad_enabled()
        if grad:
            _set_grad_enabled(False)
        try:
            for i, t in enumerate(inputs):
                if id(t) not in slots:
                    add(event, _INPUT_SLOTS[i] if i < 32 else f"input.{i}", t)
            if rec.mode == "replay":
                for name, p in list(module.named_parameters()) + list(module.named_buffers()):
                    add(event, f"param.{name}", p)
        finally:
            if grad:
                _set_grad_enabled(True)
        encoded = None
        if rec.mode == "replay":
            slot = lambda t: rec.slot_of(event, t)  # noqa: E731
            encoded = {**encode_call(args, kwargs, slot), "training": module.training}
        self._fwd_inputs.setdefault(id(module), []).append((event, encoded))

    def _post(self, scope: str, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if _is_compiling():
            return
        stack = self._stack
        if stack and stack[-1] == scope:
            stack.pop()
        elif scope in stack:
            del stack[len(stack) - 1 - stack[::-1].index(scope)]
        outputs = None
        boundaries = self._boundaries.get(id(module))
        if boundaries:
            boundary, n_inputs = boundaries.pop()
            try:
                outputs = flatten_tensors(output)
                edges = _tag_graph(outputs, scope, boundary, self._shortcuts, self._tag_nodes)
                if self._wants(scope):
                    self._watch_backward(module, scope, outputs, boundary, edges, n_inputs)
            except Exception as err:  # noqa: BLE001
                self.capture_failed(err)
        if not stack:  # the outermost call is done: no call left to take a shortcut or share a hook
            self._shortcuts.clear()
            self._prehooked.clear()  # (their nodes, and the graph behind them, are not held)
            self._posthooked.clear()
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
            if outputs is None:
                outputs = flatten_tensors(output)
            rec = self.recorder
            grad = _is_grad_enabled()
            if grad:
                _set_grad_enabled(False)
            try:
                for i, t in enumerate(outputs):
                    rec.add(event, _OUTPUT_SLOTS[i] if i < 32 else f"output.{i}", t)
            finally:
                if grad:
                    _set_grad_enabled(True)
            rec.finish(event, args=encoded)
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
    def _watch_backward(self, module: nn.Module, scope: str, outputs: List[torch.Tensor],
                        boundary: "_Boundary", edges: list, n_inputs: int) -> None:
        call = {"scope": scope, "name": class_name(module), "outputs": {}, "inputs": {},
                "remaining": 0, "step": self.recorder.step, "done": False}
        remaining = 0
        for k, t in enumerate(outputs):
            if not t.requires_grad:
                continue
            node = t.grad_fn
            if node is not None:
                self._waiting(node, False).append((call, k, t.output_nr))
            else:
                t.register_hook(functools.partial(self._grad_outputs, [(call, k, None)]))
            remaining += 1
        slot_of = boundary.slot_of
        for node, j, key in edges:
            self._waiting(node, True).append((call, slot_of[key], j))
            remaining += 1
        if remaining:
            call["remaining"] = remaining
            self._backward_calls.append(call)

    def _waiting(self, node: Any, post: bool) -> list:
        """The module calls waiting for a gradient at ``node``: those it passes on to their inputs
        (``post``) or those it receives for their outputs. One hook per node serves them all, in
        the order they asked (an inner module's output is often its caller's: fc2's and its
        MLP's), instead of one registration and one call from the engine each."""
        table = self._posthooked if post else self._prehooked
        entry = table.get(id(node))  # the table holds the node: its id stays its own
        if entry is None:
            waiting: list = []
            if post:
                node.register_hook(functools.partial(self._grad_inputs, waiting))
            else:
                node.register_prehook(functools.partial(self._grad_outputs, waiting))
            entry = table[id(node)] = (node, waiting)
        return entry[1]

    def _grad_outputs(self, waiting: list, grads: Any) -> None:
        for call, k, output_nr in waiting:
            grad = grads if output_nr is None else grads[output_nr]
            if isinstance(grad, torch.Tensor):
                call["outputs"][k] = grad
            call["remaining"] -= 1
            if call["remaining"] == 0:
                self._emit_backward(call)

    def _grad_inputs(self, waiting: list, grad_inputs: Any, grad_outputs: Any) -> None:
        for call, i, j in waiting:
            grad = grad_inputs[j]
            if isinstance(grad, torch.Tensor):
                inputs = call["inputs"]
                prev = inputs.get(i)
                if prev is None:
                    inputs[i] = grad
                else:
                    # capture's own arithmetic: not an op of the model's backward
                    was_paused, self.paused = self.paused, True
                    try:
                        with _NoGrad():
                            inputs[i] = prev + grad
                    finally:
                        self.paused = was_paused
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
            rec = self.recorder
            event = rec.begin("module", call["scope"], call["name"], "backward")
            enabled = _is_grad_enabled()  # (off in a backward, unless it builds a graph)
            if enabled:
                _set_grad_enabled(False)
            try:
                for k, grad in sorted(call["outputs"].items()):
                    rec.add(event, _GRAD_OUTPUT_SLOTS[k] if k < 32 else f"grad_output.{k}", grad)
                for i, grad in sorted(call["inputs"].items()):
                    rec.add(event, _GRAD_INPUT_SLOTS[i] if i < 32 else f"grad_input.{i}", grad)
            finally:
                if enabled:
                    _set_grad_enabled(True)
            rec.finish(event)
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
                    from .deepspeed import GRADIENT_SOURCE
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


