"""The watch session: hooks that measure a few numbers per tensor per step, read back once per step.

Per watched step (every ``every``-th step):

- every watched module's outputs and output gradients: the statistics of
  :class:`~precisiondiff.capture.stats.StatsBatch` (min, max, mean, abs-mean, L2 norm, NaN and
  Inf counts, content fingerprint), batched and read back in one copy per device;
- every parameter's gradient L2 norm (one multi-tensor ``_foreach_norm`` per device and dtype);
  every ``param_every``-th watched step (a full step) also its weight's norm and, when an
  optimizer is watched, the norm of each optimizer state tensor and the update/weight ratio
  ``‖w_after − w_before‖ / ‖w_after‖``;
- the loss.

The scalars are stacked on their device and copied to the host once per step, into pinned
memory without blocking; on an accelerator a step's line is written when the next step ends
(its copy is long finished by then), so watch never waits for the device mid-step.

Watch never raises into the training loop: an error of its own becomes a ``note`` line in the
log and one :class:`WatchWarning`, and watching stops. It never changes the run: it reads
tensors, registers gradient hooks that return nothing, and draws no random numbers.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import sys
import warnings
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..capture.closure import after_closure
from ..capture.dispatch import in_backward
from ..capture.filters import parse_selection
from ..capture.distributed import process_groups, rank_and_world
from ..capture.serialize import flatten_tensors
from ..capture.stats import StatsBatch, copy_to_host
from ..errors import PrecisionDiffError
from ..runtime.gloo_exit import guard_exit
from .log import FIELDS, LOG_FILE, LogWriter
from .replay import ReplayWindow
from .shards import shard_fields
from .tensors import SnapshotMemory, _norms, snapshot, unwrapped, update_norms
from .trigger import Triggers
from .zero import zero_after, zero_before, zero_shape, zero_shards

__all__ = ["Watch", "WatchWarning", "watch", "LEVELS", "layer_modules", "losses_from_backward"]

LEVELS = ("default", "all")
log = logging.getLogger(__name__)
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


class WatchWarning(UserWarning):
    """Watch stopped because of an error of its own; the training ran on."""


def layer_modules(root: nn.Module, prefix: str = "") -> Dict[nn.Module, str]:
    """The modules the default level watches, with their paths: the root, its children, and the
    members of every ``ModuleList``/``ModuleDict``/``Sequential`` (the repeated blocks)."""
    def full(name: str) -> str:
        return f"{prefix}.{name}" if prefix and name else (prefix or name)

    out: Dict[nn.Module, str] = {root: full("")}
    for name, module in root.named_modules():
        if module is not root and not isinstance(module, (*_CONTAINERS, nn.Sequential)):
            continue
        for child_name, child in module.named_children():
            if not isinstance(child, _CONTAINERS) and child not in out:
                out[child] = full(f"{name}.{child_name}" if name else child_name)
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class _Pending:
    """One watched step waiting for its read-back: the statistics batch and the scalars' copies."""

    __slots__ = ("step", "keys", "batch", "scalars", "copies", "dtypes", "param_dtypes")

    def __init__(self, step: int, keys: List[Tuple[str, int, int]], batch: StatsBatch,
                 scalars: List[Tuple[int, Tuple[str, str]]], copies: list, dtypes: Optional[dict],
                 param_dtypes: Optional[dict] = None) -> None:
        self.step, self.keys, self.batch, self.scalars, self.copies, self.dtypes = \
            step, keys, batch, scalars, copies, dtypes
        self.param_dtypes = param_dtypes

    def record(self) -> Dict[str, Any]:
        self.batch.resolve()
        values: List[float] = []
        for host, done in self.copies:
            if done is not None:
                done.synchronize()  # this copy only; it finished a step ago
            values.extend(host.tolist())
        record: Dict[str, Any] = {"step": self.step, "loss": None}
        params: Dict[str, Dict[str, float]] = {}
        for (_, (name, what)), value in sorted(zip(self.scalars, values), key=lambda item: item[0][0]):
            if name == "" and what == "loss":
                record["loss"] = value
            else:
                params.setdefault(name, {})[what] = value
        tensors = {}
        for key, handle, numel in self.keys:
            s = {**self.batch.get(handle), "numel": numel}  # numel: ranks' statistics combine by it (layouts.py)
            tensors[key] = [s[f] for f in FIELDS]
        record["tensors"] = tensors
        record["params"] = params
        if self.dtypes is not None:
            record["dtypes"] = self.dtypes
        if self.param_dtypes:
            record["param_dtypes"] = self.param_dtypes
        return record


class Watch:
    """Context manager that watches a training run and writes its log (docs/watch.md).

    Args:
        out: the log directory (``out/rank{N}/`` per rank when the job has several).
        model: watch this model's modules; ``None`` watches every module that runs (scripts).
        optimizer: an optimizer (or a list) whose steps measure gradients before and weights,
            state and updates after; without one, weights and gradients are measured at :meth:`step`.
        level: ``default`` (the root, its children and the members of module lists: the layers)
            or ``all`` (every module).
        modules: a regex (``re.search`` on module paths) instead of ``level``'s selection.
        every: watch every N-th step.
        param_every: weight norms, optimizer state norms and update ratios on every N-th watched step.
        meta: extra fields for the header's ``meta``.
        overwrite: replace an existing log.
        global_hooks: hook every module and every optimizer of the process (script watching);
            each ``optimizer.step()`` ends a step and the loss is what ``backward()`` was called on.
        replay_steps: capture these steps (``"5,6"``) in replay mode into ``out/replay`` as the run
            goes (:mod:`.replay`), for ``precisiondiff bisect out/replay``.
        ref: a reference watch log (``watch --ref``): each watched step is judged against its same
            step by compare's rule, and the step after the first one that crosses is captured in
            replay mode into ``out/replay`` (:mod:`.trigger`).
        ref_noise: a noise run's log for ``ref`` (its error against ``ref`` is the band).
        on_anomaly: the same capture at the first NaN/Inf, loss spike or gradient norm jump.

    Example:
        >>> with precisiondiff.watch("runs/w", model=model, optimizer=opt) as w:
        ...     for x, y in data:
        ...         loss = F.cross_entropy(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
        ...         w.step(loss=loss)
    """

    def __init__(self, out: "str | os.PathLike", *, model: Optional[nn.Module] = None,
                 optimizer: Any = None, level: str = "default", modules: Optional[str] = None,
                 every: int = 1, param_every: int = 10, meta: Optional[dict] = None,
                 overwrite: bool = False, global_hooks: bool = False, replay_steps: Optional[str] = None,
                 ref: "str | os.PathLike | None" = None, ref_noise: "str | os.PathLike | None" = None,
                 on_anomaly: bool = False) -> None:
        if level not in LEVELS:
            raise PrecisionDiffError(f"unknown watch level {level!r}: use one of {', '.join(LEVELS)}")
        if int(every) < 1 or int(param_every) < 1:
            raise PrecisionDiffError("--every and --param-every must be at least 1")
        try:
            self._modules_re = re.compile(modules) if modules else None
        except re.error as err:
            raise PrecisionDiffError(f"bad --modules regex {modules!r}: {err}") from err
        if model is None and not global_hooks:
            raise PrecisionDiffError("watch needs a model (or global_hooks=True to watch every module)")
        self.out = os.fspath(out)
        self.level, self.every, self.param_every = level, int(every), int(param_every)
        self.meta = dict(meta or {})
        self.overwrite = overwrite
        self.global_hooks = global_hooks
        self._model = weakref.ref(model) if model is not None else None
        chosen = parse_selection(replay_steps) if replay_steps else None
        self._replay = ReplayWindow(os.path.join(self.out, "replay"), chosen, {**self.meta, "watch": self.out}) \
            if chosen else None
        optimizers = optimizer if isinstance(optimizer, (list, tuple)) else ([optimizer] if optimizer is not None else [])
        self._optimizers = list(optimizers)
        for opt in self._optimizers:
            if not hasattr(opt, "register_step_pre_hook"):
                raise PrecisionDiffError(f"{type(opt).__name__} is not a torch.optim.Optimizer: give its inner "
                                         "torch optimizer, or none (weights and gradients are then read at w.step(), "
                                         "before zero_grad)")
        self.rank, self.world_size = rank_and_world()
        self._triggers: Optional[Triggers] = None
        if ref is not None or ref_noise is not None or on_anomaly:
            if replay_steps:
                raise PrecisionDiffError("give --replay-steps or a trigger (--ref, --on-anomaly), not both: "
                                         "each captures into OUT/replay")
            self._triggers = Triggers(ref=ref, ref_noise=ref_noise, on_anomaly=on_anomaly, rank=self.rank,
                                      world=self.world_size)
        self.triggered: Optional[Dict[str, Any]] = None  # the trigger's hit: the step, the rule, the reason
        self.trigger_error: Optional[str] = None  # why the trigger stopped (it judges no more steps)
        self.trigger_refused = False  # because the reference was refused once the run had started
        self._replay_in_forward = False  # a triggered window of a script opens at the next module call
        self._model_checked = False
        self._header: Dict[str, Any] = {}
        self.step_index = 0
        self.errors: List[str] = []
        self._handles: List[Any] = []
        self._watched: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()
        self._named: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()
        self._param_names: Dict[int, str] = {}
        self._roots = 0
        self._root_refs: List[Tuple[Any, str]] = []  # script watching: the modules first called outermost
        self._writer: Optional[LogWriter] = None
        self._pending: List[_Pending] = []
        self._wrote_dtypes = False
        self._declared: set = set()  # (parameter, quantity) pairs whose dtype the log has
        self._early_notes: List[str] = []  # notes waiting for the log to open
        self._closed = False
        # The process groups seen, held until close: see _hold_process_groups.
        self._groups: Dict[int, Any] = {}
        # the weights' snapshots' kept CPU buffers, per optimizer (tensors.SnapshotMemory)
        self._snapshots: Dict[int, SnapshotMemory] = {}
        self._begin_step()

    # -- lifecycle ----------------------------------------------------------------------------
    def _directory(self) -> str:
        return os.path.join(self.out, f"rank{self.rank}") if self.world_size > 1 else self.out

    def __enter__(self) -> "Watch":
        existing = os.path.join(self._directory(), LOG_FILE)
        if os.path.exists(existing) and not self.overwrite:
            raise PrecisionDiffError(f"{existing} exists: choose another directory or pass --overwrite")
        model = self._model() if self._model is not None else None
        if self._replay is not None:
            self._replay.check()
        if self._triggers is not None:
            ReplayWindow(os.path.join(self.out, "replay"), frozenset({0}), {}).check()
            if model is not None and self._triggers.ref is not None:  # a user error before the training starts
                self._triggers.ref.check_model(self._signature())
                self._model_checked = True
        if model is not None:
            self._name_tree(model, "")
            for module, scope in self._watched.items():
                self._handles.append(module.register_forward_hook(self._fwd_post))
        if self.global_hooks:
            from torch.nn.modules import module as nn_module
            self._handles.append(nn_module.register_module_forward_pre_hook(self._global_pre))
            self._handles.append(nn_module.register_module_forward_hook(self._fwd_post))
            from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
            self._handles.append(register_optimizer_step_pre_hook(self._optimizer_pre))
            self._handles.append(register_optimizer_step_post_hook(self._optimizer_post_global))
        else:
            for opt in self._optimizers:
                self._handles.append(opt.register_step_pre_hook(self._optimizer_pre))
                self._handles.append(opt.register_step_post_hook(self._optimizer_post))
        if self._replay is not None and self._replay.first == 0:
            self._replay_safely(lambda r: r.open(model, 0))
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(complete=exc_type is None)

    def close(self, *, complete: bool = True) -> None:
        """Write what is pending and, when the run ended normally (``complete``), mark the log
        complete (otherwise it reads as partial); remove every hook. Never raises."""
        if self._closed:
            return
        self._closed = True
        if self._replay is not None:
            self._replay_safely(lambda r: r.close())
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._groups.clear()  # the Python objects go last: their destructor releases the GIL
        for memory in self._snapshots.values():
            memory.release()
        self._snapshots.clear()
        try:
            self._drain(all_of_them=True)
            if self._writer is None and not self.errors:
                self._open()
            if self._writer is not None:
                self._write_notes()
                if complete:
                    self._writer.close(steps=self.step_index)
                else:
                    self._writer.abandon()
        except Exception as err:  # noqa: BLE001
            self._fail(err)
            if self._writer is not None:
                self._writer.abandon()

    # -- naming and selection -----------------------------------------------------------------
    def _selected(self, name: str, module: nn.Module, layers: Dict[nn.Module, str]) -> bool:
        if self._modules_re is not None:
            return bool(self._modules_re.search(name))
        return self.level == "all" or module in layers

    def _name_tree(self, root: nn.Module, prefix: str) -> None:
        inner = unwrapped(root)
        if inner is not root:
            for name, module in root.named_modules():  # the wrappers themselves are not watched
                if module is inner:
                    break
                self._named[module] = f"(wrapper){name}"
            root = inner
        layers = layer_modules(root, prefix)
        for name, module in root.named_modules():
            if module in self._named:
                continue
            full = f"{prefix}.{name}" if prefix and name else (prefix or name)
            self._named[module] = full
            if not isinstance(module, _CONTAINERS) and self._selected(full, module, layers):
                self._watched[module] = full
        for name, p in root.named_parameters():
            self._param_names.setdefault(id(p), f"{prefix}.{name}" if prefix else name)

    def _global_pre(self, module: nn.Module, args: Any) -> None:
        r = self._replay
        if self._replay_in_forward and r is not None and r.session is None and not r.done \
                and self.step_index == r.first:
            self._replay_safely(lambda r: r.open_in_forward(module, args, self.step_index))
        if module in self._named or self.errors:
            return
        try:
            prefix = "" if self._roots == 0 else f"{type(module).__name__}_{self._roots}"
            self._roots += 1
            self._root_refs.append((weakref.ref(unwrapped(module)), prefix))
            self._name_tree(module, prefix)
        except Exception as err:  # noqa: BLE001
            self._fail(err)

    # -- per step -----------------------------------------------------------------------------
    def _begin_step(self) -> None:
        self._on = (self.step_index % self.every == 0) and not self.errors and not self._closed
        # a full step also reads every weight (its norm), each optimizer state and the update: on
        # every param_every-th watched step only, since each is a pass over the parameters'
        # memory (docs/watch.md, "Cost"); a light step reads the gradients once
        self._params_full = self._on and (self.step_index // self.every) % self.param_every == 0
        self._batch = StatsBatch(parallel=True) if self._on else None
        self._keys: List[Tuple[str, int, int]] = []
        self._dtypes: Dict[str, str] = {}
        self._calls: Dict[str, int] = {}
        # the step's scalars on their devices: (parameter, quantity) names and 0-d tensors, in order
        self._scalar_names: List[Tuple[str, str]] = []
        self._scalar_values: List[torch.Tensor] = []
        self._new_dtypes: Dict[str, Dict[str, str]] = {}  # quantities first seen in this step: their dtypes
        self._seen: Dict[int, Tuple[Any, int, int]] = {}  # id(tensor) -> (weakref, version, handle)
        self._plists: Dict[int, List[Tuple[str, torch.Tensor]]] = {}  # id(optimizer) -> its parameters
        self._losses: List[torch.Tensor] = []
        self._before: Dict[int, List[torch.Tensor]] = {}
        self._grads_done: set = set()
        self._params_done = False

    def _add(self, key: str, t: torch.Tensor) -> None:
        # the same tensor twice in a step (the root's output is its last layer's, and so is its
        # gradient): measured once, unless it was modified in place since
        seen = self._seen.get(id(t))
        if seen is not None and seen[0]() is t and seen[1] == t._version:
            handle = seen[2]
        else:
            with torch.no_grad():
                handle = self._batch.add(t.detach())
            self._seen[id(t)] = (weakref.ref(t), t._version, handle)
        self._keys.append((key, handle, t.numel()))
        self._dtypes.setdefault(key, _dtype_name(t.dtype))

    def _scalars(self, names: List[Tuple[str, str]], values: Sequence[torch.Tensor],
                 held: Optional[Sequence[torch.Tensor]] = None) -> None:
        """Queue a step's per-parameter scalars; ``held``: the tensors whose dtype each one is
        judged at (the log's ``param_dtypes``, written where a quantity first appears)."""
        self._scalar_names.extend(names)
        self._scalar_values.extend(values)
        if held is not None:
            declared = self._declared
            for (name, what), t in zip(names, held):
                if (name, what) not in declared:
                    declared.add((name, what))
                    self._new_dtypes.setdefault(name, {})[what] = _dtype_name(t.dtype)

    def _fwd_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._on:
            return
        scope = self._watched.get(module)
        if scope is None or in_backward():  # a recompute (activation checkpointing) was watched already
            return
        try:
            with self._quiet():
                self._watch_outputs(scope, output)
        except Exception as err:  # noqa: BLE001 - watch's error, not the training's
            self._fail(err)

    def _watch_outputs(self, scope: str, output: Any) -> None:
        call = self._calls.get(scope, 0)
        self._calls[scope] = call + 1
        base = scope if call == 0 else f"{scope}#{call}"
        floating = [t for t in flatten_tensors(output) if t.is_floating_point()]
        for i, t in enumerate(floating):
            slot = "output" if i == 0 else f"output.{i}"
            self._add(f"{base}:{slot}", t)
            if t.requires_grad and torch.is_grad_enabled():
                self._watch_grad(f"{base}:grad_{slot}", t)

    def _watch_grad(self, key: str, t: torch.Tensor) -> None:
        step = self.step_index

        def take(grad: Optional[torch.Tensor]) -> None:
            if grad is None or not self._on or self.step_index != step:
                return
            try:
                with self._quiet():
                    self._add(key, grad)
            except Exception as err:  # noqa: BLE001
                self._fail(err)

        node = t.grad_fn
        if node is not None:
            # a pre-hook on the node that produced the output sees the gradient of the value the
            # module returned, even if the caller modifies it in place afterwards
            index = t.output_nr
            node.register_prehook(lambda grads: take(grads[index]))
        else:
            t.register_hook(lambda grad: take(grad))

    def note_loss(self, tensors: Any) -> None:
        """Remember ``tensors`` as this step's loss if it is one floating number (what a script's
        ``backward()`` was called on); several in a step (gradient accumulation) are averaged."""
        if not self._on:
            return
        try:
            if isinstance(tensors, torch.Tensor) and tensors.numel() == 1 and tensors.is_floating_point():
                self._losses.append(tensors.detach().reshape(()))
        except Exception as err:  # noqa: BLE001
            self._fail(err)

    # -- parameters ---------------------------------------------------------------------------
    def _param_list(self, optimizer: Any = None) -> List[Tuple[str, torch.Tensor]]:
        if optimizer is not None:
            cached = self._plists.get(id(optimizer))
            if cached is not None:  # the pre-hook's list, in the same step's post-hook
                return cached
            params = [p for group in optimizer.param_groups for p in group["params"]]
        else:
            model = self._model() if self._model is not None else None
            params = list(model.parameters()) if model is not None else []
        out, seen = [], set()
        for i, p in enumerate(params):
            if id(p) in seen:
                continue
            seen.add(id(p))
            out.append((self._param_names.get(id(p), f"param.{i}"), p))
        if optimizer is not None:
            self._plists[id(optimizer)] = out
        return out

    def _grad_norms(self, params: List[Tuple[str, torch.Tensor]]) -> None:
        done = self._grads_done
        with_grad = [(n, p.grad) for n, p in params if p.grad is not None and id(p) not in done]
        done.update(id(p) for _, p in params)
        grads = [g for _, g in with_grad]
        self._scalars([(n, "grad") for n, _ in with_grad], _norms(grads), grads)

    def _optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> Any:
        if not self._on:
            return None

        def before_update() -> None:
            try:
                with self._quiet():
                    self._grad_norms_and_copies(optimizer)
            except Exception as err:  # noqa: BLE001
                self._fail(err)
        return after_closure(args, kwargs, before_update)  # a closure's backward comes first

    def _grad_norms_and_copies(self, optimizer: Any) -> None:
        if zero_before(self, optimizer):  # a DeepSpeed ZeRO partition: per parameter fragment (zero.py)
            return
        params = self._param_list(optimizer)
        self._grad_norms(params)
        if self._params_full:
            with torch.no_grad():
                self._before[id(optimizer)] = snapshot([p for _, p in params], self._snapshot_memory(optimizer))

    def _snapshot_memory(self, optimizer: Any) -> SnapshotMemory:
        """The kept buffer of ``optimizer``'s weights' snapshots (one per optimizer: their steps'
        snapshots may be held at once)."""
        memory = self._snapshots.get(id(optimizer))
        if memory is None:
            memory = self._snapshots[id(optimizer)] = SnapshotMemory()
        return memory

    def _optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._on:
            return
        if not self._params_full:  # a light step: the gradients' norms were all (see _begin_step)
            self._params_done = True
            return
        try:
            with torch.no_grad(), self._quiet():
                if zero_after(self, optimizer):  # a DeepSpeed ZeRO partition: per parameter fragment (zero.py)
                    self._params_done = True
                    return
                params = self._param_list(optimizer)
                tensors = [p for _, p in params]
                before = self._before.pop(id(optimizer), None)
                if before is not None and len(before) == len(params):
                    # ‖w_after‖ and ‖w_after − w_before‖ in one pass over both (tensors.update_norms)
                    weights, updates = update_norms(tensors, before)
                    del before
                    self._scalars([(n, "weight") for n, _ in params], weights, tensors)
                    self._scalars([(n, "update_ratio") for n, _ in params], torch._foreach_div(updates, weights),
                                  tensors)
                else:
                    self._scalars([(n, "weight") for n, _ in params], _norms(tensors), tensors)
                self._state_norms(optimizer, params)
            self._params_done = True
        except Exception as err:  # noqa: BLE001
            self._fail(err)

    def _state_norms(self, optimizer: Any, params: List[Tuple[str, torch.Tensor]]) -> None:
        names, tensors = [], []
        state = optimizer.state
        for name, p in params:
            for what, value in state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    names.append((name, f"state.{what}"))
                    tensors.append(value)
        self._scalars(names, _norms(tensors), tensors)  # each judged at its own dtype (compare.py)

    def _optimizer_post_global(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._optimizer_post(optimizer, args, kwargs)
        self.step()

    # -- step end -----------------------------------------------------------------------------
    def step(self, loss: Any = None) -> None:
        """End a training step: read back its numbers (once per device) and append them to the
        log. Call it after ``optimizer.step()`` (and before ``zero_grad`` when no optimizer is
        watched, so gradients are still there). Never raises."""
        if self._closed:
            return
        if self._on:
            try:
                with self._quiet():
                    self._finish_step(loss)
            except Exception as err:  # noqa: BLE001
                self._fail(err)
        self.step_index += 1
        self._hold_process_groups()
        self._begin_step()
        if self._replay is not None and not self.global_hooks:
            self._replay_safely(self._replay_at_step_end)

    def _hold_process_groups(self) -> None:
        """Keep a reference to every process group until :meth:`close`, so that the last one to go
        is the Python object, whose destructor releases the GIL while gloo's threads are joined.
        Otherwise, after ``destroy_process_group()``, a DDP Reducer's destructor can drop the last
        reference while holding the GIL, and a gloo thread that still has to free a finished
        all-reduce's Python object (its thread-local state) then waits for the GIL for ever: the
        exit deadlock of docs/watch.md, "A gloo DDP job's exit"."""
        try:
            for pg in process_groups():
                self._groups.setdefault(id(pg), pg)
            if self._groups:
                guard_exit()  # and gloo's workers idle before the interpreter finalizes (runtime/gloo_exit.py)
        except Exception:  # noqa: BLE001  (never into the training loop; the hold is an aid only)
            pass

    # -- replay window (replay.py says where it may open and close) -----------------------------
    def _quiet(self) -> Any:
        return self._replay.quiet() if self._replay is not None else contextlib.nullcontext()

    def _replay_at_step_end(self, r: ReplayWindow) -> None:
        """Python API: ``w.step()`` is the user's code, where a session may open and close."""
        if r.active:
            r.session.step()  # ends the step that just finished
            if self.step_index > r.last:
                self._replay_note(r.close())
        elif not r.done and self.step_index == r.first:
            r.open(self._model() if self._model is not None else None, self.step_index)

    def after_backward(self) -> None:
        """Script watching: a ``backward()`` returned, outside every hook (see :mod:`.replay`)."""
        r = self._replay
        if r is None or not self.global_hooks:
            return
        if r.active and self.step_index > r.last:
            self._replay_safely(lambda r: self._replay_note(r.close()))
        elif r.session is None and self.step_index == r.first - 1:
            self._replay_safely(lambda r: r.open(None, self.step_index))

    def _replay_safely(self, action: Any) -> None:
        try:
            action(self._replay)
        except Exception as err:  # noqa: BLE001 - the replay capture's error, not the training's
            self._replay_note(f"{type(err).__name__}: {err}")
            self._replay.done = True

    def _replay_note(self, error: Optional[str]) -> None:
        if error is None:
            return
        message = f"replay capture stopped: {error}"
        self._early_notes.append(message)
        try:
            warnings.warn(f"precisiondiff watch: {message}; the training and the watch run on", WatchWarning,
                          stacklevel=3)
        except Warning:
            pass

    def _finish_step(self, loss: Any) -> None:
        with torch.no_grad():
            if not self._params_done:
                params = self._param_list()
                self._grad_norms(params)
                if self._params_full:
                    tensors = [p for _, p in params]
                    self._scalars([(n, "weight") for n, _ in params], _norms(tensors), tensors)
            if loss is not None:
                self._losses = [loss.detach().reshape(()) if isinstance(loss, torch.Tensor)
                                else torch.tensor(float(loss), dtype=torch.float64)]
            scalar_names, scalar_values = self._scalar_names, self._scalar_values
            if self._losses:
                losses = [x.to(torch.float64 if x.device.type == "cpu" else torch.float32) for x in self._losses]
                value = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
                scalar_names.insert(0, ("", "loss"))
                scalar_values.insert(0, value)
            names: List[Tuple[str, str]] = []
            copies = []
            # one stack per (device, dtype), then one conversion and one host copy per device: a
            # few kernels per step, not one per scalar
            groups: Dict[torch.device, Dict[torch.dtype, List[int]]] = {}
            for i, value in enumerate(scalar_values):
                groups.setdefault(value.device, {}).setdefault(value.dtype, []).append(i)
            for device, by_dtype in groups.items():
                acc = torch.float64 if device.type == "cpu" else torch.float32
                parts, order = [], []
                for index in by_dtype.values():
                    parts.append(torch.stack([scalar_values[i].reshape(()) for i in index]).to(acc))
                    order.extend(index)
                vector = parts[0] if len(parts) == 1 else torch.cat(parts)
                names.extend((i, scalar_names[i]) for i in order)  # record() restores the order
                (host,), done = copy_to_host([vector])
                copies.append((host, done))
            self._batch.start()
        self._pending.append(_Pending(self.step_index, self._keys, self._batch, names, copies, self._dtypes,
                                      self._new_dtypes))
        # a trigger decides at the step's end, so the next step can be captured: read it back now
        self._drain(all_of_them=not self._on_accelerator(copies) or self._triggers is not None)

    @staticmethod
    def _on_accelerator(copies: list) -> bool:
        return any(done is not None for _, done in copies)

    def _drain(self, *, all_of_them: bool) -> None:
        """Write the pending steps: all of them, or all but the newest (its copy may be in flight)."""
        keep = 0 if all_of_them else 1
        while len(self._pending) > keep:
            pending = self._pending.pop(0)
            if self._writer is None:
                self._open()
            elif self._wrote_dtypes:
                pending.dtypes = None  # the tensors' dtypes are in the first step record only
            self._write_notes()
            record = pending.record()
            if not record["tensors"] and not record["params"] and record["loss"] is None:
                record["note"] = "nothing was measured in this step"
            self._writer.write(record)
            self._wrote_dtypes = True
            if self._triggers is not None and self.triggered is None and self.trigger_error is None:
                self._judge(record)

    # -- triggers (trigger.py): the first step that crosses arms a replay capture of the next -----
    def _judge(self, record: Dict[str, Any]) -> None:
        try:
            if self._triggers.ref is not None and not self._model_checked:
                self._triggers.ref.check_model(self._header["model"])  # a script's model is known now
                self._model_checked = True
            hit = self._triggers.judge(self._header, record)
        except Exception as err:  # noqa: BLE001 - a refused reference or the rule's own error: the run goes on
            refused = isinstance(err, PrecisionDiffError)  # a user error: watch_script reports it when the run ends
            self.trigger_error = str(err) if refused else f"{type(err).__name__}: {err}"
            message = f"trigger stopped: {self.trigger_error}"
            self._writer.write({"note": message})
            self.trigger_refused = refused
            if refused:
                return
            try:
                warnings.warn(f"precisiondiff watch: {message}; the training and the watch run on", WatchWarning,
                              stacklevel=3)
            except Warning:
                pass
            return
        if hit is None:
            return
        self.triggered = hit
        step = int(record["step"]) + 1
        hit["captured_step"] = step
        replay = os.path.join(self.out, "replay")
        self._writer.write({"note": f"trigger at step {record['step']} ({hit['rule']}: {hit['reason']}): "
                                    f"step {step} is captured in replay mode into {replay}", "trigger": hit})
        log.warning("precisiondiff watch: step %s crossed (%s: %s); capturing step %d in replay mode into %s",
                    record["step"], hit["rule"], hit["reason"], step, replay)
        self._replay = ReplayWindow(replay, frozenset({step}), {**self.meta, "watch": self.out, "trigger": hit})
        self._replay_in_forward = self.global_hooks

    # -- the log ------------------------------------------------------------------------------
    def _write_notes(self) -> None:
        while self._early_notes and self._writer is not None:
            self._writer.write({"note": self._early_notes.pop(0)})

    def _signature(self) -> Dict[str, Any]:
        model = self._model() if self._model is not None else None
        roots = [(unwrapped(model), "")] if model is not None else [(ref(), prefix) for ref, prefix in self._root_refs]
        named = [(f"{prefix}.{name}" if prefix else name, p) for root, prefix in roots if root is not None
                 for name, p in root.named_parameters()]
        params = [[name, zero_shape(p)] for name, p in named]
        # the model's identity: its parameters' names and shapes, not their dtypes (a bf16 and a
        # float64 run of one model are the point of comparing)
        digest = hashlib.sha1(repr(sorted((n, tuple(s)) for n, s in params)).encode()).hexdigest()
        dtypes = sorted({str(p.dtype).replace("torch.", "") for _, p in named})
        sig = {"signature": digest[:16], "params": params, "modules": sorted(set(self._watched.values())),
               "param_dtypes": dtypes}
        shards = {name: f for name, p in named if (f := shard_fields(p)) is not None}
        shards.update(zero_shards(self))  # ZeRO fragments (zero.py)
        if shards:  # DTensor parameters: each rank measures its shard (combined by shards.combine_ranks)
            sig["shards"] = shards
        return sig

    def _open(self) -> None:
        self.rank, self.world_size = rank_and_world()  # a script initializes its process group after enter
        header = {"model": self._signature(), "level": self.level, "modules_regex": self._modules_re.pattern
                  if self._modules_re else None, "every": self.every, "param_every": self.param_every,
                  "rank": self.rank, "world_size": self.world_size,
                  "meta": {"torch": torch.__version__, "argv": list(sys.argv), **self.meta}}
        self._writer = LogWriter(self._directory(), header, overwrite=self.overwrite)
        self._header = header

    def _fail(self, err: BaseException) -> None:
        """Watch's own error: stop watching, note it in the log, warn once. Never raises."""
        first = not self.errors
        self.errors.append(f"{type(err).__name__}: {err}")
        self._on = False
        if not first:
            return
        log.error("watch stopped at step %d: %s", self.step_index, err, exc_info=err)
        try:
            if self._writer is not None:
                self._writer.write({"note": f"watch stopped at step {self.step_index}: {self.errors[0]}"})
        except Exception:  # noqa: BLE001
            pass
        try:
            warnings.warn(f"precisiondiff watch stopped at step {self.step_index}: {self.errors[0]}; "
                          "the training runs on and the log keeps the steps before", WatchWarning, stacklevel=3)
        except Warning:  # warnings turned into errors must not reach the training either
            pass


@contextlib.contextmanager
def losses_from_backward(w: Watch) -> Iterator[None]:
    """While inside, every ``backward()`` on a one-element tensor tells ``w`` its loss."""
    original = torch.autograd.backward

    def backward(tensors, *args, **kwargs):
        w.note_loss(tensors)
        result = original(tensors, *args, **kwargs)
        w.after_backward()
        return result

    torch.autograd.backward = backward
    try:
        yield
    finally:
        torch.autograd.backward = original


def watch(out: "str | os.PathLike", *, model: Optional[nn.Module] = None, optimizer: Any = None,
          level: str = "default", modules: Optional[str] = None, every: int = 1, param_every: int = 10,
          meta: Optional[dict] = None, overwrite: bool = False, replay_steps: Optional[str] = None,
          ref: "str | os.PathLike | None" = None, ref_noise: "str | os.PathLike | None" = None,
          on_anomaly: bool = False) -> Watch:
    """Watch a training run: a few statistics per layer, parameter and step, and the loss.

    Args:
        out: the log directory (docs/watch.md).
        model: the model whose layers are watched.
        optimizer: its optimizer (or a list): gradients are read before its step, weights, state
            and updates after.
        level: ``default`` (the layers: the root, its children, members of module lists) or ``all``.
        modules: a regex on module paths instead of the level's selection.
        every: watch every N-th step; param_every: weight norms, state norms and update ratios every N-th watched step.
        meta: extra fields for the log's header.
        overwrite: replace an existing log.
        replay_steps: capture these steps (``"5,6"``) in replay mode into ``out/replay``.
        ref: a reference watch log: the first step whose statistics cross compare's threshold
            against the reference's same step makes the next step be captured in replay mode
            into ``out/replay``; ref_noise: a noise run's log that gives ``ref`` its band.
        on_anomaly: the same capture at the first NaN/Inf, loss spike or gradient norm jump.

    Returns:
        A :class:`Watch` to use as a context manager; call ``.step(loss=loss)`` after each step.

    Example:
        >>> with precisiondiff.watch("runs/w", model=model, optimizer=opt) as w:
        ...     loss = model(x).sum(); loss.backward(); opt.step(); opt.zero_grad(); w.step(loss=loss)
    """
    return Watch(out, model=model, optimizer=optimizer, level=level, modules=modules, every=every,
                 param_every=param_every, meta=meta, overwrite=overwrite, replay_steps=replay_steps,
                 ref=ref, ref_noise=ref_noise, on_anomaly=on_anomaly)
