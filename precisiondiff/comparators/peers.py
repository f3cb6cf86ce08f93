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

With ``e(x) = ||x - g||_2`` and ``M(x) = max_i |x_i - g_i| / s_i`` over the elements finite in
both, the kernel passes when both hold (the more lenient peer counts)::

    RMSE rule: e(d) <= factor * max_peers e(p) + floor
               floor = || max(u * |g|, spacing(g) / 2) + accum_factor * K * u_acc * magnitude ||_2
    max rule:  M(d) <= factor * max_peers M(p) + MAX_FLOOR
               s_i = spacing(max(|g_i|, SIGNIFICANCE * rms(g))) + (accum_factor * K * u_acc + u) * magnitude_i

``factor`` is Dynamo ``same()``'s RMSE ratio (3 for 16-bit and 8-bit dtypes, 2 otherwise), ``u``
the unit roundoff of the compute dtype, the floor one correct final rounding of every element
plus float32 accumulation of the op's magnitude (``magnitude`` and ``K`` from
:mod:`~precisiondiff.comparators.accumulation`). The max rule (msprobe's max-error ratio) is what
sees a bf16 accumulator inside a norm that the RMSE ratio alone lets through; its unit ``s_i`` is
one ULP of the element, or of the significance threshold for elements far below the tensor's
size, so small elements are judged by absolute error (torch.testing's ``atol``, msprobe's
small-value rule). A NaN or infinity where the rounded golden has none fails unless a peer gives
the same value there. Per-element ULP figures stay what is *reported*; this rule gives the verdict.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .attention_math import attention_backward
from .bounds import PEER_FACTOR, PEER_FACTOR_LOW
from .error_stats import det_norm
from .peer_measures import (ACCUM_FACTOR, SIGNIFICANCE, _with_magnitude, floor_allowance, measure_in_blocks,
                            measure_whole, peer_dtype)
from .ulp import float_format

__all__ = ["PeerVerdict", "judge_against_peers", "significance_floor", "peer_factor", "peer_dtype", "compute_dtype",
           "float32_peer", "decomposition_peer", "semantics_peer", "element_scale", "reductions_in_dtype", "reference_semantics", "ACCUM_FACTOR", "SIGNIFICANCE", "MAX_FLOOR"]

#: Slack of the max rule in its per-element unit (one ULP): a kernel may differ from a peer that
#: happens to be correctly rounded by one rounding of its own.
MAX_FLOOR = 1.0
#: Outputs with more elements are judged a block of this many elements at a time
#: (:mod:`~precisiondiff.comparators.peer_measures`: the same figures, bit for bit). Measured whole, the
#: rule holds ~16 float64 temporaries of the output's size at once: 8 GiB for a 32000 x 2048 gradient.
JUDGE_BLOCK_ELEMENTS = 1 << 20


def peer_factor(dtype: torch.dtype) -> float:
    """Dynamo ``same()``'s RMSE ratio: 3 for 16-bit and 8-bit dtypes, 2 for float32/float64."""
    return PEER_FACTOR if dtype in (torch.float32, torch.float64) else PEER_FACTOR_LOW


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
    """``|| max(u |g|, spacing(g) / 2) + ACCUM_FACTOR * K * u_acc * magnitude ||_2`` over the finite
    elements of ``golden``: one correct rounding of every element (subnormals included) plus
    float32 accumulation of the op's magnitude."""
    from .ulp import ulp_spacing
    g = golden.detach().to(torch.float64)
    g = torch.where(torch.isfinite(g), g, torch.zeros_like(g))
    # one correct rounding: u |g|, or half the (constant) spacing where g is subnormal or 0
    m_abs = magnitude.detach().to(device=g.device, dtype=torch.float64).abs() if magnitude is not None else None
    return det_norm(floor_allowance(g.abs(), ulp_spacing(g, dtype).to(torch.float64), dtype, m_abs, k))


@dataclass(frozen=True)
class PeerVerdict:
    """The peer rule's judgement of one tensor.

    Attributes:
        passed: both rules hold and no NaN/Inf goes unexplained.
        error: ``||d - g||_2 / ||g||_2`` (relative L2 of the kernel).
        peer_error: the larger relative L2 of the peers (0.0 when none ran).
        peers: each peer's relative L2 (``float32``, ``decomposition``).
        floor: the L2 significance floor, relative to ``||g||_2``.
        factor: the ratio allowed (both rules).
        bound: ``factor * peer_error + floor`` (relative).
        ratio: the worse of the two rules' ``error / bound``.
        max_error, peer_max_error: the largest scaled error of the kernel and of the most lenient
            peer, in units of the per-element scale (``ULP`` of the element or of the significance
            threshold, plus the accumulation allowance).
        special_mismatch: NaN/Inf positions no peer explains.
        message: one line when it fails.
        stats: the error statistics' figures (:func:`~precisiondiff.comparators.error_stats.judge_statistics`:
            bias, RMSE ratio and its significance, tail, flushed subnormals).
        notes: facts reported without a verdict (subnormal outputs flushed to zero).
    """

    passed: bool
    error: float
    peer_error: float
    peers: Dict[str, float]
    floor: float
    factor: float
    bound: float
    ratio: float
    max_error: float
    peer_max_error: float
    special_mismatch: int
    message: str = ""
    stats: Dict[str, Any] = field(default_factory=dict)
    notes: Tuple[str, ...] = ()

    def as_dict(self) -> Dict[str, Any]:
        """JSON-safe fields (infinities as strings)."""
        def safe(v: Any) -> Any:
            return repr(v) if isinstance(v, float) and not math.isfinite(v) else v
        return {"rule": "peer", "passed": self.passed, "error": safe(self.error), "peer_error": safe(self.peer_error),
                "peers": {k: safe(v) for k, v in self.peers.items()}, "floor": safe(self.floor),
                "factor": self.factor, "bound": safe(self.bound), "max_error": safe(self.max_error),
                "peer_max_error": safe(self.peer_max_error), "ratio": safe(self.ratio),
                "special_mismatch": self.special_mismatch, "stats": self.stats, "notes": list(self.notes)}


def element_scale(golden: torch.Tensor, dtype: torch.dtype, *, magnitude: Optional[torch.Tensor] = None,
                  k: Optional[int] = None, partials: bool = True) -> torch.Tensor:
    """Per-element unit of the max rule: ``spacing(max(|g_i|, SIGNIFICANCE * rms(g)))`` in
    ``dtype`` plus ``(ACCUM_FACTOR * K * u_acc + u) * magnitude_i``: one ULP of the element, or of
    the significance threshold for elements far below the tensor's size (judged by absolute
    error), plus what float32 accumulation of the op's magnitude may add and one rounding, in
    the DUT dtype, of a partial result as large as the magnitude (a split or scattered sum:
    an element that cancels is judged against what was summed into it). ``partials=False`` leaves
    that rounding out: float32 accumulation alone (the error statistics' tail of an op that is not
    a scatter-add)."""
    from .error_stats import element_ulp
    g = torch.where(torch.isfinite(golden), golden, torch.zeros_like(golden)).abs()
    return _with_magnitude(element_ulp(g, dtype, SIGNIFICANCE), dtype, magnitude, k, partials)


def judge_against_peers(dut: torch.Tensor, golden: torch.Tensor, peers: Mapping[str, Optional[torch.Tensor]], *,
                        magnitude: Optional[torch.Tensor] = None, k: Optional[int] = None,
                        factor: Optional[float] = None, dtype: Optional[torch.dtype] = None,
                        what: str = "output", partial_sums: bool = True) -> PeerVerdict:
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
        partial_sums: the op may round partial sums to its dtype (a scatter-add:
            :func:`~precisiondiff.comparators.accumulation.rounds_partial_sums`); otherwise the tail
            of the error statistics is measured against float32 accumulation alone, its floor and
            slack in ULP of the element.
    """
    dtype = dut.dtype if dtype is None else dtype
    factor = peer_factor(dtype) if factor is None else factor
    if dut.numel() != golden.numel():
        raise ValueError(f"{what}: shapes differ: {tuple(dut.shape)} vs {tuple(golden.shape)}")
    g = golden.detach().to(torch.float64).flatten()
    mag = magnitude.detach().flatten() if magnitude is not None else None
    # a magnitude of another shape (broadcast) is measured whole: blocks slice it as the output
    if g.numel() > JUDGE_BLOCK_ELEMENTS and (mag is None or mag.numel() == g.numel()):
        ms = measure_in_blocks(dut.detach().flatten(), g, {n: p.detach().flatten() for n, p in peers.items()
                                                           if p is not None and p.numel() == g.numel()},
                               mag, k, dtype, partial_sums, JUDGE_BLOCK_ELEMENTS)
    else:
        ms = measure_whole(dut, g, peers, mag, k, dtype, partial_sums)
    n_special, gnorm, e_dut, m_dut, e_peers, m_peers, floor, stats = ms
    e_peer = max(e_peers.values(), default=0.0)
    m_peer = max(m_peers.values(), default=0.0)
    bound = factor * e_peer + floor
    m_bound = factor * m_peer + MAX_FLOOR
    l2_ok = e_dut <= bound
    max_ok = m_dut <= m_bound
    passed = n_special == 0 and l2_ok and max_ok and stats.passed
    rel = (lambda e: e / gnorm) if gnorm > 0 else (lambda e: 0.0 if e == 0 else math.inf)
    ratio = max(e_dut / bound if bound > 0 else (0.0 if e_dut == 0 else math.inf), m_dut / m_bound)
    message = ""
    if not passed:
        shown = ", ".join(f"{n} {rel(e):.3g}" for n, e in e_peers.items()) or "none ran"
        parts = []
        if not l2_ok:
            parts.append(f"relative L2 error {rel(e_dut):.3g} exceeds {factor:g} x the emulated peers' "
                         f"({shown}) + floor {rel(floor):.3g} = {rel(bound):.3g}")
        if not max_ok:
            shown_m = ", ".join(f"{n} {v:.3g}" for n, v in m_peers.items()) or "none ran"
            parts.append(f"worst element {m_dut:.3g} ULP (of the element or the significance threshold) exceeds "
                         f"{factor:g} x the emulated peers' ({shown_m}) + {MAX_FLOOR:g} = {m_bound:.3g}")
        if n_special:
            parts.append(f"{n_special} NaN/Inf where the golden and every peer differ")
        parts.extend(stats.failures)
        message = f"{what}: " + "; ".join(parts)
    return PeerVerdict(passed, rel(e_dut), rel(e_peer), {n: rel(e) for n, e in e_peers.items()}, rel(floor),
                       factor, rel(bound), ratio, m_dut, m_peer, n_special, message, stats.figures,
                       tuple(stats.notes))


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


def _flash_attention_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p=0.0, is_causal=False,
                                  *, attn_mask=None, scale=None):
    """The flash attention backward as the gradient of the math attention, every step in the
    dtype of its inputs (``torch._decomp`` has no entry for it)."""
    return attention_backward(grad_out, query, key, value, out, attn_mask, is_causal, scale)[:3]


#: Reference semantics for backward ops that ``torch._decomp`` lacks: autograd of the forward's
#: decomposition, run in the DUT dtype.
_BACKWARD_SEMANTICS: Dict[str, Callable[..., Any]] = {
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": _flash_attention_cpu_backward,
}


def reference_semantics(func: Any) -> Optional[Callable[..., Any]]:
    """PyTorch's own reference implementation of an op: its ``torch._decomp`` decomposition, or
    for a backward op without one, autograd of its forward's decomposition. None if neither."""
    from torch._decomp import decomposition_table
    found = decomposition_table.get(func)
    return found if found is not None else _BACKWARD_SEMANTICS.get(str(func))


class _Decompose(TorchDispatchMode):
    """Run each op through its ``torch._decomp`` decomposition; count the ops that had none."""

    def __init__(self) -> None:
        super().__init__()
        self.missing: List[str] = []
        self.decomposed = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        decomp = reference_semantics(func)
        if decomp is not None:
            out = decomp(*args, **kwargs)
            if out is not NotImplemented:
                self.decomposed += 1
                return out
        if not getattr(func, "is_view", False) and any(
                t.is_floating_point() for t in _flat((args, kwargs))):
            self.missing.append(str(func))
        return func(*args, **kwargs)


@contextlib.contextmanager
def reductions_in_dtype() -> Iterator[None]:
    """PyTorch's math attention in the dtype it is given: by default it upcasts bf16/fp16 to
    float32 (``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp``, which the CPU math path
    reads too); a reference semantics *in the DUT dtype* must not."""
    flag = getattr(torch.backends.cuda, "allow_fp16_bf16_reduction_math_sdp", None)
    getter = getattr(torch._C, "_get_math_sdp_allow_fp16_bf16_reduction", None)
    if flag is None or getter is None:
        yield
        return
    before = getter()
    flag(True)
    try:
        yield
    finally:
        flag(before)


def semantics_peer(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
                   out_dtypes: Sequence[Optional[torch.dtype]]) -> Optional[List[Optional[torch.Tensor]]]:
    """``fn``, an op's reference semantics written with PyTorch ops (a fused attention's math attention),
    run as it is in the DUT's dtypes (``args`` as the DUT had them): the op's decomposition peer when
    ``torch._decomp`` has no entry for it. None when it fails."""
    try:
        with torch.no_grad(), reductions_in_dtype():
            outs = _flat(fn(*args, **kwargs))
    except Exception:  # noqa: BLE001 - the semantics do not run for these inputs: no peer
        return None
    return [o.to(dt) if dt is not None and o.is_floating_point() else None
            for o, dt in zip(outs, list(out_dtypes) + [None] * (len(outs) - len(out_dtypes)))]


def decomposition_peer(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
                       out_dtypes: Sequence[Optional[torch.dtype]]) -> Optional[List[Optional[torch.Tensor]]]:
    """``fn`` with every op it dispatches replaced by its ``torch._decomp`` decomposition, run in
    the DUT's dtypes (``args`` as the DUT had them). None when some floating op of the call has
    no decomposition (it would run the kernel under judgement itself) or it fails."""
    mode = _Decompose()
    try:
        with torch.no_grad(), reductions_in_dtype(), mode:
            outs = _flat(fn(*args, **kwargs))
    except Exception:  # the decomposition does not run for these inputs: no peer
        return None
    if mode.missing or not mode.decomposed:
        return None
    return [o.to(dt) if dt is not None and o.is_floating_point() else None
            for o, dt in zip(outs, list(out_dtypes) + [None] * (len(outs) - len(out_dtypes)))]
