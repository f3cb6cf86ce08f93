"""The torch side of the search: build units from recorded events, isolate each one the pure
:class:`~precisiondiff.bisect.search.Search` asks for, and collect the evidence.

Shared by live bisect (events from an in-memory capture) and offline bisect (events from a dump).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..comparators.accumulation import is_random_call, magnitude_op
from ..comparators.peers import compute_dtype
from . import _compat
from . import judge as J
from .isolate import (GoldenMode, IncompleteTemplate, UnitEvent, Unreplayable, is_meta_template,
                      replay_module_backward, replay_module_forward, replay_module_step, replay_op, resolve_op)
from .optimizer import is_update, replay_update
from .references import reference_for
from .reuse import ReplayedOps, RoundedOps
from .search import Finding, Judgement, Search, Unit

__all__ = ["EngineInput", "EngineOutput", "OpResult", "ModuleResult", "ModuleContext", "run_search", "judge_op_unit",
           "judge_module_unit", "forward_module_calls", "replay_bytes",
           "DEFAULT_MAX_REPLAY_BYTES", "random_outputs_of", "random_outputs_in_order", "DATA_MOVEMENT_OPS"]

log = logging.getLogger(__name__)

# Ops that only move or create data: nothing to round, so nothing to isolate.
DATA_MOVEMENT_OPS = frozenset(f"aten.{n}" for n in (
    "clone.default", "_unsafe_view.default", "view.default", "reshape.default", "expand.default",
    "permute.default", "transpose.int", "t.default", "slice.Tensor", "select.int", "cat.default",
    "stack.default", "split.Tensor", "split_with_sizes.default", "unsqueeze.default",
    "squeeze.dim", "squeeze.default", "contiguous.default", "zeros.default", "ones.default",
    "empty.memory_format", "zeros_like.default", "ones_like.default", "empty_like.default",
    "new_zeros.default", "new_empty.default", "new_ones.default", "full.default", "fill_.Scalar",
    "zero_.default", "alias.default", "unbind.int", "embedding.default", "index_select.default",
    "masked_fill.Scalar", "_reshape_alias.default", "as_strided.default", "full_like.default",
    "scalar_tensor.default", "arange.default", "arange.start", "tril.default", "triu.default"))


@dataclass
class EngineInput:
    """What the search needs.

    Attributes:
        events: the DUT's recorded events (one step), any order.
        dut_dtype: the DUT's compute dtype (module judgement, emulation).
        ref_device, ref_dtype: where and in which dtype golden values are computed.
        module_of: scope -> the module object to replay (None: modules cannot be replayed).
        param_grad: full parameter name -> the DUT's accumulated gradient loader.
        direction: restrict to "forward" or "backward".
        progress: called as ``progress(done, total, label)``.
        random_outputs: a module's forward call -> the DUT's outputs of the random ops inside it, in
            call order (:func:`random_outputs_of`); module replays reuse them. Default: from ``events``.
        noise: ``(scope, name, direction, call) -> run-to-run max abs difference`` of an op call's
            outputs between two DUT runs (live ``noise=True``); an op over its budget whose max
            abs error against the golden is at most ``NOISE_FACTOR`` times a nonzero difference is
            judged within noise, not over. None: no second run.
        judge_after_culprit: also isolate the modules that run after the first offending op
            (further module candidates; they cannot change the culprit).
        accept: findings the user has read (:class:`~precisiondiff.bisect.findings.Accept`): an
            offending op they match is recorded as ``accepted`` and does not offend.
        peer_device, peer_name: a real second implementation (``bisect --peer cpu/bf16``): where
            the emulated peers are computed for an op, it is replayed there too on the DUT's own
            inputs, and its error joins theirs (``peer.peers[peer_name]``, ``peer.real_peer``).
        max_replay_bytes: block-wise replay: a module whose parameters and buffers take more
            than this many bytes in the reference dtype is not replayed whole; the search
            descends into it as into a module over budget, so the replays go block by block
            (docs/bisect.md, "Host memory"). None: every module is replayed whole.
        op_pool: judges op units elsewhere (:mod:`precisiondiff.bisect.workers`): ``judge(events)``
            returns ``{seq: OpResult}`` for a window of ``window`` upcoming ops; the search
            consumes them in order, exactly as if judged here.
        rule: the op rule, ``"peer"`` or ``"mlu-ops"`` (judge.py :func:`judge_tensor`; with a real
            peer, mlu-ops' baseline is that peer).
    """

    events: List[UnitEvent]
    dut_dtype: torch.dtype
    ref_device: str = "cpu"
    ref_dtype: torch.dtype = torch.float64
    module_of: Optional[Callable[[str], Optional[torch.nn.Module]]] = None
    # switches module_of from meta templates to the real model (offline.Templates.real): False when
    # it already was. None: templates are what they are.
    real_templates: Optional[Callable[[], bool]] = None
    param_grad: Dict[str, Callable[[], torch.Tensor]] = field(default_factory=dict)
    direction: Optional[str] = None
    module_class_of: Optional[Callable[[str], Optional[str]]] = None
    max_candidates: int = 3
    progress: Optional[Callable[[int, int, str], None]] = None
    overrides: Optional[Dict[str, Dict[str, Any]]] = None
    noise: Optional[Dict[Tuple[str, str, str, int], float]] = None
    random_outputs: Optional[Callable[[UnitEvent], List[List[torch.Tensor]]]] = None
    judge_after_culprit: bool = False
    accept: Sequence[Any] = ()
    peer_device: Optional[str] = None
    peer_name: str = ""
    max_replay_bytes: Optional[int] = None
    op_pool: Optional[Any] = None
    rule: str = "peer"


DEFAULT_MAX_REPLAY_BYTES = 1 << 30  # a module larger than this in the reference dtype is replayed block-wise


OpResult = Tuple[Judgement, dict, Dict[str, int], Optional[int]]
"""An op's judgement, its detail, the replays it cost (counter keys) and, when its outputs are
its goldens correctly rounded, their number (for the emulation's reuse), else None."""


@dataclass
class EngineOutput:
    """The finding, and per unit what was measured."""

    finding: Finding
    units: Dict[int, UnitEvent]
    details: Dict[int, dict]
    replayed_ops: int
    forward_ops: int
    unreplayable_ops: List[str]
    breakdown: Dict[str, int] = field(default_factory=dict)
    skipped: List[int] = field(default_factory=list)
    reused_ops: int = 0  # emulated ops taken from the op replays (reuse.py), not run
    block_wise: List[str] = field(default_factory=list)  # modules not replayed whole (max_replay_bytes)


def _is_candidate_op(ev: UnitEvent) -> bool:
    if ev.name in DATA_MOVEMENT_OPS:
        return False
    return bool(ev.floating_slots("output."))


def _parents(events: List[UnitEvent]) -> Dict[int, Optional[int]]:
    """Innermost enclosing module call of every event (same direction).

    The enclosing scope is the longest module scope that is a prefix of the event's scope; of
    that module's calls, the first to finish after the event (the backward event of a module
    whose inputs need no gradient is recorded as soon as its grad_output arrives, i.e. early:
    then its last call).
    """
    calls: Dict[Tuple[str, str], List[UnitEvent]] = {}
    for m in events:
        if m.kind == "module":
            calls.setdefault((m.direction, m.scope), []).append(m)
    for ms in calls.values():
        ms.sort(key=lambda e: e.seq)
    parents: Dict[int, Optional[int]] = {}
    for ev in events:
        best_scope: Optional[str] = None
        for (direction, s) in calls:
            if direction != ev.direction:
                continue
            if ev.kind == "module":
                inside = ev.scope != s and (s == "" or ev.scope.startswith(s + "."))
            else:
                inside = s == "" or ev.scope == s or ev.scope.startswith(s + ".")
            if inside and (best_scope is None or len(s) > len(best_scope)):
                best_scope = s
        if best_scope is None:
            parents[ev.seq] = None
            continue
        ms = calls[(ev.direction, best_scope)]
        after = [m for m in ms if m.seq > ev.seq]
        parents[ev.seq] = (after[0] if after else ms[-1]).seq
    return parents


def random_outputs_in_order(events: List[UnitEvent]) -> List[List[torch.Tensor]]:
    """The recorded outputs of every random op call (dropout masks), in execution order: a
    reference run of the whole workload reuses them (:class:`~precisiondiff.bisect.isolate.GoldenMode`)."""
    randoms = sorted((e for e in events if e.kind == "op" and _is_random(e)), key=lambda e: e.seq)
    return [[r.load(s) for s in sorted((s for s in r.slots if s.startswith("output.") and r.slots[s][2]),
                                       key=lambda s: int(s.split(".")[1]))] for r in randoms]


def random_outputs_of(events: List[UnitEvent]) -> Callable[[UnitEvent], List[List[torch.Tensor]]]:
    """For a module's forward call, the recorded outputs of the random ops it ran (dropout
    masks), in call order: random ops are data, replays reuse the DUT's draws."""
    forward = [e for e in events if e.kind in ("op", "module") and e.direction == "forward"]
    randoms = [e for e in forward if e.kind == "op" and _is_random(e)]
    if not randoms:
        return lambda ev: []
    parents = _parents(forward)

    def of(module_ev: UnitEvent) -> List[List[torch.Tensor]]:
        found = []
        for r in sorted(randoms, key=lambda e: e.seq):
            p = parents.get(r.seq)
            while p is not None and p != module_ev.seq:
                p = parents.get(p)
            if p == module_ev.seq:
                found.append([r.load(s) for s in sorted((s for s in r.slots if s.startswith("output.")
                                                         and r.slots[s][2]), key=lambda s: int(s.split(".")[1]))])
        return found
    return of


def run_search(inp: EngineInput) -> EngineOutput:
    """Isolate units in execution order until the culprit (and a few candidates) are known."""
    if inp.random_outputs is None:
        inp.random_outputs = random_outputs_of(inp.events)
    events = [e for e in inp.events if e.kind in ("op", "module")
              and (inp.direction is None or e.direction == inp.direction)]
    events = [e for e in events if e.kind == "module" or _is_candidate_op(e)]
    by_seq = {e.seq: e for e in events}
    parents = _parents(events)
    units = [Unit(e.seq, e.kind, e.direction, parents[e.seq]) for e in events]
    search = Search(units, max_candidates=inp.max_candidates, judge_after_culprit=inp.judge_after_culprit)
    forward_calls = forward_module_calls(inp.events)
    counter: Dict[str, int] = {"ops": 0}
    rounded = RoundedOps(inp.ref_device, inp.ref_dtype, inp.dut_dtype) if inp.module_of is not None else None
    pair = _top_level_pairs(events, parents, forward_calls)
    shared: Dict[int, Any] = {}
    unreplayable: List[str] = []
    details: Dict[int, dict] = {}
    # module uid -> the unreplayable ops it stands in for (innermost replayable module)
    holding: Dict[int, List[int]] = {}
    total = len(units)
    done = 0
    explained: set = set()  # modules around an accepted op
    ahead: Dict[int, OpResult] = {}  # ops judged ahead by the op pool, not yet consumed
    ahead_modules: Dict[int, ModuleResult] = {}  # the same for module units
    # top-level forward+backward pairs share one replay on this process (``shared``): not pooled
    local_only = set(pair) | {b.seq for b in pair.values()}
    pool_modules = getattr(inp.op_pool, "judge_modules", None) is not None and inp.module_of is not None
    block_wise: List[str] = []
    while (uid := search.next_query()) is not None:
        ev = by_seq[uid]
        if inp.progress is not None:
            inp.progress(done, total, f"{ev.direction} {ev.scope or '<root>'} {ev.name}")
        if ev.kind == "op":
            if inp.op_pool is not None:
                if uid not in ahead:
                    window = inp.op_pool.window
                    if getattr(inp.op_pool, "pipelined", False):  # the next window queued behind this one
                        ahead.update(inp.op_pool.judge([by_seq[u] for u in search.upcoming_ops(2 * window)],
                                                       wait_for=window))
                    else:
                        ahead.update(inp.op_pool.judge([by_seq[u] for u in search.upcoming_ops(window)]))
                judgement, detail, spent, n_rounded = ahead.pop(uid)
                for key, n in spent.items():
                    counter[key] = counter.get(key, 0) + n
                if rounded is not None and n_rounded is not None:
                    rounded.register(ev, n_rounded)
            else:
                judgement, detail = _judge_op(ev, inp, counter, rounded)
            if judgement.over and any(a.matches(ev.name, ev.scope) for a in inp.accept):
                judgement, detail = Judgement(replayable=True, over=False), dict(detail, accepted=True)
                up = parents[uid]
                while up is not None:  # the modules around it: their error includes the accepted op's
                    explained.add(up)
                    up = parents[up]
            if not judgement.replayable:
                if ev.name not in unreplayable:
                    unreplayable.append(ev.name)
                if parents[uid] is not None:
                    holding.setdefault(parents[uid], []).append(uid)
        else:
            if getattr(inp.op_pool, "pipelined", False) and (ahead or inp.op_pool.queued()):
                ahead.clear()  # the op phase is over: what was judged or queued ahead is not needed
                inp.op_pool.drop_queued()
            held = [by_seq[u] for u in holding.get(uid, [])]
            pooled = None
            if pool_modules and uid not in local_only:
                if uid not in ahead_modules:
                    window = [u for u in search.upcoming_modules(inp.op_pool.workers * MODULES_AHEAD_PER_WORKER)
                              if u not in local_only]
                    context = ModuleContext(inp, frozenset(unreplayable), forward_calls, rounded)
                    ahead_modules.update(inp.op_pool.judge_modules(
                        [(by_seq[u], tuple(holding.get(u, []))) for u in window], context))
                pooled = ahead_modules.pop(uid, None)
                # judged on what is known now: the same unreplayable ops and the same held ones
                if pooled is not None and (pooled[0] != tuple(holding.get(uid, []))
                                           or pooled[1] != len(unreplayable)):
                    pooled = None
            if pooled is not None:
                judgement, detail, spent = pooled[2:]
                for key, n in spent.items():
                    counter[key] = counter.get(key, 0) + n
            else:
                judgement, detail = _judge_module(
                    ev, inp, counter, set(unreplayable), forward_calls, held,
                    bwd=pair[uid] if uid in pair and search.will_judge(pair[uid].seq) else None,
                    shared=shared, rounded=rounded)
            if not judgement.replayable and held and parents[uid] is not None:
                holding.setdefault(parents[uid], []).extend(holding.pop(uid))
            if uid in explained and judgement.over:
                judgement, detail = Judgement(replayable=True, over=False), dict(detail, accepted_inside=True)
            if held and judgement.replayable:
                detail["holds_unreplayable"] = [{"scope": h.scope, "name": h.name, "call": h.call,
                                                 "reason": details.get(h.seq, {}).get("reason", "")}
                                                for h in held]
            if detail.get("block_wise"):  # not replayed: judged through its children, no detail of its own
                block_wise.append(f"{ev.scope or '<root>'} ({ev.direction})")
                search.record(uid, judgement)
                done += 1
                continue
        details[uid] = detail
        search.record(uid, judgement)
        done += 1
    if inp.progress is not None:
        inp.progress(total, total, "done")
    forward_ops = sum(1 for e in inp.events if e.kind == "op" and e.direction == "forward") or 1
    breakdown = {k: v for k, v in counter.items() if k not in ("ops", "reused")}
    return EngineOutput(search.result(), by_seq, details, counter["ops"], forward_ops, unreplayable,
                        breakdown=breakdown, skipped=list(search.skipped), reused_ops=counter.get("reused", 0),
                        block_wise=block_wise)


class _RoundingProbe:
    """Stands in for :class:`RoundedOps` where an op is judged away from the search: notes how
    many outputs round correctly, for the search's process to register (``OpResult``)."""

    def __init__(self, inp: EngineInput) -> None:
        self._rounded = RoundedOps(inp.ref_device, inp.ref_dtype, inp.dut_dtype)
        self.n_out: Optional[int] = None

    def add(self, ev: UnitEvent, golden: List[torch.Tensor], func: Callable) -> None:
        self.n_out = self._rounded.correctly_rounded(ev, golden, func)


def judge_op_unit(ev: UnitEvent, inp: EngineInput, rounding: bool = True) -> OpResult:
    """Judge one op call as the search does (a replay worker's unit of work): the judgement,
    its detail, the replays it cost and, with ``rounding`` (module replays will reuse op
    replays), how many of its outputs are their goldens correctly rounded."""
    counter: Dict[str, int] = {"ops": 0}
    probe = _RoundingProbe(inp) if rounding else None
    judgement, detail = _judge_op(ev, inp, counter, probe)
    return judgement, detail, counter, probe.n_out if probe is not None else None


MODULES_AHEAD_PER_WORKER = 2  # module units judged ahead per worker (each replays a whole module)

ModuleResult = Tuple[Tuple[int, ...], int, Judgement, dict, Dict[str, int]]
"""A module unit judged by a pool: the held ops (seqs) and the number of unreplayable ops it was
judged with (the search takes it only if both are still so), its judgement, detail and replays."""


@dataclass
class ModuleContext:
    """What a module unit's judgement needs beyond its event, fixed once the op phase is over: the
    step's input, the unreplayable op names, the forward calls and the op replays' roundings."""

    inp: EngineInput
    fallback: frozenset
    forward_calls: Dict[Tuple[str, str], List[UnitEvent]]
    rounded: Optional[RoundedOps]


def forward_module_calls(events: Sequence[UnitEvent]) -> Dict[Tuple[str, str], List[UnitEvent]]:
    """``(scope, name) -> `` the forward calls of that module, in call order."""
    calls: Dict[Tuple[str, str], List[UnitEvent]] = {}
    for e in events:
        if e.kind == "module" and e.direction == "forward":
            calls.setdefault((e.scope, e.name), []).append(e)
    for c in calls.values():
        c.sort(key=lambda e: e.call)
    return calls


def judge_module_unit(ev: UnitEvent, held: Sequence[UnitEvent], ctx: ModuleContext) -> Tuple[Judgement, dict, Dict[str, int]]:
    """Judge one module call as the search does (a replay worker's unit of work; not a top-level
    forward+backward pair, which shares its replay): the judgement, its detail and its replays."""
    counter: Dict[str, int] = {"ops": 0}
    judgement, detail = _judge_module(ev, ctx.inp, counter, set(ctx.fallback), ctx.forward_calls, held,
                                      rounded=ctx.rounded)
    return judgement, detail, counter


def replay_bytes(module: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of a module's parameters and buffers in ``dtype`` (floating ones; others as they are):
    what a float64 replay of it copies before any activation."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(t.numel() * (size if t.is_floating_point() else t.element_size())
               for t in (*module.parameters(), *module.buffers()))


def _top_level_pairs(events: List[UnitEvent], parents: Dict[int, Optional[int]],
                     forward_calls: Dict[Tuple[str, str], List[UnitEvent]]) -> Dict[int, UnitEvent]:
    """Top-level forward module call -> its backward call, when both are units: the search
    judges every top-level unit, so one forward+backward replay serves both."""
    out: Dict[int, UnitEvent] = {}
    for ev in events:
        if ev.kind != "module" or ev.direction != "backward" or parents.get(ev.seq) is not None:
            continue
        calls = forward_calls.get((ev.scope, ev.name), [])
        index = len(calls) - 1 - ev.call
        if 0 <= index < len(calls) and calls[index].seq in parents and parents[calls[index].seq] is None:
            out[calls[index].seq] = ev
    return out


def _judge_op(ev: UnitEvent, inp: EngineInput, counter: Dict[str, int],
              rounded: Optional[RoundedOps] = None) -> Tuple[Judgement, dict]:
    """Judge an op call by the peer rule (judge.py): its error against what correct
    implementations in the DUT dtype give on the same inputs. Random ops are data."""
    if _is_random(ev):
        return Judgement(replayable=True), {"replayable": True, "passed": True, "random": True, "local": {},
                                            "budget": {}, "message": "random op: its outputs are data"}
    # The magnitude (the op on |inputs|) only widens the bounds: an op that passes without it
    # passes with it, so it is replayed only for an op that does not (one replay saved per
    # matmul-like op). A budget override can accept on the ULP budget, which the magnitude
    # also widens: then it is computed up front, as the override path needs it.
    # an optimizer update's outputs are its written state, judged in the state's own dtype
    # (bisect/optimizer.py): no magnitude, and the inputs' dtypes do not widen the bound
    update = is_update(ev)
    has_magnitude = magnitude_op(ev.name) and not update
    eager = has_magnitude and _overrides_apply(ev, inp)
    try:
        rep = (replay_update if update else replay_op)(ev, device=inp.ref_device, dtype=inp.ref_dtype,
                                                       magnitude=eager)
    except Unreplayable as err:
        log.info("not replayable: %s", err)
        return Judgement(replayable=False), {"replayable": False, "reason": str(err)}
    _count(counter, "op_golden", 1)
    if rep.magnitudes is not None:
        _count(counter, "op_magnitude", 1)
    in_dtypes = [] if update else [getattr(torch, info[0]) for slot, info in ev.slots.items()
                                   if slot.startswith("input.") and isinstance(getattr(torch, info[0], None), torch.dtype)
                                   and getattr(torch, info[0]).is_floating_point]
    outputs = _op_outputs(ev, rep, in_dtypes)
    if isinstance(outputs, dict):
        return Judgement(replayable=False), outputs
    if rounded is not None and reference_for(ev.name) is None and not update:
        rounded.add(ev, rep.golden, resolve_op(ev.name))
    if not outputs:
        return Judgement(replayable=True), {"replayable": True, "passed": True, "local": {}, "budget": {}}
    module_class = inp.module_class_of(ev.scope) if inp.module_class_of is not None else None
    n_out = len(rep.golden)
    dtypes: List[Optional[torch.dtype]] = [None] * n_out
    for o in outputs:
        dtypes[o.index] = o.dut.dtype

    class _NeedsMagnitude(Exception):
        pass

    def peers() -> Dict[str, Any]:
        if has_magnitude and rep.magnitudes is None:
            raise _NeedsMagnitude
        _count(counter, "op_peers", 2)
        found = rep.peers(dtypes)
        if inp.peer_device is not None:
            _count(counter, "op_real_peer", 1)
            found[inp.peer_name] = rep.on_device(inp.peer_device)
        return found
    try:
        oj = J.judge_op_outputs(ev.name, outputs, peers, module_class=module_class, overrides=inp.overrides,
                                rule=inp.rule, real_peer=inp.peer_name if inp.peer_device is not None else None)
    except _NeedsMagnitude:
        rep.magnitudes = rep.magnitudes_of()
        _count(counter, "op_magnitude", 1)
        outputs = _op_outputs(ev, rep, in_dtypes)
        oj = J.judge_op_outputs(ev.name, outputs, peers, module_class=module_class, overrides=inp.overrides,
                                rule=inp.rule, real_peer=inp.peer_name if inp.peer_device is not None else None)
    return _op_verdict(ev, inp, outputs, oj)


def _count(counter: Dict[str, int], key: str, n: int) -> None:
    counter[key] = counter.get(key, 0) + n
    counter["ops"] = counter.get("ops", 0) + n


def _overrides_apply(ev: UnitEvent, inp: EngineInput) -> bool:
    """Whether a budget override may apply to this op (then its ULP budget can decide)."""
    if not inp.overrides:
        return False
    return any("." not in key or ev.name == key or ev.name.startswith(key + ".") for key in inp.overrides)


def _op_outputs(ev: UnitEvent, rep: Any, in_dtypes: List[torch.dtype]) -> "List[J.OpOutput] | dict":
    """The op's floating outputs to judge, or the detail of why it cannot be judged."""
    outputs = []
    for i, g in enumerate(rep.golden):
        slot = f"output.{i}"
        info = ev.slots.get(slot)
        if info is None or not info[2] or not g.is_floating_point():
            continue
        dut = ev.load(slot)
        if not dut.is_floating_point():
            continue
        if tuple(dut.shape) != tuple(g.shape):
            return {"replayable": False, "reason": f"{slot}: golden shape {tuple(g.shape)} "
                                                   f"!= recorded {tuple(dut.shape)}"}
        mag = rep.magnitudes[i] if rep.magnitudes is not None and i < len(rep.magnitudes) else None
        k = rep.ks[i] if i < len(rep.ks) else None
        outputs.append(J.OpOutput(slot, i, dut, g, mag, k, compute_dtype(dut.dtype, in_dtypes)))
    return outputs


def _op_verdict(ev: UnitEvent, inp: EngineInput, outputs: List[J.OpOutput],
                oj: J.OpJudgement) -> Tuple[Judgement, dict]:
    """The judgement and detail of a judged op; the run-to-run noise floor applies here."""
    detail = {"replayable": True, "passed": oj.passed, "local": oj.local, "budget": oj.budget,
              "slot": oj.slot, "message": oj.message, "peer": oj.peer}
    if inp.peer_device is not None and oj.peer and inp.peer_name in (oj.peer.get("peers") or {}):
        oj.peer["real_peer"] = inp.peer_name
    floor = (inp.noise or {}).get((ev.scope, ev.name, ev.direction, ev.call), 0.0)
    if floor > 0:
        detail["noise"] = floor
    if not oj.passed and floor > 0:
        err = J.max_abs_error([(o.dut, o.golden) for o in outputs])
        detail["noise_error"] = err
        if err <= J.NOISE_FACTOR * floor:
            detail.update(passed=True, within_noise=True,
                          message=f"within run-to-run noise: max abs error {err:.3g} <= {J.NOISE_FACTOR:g} x "
                                  f"the DUT's run-to-run max abs difference {floor:.3g} (over budget: "
                                  f"{oj.message.splitlines()[0] if oj.message else ''})")
            return Judgement(replayable=True, over=False), detail
    return Judgement(replayable=True, over=not oj.passed), detail


def _is_random(ev: UnitEvent) -> bool:
    """A random op (``torch.Tag.nondeterministic_seeded``, dropout actually on)."""
    if not ev.args:
        return is_random_call(ev.name)
    scalars = lambda v: v if isinstance(v, (int, float, bool)) or v is None else 0  # noqa: E731
    args = [scalars(a) for a in ev.args.get("args", [])]
    kwargs = {k: scalars(v) for k, v in (ev.args.get("kwargs") or {}).items()}
    return is_random_call(ev.name, args, kwargs)


def _golden_step(template: torch.nn.Module, fwd: UnitEvent, bwd: UnitEvent, inp: EngineInput, fallback: set,
                 randoms: List[List[torch.Tensor]], counter: Dict[str, int],
                 shared: Dict[int, Any], replayed: ReplayedOps) -> Optional[Dict[str, torch.Tensor]]:
    """The golden of a top-level module's forward call from the replay that its backward call
    needs anyway (the backward replay recomputes the forward): the backward's golden is kept in
    ``shared`` (with ``replayed``, the replay's first-level ops) for when the search reaches it.
    None when that replay fails (then the forward is replayed alone, as before)."""
    ops: Dict[str, int] = {}
    mode = GoldenMode(fallback=fallback, counter=ops, random_outputs=randoms, replayed=replayed)
    try:
        outputs, grads = replay_module_step(template, fwd, bwd, device=inp.ref_device, dtype=inp.ref_dtype,
                                            mode=mode)
    except Unreplayable:
        return None
    finally:
        _count(counter, "module_golden", ops.get("ops", 0))
    shared[bwd.seq] = (grads, replayed)
    return outputs


def _judge_module(ev: UnitEvent, inp: EngineInput, counter: Dict[str, int], fallback: set,
                  forward_calls: Dict[Tuple[str, str], List[UnitEvent]],
                  held: Sequence[UnitEvent] = (), bwd: Optional[UnitEvent] = None,
                  shared: Optional[Dict[int, Any]] = None,
                  rounded: Optional[RoundedOps] = None) -> Tuple[Judgement, dict]:
    """:func:`_judge_module_with` the template ``inp.module_of`` gives; a template built on the meta
    device whose state the dump does not restore (:class:`IncompleteTemplate`, or a replay failing
    with an error that names the meta device: a tensor held in a container or a closure) is judged
    again with the real model (``inp.real_templates``), as a replay worker does."""
    template = inp.module_of(ev.scope) if inp.module_of is not None else None
    if inp.real_templates is None or template is None or not is_meta_template(template):
        return _judge_module_with(ev, inp, counter, fallback, forward_calls, held, bwd, shared, rounded)
    tried: Dict[str, int] = {}
    try:
        judgement, detail = _judge_module_with(ev, inp, tried, fallback, forward_calls, held, bwd, shared, rounded)
        if judgement.replayable or "meta" not in str(detail.get("reason", "")).lower():
            for key, n in tried.items():
                counter[key] = counter.get(key, 0) + n
            return judgement, detail
    except IncompleteTemplate:
        pass
    inp.real_templates()
    return _judge_module_with(ev, inp, counter, fallback, forward_calls, held, bwd, shared, rounded)


def _judge_module_with(ev: UnitEvent, inp: EngineInput, counter: Dict[str, int], fallback: set,
                       forward_calls: Dict[Tuple[str, str], List[UnitEvent]],
                       held: Sequence[UnitEvent] = (), bwd: Optional[UnitEvent] = None,
                       shared: Optional[Dict[int, Any]] = None,
                       rounded: Optional[RoundedOps] = None) -> Tuple[Judgement, dict]:
    """Judge a module call against emulated rounding (judge.py). A module that holds ops which
    could not be replayed (``held``) stands in for them: it is also judged per element against
    the loosest of their budgets (:func:`~precisiondiff.bisect.judge.judge_standin`), since the
    module rule alone is far coarser than an op budget.

    ``bwd``: the backward call of this (forward, top-level) module call that the search will
    judge too: one forward+backward replay gives both goldens, the backward's kept in
    ``shared`` (keyed by its seq) until the search reaches it."""
    template = inp.module_of(ev.scope) if inp.module_of is not None else None
    if template is None:
        return Judgement(replayable=False), {"replayable": False,
                                            "reason": "module objects not available (pass --workload)"}
    if inp.max_replay_bytes is not None and replay_bytes(template, inp.ref_dtype) > inp.max_replay_bytes:
        # block-wise: not replayed whole; as a module that cannot be replayed, it hands what it
        # stands in for to its parent and the search descends into its children
        return Judgement(replayable=False), {"replayable": False, "block_wise": True,
                                            "reason": f"larger than max_replay_bytes ({inp.max_replay_bytes})"}
    fwd = ev
    calls = forward_calls.get((ev.scope, ev.name), [])
    if ev.direction == "backward":
        index = len(calls) - 1 - ev.call
        if not (0 <= index < len(calls)):
            return Judgement(replayable=False), {"replayable": False, "reason": "no matching forward call"}
        fwd = calls[index]

    randoms = inp.random_outputs(fwd) if inp.random_outputs is not None else []

    replayed = ReplayedOps(inp.dut_dtype)

    def replay(round_to: Optional[torch.dtype], decompose: bool = False) -> Dict[str, torch.Tensor]:
        kind = "module_golden" if round_to is None else ("module_semantic" if decompose else "module_emulated")
        ops: Dict[str, int] = {}
        mode = GoldenMode(fallback=fallback, round_to=round_to, counter=ops, decompose=decompose,
                          random_outputs=randoms, reuse=rounded, replayed=replayed)
        try:
            if ev.direction == "forward":
                return replay_module_forward(template, ev, device=inp.ref_device, dtype=inp.ref_dtype, mode=mode)
            return replay_module_backward(template, fwd, ev, device=inp.ref_device, dtype=inp.ref_dtype, mode=mode)
        finally:
            _count(counter, kind, ops.get("ops", 0))
            counter["reused"] = counter.get("reused", 0) + ops.get("reused", 0)

    try:
        golden = None
        if shared is not None and ev.seq in shared:
            golden, replayed = shared.pop(ev.seq)
        if golden is None and bwd is not None:
            golden = _golden_step(template, ev, bwd, inp, fallback, randoms, counter, shared, replayed)
        if golden is None:
            golden = replay(None)
    except Unreplayable as err:
        return Judgement(replayable=False), {"replayable": False, "reason": str(err)}
    dut: Dict[str, torch.Tensor] = {}
    for slot in golden:
        if slot.startswith("param_grad."):
            if len(calls) != 1:
                continue  # accumulated over several calls: not this call's gradient
            full = f"{ev.scope}.{slot[len('param_grad.'):]}" if ev.scope else slot[len("param_grad."):]
            loader = inp.param_grad.get(full)
            if loader is not None:
                dut[slot] = loader()
        else:
            info = ev.slots.get(slot)
            if info is not None and info[2]:
                dut[slot] = ev.load(slot)
    keys = [k for k in golden if k in dut and dut[k].is_floating_point()
            and tuple(dut[k].shape) == tuple(golden[k].shape)]
    if not keys:
        return Judgement(replayable=True), {"replayable": True, "passed": True, "local": {}, "budget": {}}
    first = J.judge_module([(dut[k], golden[k], None) for k in keys], inp.dut_dtype)
    if not first.over and not held:
        return Judgement(replayable=True), {"replayable": True, "passed": True, "local": first.local,
                                            "budget": first.budget}
    try:
        emulated = replay(inp.dut_dtype)
    except Unreplayable as err:
        return Judgement(replayable=False), {"replayable": False, "reason": str(err)}
    mj = J.judge_module([(dut[k], golden[k], emulated.get(k)) for k in keys], inp.dut_dtype)
    if mj.over:  # also PyTorch's reference semantics in the DUT dtype: the more lenient counts
        try:
            semantic = replay(inp.dut_dtype, decompose=True)
        except Unreplayable:
            semantic = {}
        mj = J.judge_module([(dut[k], golden[k], (emulated.get(k), semantic.get(k))) for k in keys],
                            inp.dut_dtype)
    detail = {"replayable": True, "passed": not mj.far, "local": mj.local, "budget": mj.budget,
              "over": mj.over, "far": mj.far}
    over = mj.over
    if held:
        module_class = inp.module_class_of(ev.scope) if inp.module_class_of is not None else None
        budgets = [_compat.budget_for_op(h.name, inp.dut_dtype, module_class, inp.overrides) for h in held]
        loosest = max(budgets, key=lambda b: b.max_ulp)
        keys_em = [k for k in keys if k in emulated and tuple(emulated[k].shape) == tuple(golden[k].shape)]
        sj = J.judge_standin([(k, dut[k], golden[k], emulated[k]) for k in keys_em], loosest)
        over = over or sj.over
        detail.update(over=over, passed=not over, standin=sj.local, local=dict(mj.local, **sj.local),
                      budget=dict(mj.budget, standin=sj.budget))
        if sj.message:
            detail["message"] = sj.message
    return Judgement(replayable=True, over=over, far=mj.far), detail
