"""Replaying a parameter update: one op of ``optimizer.step()`` (or GradScaler, clip_grad_norm_)
recorded with direction ``optimizer`` (:mod:`precisiondiff.capture.optimizer`).

An update op writes its tensors in place (``_fused_adamw_`` writes the parameter, its gradient
and every moment; a vendor fused AdamW its master weights too), so what it computes is the
written tensors after the call, recorded as ``output.N`` in argument order. The replay runs the
op on the DUT's recorded state (parameter, gradient, moments, step, and the scalars lr, betas...
from its arguments) upcast to the reference dtype and takes the same written tensors: the
golden. Its peer is a correct implementation in the DUT's state dtypes: the op run in float32 on
the same state and each written tensor rounded once to its dtype (a float32 master weight stays
float32, a bf16 moment is rounded once to bf16). Bisect judges the outputs by the peer rule, each
in its own dtype (the state's precision, not the gradient's), as it judges any op. An op that
takes its one-element scalars in float32 only (GradScaler's ``_amp_*`` ops: scale, inverse scale,
found_inf) is replayed with those kept in their recorded dtype.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from ..capture.optimizer import OPTIMIZER, written_tensors
from ..capture.serialize import decode_args
from ..comparators.peers import peer_dtype
from .isolate import (OpReplay, Unreplayable, UnitEvent, _call, _dtype_map, _keep_dtype, _loader, _upcaster,
                      resolve_op)
from .references import reference_for

__all__ = ["is_update", "replay_update"]


def is_update(ev: UnitEvent) -> bool:
    """An op of a parameter update (direction ``optimizer``)."""
    return ev.kind == "op" and ev.direction == OPTIMIZER


def replay_update(ev: UnitEvent, *, device: str, dtype: torch.dtype, magnitude: bool = False) -> OpReplay:
    """The golden written tensors of an update op from the DUT's recorded state, and its
    float32 peer (module docstring). ``magnitude`` is accepted for :func:`replay_op`'s
    signature: an update has no magnitude (its outputs are judged in their own dtype).

    Raises:
        Unreplayable: not recorded in replay mode, or the op fails on the reference.
    """
    if not ev.args or not ev.args.get("replayable", False):
        raise Unreplayable(f"{ev.name}: arguments not recorded (capture with --mode replay)")
    func = resolve_op(ev.name)
    fn = reference_for(ev.name) or func
    enc_args, enc_kwargs = ev.args.get("args", []), ev.args.get("kwargs", {})

    def convert(to: torch.dtype, keep_scalars: bool) -> Callable[[torch.Tensor], torch.Tensor]:
        up, keep = _upcaster(device, to), _keep_dtype(device)
        return lambda t: keep(t) if keep_scalars and t.numel() <= 1 and t.is_floating_point() else up(t)

    def run(to: torch.dtype) -> List[torch.Tensor]:
        try:
            return run_as(to, False)
        except Unreplayable:
            # GradScaler's ops take their scale, inverse scale and found_inf as float32 tensors
            # only: those one-element scalars stay in their recorded dtype, the rest is upcast
            return run_as(to, True)

    def run_as(to: torch.dtype, keep_scalars: bool) -> List[torch.Tensor]:
        tensor_of = _loader(ev, convert(to, keep_scalars))
        try:
            args = decode_args(enc_args, tensor_of, device=device, dtype_map=_dtype_map(to))
            kwargs = decode_args(enc_kwargs, tensor_of, device=device, dtype_map=_dtype_map(to))
        except ValueError as err:
            raise Unreplayable(f"{ev.name}: {err}") from err
        with torch.no_grad():
            out = _call(fn, args, kwargs, ev.name)
        return written_tensors(func, args, dict(kwargs), out)

    golden = run(dtype)

    def peers(out_dtypes: List[Optional[torch.dtype]]) -> Dict[str, Optional[List[Optional[torch.Tensor]]]]:
        wide = max((d for d in out_dtypes if d is not None), key=lambda d: torch.finfo(d).bits, default=torch.float32)
        try:
            outs = run(peer_dtype(wide))
        except Unreplayable:
            return {"float32": None, "decomposition": None}
        pad = list(out_dtypes) + [None] * (len(outs) - len(out_dtypes))
        return {"float32": [o.to(dt) if dt is not None and o.is_floating_point() else None for o, dt in zip(outs, pad)],
                "decomposition": None}

    no_magnitude: Callable[[], Any] = lambda: None  # noqa: E731
    return OpReplay(golden, None, [None] * len(golden), peers, no_magnitude)
