"""The capture session: lifecycle, steps, the op dispatch mode, and what happens when capture
itself fails.

``with precisiondiff.capture("runs/dut", model=model) as cap: ...; cap.step()`` records every
module call (forward inputs/outputs, backward grad_output/grad_input), every op, and parameter
gradients after accumulation. With ``model=None`` it installs global module hooks instead, so an
unmodified script can be captured (``precisiondiff capture --script``). The hooks themselves are
in :mod:`.hooks`, torch.distributed and DTensor in :mod:`.distributed`.

Capture never raises into the user's workload: an error of its own (statistics, a full disk)
stops recording, becomes a note in ``meta.json`` (``capture_errors``) and a
:class:`CaptureWarning`; the workload runs on.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import warnings
import weakref
from typing import Any, Dict, Iterator, List, Optional

from torch import nn

from ..errors import PrecisionDiffError
from ..runtime.gloo_exit import guard_exit
from . import compiled, distributed
from .compiled import ENGINES, CompiledOps
from .dispatch import HOP_NOTE, OpCaptureMode
from .filters import CaptureFilter, parse_selection
from .gather import FullGather, wanted as gather_wanted
from .hooks import CURRENT_NODE, SCOPE_TAG, ModuleHooks
from .recorder import MODES, Recorder, Sink

__all__ = ["CaptureSession", "CaptureWarning", "capture", "LEVELS", "DEFAULT_MAX_HOST_MEMORY"]

LEVELS = ("module", "op", "all")
DEFAULT_MAX_HOST_MEMORY = 2 << 30  # bytes of tensor copies capture may hold on the host
log = logging.getLogger(__name__)


class CaptureWarning(UserWarning):
    """Capture stopped recording because of an error of its own; the workload ran on."""


def _freeze_heap() -> bool:
    """Keep the objects alive when capture starts out of the cycle collector's scans until it
    ends (``gc.freeze``); True if frozen here.

    Capture keeps thousands of small records alive for a while (the de-duplication window, a
    batch of events), so the collector promotes them to its oldest generation, and every ~10k op
    events that started a full collection of the whole process: 0.4-0.6 s with PyTorch imported
    (~60 us per op event over a long capture). Frozen, a full collection scans only what was
    allocated since. Objects already alive are not collected meanwhile (a cycle among them that
    becomes garbage during capture is collected after it). Left alone when the program froze
    objects itself or turned the collector off."""
    if not gc.isenabled() or gc.get_freeze_count():
        return False
    gc.freeze()
    return True


# The youngest generation's collection threshold while a session records (every session, both
# engines): an op event is ~8 dicts and lists that live until the sink takes them, so at the
# default (700 allocations) the collector scans them young about once per 90 events for nothing
# (~0.7 us per event on the tiny-ops bench).
YOUNG_THRESHOLD = 20000


def _raise_young_threshold() -> Optional[tuple]:
    """Raise the collector's youngest threshold to :data:`YOUNG_THRESHOLD` while the
    session records; returns the thresholds to put back (None: left alone). Each event's records
    live until the read-back, so at the default (700) the collector scanned them young eight times
    a step of 12 blocks (module level: 1.5-2.5 ms of a 66 ms captured step)."""
    current = gc.get_threshold()
    if not gc.isenabled() or not 0 < current[0] < YOUNG_THRESHOLD:
        return None
    gc.set_threshold(YOUNG_THRESHOLD, *current[1:])
    return current


def _compiled(model: nn.Module) -> Optional[str]:
    """The path of a ``torch.compile``d module inside ``model`` (``""`` for the root), or None."""
    for name, module in model.named_modules():
        if type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod"):
            return name
    return None


class CaptureSession(ModuleHooks):
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
        max_host_memory: bytes of tensor copies held on the host (tensors/replay modes): a
            quarter waits for a statistics read-back, half in the writer's queue, a quarter in
            the shard being written.
        durable: fsync the dump at every step's end, not only when it is closed (a killed
            process keeps every finished step either way; this also survives a power loss).
        engine: how op-level calls are recorded: ``python`` (the ``TorchDispatchMode``) or
            ``compiled`` (a C++ dispatcher hook for the common call, the Python mode for the
            rest: :mod:`.compiled`; statistics mode only, else the Python path). Default: the
            ``PRECISIONDIFF_CAPTURE_ENGINE`` environment variable, else ``python``.

    Example:
        >>> with CaptureSession("runs/dut", model=model, mode="tensors") as cap:
        ...     model(x).sum().backward()
        ...     cap.step()
    """

    def __init__(self, out: "str | os.PathLike | None" = None, *, model: Optional[nn.Module] = None,
                 level: str = "all", mode: str = "stats", format: str = "safetensors",
                 filter: Optional[CaptureFilter] = None, meta: Optional[dict] = None,
                 sink: Optional[Sink] = None, overwrite: bool = False,
                 max_host_memory: int = DEFAULT_MAX_HOST_MEMORY, gather_full: "bool | str" = False,
                 durable: bool = False, engine: Optional[str] = None) -> None:
        if level not in LEVELS:
            raise PrecisionDiffError(f"unknown level {level!r}: use one of {', '.join(LEVELS)}")
        if mode not in MODES:
            raise PrecisionDiffError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
        if format not in ("safetensors", "h5"):
            raise PrecisionDiffError(f"unknown format {format!r}: use safetensors or h5")
        if sink is None and out is None:
            raise PrecisionDiffError("capture needs an output directory")
        if int(max_host_memory) < (4 << 20):
            raise PrecisionDiffError(f"--max-host-memory {max_host_memory} is too small: give at least 4 MiB")
        self.max_host_memory = int(max_host_memory)
        engine = engine or os.environ.get("PRECISIONDIFF_CAPTURE_ENGINE") or "python"
        if engine not in ENGINES:
            raise PrecisionDiffError(f"unknown capture engine {engine!r}: use one of {', '.join(ENGINES)}")
        self.engine = engine
        self._compiled: Optional[CompiledOps] = None
        self.engine_report: Optional[dict] = None  # meta.json's capture_engine, once closed
        self.gather_full = gather_full  # DTensors' full tensors too (gather.py)
        self.errors: List[str] = []  # capture's own failures (it stopped at the first)
        self.out, self.level, self.mode, self.format = out, level, mode, format
        self.filter = filter or CaptureFilter()
        self.meta = dict(meta or {})
        self.overwrite = overwrite
        self.durable = bool(durable)
        self._model = weakref.ref(model) if model is not None else None
        self._sink = sink
        self.rank, self.world_size = distributed.rank_and_world()
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
        # autograd nodes carry their module's scope for backward ops: not when no op is recorded
        self._tag_nodes = level != "module"
        self._scopes_wanted: Dict[str, bool] = {}  # the scope filter's answers
        self._boundaries: Dict[int, List[tuple]] = {}
        self._shortcuts: Dict[int, tuple] = {}  # keyed by id(node); cleared every step
        # id(node) -> (node, module calls waiting for its gradients): hooks.ModuleHooks._waiting
        self._prehooked: Dict[int, tuple] = {}
        self._posthooked: Dict[int, tuple] = {}
        self._backward_calls: List[dict] = []  # module backward calls waiting for gradients
        self._closed = False
        self._layout: Dict[str, Any] = {}  # the process groups as last seen at a step's end
        self.error: Optional[BaseException] = None
        self.recorder: Optional[Recorder] = None
        self._wanted_step = -1
        self._wanted = False
        self._froze = False  # gc.freeze() by this session (_freeze_heap)
        self._gc_threshold: Optional[tuple] = None  # the collector's thresholds to put back

    # -- state -------------------------------------------------------------------------------
    @property
    def step_index(self) -> int:
        return self.recorder.step if self.recorder else 0

    @property
    def recording(self) -> bool:
        """Whether events of the current step and rank are being recorded."""
        rec = self.recorder
        if rec is None or self.errors or self._recomputing:
            return False
        if rec.step != self._wanted_step:  # asked for every op: the filter once per step
            self._wanted = self.filter.want_rank(self.rank) and self.filter.want_step(rec.step)
            self._wanted_step = rec.step
        return self._wanted

    def current_scope(self, backward: bool = False) -> str:
        """The module path the running op belongs to (``backward``: from the autograd node)."""
        if backward and CURRENT_NODE is not None:
            node = CURRENT_NODE()
            if node is not None:
                scope = node.metadata.get(SCOPE_TAG)
                if scope is not None:
                    return scope
        return self._stack[-1] if self._stack else ""

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> "CaptureSession":
        if distributed.is_initialized():
            guard_exit()  # gloo's workers idle before the interpreter finalizes (runtime/gloo_exit.py)
        # A script runs a training loop: every key carries its step. The Python API's first step
        # stays plain until .step() is called (docs/capture.md); an explicit selection decides.
        if self.filter.steps is not None:
            multi_step: Optional[bool] = len(self.filter.steps) > 1
        else:
            multi_step = True if self._model is None else None
        model = self._model() if self._model is not None else None
        if model is not None and _compiled(model) is not None:
            where = _compiled(model) or "the model"
            raise PrecisionDiffError(f"{where} is compiled with torch.compile, which capture cannot record as "
                                     "compiled (its hooks would run it eagerly): capture the module "
                                     "before torch.compile, or its ._orig_mod")
        if self._sink is None:
            from .sinks import DumpSink
            meta = {"level": self.level, "mode": self.mode, "rank": self.rank,
                    "world_size": self.world_size, "multi_step": multi_step,
                    "max_host_memory": self.max_host_memory, **distributed.layout(), **self.meta}
            if self.mode == "replay":  # tensor arguments carry the layout the call saw (serialize.py)
                meta["arg_layouts"] = True
            self._sink = DumpSink(self.out, format=self.format, meta=meta, overwrite=self.overwrite,
                                  queue_bytes=self.max_host_memory // 2,
                                  shard_bytes=self.max_host_memory // 4, durable=self.durable)
        self.recorder = Recorder(self._sink, mode=self.mode, multi_step=multi_step, rank=self.rank,
                                 host_bytes=self.max_host_memory // 4)
        if gather_wanted(self.gather_full):
            self.recorder.gather = FullGather(self.gather_full)
        try:
            if model is not None:
                self._hook_model(model)
            else:
                self._hook_globally()
            if self.level in ("op", "all"):
                self._mode = OpCaptureMode(self)
                self._start_compiled()
                self._mode.__enter__()
        except BaseException:
            self._remove_hooks()
            self._stop_compiled()
            self._resume_outer_hook()
            raise
        self._froze = _freeze_heap()
        self._gc_threshold = _raise_young_threshold()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._settle_collectives()
        hops: Dict[str, int] = {}
        if self._mode is not None:
            hops = self._mode.hops_seen
            self._mode.__exit__(None, None, None)
            self._mode = None
        engine = self.engine_report = self._stop_compiled()
        self._resume_outer_hook()
        self._remove_hooks()
        # Whatever stopped the run, what was recorded is written; capture's own errors become
        # notes (``errors``), never an exception replacing the workload's outcome.
        if not self.errors:
            try:
                self._emit_pending_backward()
                self._emit_param_grads()
                if exc_type is None:
                    self._gather_full()
                self.recorder.flush()
            except Exception as err:  # noqa: BLE001
                self.capture_failed(err)
        note = getattr(self._sink, "update_meta", None)
        if note is not None:
            # groups created during the run (a script may destroy them before capture ends)
            fields: Dict[str, Any] = distributed.layout()
            if "groups" in fields:
                guard_exit()
            else:
                fields.update(self._layout)
            if self.errors:
                fields["capture_errors"] = list(self.errors)
            if engine is not None:
                fields["capture_engine"] = engine
            if hops:  # recorded as units, not op by op (dispatch.py)
                fields["higher_order_ops"] = {name: {"calls": n, "note": HOP_NOTE} for name, n in hops.items()}
            try:
                note(**fields)
            except Exception as err:  # noqa: BLE001
                log.warning("could not note %s in the dump: %s", sorted(fields), err)
        try:
            self._sink.close(complete=exc_type is None and not self.errors)
        except Exception as err:  # noqa: BLE001
            self.capture_failed(err)
        self._closed = True  # graph hooks still attached to live tensors fire into nothing
        self._release_graph()
        if self._froze:
            self._froze = False
            gc.unfreeze()
        threshold, self._gc_threshold = self._gc_threshold, None
        if threshold is not None and gc.get_threshold() == (YOUNG_THRESHOLD, *threshold[1:]):
            gc.set_threshold(*threshold)  # unless the program changed it meanwhile

    def _release_graph(self) -> None:
        """Drop what the session holds of the step's autograd graph and tensors. The graph's
        hooks hold the session through references its cycle collector cannot see (C++ nodes): a
        session holding the graph back was never freed, with its recorder and the tensors of its
        de-duplication window."""
        self._shortcuts.clear()
        self._boundaries.clear()
        self._prehooked.clear()
        self._posthooked.clear()
        self._backward_calls.clear()
        self._fwd_inputs.clear()
        self._stack.clear()
        if self.recorder is not None:
            self.recorder.release()

    def _start_compiled(self) -> None:
        """The compiled engine's hook bound to the op mode, when asked for and possible. A
        session holding it already (this one runs inside it) steps aside until this one ends: its
        hook would record the calls first and hide them from this session's mode (its own Python
        mode, still pushed, records its calls meanwhile)."""
        self._outer_hook = compiled.held()
        if self._outer_hook is not None:
            self._outer_hook.enable(False)
        if self.engine != "compiled" or self.mode != "stats":
            return
        ext = compiled.load()
        if ext is None:
            return
        if self._outer_hook is not None:  # one hook per process: the Python engine for this one
            self._compiled_refused = "another capture session holds the compiled hook"
            return
        self._compiled = self._mode.compiled = CompiledOps(self._mode, ext)
        self.recorder.before_events = self._compiled.drain

    def _stop_compiled(self) -> Optional[dict]:
        """Drain and release the compiled hook; what meta.json says of the engine (None: the
        Python engine, as asked)."""
        done = self._compiled
        if done is None:
            if self.engine == "python" or self.level == "module":
                return None
            why = "statistics mode only" if self.mode != "stats" else \
                getattr(self, "_compiled_refused", None) or compiled.unavailable_reason()
            return {"name": "python", "asked": self.engine, "why": why}
        self._compiled = None
        done.close()
        self.recorder.before_events = None
        return {"name": "compiled", **done.counts()}

    def _resume_outer_hook(self) -> None:
        outer, self._outer_hook = getattr(self, "_outer_hook", None), None
        if outer is not None:
            outer.enable(True)

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Run a block as if capture were not there: nothing recorded, the op mode removed."""
        was, self.paused = self.paused, True
        mode = self._mode
        if mode is not None:
            mode.__exit__(None, None, None)
        try:
            yield
        finally:
            if mode is not None:
                mode.uninitialized.clear()  # what ran meanwhile may have written them unseen
                mode.__enter__()
            self.paused = was

    def update_meta(self, **fields: Any) -> None:
        """Fields for the dump's meta.json, written when the session closes (dump sinks only)."""
        update = getattr(self._sink, "update_meta", None)
        if update is not None:
            update(**fields)

    def capture_failed(self, err: BaseException) -> None:
        """Capture's own error: stop recording, note it, warn once. Never raises."""
        if self.errors:
            return
        step = self.recorder.step if self.recorder is not None else 0
        self.errors.append(f"{type(err).__name__}: {err}")
        self.error = err
        log.error("capture stopped at step %d: %s", step, err, exc_info=err)
        message = (f"precisiondiff stopped recording at step {step}: {type(err).__name__}: {err}; "
                   "the workload runs on and the dump keeps what was recorded before")
        try:
            warnings.warn(message, CaptureWarning, stacklevel=3)
        except Warning:  # warnings turned into errors must not reach the workload either
            pass

    def _settle_collectives(self) -> None:
        """Record the collectives no op has read yet (distributed.Deferred); never raises."""
        deferred = self._mode.deferred if self._mode is not None else None
        if deferred is None:
            return
        deferred.new_step()
        if not deferred.items:
            return
        if self.errors:
            for item in deferred.items:
                deferred._hold(item)
            deferred.items.clear()
            return
        was, self.paused = self.paused, True
        try:
            deferred.settle_all()
        except Exception as err:  # noqa: BLE001
            self.capture_failed(err)
        finally:
            self.paused = was

    def _gather_full(self) -> None:
        """Gather the noted DTensors' full tensors on every rank (gather.py); never raises."""
        gather = self.recorder.gather if self.recorder is not None else None
        if gather is None:
            return
        try:
            with self.suspended():
                gather.exchange(None if self.errors or not self.recording else self.recorder)
        except Exception as err:  # noqa: BLE001
            self.capture_failed(err)

    def step(self) -> None:
        """End a training step: emit parameter gradients, then number events from step+1."""
        if distributed.is_initialized():
            self._layout = distributed.layout()
            guard_exit()  # gloo's workers idle before the interpreter finalizes (runtime/gloo_exit.py)
        if self.errors:
            self._gather_full()  # agree with the other ranks, which may be gathering
            self.recorder.step += 1
            return
        self._settle_collectives()
        try:
            self._emit_pending_backward()
            self._emit_param_grads()
            self._gather_full()
            self.paused = True  # the sink may run tensor ops: they must not be recorded
            self.recorder.end_step()
        except Exception as err:  # noqa: BLE001
            self.capture_failed(err)
        finally:
            self.paused = False
        self._stack.clear()
        self._shortcuts.clear()
        self._boundaries.clear()
        self._prehooked.clear()
        self._posthooked.clear()
        if self._mode is not None:
            self._mode.uninitialized.clear()

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._direct = None


def capture(out: "str | os.PathLike | None" = None, *, model: Optional[nn.Module] = None,
            level: str = "all", mode: str = "stats", format: str = "safetensors",
            scope: Optional[str] = None, scope_exclude: Optional[str] = None,
            op: Optional[str] = None, op_exclude: Optional[str] = None,
            steps: "str | None" = None, ranks: "str | None" = None, views: bool = False,
            meta: Optional[dict] = None, sink: Optional[Sink] = None,
            overwrite: bool = False, max_host_memory: int = DEFAULT_MAX_HOST_MEMORY,
            gather_full: "bool | str" = False, durable: bool = False,
            engine: Optional[str] = None) -> CaptureSession:
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
        max_host_memory: bytes of tensor copies capture may hold on the host (default 2 GiB).
        gather_full: also record DTensors' full tensors (``True``, or a regex on record keys),
            gathered at each step's end on every rank (docs/distributed.md); default local shards only.
        durable: fsync the dump at every step's end (default: written at every step's end,
            fsynced once at close; only a power loss during the run can lose finished steps).
        engine: ``python`` or ``compiled`` (op levels, statistics mode: a C++ dispatcher hook
            records the common op call; :class:`CaptureSession`).

    Returns:
        A :class:`CaptureSession` to use as a context manager; call ``.step()`` between steps.

    Example:
        >>> with precisiondiff.capture("runs/dut", model=model, mode="tensors") as cap:
        ...     loss = model(x).sum(); loss.backward(); cap.step()
    """
    filt = CaptureFilter(scope=scope, scope_exclude=scope_exclude, op=op, op_exclude=op_exclude,
                         steps=parse_selection(steps), ranks=parse_selection(ranks), views=views)
    return CaptureSession(out, model=model, level=level, mode=mode, format=format, filter=filt,
                          meta=meta, sink=sink, overwrite=overwrite, max_host_memory=max_host_memory,
                          gather_full=gather_full, durable=durable, engine=engine)
