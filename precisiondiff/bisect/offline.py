"""Offline bisect: the DUT's side comes from a dump captured with ``--mode replay`` (on the MLU
machine, say), the reference side runs here. Ops replay from the dump alone; ``workload``
rebuilds the modules for module-level replay (their parameters come from the dump's
``param.<name>`` slots, so the DUT's own weights are used) and, without a reference dump,
runs the reference for the final error. The units go through the same isolation engine as
live bisect (:func:`precisiondiff.bisect.engine.run_search`).
"""
from __future__ import annotations

import os

import logging
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ..errors import BisectError, PrecisionDiffError
from ..runtime.gloo_exit import guard_exit
from ..runtime.targets import Target, checked_held
from .assemble import assemble
from .engine import DEFAULT_MAX_REPLAY_BYTES, EngineInput, replay_bytes
from .evidence import finals_of, input_evidence, param_grads_of
from .findings import resolve_accepts
from .isolate import UnitEvent
from .repro import write_culprit_repro
from .result import BisectResult
from ..store.schema import tensor_key
from .substitute import final_errors
from .training import mark_steps, search_steps
from ..compare.unwrap import wrapper_prefix

__all__ = ["bisect_dump", "bisect_dump_distributed", "events_from_dump", "workload_modules"]

log = logging.getLogger(__name__)


def events_from_dump(dump: Any, *, step: Optional[int] = None, all_steps: bool = False) -> List[UnitEvent]:
    """The events of a loaded dump (one step: the first unless ``step``; every step with
    ``all_steps``) as :class:`UnitEvent`."""
    out: List[UnitEvent] = []
    first: Optional[int] = step
    for ev in dump.events():
        if first is None:
            first = ev.step
        if ev.step != first and not all_steps:
            continue
        slots = {t.slot: (t.dtype, tuple(t.shape), t.has_data) for t in ev.tensors}
        keys = {t.slot: t.key for t in ev.tensors}

        def load(slot: str, _keys: Dict[str, str] = keys) -> torch.Tensor:
            return dump.tensor(_keys[slot])
        out.append(UnitEvent(ev.seq, ev.kind, ev.scope, ev.name, ev.direction, ev.call, slots, ev.args, load,
                             step=ev.step))
    return out


def _op_pool(inp: EngineInput, dump_path: Any, workers: int, distributed: bool, modules: Dict[str, Any],
             workload: Any, prepare: Any, modules_on_workers: bool = False) -> Any:
    """The op pool of ``workers`` local processes or of the torch.distributed job, or None. A job's
    processes judge module units too (each has built the model); local workers only with
    ``modules_on_workers`` (each then builds the workload itself)."""
    from .workers import DistPool, LocalPool
    if distributed:
        return DistPool(inp, rounding=bool(modules))
    if workers is None or workers <= 1:
        return None
    if prepare is not None or (workload is not None and not isinstance(workload, str)):
        raise BisectError("--workers: the dump's ops are judged in worker processes, which need a workload "
                          "given as path/file.py:fn or package.module:fn (a multi-rank dump is shared out by rank)")
    classes = {sc: type(m).__name__ for sc, m in modules.items()}
    return LocalPool(workers, os.fspath(dump_path), inp, classes, events_of=events_from_dump, workload=workload,
                     rounding=bool(modules), modules_of=workload_modules if modules and modules_on_workers else None)


def _open(path: Any, what: str) -> Any:
    from ..store import load
    if not Path(path).is_dir():
        raise BisectError(f"{what} {path} is not a dump directory; capture one with "
                          "`precisiondiff capture WORKLOAD --mode replay -o DIR`")
    try:
        dump = load(path)
    except PrecisionDiffError as err:
        raise BisectError(f"{what} {path}: {err}") from err
    if len(dump.ranks) > 1:
        raise BisectError(f"{what} {path} holds ranks {sorted(dump.ranks)}: pass one rank's "
                          f"directory, e.g. {Path(path) / 'rank0'}")
    return dump


def _dut_target(meta: Dict[str, Any], dump: Any) -> str:
    """The dump's target; a ``--script`` capture (target ``script``) places its model itself: then
    its device and most frequent floating dtype of op outputs."""
    target = meta.get("target") or "cpu/bf16"
    if target != "script":
        return target
    counts: Dict[str, int] = {}
    device = "cpu"
    for i, ev in enumerate(dump.events(kind="op")):
        if i >= 5000:  # enough to know
            break
        device = (ev.device or device).split(":")[0]
        for t in ev.tensors:
            if t.slot.startswith("output.") and t.dtype in ("bfloat16", "float16", "float32", "float64"):
                counts[t.dtype] = counts.get(t.dtype, 0) + 1
    dtype = max(counts, key=lambda d: counts[d]) if counts else "bfloat16"
    return f"{device}/{ {'bfloat16': 'bf16', 'float16': 'fp16', 'float32': 'fp32'}.get(dtype, dtype)}"


def _check_same_model(meta_a: Dict[str, Any], meta_b: Dict[str, Any], events_a: list, events_b: list,
                      a: Any, b: Any) -> None:
    """Refuse a reference dump of another workload or model (it would be silently misaligned)."""
    wa, wb = meta_a.get("workload"), meta_b.get("workload")
    if wa and wb and os.path.basename(str(wa)) != os.path.basename(str(wb)):
        raise BisectError(f"{a} is a capture of {wa} but {b} of {wb}: pass a REF_DUMP of the same workload")
    mods_a = {(e.scope, e.name) for e in events_a if e.kind == "module"}
    mods_b = {(e.scope, e.name) for e in events_b if e.kind == "module"}
    if mods_a and mods_b and len(mods_a & mods_b) < len(mods_a) / 2:
        raise BisectError(f"{a} and {b} hold different models (only {len(mods_a & mods_b)} of "
                          f"{len(mods_a)} modules in common): pass a REF_DUMP of the same workload")


class _PassThrough(torch.nn.Module):
    """A wrapper level that only calls the module it holds (the ``module`` of DeepSpeed's engine or DDP)."""

    def __init__(self, attr: str, inner: torch.nn.Module) -> None:
        super().__init__()
        self._attr = attr
        self.add_module(attr, inner)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, self._attr)(*args, **kwargs)


def _nested(model: torch.nn.Module, prefix: str) -> torch.nn.Module:
    """``model`` under pass-through levels named by ``prefix`` (``module.module``: two levels)."""
    for attr in reversed(prefix.split(".")):
        model = _PassThrough(attr, model)
    return model


def _workload_for(workload: Any, meta: Dict[str, Any], events: List[UnitEvent], dut_dump: Any, *,
                  on_meta: bool = False) -> Any:
    """The workload (its seed from the dump) whose model holds every module the dump recorded, under
    the dump's wrapper prefix (DeepSpeed's, DDP's ``module.``) when the bare model is given; and
    that prefix.

    Raises:
        BisectError: a recorded module is not in the model.
    """
    from ..runtime.workload import load_workload
    if on_meta:
        with torch.device("meta"):
            wl = load_workload(workload, seed=int(meta.get("seed") or 0))
    else:
        wl = load_workload(workload, seed=int(meta.get("seed") or 0))
    modules = dict(wl.model.named_modules())
    recorded = {e.scope for e in events if e.kind == "module"}
    prefix = wrapper_prefix(sorted(recorded), list(modules))
    if prefix:  # a dump captured through an engine's wrapper (DeepSpeed, DDP), the bare model given
        wl.model = _nested(wl.model, prefix)
        modules = dict(wl.model.named_modules())
    missing = sorted(s for s in recorded if s not in modules)
    if missing:
        raise BisectError(f"the workload's model has no module {missing[0]!r} recorded in {dut_dump}: "
                          "pass the --workload the dump was captured from")
    return wl, prefix


class Templates:
    """The workload's modules the search replays: built on the meta device first (no memory, no
    random initialisation, which takes 12 s on one core at 853 M parameters; a replay fills every
    parameter and buffer from the call's ``param.*`` slots), the real model only when needed: a
    template whose state the dump does not restore (:meth:`real`, the engine's fallback), a
    builder that does not run on the meta device, or the reference run (:meth:`workload`)."""

    def __init__(self, workload: Any, meta: Dict[str, Any], events: List[UnitEvent], dut_dump: Any) -> None:
        self._args = (workload, meta, events, dut_dump)
        try:
            self._wl, self.prefix = _workload_for(*self._args, on_meta=True)
            self.on_meta = True
        except BisectError:
            raise
        except Exception:  # noqa: BLE001 - a builder that needs real tensors: the real model
            self._wl, self.prefix = _workload_for(*self._args)
            self.on_meta = False
        self.modules: Dict[str, torch.nn.Module] = dict(self._wl.model.named_modules())

    @property
    def model(self) -> torch.nn.Module:
        """The model as built so far (meta or real): its structure and sizes."""
        return self._wl.model

    def get(self, scope: str) -> Optional[torch.nn.Module]:
        """The module at ``scope`` (meta until :meth:`real`)."""
        return self.modules.get(scope)

    def real(self) -> bool:
        """Build the real model and replay with it from now on; False when it already is."""
        if not self.on_meta:
            return False
        self._wl, self.prefix = _workload_for(*self._args)
        self.modules, self.on_meta = dict(self._wl.model.named_modules()), False
        return True

    def workload(self) -> Any:
        """The real workload (its model initialised as at capture, its inputs)."""
        self.real()
        return self._wl


def workload_modules(workload: Any, meta: Dict[str, Any], events: List[UnitEvent], *,
                     on_meta: bool = False) -> Dict[str, torch.nn.Module]:
    """The workload's modules by scope, as a bisect of the dump with ``meta`` and ``events`` replays
    them (a replay worker's, bisect/workers.py).

    ``on_meta``: built on the meta device (no memory, no initialisation: the parameters come from
    the dump); the replay refuses such a template where the dump does not restore all its state
    (:class:`~precisiondiff.bisect.isolate.IncompleteTemplate`)."""
    first = [e for e in events if e.step == events[0].step] if events else events
    return dict(_workload_for(workload, meta, first, "the dump", on_meta=on_meta)[0].model.named_modules())


def bisect_dump(dut_dump: "str | Path", ref_dump: "str | Path | None" = None, *, ref: "str | Target" = "cpu/float64",
                workload: "str | Callable[[], Any] | None" = None, direction: Optional[str] = None,
                budgets: Any = None, progress: Optional[Callable[[int, int, str], None]] = None,
                max_candidates: int = 3,
                prepare: Optional[Callable[[List[UnitEvent]], List[UnitEvent]]] = None,
                accept: Optional[Sequence[str]] = None,
                allow_narrowed: bool = False, repro: "str | Path | None" = None,
                max_elements: Optional[int] = None, peer: "str | Target | None" = None,
                workers: int = 1, distributed: bool = False,
                max_replay_bytes: Optional[int] = DEFAULT_MAX_REPLAY_BYTES,
                rule: str = "peer", blame_known: bool = False, modules_on_workers: bool = False) -> BisectResult:
    """Bisect from a dump captured with ``--mode replay``.

    Args:
        dut_dump: the DUT's dump directory (``precisiondiff capture W --mode replay -o DIR``).
        ref_dump: a dump of the same workload on the reference (any mode with the root module's
            output; ``--mode tensors --level all`` also gives the evidence on the culprit's inputs).
        ref: the reference target the units are replayed on.
        workload: the workload spec that rebuilt the dump's model (module-level replay; the
            reference run when there is no ``ref_dump``). Seeded with the dump's seed.
        direction: ``"forward"`` or ``"backward"`` only.
        budgets: op budget overrides (see :func:`precisiondiff.bisect.bisect`).
        progress: called as ``progress(done, total, label)``.
        max_candidates: offending units to report after the culprit.
        prepare: maps the dump's events to those searched (multi-rank bisect leaves collectives
            out and adapts DTensor op calls: :mod:`precisiondiff.bisect.ranks`).
        accept: accepted findings ``["OP[@SCOPE]", ...]`` (see :func:`precisiondiff.bisect.bisect`).
        blame_known: judge the documented stock findings as offenders (see
            :func:`precisiondiff.bisect.bisect`).
        allow_narrowed: a float64 ``ref`` on a device that holds float64 as float32 runs as
            the float32 target it is (a note), instead of being refused.
        repro, max_elements: write an op culprit's standalone repro into this directory
            (:mod:`precisiondiff.bisect.repro`), slicing tensors beyond ``max_elements``.
        peer: ``DEVICE[/DTYPE]``, a real second implementation in the DUT's dtype: ops whose
            peers are needed are also replayed there from the dump's inputs (docs/bisect.md,
            "A real peer").
        workers: judge the op replays on this many processes of this host (bisect/workers.py);
            the result is the same as with one.
        modules_on_workers: with ``workers``, the module replays too: each worker then builds the
            workload's model (its random init: 8 s at 100 M parameters on one core), which costs
            more than it saves on this machine (docs/performance.md, "Scale"); off by default.
        distributed: this process is one of a torch.distributed job (``torchrun ... bisect DUMP``,
            the default group initialised): the job's processes share the op replays; every one
            returns the same result.
        max_replay_bytes: block-wise replay: modules larger than this in the reference dtype are
            not replayed whole (their blocks are), and when a culprit is found in a model larger
            than this the reference run of the whole model is left out (a note; docs/bisect.md,
            "Host memory"). None: the whole model is replayed as before.
        rule: ``"peer"`` or ``"mlu-ops"`` (see :func:`precisiondiff.bisect.bisect`).

    Returns:
        A :class:`BisectResult`; ``confirmation.final_error_after_substitution`` is None (a
        substitution reruns the DUT: use live bisect on the DUT machine).

    Raises:
        BisectError: not a dump, not captured in replay mode, or a workload that does not match.

    Example:
        >>> r = bisect_dump("runs/mlu", workload="examples/tiny_transformer.py:build_with_bug")  # doctest: +SKIP
    """
    from .cost import cost_figures, step_cost
    from ..runtime.float32_switches import tf32_notes
    from .live import check_options, known_accepts_of, peer_of, rule_of, run_reference, self_peer_notes
    overrides = check_options(direction, budgets)
    accepts = resolve_accepts(accept)
    started = time.perf_counter()
    dump = _open(dut_dump, "DUT_DUMP")
    meta = dump.meta
    if meta.get("mode") != "replay":
        raise BisectError(f"{dut_dump} was captured in {meta.get('mode')!r} mode; bisect needs "
                          "`precisiondiff capture WORKLOAD --mode replay`")
    dut = Target.parse(_dut_target(meta, dump))
    accepts = accepts if blame_known else accepts + known_accepts_of(dut)
    ref_t, ref_note = checked_held(Target.parse(ref), allow_narrowed=allow_narrowed)
    if ref_t.autocast:
        raise BisectError(f"reference {ref_t}: a reference cannot use autocast; use e.g. cpu/float64")
    peer_device, peer_name = peer_of(peer, dut)
    rule_notes = (rule_of(rule, peer_device) + self_peer_notes(dut, ref_t)
                  + tf32_notes(dut, meta.get("float32_switches")))  # the switches the capture ran with
    every = events_from_dump(dump, all_steps=prepare is None)  # training steps: each one judged
    if prepare is not None:
        every = prepare(every)
    events = [e for e in every if e.step == every[0].step] if every else every
    if direction == "optimizer" and not any(e.direction == "optimizer" for e in every):
        raise BisectError(f"{dut_dump} holds no optimizer events: its steps were captured without "
                          "optimizer.step() (capture training steps: a Workload with optimizer=, "
                          "capture --script, or watch --replay-steps/--ref)")
    notes: List[str] = ([ref_note] if ref_note else []) + rule_notes
    if not meta.get("arg_layouts"):
        notes.append("the dump records no argument layouts (captured before they were recorded): ops replay "
                     "on contiguous copies, so a kernel with a layout-dependent path may round differently")
    modules: Dict[str, torch.nn.Module] = {}
    templates = None
    if workload is not None:
        templates = Templates(workload, meta, events, dut_dump)
        modules, prefix = dict(templates.modules), templates.prefix
        if prefix:
            notes.append(f"the workload's model is replayed under the dump's wrapper prefix '{prefix}.' "
                         "(the wrapper's own module is a pass-through)")
    else:
        notes.append("modules not replayed (no --workload): ops are judged from the dump alone")

    ref_tensor: Callable[[str], Optional[torch.Tensor]] = lambda key: None
    ref_output = ref_grads = None
    if ref_dump is not None:
        rd = _open(ref_dump, "REF_DUMP")
        ref_events = events_from_dump(rd)
        _check_same_model(meta, rd.meta, events, ref_events, dut_dump, ref_dump)
        ref_output, ref_grads = finals_of(ref_events)
        keys = set(rd.keys())
        ref_tensor = lambda key: rd.tensor(key) if key in keys and rd.record(key).has_data else None
        ref_runs = 0
    else:
        ref_runs = 0

    pool = None

    def make_input(step_events: List[UnitEvent]) -> EngineInput:
        return EngineInput(
            events=step_events, dut_dtype=dut.dtype, ref_device=ref_t.device, ref_dtype=ref_t.dtype,
            module_of=templates.get if modules else None, real_templates=templates.real if modules else None,
            module_class_of=lambda sc: type(modules[sc]).__name__ if sc in modules else None,
            param_grad=param_grads_of(step_events), direction=direction, max_candidates=max_candidates,
            progress=progress, overrides=overrides, accept=accepts, peer_device=peer_device, peer_name=peer_name,
            max_replay_bytes=max_replay_bytes, op_pool=pool, rule=rule)
    pool = _op_pool(make_input([]), dut_dump, workers, distributed, modules, workload, prepare, modules_on_workers)
    t1 = time.perf_counter()
    try:
        out, steps = search_steps(every, make_input)
    finally:
        if pool is not None:
            pool.close()
    search_s = time.perf_counter() - t1
    too_large = (templates is not None and max_replay_bytes is not None and out.finding.culprit is not None
                 and replay_bytes(templates.model, ref_t.dtype) > max_replay_bytes)
    if too_large:
        notes.append(f"the reference run of the whole model was left out (block-wise: the model takes "
                     f"{replay_bytes(templates.model, ref_t.dtype) / 2**30:.1f} GiB in {ref_t}, over max_replay_bytes "
                     f"{max_replay_bytes / 2**30:.1f} GiB): no final error; the verdict needs only the replays "
                     "(give a REF_DUMP, or a larger --max-replay-bytes, for the final error)")
    if ref_dump is None and templates is not None and not too_large:  # after the search: only the culprit's scope is kept
        culprit_ev = out.units[out.finding.culprit] if out.finding.culprit is not None else None
        ref_result, ref_tensor, ref_notes = run_reference(templates.workload(), ref_t, events, evidence_for=culprit_ev)
        ref_output, ref_grads = ref_result.output, {n: p.grad for n, p in ref_result.model.named_parameters()
                                                    if p.grad is not None}
        notes += ref_notes
        ref_runs = 1
    dut_output, dut_grads = finals_of(events)
    final = None
    if ref_output is not None and dut_output is not None:
        final = final_errors(dut_output, None, dut_grads, ref_output, None, ref_grads or {})
    confirmation: Dict[str, Any] = {"final_error_before": final["final"] if final else None,
                                    "final_error_after_substitution": None, "detail_before": final}
    evidence = None
    if out.finding.culprit is not None:
        notes.append("substitution not run: it reruns the DUT (run live bisect on the DUT machine)")
        evidence = input_evidence(out.units[out.finding.culprit], ref_tensor, dut.dtype)
    wall_s = time.perf_counter() - started
    step = step_cost(any(e.direction == "backward" for e in events))
    cost = {"dut_runs": 0, "ref_runs": ref_runs,
            **cost_figures({"reference": step * ref_runs}, out, step),
            "units_isolated": out.finding.queries, "units_not_isolated": len(out.skipped),
            "ops_replayed": out.replayed_ops, "ops_reused": out.reused_ops,
            "ops_per_forward": out.forward_ops, "wall_s": round(wall_s, 3), "search_s": round(search_s, 3)}
    if out.block_wise:
        cost["block_wise"] = {"max_replay_bytes": max_replay_bytes, "not_replayed_whole": out.block_wise}
    if pool is not None:
        cost["workers"] = {"n": pool.workers, "kind": type(pool).__name__, "module_units": pool.modules_sent,
                           **({"peak_rss": pool.peak_rss()} if hasattr(pool, "peak_rss") else {}),
                           **({"templates": dict(pool.templates)} if getattr(pool, "templates", None) else {}),
                           **({"waited_s": round(pool.waited_s, 3)} if hasattr(pool, "waited_s") else {})}
    result = assemble(out, dut=dut, ref=ref_t, final=final, confirmation=confirmation, cost=cost,
                      notes=notes, input_check=evidence)
    if len({e.step for e in every}) > 1:
        mark_steps(result, out, steps)
        if final is not None:
            result.notes.append(f"the final error is step {events[0].step}'s (the first captured step)")
    if result.culprit is not None and out.finding.culprit is not None:
        ev = out.units[out.finding.culprit]
        # what `precisiondiff repro RESULT.json` reads back: the dump and the culprit's tensors
        result.culprit["dump"] = os.path.abspath(os.fspath(dut_dump))
        result.culprit["keys"] = {s: tensor_key(ev.scope, ev.name, ev.call, ev.direction, s) for s in ev.slots}
        if repro is not None:
            write_culprit_repro(result, ev, repro, ref_t, max_elements)
    return result


def bisect_dump_distributed(dut_dump: Any, ref_dump: Any = None, **options: Any) -> Any:
    """:func:`~precisiondiff.bisect.offline.bisect_dump` in every process of a torchrun job, the
    op replays shared out (:class:`DistPool`; gloo, created from torchrun's environment when
    there is no default group). Returns the result on process 0 and None on the others (every
    process computed the same one)."""
    import torch.distributed as dist
    from .workers import threads_per_worker
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo")
        guard_exit()  # gloo's workers idle before the interpreter finalizes (runtime/gloo_exit.py)
    try:
        torch.set_num_threads(threads_per_worker(int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))))
        result = bisect_dump(dut_dump, ref_dump, distributed=True, **options)
        me = dist.get_rank()
    finally:
        if owned:
            dist.destroy_process_group()
    return result if me == 0 else None
