"""Emulation from the op replays: an op whose DUT output is its golden correctly rounded.

A module's *emulation* (judge.py) replays the module on the reference with every op's output
rounded to the DUT dtype. When an op of that replay gets exactly the arguments that a recorded
DUT op call got (the same op, bitwise the same upcast tensors, the same other arguments), its
emulated output is its golden rounded to the DUT dtype; the op's own replay already computed
that golden, and when it rounds to the DUT's recorded output bit for bit, the emulated output
*is* the DUT's recorded output, upcast. The replay then takes it instead of running the op
again: exact, not an approximation. Since the emulation's inputs are the DUT's own inputs of the
module, the emulated chain coincides with the DUT's as long as the DUT's ops round correctly,
and only the ops from the first difference on are run.

Nothing is held but the event of each correctly rounded op call (its recorded tensors stay in
the capture's store); the arguments are re-read and compared when a replayed call matches the
key (op, tensor shapes, first and last element of the first floating tensor).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..capture.serialize import decode_call
from .isolate import UnitEvent, _loader, _upcaster, _dtype_map

__all__ = ["RoundedOps", "ReplayedOps"]

Key = Tuple[Any, ...]


def _leaves(args: Any, kwargs: Any) -> List[Any]:
    return torch.utils._pytree.tree_leaves((args, kwargs))


def _key(name: str, leaves: List[Any], float_dtype: Optional[torch.dtype] = None) -> Optional[Key]:
    shapes, probe = [], None
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            dt = float_dtype if float_dtype is not None and leaf.is_floating_point() else leaf.dtype
            shapes.append((tuple(leaf.shape), dt))
            if probe is None and leaf.is_floating_point() and leaf.numel() > 0:
                flat = leaf.detach().reshape(-1)
                probe = (float(flat[0]), float(flat[-1]))
    if probe is None:
        return None
    return (name, tuple(shapes), probe)


def _same(a: List[Any], b: List[Any]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            # the same layout too: a kernel may round differently for another one (docs/bisect.md)
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or x.dtype != y.dtype \
                    or x.shape != y.shape or x.device != y.device or x.stride() != y.stride() \
                    or not torch.equal(x, y):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


class RoundedOps:
    """The recorded op calls whose DUT outputs are their goldens correctly rounded to ``dtype``.

    Args:
        device, dtype: the reference device and dtype (the replays' upcast).
        round_to: the DUT dtype the emulation rounds to.
    """

    def __init__(self, device: str, dtype: torch.dtype, round_to: torch.dtype) -> None:
        self.device, self.dtype, self.round_to = device, dtype, round_to
        self._by_key: Dict[Key, List[Tuple[UnitEvent, int]]] = {}
        self.hits = 0

    def add(self, ev: UnitEvent, golden: List[torch.Tensor], func: Callable) -> bool:
        """Register ``ev`` when every output of ``func`` is a floating tensor that the DUT
        recorded in ``round_to`` and ``golden`` rounds to it bit for bit."""
        n_out = self.correctly_rounded(ev, golden, func)
        return n_out is not None and self.register(ev, n_out)

    def correctly_rounded(self, ev: UnitEvent, golden: List[torch.Tensor], func: Callable) -> Optional[int]:
        """The number of outputs of ``ev`` when each is its ``golden`` rounded to ``round_to`` bit
        for bit (and ``func`` returns plain tensors only), else None. Needs the golden: a replay
        worker answers it (bisect/workers.py), the search's process then :meth:`register` s."""
        returns = getattr(getattr(func, "_schema", None), "returns", None)
        if not returns or getattr(func._schema, "is_mutable", True) \
                or any(str(r.type) != "Tensor" for r in returns) or len(golden) != len(returns):
            return None
        for i, g in enumerate(golden):
            info = ev.slots.get(f"output.{i}")
            if info is None or not info[2] or info[0] != str(self.round_to).removeprefix("torch.") \
                    or not g.is_floating_point():
                return None
            dut = ev.load(f"output.{i}")
            if tuple(dut.shape) != tuple(g.shape) or not torch.equal(g.to(self.round_to), dut.to(g.device)):
                return None
        return len(golden)

    def register(self, ev: UnitEvent, n_out: int) -> bool:
        """Register ``ev``, whose ``n_out`` outputs are their goldens correctly rounded."""
        leaves = self._args(ev, upcast=False)  # the key from the recorded tensors: no copy
        key = _key(ev.name, leaves, self.dtype) if leaves is not None else None
        if key is None:
            return False
        self._by_key.setdefault(key, []).append((ev, n_out))
        return True

    def export(self) -> Dict[Key, List[Tuple[int, int, int]]]:
        """What is registered, by ``(step, seq, n_out)`` of each call: a replay worker holding
        the same events rebuilds it with :meth:`imported` (bisect/workers.py)."""
        return {key: [(ev.step, ev.seq, n) for ev, n in calls] for key, calls in self._by_key.items()}

    def imported(self, exported: Dict[Key, List[Tuple[int, int, int]]],
                 events: Dict[Tuple[int, int], UnitEvent]) -> "RoundedOps":
        """This registry with ``exported`` (another process's :meth:`export`) in it, in its order;
        ``events``: ``(step, seq) -> event``."""
        self._by_key = {key: [(events[(step, seq)], n) for step, seq, n in calls]
                        for key, calls in exported.items()}
        return self

    def _args(self, ev: UnitEvent, upcast: bool = True) -> Optional[List[Any]]:
        if not ev.args or not ev.args.get("replayable", False):
            return None
        convert = _upcaster(self.device, self.dtype) if upcast else (lambda t: t)
        dmap = _dtype_map(self.dtype) if upcast else (lambda dt: dt)
        tensor_of = _loader(ev, convert)
        try:
            args, kwargs = decode_call(ev.args, tensor_of, device=self.device if upcast else None, dtype_map=dmap)
        except Exception:  # noqa: BLE001 - a call that cannot be decoded is simply not reused
            return None
        return _leaves(args, kwargs)

    def lookup(self, name: str, args: Any, kwargs: Any) -> Optional[Any]:
        """The emulated output of ``name(*args, **kwargs)`` when a registered call had exactly
        these arguments (the DUT's outputs upcast, in the op's return structure), else None."""
        if not self._by_key:
            return None
        leaves = _leaves(args, kwargs)
        candidates = self._by_key.get(_key(name, leaves) or ("",), [])
        for ev, n_out in candidates:
            recorded = self._args(ev)
            if recorded is not None and _same(recorded, leaves):
                outs = [ev.load(f"output.{i}").to(device=self.device, dtype=self.dtype) for i in range(n_out)]
                self.hits += 1
                return outs[0] if len(outs) == 1 else tuple(outs)
        return None


class ReplayedOps:
    """The op calls of one unit's golden replay whose floating arguments are all exact in the
    DUT dtype (the unit's inputs and parameters, upcast; the DUT's ``grad_output``): the
    unit's emulated replay makes the same calls with the same arguments (its inputs are the
    same and rounding leaves them unchanged), so it takes their golden outputs, rounded, instead
    of running them again. Exact: the arguments are compared bit for bit. Holds copies of those
    calls' arguments and outputs until the unit is judged (first-level ops only)."""

    def __init__(self, round_to: torch.dtype) -> None:
        self.round_to = round_to
        self._by_key: Dict[Key, List[Tuple[List[Any], Any]]] = {}

    def record(self, name: str, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Keep ``out`` of this call of the golden replay if its arguments are exact in the DUT dtype."""
        if getattr(getattr(func, "_schema", None), "is_mutable", True):
            return
        leaves = _leaves(args, kwargs)
        floats = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not floats or any(not torch.equal(t, t.to(self.round_to).to(t.dtype)) for t in floats):
            return
        key = _key(name, leaves)
        if key is None:
            return
        copy = lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
        self._by_key.setdefault(key, []).append(([copy(v) for v in leaves],
                                                 torch.utils._pytree.tree_map(copy, out)))

    def lookup(self, name: str, args: Any, kwargs: Any, round_to: torch.dtype) -> Optional[Any]:
        """The golden replay's output of exactly this call, rounded to ``round_to``, else None."""
        if not self._by_key:
            return None
        leaves = _leaves(args, kwargs)
        for recorded, out in self._by_key.get(_key(name, leaves) or ("",), []):
            if _same(recorded, leaves):
                rnd = lambda v: (v.to(round_to).to(v.dtype) if isinstance(v, torch.Tensor)  # noqa: E731
                                 and v.is_floating_point() else v.clone() if isinstance(v, torch.Tensor) else v)
                return torch.utils._pytree.tree_map(rnd, out)
        return None
