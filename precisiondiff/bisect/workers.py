"""Replays on many workers: the op and module replays of a bisect's descent judged on several processes.

The float64 op replays are independent per op call, so the search (:func:`~precisiondiff.bisect.
engine.run_search`) asks an *op pool* to judge a window of the ops it will isolate next and then
consumes the judgements in its own order, exactly as if it had judged each op itself: the
verdict, the culprit and every figure are those of one worker (the ops judged ahead past the
point where the search stops are dropped, and their replays are not counted). The module phase
can go the same way: the modules queued next (siblings of the descent) are judged ahead with the
op replays' roundings (bisect/reuse.py) sent from the search; a torchrun job's processes always
(each has built the model), local workers only with ``modules_on_workers`` (each then builds the
workload's modules on the meta device, the real model only where the dump cannot fill that template);
a top-level module's
forward and backward share one replay and stay on the search's process.

* :class:`LocalPool` (``bisect DUMP --workers N``): N processes on this host, each with the dump
  open (it reads only the ops it judges) and the workload's module imported for its custom ops;
* :class:`DistPool` (``torchrun --nproc-per-node N -m precisiondiff bisect DUMP``): every process of
  the job runs the same search; process ``i`` of ``W`` judges ops ``i, i+W...`` of each window and
  the judgements are all-gathered (gloo), so every process goes on with the same ones.

Multi-rank dumps are shared out by rank instead (:mod:`.ranks`).
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .engine import (EngineInput, ModuleContext, ModuleResult, OpResult, forward_module_calls, judge_module_unit,
                     judge_op_unit, random_outputs_of)
from .isolate import IncompleteTemplate, UnitEvent

__all__ = ["LocalPool", "DistPool", "WINDOW_PER_WORKER", "threads_per_worker", "import_workload_module",
           "warm_kernels"]

WINDOW_PER_WORKER = 32  # ops judged ahead per worker: enough to balance large and small ops
CHUNK = 4  # ops per task sent to a local worker

_STATE: Dict[str, Any] = {}  # a local worker's dump, events and options


def threads_per_worker(workers: int) -> int:
    """Intra-op threads of each of ``workers`` processes on this host: the cores shared out."""
    return max(1, (os.cpu_count() or 1) // max(1, workers))


def warm_kernels() -> None:
    """Compile (or load from numba's cache) the compare tile's kernels in this process, before
    workers start: N workers meeting a cold cache would each compile them and fill one cache at
    once, which numba does not make safe (numba#4807: a process loading another's half-written
    cache can crash). Never raises: without numba there is nothing to warm."""
    try:
        from ..comparators.metrics import compare_tensors
        expected = torch.linspace(-1.0, 1.0, 4096, dtype=torch.float64)
        for dtype in (torch.bfloat16, torch.float32):
            compare_tensors((expected * 1.001).to(dtype), expected)
    except Exception:  # noqa: BLE001 - a warm-up only
        pass


def _options(inp: EngineInput, module_classes: Dict[str, str]) -> Dict[str, Any]:
    return {"dut_dtype": inp.dut_dtype, "ref_device": inp.ref_device, "ref_dtype": inp.ref_dtype,
            "overrides": inp.overrides, "peer_device": inp.peer_device, "peer_name": inp.peer_name,
            "rule": inp.rule, "max_replay_bytes": inp.max_replay_bytes, "module_classes": module_classes}


def import_workload_module(workload: Any) -> None:
    """Import the module of a ``path.py:fn`` / ``package.module:fn`` spec (its custom ops), without
    building the workload.

    Raises:
        BisectError: the module cannot be imported.
    """
    from ..errors import BisectError, PrecisionDiffError
    if workload is None or callable(workload):
        return
    from ..runtime.workload import _load_module
    module_part = str(workload).rsplit(":", 1)[0] if ":" in str(workload) else str(workload)
    try:
        _load_module(module_part)
    except PrecisionDiffError as err:
        raise BisectError(str(err)) from err


def _init(events_of: Callable[..., List[UnitEvent]], dump_path: str, workload_module: Optional[str],
          options: Dict[str, Any], threads: int, modules_of: Optional[Callable[..., Dict[str, Any]]] = None) -> None:
    """A local worker's start: threads, the workload's custom ops, the dump's events
    (``events_of(dump, all_steps=True)``: offline.events_from_dump). ``modules_of(workload, meta,
    events)`` builds the workload's modules for module units, at the first one."""
    torch.set_num_threads(threads)
    import_workload_module(workload_module)
    from ..store import load
    dump = load(dump_path)
    events = events_of(dump, all_steps=True)
    classes = options.pop("module_classes")
    _STATE["events"] = {(e.step, e.seq): e for e in events}
    _STATE["options"] = dict(options, module_class_of=classes.get)
    _STATE["input"] = EngineInput(events=[], **_STATE["options"])
    _STATE["build"] = (lambda on_meta: modules_of(workload_module, dump.meta, events, on_meta=on_meta)) \
        if modules_of is not None else (lambda on_meta: {})
    _STATE["modules"] = None  # built at the first module unit: on the meta device first
    _STATE["templates"] = None  # "meta" or "built"
    _STATE["steps"] = {}


def _judge_chunk(keys: Sequence[Tuple[int, int]], rounding: bool) -> List[Tuple[Tuple[int, int], OpResult]]:
    inp = _STATE["input"]
    return [(k, judge_op_unit(_STATE["events"][k], inp, rounding)) for k in keys]


def _templates(real: bool = False) -> None:
    """A local worker's module templates, built once: on the meta device (no memory, no random
    init: 8 s on one core at 100 M parameters; the parameters come from the dump), or the
    workload's real model when ``real`` or when its builder does not run on the meta device."""
    if _STATE["modules"] is not None and (not real or _STATE["templates"] == "built"):
        return
    if not real:
        try:
            _STATE["modules"], _STATE["templates"] = _STATE["build"](True), "meta"
            return
        except Exception:  # noqa: BLE001 - a builder that needs real tensors: the real model
            pass
    _STATE["modules"], _STATE["templates"] = _STATE["build"](False), "built"
    _STATE["steps"] = {}  # contexts hold the previous templates


def _step_context(step: int, fallback: frozenset, rounded: Optional[Dict[Any, Any]]) -> ModuleContext:
    """A local worker's module context for ``step`` (its events, the modules, built once)."""
    _templates()
    if step not in _STATE["steps"]:
        from .evidence import param_grads_of
        events = [e for (s, _), e in _STATE["events"].items() if s == step]
        modules = _STATE["modules"]
        inp = EngineInput(events=events, module_of=modules.get if modules else None,
                          param_grad=param_grads_of(events), random_outputs=random_outputs_of(events),
                          **_STATE["options"])
        _STATE["steps"] = {step: (inp, forward_module_calls(events))}
    inp, calls = _STATE["steps"][step]
    registry = None
    if rounded is not None:
        from .reuse import RoundedOps
        registry = RoundedOps(inp.ref_device, inp.ref_dtype, inp.dut_dtype).imported(rounded, _STATE["events"])
    return ModuleContext(inp, fallback, calls, registry)


def _judge_module(key: Tuple[int, int], held: Tuple[int, ...], fallback: frozenset,
                  rounded: Optional[Dict[Any, Any]]) -> Tuple[Tuple[int, int], Any]:
    ev = _STATE["events"][key]
    held_events = [_STATE["events"][(key[0], h)] for h in held]
    ctx = _step_context(key[0], fallback, rounded)
    if _STATE["templates"] == "meta":
        try:
            result = judge_module_unit(ev, held_events, ctx)
        except IncompleteTemplate:
            result = None
        # a failure that names the meta device: state the dump does not restore (a tensor held in
        # a container or a closure) reached the computation. Replayed with the real model, as the
        # search's process would replay it.
        if result is not None and (result[0].replayable or "meta" not in str(result[1].get("reason", "")).lower()):
            return key, result, "meta"
        _templates(real=True)
        ctx = _step_context(key[0], fallback, rounded)
    return key, judge_module_unit(ev, held_events, ctx), "built"


def _module_results(tasks: Sequence[Tuple[UnitEvent, Tuple[int, ...]]], ctx: ModuleContext,
                    results: Sequence[Tuple[Any, dict, Dict[str, int]]]) -> Dict[int, ModuleResult]:
    n = len(ctx.fallback)
    return {ev.seq: (held, n, *res) for (ev, held), res in zip(tasks, results)}


class LocalPool:
    """``workers`` processes on this host judging op units of one dump.

    Args:
        workers: the number of processes.
        dump_path: the dump every worker opens (each reads the tensors of the ops it judges).
        inp: the search's input (dtypes, devices, overrides, peer), as the workers rebuild it.
        module_classes: scope -> module class name (op budgets per module class), so that the
            workers need not build the model.
        workload: the workload spec whose module is imported in each worker (custom ops) and
            whose modules a worker builds for module units (``modules_of``).
        rounding: whether module replays will reuse the op replays (then each result says how
            many outputs round correctly).
        events_of: ``events_of(dump, all_steps=True)``, the dump's events (a module-level function:
            it is sent to the workers by name).
        modules_of: ``modules_of(workload, meta, events)``, the workload's modules by scope (a
            module-level function); None: module units are judged on the search's process.
    """

    def __init__(self, workers: int, dump_path: str, inp: EngineInput, module_classes: Dict[str, str], *,
                 events_of: Callable[..., List[UnitEvent]], workload: Optional[str] = None,
                 rounding: bool = True, modules_of: Optional[Callable[..., Dict[str, Any]]] = None) -> None:
        import multiprocessing
        self.workers = workers
        self.modules_sent = 0  # module units judged on the workers (some ahead, then dropped)
        self.templates: Dict[str, int] = {}  # module units judged with meta / built templates
        # seconds the search's process spent blocked on the workers: the rest of the replay phase is its
        # own work (module units, the descent), which more workers do not shorten
        self.waited_s = 0.0
        self.pipelined = True  # judge(events, wait_for) queues the events beyond wait_for ahead
        self._queued: Dict[Tuple[int, int], Any] = {}  # (step, seq) -> the future of its chunk
        self._ready: Dict[Tuple[int, int], OpResult] = {}  # judged with a chunk, not yet consumed
        if modules_of is None:
            self.judge_modules = None  # type: ignore[assignment]  (the engine then judges them itself)
        self.window = WINDOW_PER_WORKER * workers
        self.rounding = rounding
        warm_kernels()
        # spawn, not fork: the parent may hold OpenMP threads and a large model
        self._pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_init,
                                         initargs=(events_of, os.fspath(dump_path), workload,
                                                   _options(inp, module_classes),
                                                   threads_per_worker(workers), modules_of))

    def judge(self, events: List[UnitEvent], wait_for: Optional[int] = None) -> Dict[int, OpResult]:
        """Judge ``events`` (op calls of one step) on the workers: ``{seq: OpResult}`` for the first
        ``wait_for`` of them (default: all). The rest stay queued on the workers, judged while the search
        consumes these: no worker idles at the end of a window waiting for the slowest chunk of it
        (:attr:`pipelined`). Events already queued are not sent twice."""
        started = time.perf_counter()
        keys = [(e.step, e.seq) for e in events if (e.step, e.seq) not in self._queued]
        for i in range(0, len(keys), CHUNK):
            chunk = keys[i:i + CHUNK]
            future = self._pool.submit(_judge_chunk, chunk, self.rounding)
            for key in chunk:
                self._queued[key] = future
        out: Dict[int, OpResult] = {}
        for e in events[:wait_for]:
            key = (e.step, e.seq)
            if key not in self._ready:
                for got, res in self._queued[key].result():
                    self._ready[got] = res
            self._queued.pop(key, None)
            out[e.seq] = self._ready.pop(key)
        self.waited_s += time.perf_counter() - started
        return out

    def queued(self) -> bool:
        """Whether op units are queued or judged ahead and not consumed."""
        return bool(self._queued or self._ready)

    def drop_queued(self) -> None:
        """Forget the op units queued ahead and not consumed (the op phase is over): those not started
        are cancelled, so the module phase does not share the cores with them."""
        for future in set(self._queued.values()):
            future.cancel()
        self._queued.clear()
        self._ready.clear()

    def judge_modules(self, tasks: Sequence[Tuple[UnitEvent, Tuple[int, ...]]],
                      ctx: ModuleContext) -> Dict[int, ModuleResult]:
        """Judge module units ``(event, held op seqs)`` of one step on the workers, with the
        search's unreplayable ops and op roundings (``ctx``): ``{seq: ModuleResult}``."""
        rounded = ctx.rounded.export() if ctx.rounded is not None else None
        self.modules_sent += len(tasks)
        futures = [self._pool.submit(_judge_module, (ev.step, ev.seq), held, ctx.fallback, rounded)
                   for ev, held in tasks]
        started = time.perf_counter()
        done = [f.result() for f in futures]
        self.waited_s += time.perf_counter() - started
        for _, _, kind in done:
            self.templates[kind] = self.templates.get(kind, 0) + 1
        return _module_results(tasks, ctx, [res for _, res, _ in done])

    def peak_rss(self) -> Optional[int]:
        """The largest peak RSS of a finished worker (bytes; after :meth:`close`)."""
        import resource
        kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        return kib * 1024 if kib else None

    def close(self) -> None:
        """Stop the workers."""
        self._pool.shutdown(wait=True, cancel_futures=True)


class DistPool:
    """The processes of a torch.distributed job judging op units together: each judges its share
    of a window and the judgements are all-gathered (every process runs the same search).

    Args:
        inp: this process's search input (every process opened the same dump).
        rounding: as :class:`LocalPool`.
        group: the process group (default: the default group).
    """

    def __init__(self, inp: EngineInput, *, rounding: bool = True, group: Any = None) -> None:
        import torch.distributed as dist
        self._dist, self.group = dist, group
        self.rank, self.workers = dist.get_rank(group), dist.get_world_size(group)
        self.window = WINDOW_PER_WORKER * self.workers
        self.inp, self.rounding = inp, rounding
        self.modules_sent = 0

    def judge(self, events: List[UnitEvent]) -> Dict[int, OpResult]:
        """Judge this process's share of ``events`` and gather everyone's: ``{seq: OpResult}``."""
        mine = [(e.seq, judge_op_unit(e, self.inp, self.rounding))
                for i, e in enumerate(events) if i % self.workers == self.rank]
        gathered: List[Any] = [None] * self.workers
        self._dist.all_gather_object(gathered, mine, group=self.group)
        return {seq: res for part in gathered for seq, res in part}

    def judge_modules(self, tasks: Sequence[Tuple[UnitEvent, Tuple[int, ...]]],
                      ctx: ModuleContext) -> Dict[int, ModuleResult]:
        """Judge this process's share of the module units and gather everyone's (every process
        has the modules and the same op roundings: it registered every op's result)."""
        self.modules_sent += len(tasks)
        by_seq = {e.seq: e for e in ctx.inp.events}
        mine = [(i, judge_module_unit(ev, [by_seq[h] for h in held], ctx))
                for i, (ev, held) in enumerate(tasks) if i % self.workers == self.rank]
        gathered: List[Any] = [None] * self.workers
        self._dist.all_gather_object(gathered, mine, group=self.group)
        results: List[Any] = [None] * len(tasks)
        for part in gathered:
            for i, res in part:
                results[i] = res
        return _module_results(tasks, ctx, results)

    def close(self) -> None:
        """Nothing to stop: the job's processes are torchrun's."""

