"""The emulated-peer rule: judge a kernel by what a correct implementation in its own dtype does.

A kernel's output ``d`` (dtype ``T``) is compared with the golden ``g`` (the same op on the same
inputs in float64). On its own, ``|d - g|`` says little: a correct bf16 kernel is off by its final
rounding, by cancellation its inputs make unavoidable, by the order it sums in. So the error is
compared with that of *emulated peers*, correct implementations in dtype ``T`` run on the same
inputs (docs/comparators.md, "The peer rule"):

* ``float32``: the op computed in float32 (or the wider of float32 and ``T``) from the same
  inputs, each output rounded once to its dtype: float32 accumulation, one final rounding;
* ``decomposition``: PyTorch's own reference semantics for the op, its ``torch._decomp``
  decomposition (most are ``torch._refs``) run in ``T``, when the op has one.

With ``e(x) = ||x - g||_2`` over the elements finite in both, the kernel passes when::

    e(d) <= factor * max(e(float32 peer), e(decomposition peer)) + floor
    floor = || u * |g| + accum_factor * K * u_acc * magnitude ||_2

``factor`` is Dynamo ``same()``'s RMSE ratio (3 for 16-bit and 8-bit dtypes, 2 otherwise), ``u``
the unit roundoff of ``T``, and the floor the L2 norm of the per-element allowance of one
correct final rounding plus float32 accumulation of the op's magnitude (``magnitude`` and ``K``
from :mod:`~precisiondiff.comparators.accumulation`; without a magnitude the first term alone).
Being a norm, the rule judges small elements by their absolute error: an element of size 1e-11
in a tensor of size 1 cannot fail it, as with torch.testing's ``atol`` and msprobe's small-value
rule. A NaN or infinity where the golden has none fails unless a peer gives the same value there.
Per-element ULP figures stay what is *reported*; this rule gives the verdict.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .tolerance import PEER_FACTOR, PEER_FACTOR_LOW
from .ulp import float_format

__all__ = ["PeerVerdict", "judge_against_peers", "significance_floor", "peer_factor", "peer_dtype", "compute_dtype",
           "float32_peer", "decomposition_peer", "ACCUM_FACTOR"]

#: c of the accumulation term of the floor (Higham's gamma_K for K * u_acc <= 1/2, as the budgets).
ACCUM_FACTOR = 2.0


def peer_factor(dtype: torch.dtype) -> float:
    """Dynamo ``same()``'s RMSE ratio: 3 for 16-bit and 8-bit dtypes, 2 for float32/float64."""
    return PEER_FACTOR if dtype in (torch.float32, torch.float64) else PEER_FACTOR_LOW


def peer_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the float32 peer computes in: float32, or ``dtype`` when that is wider."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def compute_dtype(out_dtype: torch.dtype, input_dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """The least precise of an output's dtype and the op's floating input dtypes: what a
    correct implementation may round its intermediates to."""
    cands = [out_dtype] + [d for d in input_dtypes if d.is_floating_point and d.itemsize > 0]
    return max(cands, key=lambda d: float_format(d).unit_roundoff if _known(d) else 0.0)


def _known(dtype: torch.dtype) -> bool:
    try:
        float_format(dtype)
        return True
    except Exception:  # a dtype without a ULP definition (complex, ...)
        return False


def significance_floor(golden: torch.Tensor, dtype: torch.dtype, *, magnitude: Optional[torch.Tensor] = None,
                       k: Optional[int] = None) -> float:
    """``|| u * |g| + ACCUM_FACTOR * K * u_acc * magnitude ||_2`` over the finite elements of ``golden``."""
    g = golden.detach().to(torch.float64)
    allow = float_format(dtype).unit_roundoff * g.abs()
    if magnitude is not None and k:
        u_acc = float_format(peer_dtype(dtype)).unit_roundoff
        allow = allow + ACCUM_FACTOR * k * u_acc * magnitude.detach().to(device=g.device, dtype=torch.float64).abs()
    allow = torch.where(torch.isfinite(allow), allow, torch.zeros_like(allow))
    return float(torch.linalg.vector_norm(allow))


@dataclass(frozen=True)
class PeerVerdict:
    """The peer rule's judgement of one tensor.

    Attributes:
        passed: within ``factor * peer error + floor`` and no unexplained NaN/Inf.
        error: ``||d - g||_2 / ||g||_2`` (relative L2 of the kernel).
        peer_error: the larger relative L2 of the peers (0.0 when none ran).
        peers: each peer's relative L2 (``float32``, ``decomposition``).
        floor: the significance floor, relative to ``||g||_2``.
        factor: the ratio allowed.
        bound: ``factor * peer_error + floor`` (relative).
        ratio: ``error / bound``.
        special_mismatch: NaN/Inf positions no peer explains.
        message: one line when it fails.
    """

    passed: bool
    error: float
    peer_error: float
    peers: Dict[str, float]
    floor: float
    factor: float
    bound: float
    ratio: float
    special_mismatch: int
    message: str = ""

    def as_dict(self) -> Dict[str, Any]:
        """JSON-safe fields (infinities as strings)."""
        def safe(v: Any) -> Any:
            return repr(v) if isinstance(v, float) and not math.isfinite(v) else v
        return {"rule": "peer", "passed": self.passed, "error": safe(self.error), "peer_error": safe(self.peer_error),
                "peers": {k: safe(v) for k, v in self.peers.items()}, "floor": safe(self.floor),
                "factor": self.factor, "bound": safe(self.bound), "ratio": safe(self.ratio),
                "special_mismatch": self.special_mismatch}


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a == b) | (torch.isnan(a) & torch.isnan(b))


def judge_against_peers(dut: torch.Tensor, golden: torch.Tensor, peers: Mapping[str, Optional[torch.Tensor]], *,
                        magnitude: Optional[torch.Tensor] = None, k: Optional[int] = None,
                        factor: Optional[float] = None, dtype: Optional[torch.dtype] = None,
                        what: str = "output") -> PeerVerdict:
    """Judge ``dut`` against ``golden`` by the peer rule (module docstring).

    Args:
        dut: the kernel's output, in its own dtype.
        golden: the float64 (reference) output on the same inputs.
        peers: ``{"float32": tensor or None, "decomposition": tensor or None}`` (peers that could
            not run are None), each in the DUT's dtype.
        magnitude, k: the op's magnitude and accumulation length, for the floor.
        factor: the ratio; default :func:`peer_factor` of ``dtype``.
        dtype: the dtype the op computes in, for ``u`` and the factor: default the output's; a
            wider output of narrower inputs (the float32 logsumexp of a bf16 attention) is
            judged in the inputs' dtype (:func:`compute_dtype`).
        what: the tensor's name in the message.
    """
    dtype = dut.dtype if dtype is None else dtype
    factor = peer_factor(dtype) if factor is None else factor
    g = golden.detach().to(torch.float64).flatten()
    d = dut.detach().to(device=g.device, dtype=torch.float64).flatten()
    if d.shape != g.shape:
        raise ValueError(f"{what}: shapes differ: {tuple(dut.shape)} vs {tuple(golden.shape)}")
    ps = {n: p.detach().to(device=g.device, dtype=torch.float64).flatten()
          for n, p in peers.items() if p is not None and p.numel() == d.numel()}
    rounded = g.to(dut.dtype).to(torch.float64)
    finite = torch.isfinite(d) & torch.isfinite(g)
    special = ~finite & ~_same(d, rounded)
    for p in ps.values():
        special &= ~_same(d, p)
    n_special = int(special.sum())
    gf = torch.where(finite, g, torch.zeros_like(g))
    gnorm = float(torch.linalg.vector_norm(gf))
    e_dut = float(torch.linalg.vector_norm(torch.where(finite, d - g, torch.zeros_like(g))))
    e_peers = {}
    for n, p in ps.items():
        ok = finite & torch.isfinite(p)
        e_peers[n] = float(torch.linalg.vector_norm(torch.where(ok, p - g, torch.zeros_like(g))))
    e_peer = max(e_peers.values(), default=0.0)
    mag = magnitude.detach().flatten() if magnitude is not None else None
    floor = significance_floor(gf, dtype, magnitude=mag, k=k)
    bound = factor * e_peer + floor
    passed = n_special == 0 and e_dut <= bound
    rel = (lambda e: e / gnorm) if gnorm > 0 else (lambda e: 0.0 if e == 0 else math.inf)
    ratio = e_dut / bound if bound > 0 else (0.0 if e_dut == 0 else math.inf)
    message = ""
    if not passed:
        shown = ", ".join(f"{n} {rel(e):.3g}" for n, e in e_peers.items()) or "none ran"
        message = (f"{what}: relative L2 error {rel(e_dut):.3g} exceeds {factor:g} x the emulated peers' "
                   f"({shown}) + floor {rel(floor):.3g} = {rel(bound):.3g} ({ratio:.3g}x)")
        if n_special:
            message += f"; {n_special} NaN/Inf where the golden and every peer differ"
    return PeerVerdict(passed, rel(e_dut), rel(e_peer), {n: rel(e) for n, e in e_peers.items()}, rel(floor),
                       factor, rel(bound), ratio, n_special, message)


def _map_floats(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    return torch.utils._pytree.tree_map(
        lambda v: fn(v) if isinstance(v, torch.Tensor) and v.is_floating_point() else v, value)


def _flat(value: Any) -> List[Any]:
    return [v for v in torch.utils._pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]


def float32_peer(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
                 out_dtypes: Sequence[Optional[torch.dtype]]) -> Optional[List[Optional[torch.Tensor]]]:
    """The op computed in :func:`peer_dtype` from ``args`` (floating tensors and dtype arguments
    already converted by the caller) with each floating output rounded once to ``out_dtypes[i]``.
    None when the op cannot run in that dtype."""
    try:
        with torch.no_grad():
            outs = _flat(fn(*args, **kwargs))
    except Exception:  # no kernel for that dtype here: no peer
        return None
    return [o.to(dt) if dt is not None and o.is_floating_point() else None
            for o, dt in zip(outs, list(out_dtypes) + [None] * (len(outs) - len(out_dtypes)))]


class _Decompose(TorchDispatchMode):
    """Run each op through its ``torch._decomp`` decomposition; count the ops that had none."""

    def __init__(self) -> None:
        super().__init__()
        from torch._decomp import decomposition_table
        self.table = decomposition_table
        self.missing: List[str] = []
        self.decomposed = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        decomp = self.table.get(func)
        if decomp is not None:
            out = decomp(*args, **kwargs)
            if out is not NotImplemented:
                self.decomposed += 1
                return out
        if not getattr(func, "is_view", False) and any(
                t.is_floating_point() for t in _flat((args, kwargs))):
            self.missing.append(str(func))
        return func(*args, **kwargs)


def decomposition_peer(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
                       out_dtypes: Sequence[Optional[torch.dtype]]) -> Optional[List[Optional[torch.Tensor]]]:
    """``fn`` with every op it dispatches replaced by its ``torch._decomp`` decomposition, run in
    the DUT's dtypes (``args`` as the DUT had them). None when some floating op of the call has
    no decomposition (it would run the kernel under judgement itself) or it fails."""
    mode = _Decompose()
    try:
        with torch.no_grad(), mode:
            outs = _flat(fn(*args, **kwargs))
    except Exception:  # the decomposition does not run for these inputs: no peer
        return None
    if mode.missing or not mode.decomposed:
        return None
    return [o.to(dt) if dt is not None and o.is_floating_point() else None
            for o, dt in zip(outs, list(out_dtypes) + [None] * (len(outs) - len(out_dtypes)))]
