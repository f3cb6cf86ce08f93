"""Isolation: re-execute one recorded unit on the reference with the DUT's own inputs.

An op is re-executed from its recorded arguments (``torch.ops.<ns>.<op>.<overload>``, or the
reference registered for it); a module call from a copy of the module holding the DUT's own
parameters, forward, or forward then backward with the DUT's ``grad_output``. Floating tensors
are upcast to the golden dtype on the golden device; so are dtype arguments.

:class:`GoldenMode` runs inside module replays: it substitutes registered references, runs ops
that have no golden-dtype implementation in float32 instead (documented fallback), and, for
*emulation*, rounds every op's floating output to the DUT dtype.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set

import torch
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode

from ..capture.dispatch import _in_hop_compile
from ..capture.serialize import decode_call, flatten_tensors
from ..comparators.accumulation import is_random_call
from ..comparators.peers import reductions_in_dtype, reference_semantics
from ..runtime.copying import copy_model
from ..runtime.targets import complex_dtype
from .references import math_semantics, reference_for

__all__ = ["Unreplayable", "IncompleteTemplate", "is_meta_template", "UnitEvent", "resolve_op", "GoldenMode", "replay_op", "OpReplay",
           "replay_module_forward", "replay_module_backward", "replay_module_step", "FALLBACK_DTYPE"]

FALLBACK_DTYPE = torch.float32  # inside module replays, for ops with no golden-dtype kernel


class Unreplayable(Exception):
    """The unit cannot be re-executed on the reference (no implementation, missing data)."""


class IncompleteTemplate(Exception):
    """A module template built on the meta device holds state the dump does not restore (a
    parameter or buffer without its ``param.*`` slot, a plain tensor attribute): replaying it
    would compute on uninitialized memory. The caller replays with the real model instead."""


@dataclass
class UnitEvent:
    """A recorded event, the same whether it comes from a live capture or a dump.

    Attributes:
        seq, kind, scope, name, direction, call: as in the dump format.
        slots: slot -> (dtype name, shape, has data).
        args: the replay arguments (``{"args", "kwargs", "replayable", ...}``) or None.
        load: slot -> the recorded tensor (on the CPU or the DUT device).
        step: the training step it was recorded in.
    """

    seq: int
    kind: str
    scope: str
    name: str
    direction: str
    call: int
    slots: Dict[str, tuple]
    args: Optional[dict]
    load: Callable[[str], torch.Tensor] = field(repr=False, default=None)  # type: ignore[assignment]
    step: int = 0

    def floating_slots(self, prefix: str) -> List[str]:
        """Slots starting with ``prefix`` holding floating tensors, in index order."""
        found = [s for s, (dt, _, _) in self.slots.items()
                 if s.startswith(prefix) and _is_float_name(dt)]
        return sorted(found, key=_slot_order)


def _slot_order(slot: str) -> tuple:
    head, _, tail = slot.partition(".")
    return (head, int(tail)) if tail.isdigit() else (head, 1 << 30, tail)


def _is_float_name(dtype: str) -> bool:
    t = getattr(torch, dtype, None)
    return isinstance(t, torch.dtype) and t.is_floating_point


def resolve_op(name: str) -> Callable:
    """``"aten.addmm.default"`` → ``torch.ops.aten.addmm.default``.

    Raises:
        Unreplayable: no such op is registered in this process.
    """
    parts = name.split(".")
    if len(parts) < 3:
        raise Unreplayable(f"{name}: not an op name (namespace.op.overload)")
    ns, op, overload = ".".join(parts[:-2]), parts[-2], parts[-1]
    try:
        return getattr(getattr(getattr(torch.ops, ns), op), overload)
    except (AttributeError, RuntimeError) as err:
        raise Unreplayable(f"{name}: op not registered here (import the library that defines "
                           "it, or register a reference)") from err


def _upcaster(device: str, dtype: torch.dtype, *, absolute: bool = False,
              requires_grad: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    def up(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            out = t.detach().to(device=device, dtype=dtype, copy=True)
            if absolute:
                out = out.abs()
            if requires_grad:
                out.requires_grad_(True)
            return out
        return t.detach().to(device=device, copy=True)
    return up


def _dtype_map(dtype: torch.dtype) -> Callable[[torch.dtype], torch.dtype]:
    return lambda dt: dtype if dt.is_floating_point else dt


def _abs_scalars(value: Any, key: Optional[str] = None) -> Any:
    """Absolute values of float scalars and of ``alpha``/``beta`` (ints elsewhere are dims)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, float) or (isinstance(value, int) and key in ("alpha", "beta")):
        return abs(value)
    if isinstance(value, list):
        return [_abs_scalars(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_abs_scalars(v) for v in value)
    if isinstance(value, dict):
        return {k: _abs_scalars(v, k) for k, v in value.items()}
    return value


def _loader(ev: UnitEvent, convert: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[str], torch.Tensor]:
    cache: Dict[str, torch.Tensor] = {}

    def tensor_of(slot: str) -> torch.Tensor:
        if slot not in cache:
            info = ev.slots.get(slot)
            if info is None or not info[2]:
                raise Unreplayable(f"{ev.scope}/{ev.name}: tensor {slot} was not stored; capture "
                                   "with --mode replay")
            cache[slot] = convert(ev.load(slot))
        return cache[slot]
    return tensor_of


def _call(fn: Callable, args: Any, kwargs: Any, what: str) -> Any:
    try:
        return fn(*args, **kwargs)
    except Unreplayable:
        raise
    except Exception as err:  # the op has no implementation for the golden dtype/device
        raise Unreplayable(f"{what}: {type(err).__name__}: {str(err).splitlines()[0][:200]}") from err


@dataclass
class OpReplay:
    """One op call replayed on the reference.

    Attributes:
        golden: the outputs computed from the DUT's inputs upcast to the reference dtype.
        magnitudes: the op on ``|inputs|`` (ops linear in each input), else None.
        magnitudes_of: computes the magnitudes on demand (one more replay of the op).
        ks: the accumulation length of each output, from the op's schema.
        peers: called with the DUT output dtypes, computes the emulated peers
            (:mod:`precisiondiff.comparators.peers`) from the DUT's own inputs:
            ``{"float32": [...] or None, "decomposition": [...] or None}``.
        on_device: called with a device, runs the op there on the DUT's own inputs in their
            recorded dtypes (a real peer implementation: ``bisect --peer``); its outputs on the
            CPU, or None when it cannot run there.
    """

    golden: List[torch.Tensor]
    magnitudes: Optional[List[torch.Tensor]]
    ks: List[Optional[int]]
    peers: Callable[[List[Optional[torch.dtype]]], Dict[str, Optional[List[Optional[torch.Tensor]]]]]
    magnitudes_of: Callable[[], Optional[List[torch.Tensor]]] = lambda: None
    on_device: Callable[[str], Optional[List[torch.Tensor]]] = lambda device: None


def _keep_dtype(device: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t.detach().to(device=device, copy=True)


def replay_op(ev: UnitEvent, *, device: str, dtype: torch.dtype, magnitude: bool = False) -> OpReplay:
    """Golden outputs of one op call, and (``magnitude``) the op applied to ``|inputs|``.

    Raises:
        Unreplayable: not recorded in replay mode, or the op fails on the golden target.
    """
    from ..comparators.accumulation import accumulation_lengths
    from ..comparators.peers import decomposition_peer, float32_peer, peer_dtype, semantics_peer
    if not ev.args or not ev.args.get("replayable", False):
        raise Unreplayable(f"{ev.name}: arguments not recorded (capture with --mode replay)")
    fn = reference_for(ev.name) or resolve_op(ev.name)

    def decode(convert: Callable[[torch.Tensor], torch.Tensor],
               dmap: Callable[[torch.dtype], torch.dtype], absolute: bool = False,
               on: Optional[str] = None) -> "tuple[Any, Any]":
        tensor_of = _loader(ev, convert)
        try:
            args, kwargs = decode_call(ev.args, tensor_of, device=on or device, dtype_map=dmap)
        except ValueError as err:
            raise Unreplayable(f"{ev.name}: {err}") from err
        if absolute:
            args, kwargs = _abs_scalars(args), _abs_scalars(kwargs)
        return args, kwargs

    def run(absolute: bool) -> "tuple[List[torch.Tensor], Any, Any]":
        args, kwargs = decode(_upcaster(device, dtype, absolute=absolute), _dtype_map(dtype), absolute)
        with torch.no_grad():
            return flatten_tensors(_call(fn, args, kwargs, ev.name)), args, kwargs

    golden, g_args, g_kwargs = run(False)
    ks = accumulation_lengths(ev.name, g_args, g_kwargs, golden)

    def magnitudes_of() -> Optional[List[torch.Tensor]]:
        try:
            return run(True)[0]
        except Unreplayable:
            return None
    mags = magnitudes_of() if magnitude else None

    def peers(out_dtypes: List[Optional[torch.dtype]]) -> Dict[str, Optional[List[Optional[torch.Tensor]]]]:
        wide = max((d for d in out_dtypes if d is not None), key=lambda d: torch.finfo(d).bits, default=torch.float32)
        up = peer_dtype(wide)
        try:
            a_args, a_kwargs = decode(_upcaster(device, up), _dtype_map(up))
            d_args, d_kwargs = decode(_keep_dtype(device), lambda dt: dt)
        except Unreplayable:
            return {"float32": None, "decomposition": None}
        found = {"float32": float32_peer(fn, a_args, a_kwargs, out_dtypes)}
        # a registered reference or a custom op has no torch._decomp entry: only the float32 peer,
        # unless the reference is the op's built-in math semantics (a fused attention)
        if reference_for(ev.name) is None:
            found["decomposition"] = decomposition_peer(fn, d_args, d_kwargs, out_dtypes)
        else:
            found["decomposition"] = (semantics_peer(fn, d_args, d_kwargs, out_dtypes)
                                      if math_semantics(ev.name) else None)
        return found

    def on_device(peer_device: str) -> Optional[List[torch.Tensor]]:
        try:
            p_args, p_kwargs = decode(_keep_dtype(peer_device), lambda dt: dt, on=peer_device)
            with torch.no_grad():
                return [t.detach().cpu() for t in flatten_tensors(_call(fn, p_args, p_kwargs, ev.name))]
        except Unreplayable:
            return None

    return OpReplay(golden, mags, ks, peers, magnitudes_of, on_device)


class GoldenMode(TorchDispatchMode):
    """Dispatch mode for module replays on the reference.

    Args:
        fallback: op names run in :data:`FALLBACK_DTYPE`; an op that raises in the golden
            dtype is added to it and rerun there (ops with no golden-dtype kernel).
        round_to: emulation: round each floating output to this dtype (and back).
        decompose: with ``round_to``, emulate PyTorch's reference semantics instead: an op
            with a ``torch._decomp`` decomposition runs it in ``round_to`` on its inputs rounded
            to ``round_to`` (the math attention for a flash kernel, with its intermediate
            roundings); other ops as above.
        random_outputs: the DUT's outputs of the random ops (``torch.Tag.nondeterministic_seeded``)
            of the replayed calls, in call order: each random op returns the next one (upcast)
            instead of drawing fresh numbers, so the replay sees the DUT's own dropout masks.
        counter: optional dict; ``counter["ops"]`` is incremented per op that is not a view
            (cost accounting: capture does not record views either); ``counter["reused"]`` per
            op taken from ``reuse`` instead (not run).
        reuse: emulation only: a :class:`~precisiondiff.bisect.reuse.RoundedOps`; an op called
            with exactly the arguments of a recorded call whose DUT output is its golden
            correctly rounded returns that output (what the emulation computes) without running.
        replayed: a :class:`~precisiondiff.bisect.reuse.ReplayedOps`: the golden replay records
            into it its ops whose arguments are exact in the DUT dtype; an emulated replay of the
            same unit takes the output of the same call from it, rounded, without running.
    """

    def __init__(self, *, fallback: Optional[Set[str]] = None, round_to: Optional[torch.dtype] = None,
                 counter: Optional[Dict[str, int]] = None, decompose: bool = False,
                 random_outputs: Optional[List[List[torch.Tensor]]] = None, reuse: Any = None,
                 replayed: Any = None) -> None:
        super().__init__()
        self.reuse = reuse if round_to is not None else None
        self.replayed = replayed
        self.fallback = fallback or set()
        self.round_to = round_to
        self.counter = counter
        self.decompose = decompose and round_to is not None
        self.random_outputs = list(random_outputs or [])

    # a higher-order operator (flex_attention, cond...) reaches __torch_dispatch__ and runs there
    # as one unit (its inner ops below the mode), instead of raising "no rule registered"
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return _in_hop_compile()  # the HOP's eager wrapper compiles (capture/dispatch.py)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):
            self._count(False)
            out = func(*args, **kwargs)
            if self.round_to is None:
                return out
            return torch.utils._pytree.tree_map(
                lambda v: v.to(self.round_to).to(v.dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
                else v, out)
        name = str(func)
        view = getattr(func, "is_view", False)
        if is_random_call(func, args, kwargs):
            self._count(view)
            return self._recorded(func, args, kwargs)
        if self.decompose and not func._schema.is_mutable and not view:
            out = self._decomposed(func, args, kwargs)
            if out is not None:
                self._count(view)
                return out
        if self.round_to is not None and not view:
            # the op replays ran in the golden dtype: not what a fallback op runs in here
            hit = (self.reuse.lookup(name, args, kwargs)
                   if self.reuse is not None and name not in self.fallback else None)
            if hit is None and self.replayed is not None:
                hit = self.replayed.lookup(name, args, kwargs, self.round_to)
            if hit is not None:
                if self.counter is not None:
                    self.counter["reused"] = self.counter.get("reused", 0) + 1
                return hit
        self._count(view)
        ref = reference_for(name)
        if ref is not None:
            out = ref(*args, **kwargs)
        elif name in self.fallback:
            out = self._in_fallback(func, args, kwargs)
        else:
            try:
                out = func(*args, **kwargs)
            except Exception:  # no kernel for the golden dtype: fall back (documented)
                self.fallback.add(name)
                out = self._in_fallback(func, args, kwargs)
        if self.round_to is None and self.replayed is not None and not view:
            self.replayed.record(name, func, args, kwargs, out)
        if self.round_to is not None and not view:
            inputs = {id(t) for t in flatten_tensors((args, kwargs))}

            def rnd(v: Any) -> Any:
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != self.round_to:
                    rounded = v.to(self.round_to).to(v.dtype)
                    if id(v) in inputs:  # in-place op: round in place
                        v.copy_(rounded)
                        return v
                    return rounded
                return v
            out = torch.utils._pytree.tree_map(rnd, out)
        return out

    def _count(self, view: bool) -> None:
        # counted like capture records ops (views and aliases are not ops of the step), so
        # that ops replayed / ops per forward is in forwards of the workload
        if self.counter is not None and not view:
            self.counter["ops"] = self.counter.get("ops", 0) + 1

    def _recorded(self, func: Any, args: Any, kwargs: Any) -> Any:
        """A random op: the DUT's next recorded outputs, written where the op writes."""
        out = func(*args, **kwargs)  # shapes, aliasing (in-place ops return their input)
        if not self.random_outputs:
            return out
        recorded = self.random_outputs.pop(0)
        flat = flatten_tensors(out)
        with torch.no_grad():
            for t, r in zip(flat, recorded):
                if tuple(t.shape) == tuple(r.shape):
                    t.copy_(r.to(device=t.device, dtype=t.dtype))
        return out

    def _decomposed(self, func: Any, args: Any, kwargs: Any) -> Any:
        decomp = reference_semantics(func)
        if decomp is None or reference_for(str(func)) is not None:
            return None
        low = self.round_to
        golden = next((a.dtype for a in flatten_tensors((args, kwargs)) if a.is_floating_point()), None)
        if golden is None:
            return None
        down = lambda v: v.to(low) if isinstance(v, torch.Tensor) and v.is_floating_point() else v  # noqa: E731
        try:
            with reductions_in_dtype():
                out = decomp(*torch.utils._pytree.tree_map(down, args), **torch.utils._pytree.tree_map(down, kwargs))
        except Exception:  # the decomposition does not run in that dtype: emulate by rounding
            return None
        if out is NotImplemented:
            return None
        return torch.utils._pytree.tree_map(
            lambda v: v.to(golden) if isinstance(v, torch.Tensor) and v.is_floating_point() else v, out)

    @staticmethod
    def _in_fallback(func: Any, args: Any, kwargs: Any) -> Any:
        def down(v: Any) -> Any:
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                return v.to(FALLBACK_DTYPE)
            return v
        golden = next((a.dtype for a in flatten_tensors((args, kwargs)) if a.is_floating_point()),
                      torch.float64)
        out = func(*torch.utils._pytree.tree_map(down, args), **torch.utils._pytree.tree_map(down, kwargs))
        return torch.utils._pytree.tree_map(
            lambda v: v.to(golden) if isinstance(v, torch.Tensor) and v.is_floating_point() else v, out)


def is_meta_template(template: torch.nn.Module) -> bool:
    """Whether ``template`` was built on the meta device (its state comes from the dump alone)."""
    return any(t.is_meta for t in template.parameters()) or any(t.is_meta for t in template.buffers())


def _meta_attributes(module: torch.nn.Module) -> List[str]:
    """Tensors held as plain attributes of ``module``'s submodules (not parameters or buffers:
    no ``param.*`` slot restores them) that are still on the meta device."""
    return [f"{name}.{attr}" if name else attr for name, m in module.named_modules()
            for attr, v in vars(m).items() if isinstance(v, torch.Tensor) and v.is_meta]


def _module_copy(template: torch.nn.Module, ev: UnitEvent, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """The module of ``template`` on the reference ``device``/``dtype`` with the call's recorded
    parameters and buffers (its ``param.*`` slots).

    A template built on the meta device (a replay worker's: nothing to initialise) gets empty
    tensors, all of which the slots must fill.

    Raises:
        IncompleteTemplate: a meta template whose state the slots do not restore entirely.
    """
    cplx = complex_dtype(dtype)
    meta = is_meta_template(template)
    if meta:
        missing = _meta_attributes(template)
        if missing:
            raise IncompleteTemplate(f"{ev.scope}: tensor attribute {missing[0]} is not recorded")

    def place(t: torch.Tensor) -> torch.Tensor:
        # not Module.to(dtype): it casts complex buffers (a RoPE table) to the real dtype
        to = dtype if t.is_floating_point() else cplx if t.is_complex() else t.dtype
        return torch.empty_like(t, device=device, dtype=to) if t.is_meta else t.to(device=device, dtype=to)
    module = copy_model(template)._apply(place)
    unfilled = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()} if meta else set()
    up = _upcaster(device, dtype)
    with torch.no_grad():
        for slot, info in ev.slots.items():
            if not slot.startswith("param."):
                continue
            name = slot[len("param."):]
            try:
                target = module.get_parameter(name)
            except AttributeError:
                try:
                    target = module.get_buffer(name)
                except AttributeError:
                    continue
            value = up(ev.load(slot))
            if target.shape != value.shape:
                raise Unreplayable(f"{ev.scope}: parameter {name} has shape {tuple(value.shape)} "
                                   f"in the capture but {tuple(target.shape)} in the model")
            if target.is_floating_point() or target.is_complex():
                target.data = value.to(target.dtype)
            else:
                target.data = value
            unfilled.discard(name)
    if unfilled:
        raise IncompleteTemplate(f"{ev.scope}: {sorted(unfilled)[0]} is not recorded with the call")
    for p in module.parameters():
        p.grad = None
    module.train(bool((ev.args or {}).get("training", False)))
    return module


def _decode_inputs(ev: UnitEvent, device: str, dtype: torch.dtype, requires_grad: bool) -> "tuple[list, dict]":
    if not ev.args or not ev.args.get("replayable", False):
        raise Unreplayable(f"{ev.scope}: module arguments not recorded (capture with --mode replay)")
    tensor_of = _loader(ev, _upcaster(device, dtype, requires_grad=requires_grad))
    try:
        args, kwargs = decode_call(ev.args, tensor_of, device=device, dtype_map=_dtype_map(dtype))
    except ValueError as err:
        raise Unreplayable(f"{ev.scope}: {err}") from err
    return list(args), dict(kwargs)


def replay_module_forward(template: torch.nn.Module, ev: UnitEvent, *, device: str, dtype: torch.dtype,
                          mode: GoldenMode) -> Dict[str, torch.Tensor]:
    """Golden ``output.N`` of a module call, with the DUT's parameters and inputs.

    Raises:
        Unreplayable: arguments not recorded, or the module fails on the golden target.
    """
    module = _module_copy(template, ev, device, dtype)
    args, kwargs = _decode_inputs(ev, device, dtype, requires_grad=False)
    with torch.no_grad(), mode:
        out = _call(module, args, kwargs, f"module {ev.scope or '<root>'}")
    return {f"output.{i}": t for i, t in enumerate(flatten_tensors(out))}


def replay_module_backward(template: torch.nn.Module, fwd: UnitEvent, bwd: UnitEvent, *, device: str,
                           dtype: torch.dtype, mode: GoldenMode) -> Dict[str, torch.Tensor]:
    """Golden ``grad_input.N`` and ``param_grad.<name>`` of a module's backward call.

    The forward is recomputed from the DUT's inputs and parameters, then back-propagated with
    the DUT's ``grad_output``.
    """
    return replay_module_step(template, fwd, bwd, device=device, dtype=dtype, mode=mode)[1]


def replay_module_step(template: torch.nn.Module, fwd: UnitEvent, bwd: UnitEvent, *, device: str,
                       dtype: torch.dtype, mode: GoldenMode) -> "tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]":
    """One replay for both calls of a module: the golden ``output.N`` of its forward call
    ``fwd`` (as :func:`replay_module_forward` gives them) and the golden ``grad_input.N`` /
    ``param_grad.<name>`` of its backward call ``bwd`` (as :func:`replay_module_backward`)."""
    module = _module_copy(template, fwd, device, dtype)
    args, kwargs = _decode_inputs(fwd, device, dtype, requires_grad=True)
    up = _upcaster(device, dtype)
    with torch.enable_grad(), mode:
        out = _call(module, args, kwargs, f"module {fwd.scope or '<root>'}")
        outs = flatten_tensors(out)
        pairs = []
        for slot in bwd.floating_slots("grad_output."):
            i = int(slot.split(".")[1])
            if i < len(outs) and outs[i].requires_grad:
                pairs.append((outs[i], up(bwd.load(slot))))
        if not pairs:
            raise Unreplayable(f"{bwd.scope}: no output of the replayed module needs a gradient")
        # A recorded grad_output is the whole gradient of that output, including what flows back
        # into it from inside the module (T5's encoder output also feeds its decoder): the hook
        # makes it the output's gradient instead of adding the module's own share a second time.
        for o, g in pairs:
            if o.grad_fn is not None:
                o.register_hook(lambda _grad, _g=g: _g)
        _call(lambda: torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs]),
              [], {}, f"module {bwd.scope or '<root>'} backward")
    forward = {f"output.{i}": t.detach() for i, t in enumerate(outs)}
    golden: Dict[str, torch.Tensor] = {}
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.grad is not None:
            golden[f"grad_input.{i}"] = a.grad
    for name, p in module.named_parameters():
        if p.grad is not None:
            golden[f"param_grad.{name}"] = p.grad
    return forward, golden
