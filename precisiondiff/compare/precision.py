"""The precision a run really ran at, event by event: :class:`RunPrecision`.

A mixed-precision run keeps float32 tensors where its arithmetic ran in a lower precision:
under ``torch.autocast`` the matmuls run in bf16/fp16 and the normalizations, softmax and losses
in float32; an engine (FSDP2 ``MixedPrecisionPolicy``, DeepSpeed or Megatron bf16) casts the
weights to bf16 and keeps float32 master weights and gradients. A float32 tensor computed from a
bf16 matmul's output carries bf16-sized error, so judging it by a float32 bound reports a false
divergence. The precision a tensor of A is judged at is therefore the lowest floating precision
A's run has held **up to that event**, in execution order (every record of every event: inputs,
outputs, gradients), and at least the precision of A's target (``cpu/bf16+autocast`` ->
bfloat16). Events before the first low-precision one keep their own dtype's bound, so a float32
stretch ahead of the mixed-precision part is still judged at float32.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

__all__ = ["RunPrecision"]


@functools.lru_cache(maxsize=None)
def _unit_roundoff(dtype: str) -> Optional[float]:
    if not dtype.startswith(("float", "bfloat")):
        return None
    try:
        from ..comparators.ulp import float_format
        from ..store.schema import dtype_from_name
        return float_format(dtype_from_name(dtype)).unit_roundoff
    except Exception:  # noqa: BLE001 - a dtype without a known format sets no precision
        return None


class RunPrecision:
    """The lowest floating precision of A's run so far (module docstring).

    Attributes:
        base: the precision of A's target (None: a script, or a foreign target).
        current: the precision the next event is judged at (None: each tensor's own).
        since: ``(seq, scope, name, dtype)`` of the event that lowered it below ``base``.

    Example:
        >>> p = RunPrecision("float32")
        >>> class T: dtype = "bfloat16"
        >>> class E: seq, scope, name, tensors = 3, "fc1", "aten.mm.default", [T()]
        >>> p.see(E())
        'bfloat16'
    """

    def __init__(self, base: Optional[str]) -> None:
        self.base = base
        self.current = base
        self.since: Optional[tuple] = None
        self._first = base  # the run's precision before any lower one: the target's, or its first dtype

    def see(self, event: Any) -> Optional[str]:
        """Take ``event``'s records into account; returns the precision to judge it at."""
        u_now = _unit_roundoff(self.current) if self.current else 0.0
        for rec in event.tensors:
            u = _unit_roundoff(rec.dtype)
            if u is not None and self._first is None:
                self._first = rec.dtype
            if u is not None and u > (u_now or 0.0):
                self.current, u_now = rec.dtype, u
                if self.since is None or self.since[3] != rec.dtype:
                    self.since = (event.seq, event.scope, event.name, rec.dtype)
        return self.current

    def note(self) -> Optional[str]:
        """A sentence for the user when the run ran below its target's precision."""
        if self.since is None or self.current == self._first:
            return None
        seq, scope, name, dtype = self.since
        return (f"A's run computed in {dtype} from seq {seq} ({scope or '(root)'} {name}) on, though it "
                f"keeps tensors of higher precision (autocast or a mixed-precision engine): those after it "
                f"are judged by the {dtype} bound")
