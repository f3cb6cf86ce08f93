"""Streamed tensor metrics: measure only, never judge (budgets judge: see tolerance.py).

Both tensors are read in cache-sized tiles (at most ``chunk_elems`` elements), converted to
float64 on the compute device into preallocated rows, and reduced to counts, maxima,
per-block sums and an exact ULP-distance histogram, all kept on the device and read back
once. Memory stays bounded by the tile size. Sums are independent of the tiling: each fixed
4096-element block (aligned to the flat index) is summed by a fixed pairwise tree of float64
additions, and the block sums are added with :func:`math.fsum` (exactly rounded), so a
chunked comparison returns bit-identical numbers to an unchunked one.

Fast paths give the same numbers with less work: bitwise-identical tensors, same dtypes (no
rounding), and tiles where everything is finite (no NaN/Inf masks).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, Optional, Union

import torch

from .tiles import (
    REL_ERR_RATIO_LEVELS,
    ROWS,
    TILE,
    P99Histogram,
    finite_tile,
    general_tile,
    tile_distances,
    tree_sums,
)
from .tiles import P99Histogram as _P99Histogram  # noqa: F401  (tests patch it here)
from .tiles import _SIGNED_VIEW, _isfinite
from . import tiles_kernel
from .ulp import ComparatorError, float_format, round_to_dtype

__all__ = [
    "TensorMetrics",
    "compare_tensors",
    "DEFAULT_CHUNK_ELEMS",
    "DIFF3_THRESHOLDS",
    "REL_ERR_RATIO_LEVELS",
]

DEFAULT_CHUNK_ELEMS = 1 << 20
_BLOCK = 4096

#: mlu-ops diff3 switch point: below it the error is absolute, above it relative. mlu-ops uses
#: 1e-6 for float32 and 1e-4 for float16; bfloat16 takes float16's value (same relative
#: resolution order), float64 float32's, float8 1e-2 (our extension).
DIFF3_THRESHOLDS = {
    "float64": 1e-6,
    "float32": 1e-6,
    "float16": 1e-4,
    "bfloat16": 1e-4,
    "float8": 1e-2,
}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class TensorMetrics:
    """What :func:`compare_tensors` measured. Errors are ``actual - expected`` in float64.

    Element sets: *finite* elements are those where ``actual`` and ``expected`` are both
    finite; abs/rel/cosine/SQNR/diff* are over them. ULP statistics are over elements whose
    ULP distance is defined (not NaN). ``r`` below is ``expected`` rounded to ``actual``'s dtype.

    Attributes:
        numel: Element count.
        dtype_actual: dtype name of ``actual`` (also the format ULPs are counted in).
        dtype_expected: dtype name of ``expected``.
        n_finite: Elements where both sides are finite.
        max_abs_err: ``max |a - e|``.
        mean_abs_err: ``sum |a - e| / n_finite``.
        max_rel_err: ``max |a - e| / max(|e|, tiny)`` with ``tiny`` the smallest normal of
            ``actual``'s dtype (``rel_floor``).
        mean_rel_err: Mean of the same.
        rel_floor: The tiny-denominator guard used.
        cosine_similarity: ``sum(a e) / (sqrt(sum a^2) sqrt(sum e^2))``; 1 if both are all
            zero, 0 if exactly one is.
        sqnr_db: ``10 log10(sum e^2 / sum (a - e)^2)``; inf when equal.
        max_ulp: Largest :func:`ulp_distance` (integer ULPs of ``actual``'s dtype to ``r``).
        mean_ulp: Mean ULP distance.
        p99_ulp: Nearest-rank 99th percentile of the ULP distance, exact (see
            :class:`_P99Histogram`).
        max_ulp_error: Largest :func:`ulp_error` against the unrounded ``expected`` (0.5 =
            correctly rounded); what budgets judge.
        mean_ulp_error: Mean ulp_error over finite elements.
        nan_mismatch: Elements where exactly one of ``actual``, ``r`` is NaN.
        inf_mismatch: Non-NaN elements where ``actual`` or ``r`` is infinite and they differ.
        atol, rtol: Tolerance given to compare_tensors, or None.
        frac_outside_tolerance: Fraction with ``|a - e| > atol + rtol |e|`` or a NaN/Inf
            mismatch; None without a tolerance.
        diff1: mlu-ops ``sum |a - e| / sum |e|``.
        diff2: mlu-ops ``sqrt(sum (a - e)^2 / sum e^2)``.
        diff3: mlu-ops ``max(|e| < th ? |a - e| : |a - e| / |e|)``, ``th`` in
            ``DIFF3_THRESHOLDS``.
        diff4: Among finite elements with ``a != e``, the fraction with ``a < e``: 0 or 1 means
            every error has one sign (bias); NaN when no element differs.
        diff4_count: Number of differing elements diff4 is over (mlu-ops needs >= 100).
        frac_rel_err_gt_1e3: Fraction of elements with rel err > 1e-3 (or a NaN/Inf
            mismatch). msprobe's "One Thousandth Err Ratio" is ``1 -`` this.
        frac_rel_err_gt_5e3: Same with 5e-3.
    """

    numel: int
    dtype_actual: str
    dtype_expected: str
    n_finite: int
    max_abs_err: float
    mean_abs_err: float
    max_rel_err: float
    mean_rel_err: float
    rel_floor: float
    cosine_similarity: float
    sqnr_db: float
    max_ulp: float
    mean_ulp: float
    p99_ulp: float
    max_ulp_error: float
    mean_ulp_error: float
    nan_mismatch: int
    inf_mismatch: int
    atol: Optional[float]
    rtol: Optional[float]
    frac_outside_tolerance: Optional[float]
    diff1: float
    diff2: float
    diff3: float
    diff4: float
    diff4_count: int
    frac_rel_err_gt_1e3: float
    frac_rel_err_gt_5e3: float

    def to_dict(self) -> Dict[str, Any]:
        """Plain JSON-safe dict: NaN becomes None, +-inf the strings ``"inf"``/``"-inf"``.

        Example:
            >>> compare_tensors(torch.ones(2), torch.ones(2)).to_dict()["sqnr_db"]
            'inf'
        """
        out: Dict[str, Any] = {}
        for k, v in asdict(self).items():
            if isinstance(v, float):
                if math.isnan(v):
                    v = None
                elif math.isinf(v):
                    v = "inf" if v > 0 else "-inf"
            out[k] = v
        return out

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "TensorMetrics":
        """Inverse of :meth:`to_dict` (None back to NaN except for optional fields).

        Raises:
            ComparatorError: A field is missing or unknown.
        """
        names = {f.name for f in fields(cls)}
        if set(data) != names:
            raise ComparatorError(
                f"metrics dict fields differ: missing {sorted(names - set(data))}, "
                f"unknown {sorted(set(data) - names)}"
            )
        optional = {"atol", "rtol", "frac_outside_tolerance"}
        kw: Dict[str, Any] = {}
        for f in fields(cls):
            v = data[f.name]
            if f.type in ("int", "str"):
                kw[f.name] = v
            elif v is None:
                kw[f.name] = None if f.name in optional else math.nan
            else:
                kw[f.name] = float(v)
        return cls(**kw)


def _ratio(num: float, den: float) -> float:
    if den == 0:
        return 0.0 if num == 0 else math.inf
    return num / den


def compare_tensors(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    atol: Optional[float] = None,
    rtol: Optional[float] = None,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    device: Optional[Union[str, torch.device]] = None,
) -> TensorMetrics:
    """Measure how far ``actual`` is from ``expected``, streamed in bounded memory.

    Formulas (``a`` actual, ``e`` expected, both float64, sums over finite elements):
    ``abs = |a - e|``; ``rel = abs / max(|e|, tiny(dtype_actual))`` (below the smallest
    normal the spacing is constant, so this floor keeps a correctly rounded value's rel err
    at most ``u`` everywhere); cosine ``sum(a e) / (|a| |e|)``; SQNR dB
    ``10 log10(sum e^2 / sum (a - e)^2)``; ULP distance and ULP error as in
    :mod:`precisiondiff.comparators.ulp`; mlu-ops diff1..diff4 and msprobe ratios as
    documented on :class:`TensorMetrics`.

    Args:
        actual: Tensor under test; its dtype is the format ULPs are counted in.
        expected: Reference, any real dtype, same shape.
        atol: Absolute tolerance for ``frac_outside_tolerance`` (default 0 if only rtol).
        rtol: Relative tolerance for ``frac_outside_tolerance`` (default 0 if only atol).
        chunk_elems: Elements per chunk (rounded up to a multiple of 4096). Results do not
            depend on it.
        device: Device to compute on; defaults to ``actual.device``.

    Returns:
        A frozen :class:`TensorMetrics`.

    Raises:
        ComparatorError: Shapes differ or an option is invalid.
        UnsupportedDtypeError: ``actual.dtype`` has no ULP definition.

    Example:
        >>> m = compare_tensors(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))
        >>> m.max_abs_err, m.numel
        (0.5, 2)
    """
    if not isinstance(actual, torch.Tensor) or not isinstance(expected, torch.Tensor):
        raise ComparatorError("compare_tensors takes two tensors")
    if actual.shape != expected.shape:
        raise ComparatorError(
            f"shapes differ: actual {tuple(actual.shape)} vs expected {tuple(expected.shape)}"
        )
    if expected.is_complex():
        raise ComparatorError("expected is complex; compare real and imaginary parts")
    fmt = float_format(actual.dtype)
    if isinstance(chunk_elems, bool) or not isinstance(chunk_elems, int) or chunk_elems < 1:
        raise ComparatorError(f"chunk_elems must be a positive int, got {chunk_elems!r}")
    for name, tol in (("atol", atol), ("rtol", rtol)):
        if tol is not None and not (tol >= 0 and math.isfinite(tol)):
            raise ComparatorError(f"{name} must be finite and >= 0, got {tol!r}")
    has_tol = atol is not None or rtol is not None
    tol_a, tol_r = float(atol or 0.0), float(rtol or 0.0)
    chunk = -(-chunk_elems // _BLOCK) * _BLOCK
    dev = torch.device(device) if device is not None else actual.device
    tiny = fmt.smallest_normal
    key = "float8" if fmt.bits == 8 else _dtype_name(actual.dtype)
    th3 = DIFF3_THRESHOLDS[key]
    lvl1, lvl5 = REL_ERR_RATIO_LEVELS

    a_flat, e_flat = actual.reshape(-1), expected.reshape(-1)
    n = a_flat.numel()
    dt = actual.dtype
    identical = expected.dtype == dt and a_flat.device == e_flat.device and n > 0 and torch.equal(
        a_flat.view(_SIGNED_VIEW[fmt.bits]), e_flat.view(_SIGNED_VIEW[fmt.bits]))
    # Tiles: the unit of work. Results do not depend on the tiling (nor on chunk_elems), so
    # tiles are kept cache-sized; chunk_elems only bounds them from above.
    tile = min(chunk, TILE)
    if n < _BLOCK:
        length = 1 << max(n - 1, 0).bit_length()  # one partial block: pad to a power of two
    else:
        length = min(tile, -(-n // _BLOCK) * _BLOCK)
    n_blocks = -(-n // _BLOCK) if n >= _BLOCK else 1
    f64 = torch.float64
    w = torch.empty(ROWS, length, dtype=f64, device=dev)
    tmp = torch.empty(ROWS, max(length // 2, 1), dtype=f64, device=dev)
    buf = torch.empty(3, length, dtype=f64, device=dev)
    block_sums = torch.zeros(ROWS, n_blocks, dtype=f64, device=dev)
    # counts: fin, ulp_ok, nan_mm, inf_mm, outside, rel>1e-3, rel>5e-3, d!=0, d<0
    counts = torch.zeros(9, dtype=torch.int64, device=dev)
    host_counts = [0] * 9
    maxes = torch.zeros(5, dtype=f64, device=dev)
    hist = P99Histogram(dev, cap=chunk)
    sp_scale, sp_floor = 2.0 ** -fmt.mant_bits, 2.0 ** (fmt.emin - fmt.mant_bits)

    def torch_tile(i: int) -> None:
        c = min(tile, n - i)
        lc = length if n < _BLOCK else -(-c // _BLOCK) * _BLOCK
        if lc > c:
            w[:, c:lc].zero_()
        ac = a_flat[i : i + c].to(dev)
        ec = e_flat[i : i + c].to(dev)
        e = ec if ec.dtype == f64 else buf[1, :c].copy_(ec)
        if identical:
            # Bitwise equal: every error is 0; only n_finite and sum(e^2) need the data.
            fin = _isfinite(ec)
            e2 = w[3, :c]
            if bool(fin.all()):
                host_counts[0] += c
                torch.mul(e, e, out=e2)
            else:
                counts[0] += fin.sum()
                torch.mul(e, e, out=e2).masked_fill_(~fin, 0.0)
            w[[0, 1, 2, 6, 7, 8], :c] = 0.0
            w[4:6, :c] = e2
            host_counts[1] += c
            hist.add_zeros(c)
        else:
            a = ac if ac.dtype == f64 else buf[0, :c].copy_(ac)
            r = ec if ec.dtype == dt else round_to_dtype(ec, dt)
            if finite_tile(w, ac, a, e, r, c, fmt, tiny, sp_scale, sp_floor, th3,
                           has_tol, tol_a, tol_r, counts, maxes, hist, buf[2, :c]):
                host_counts[0] += c
                host_counts[1] += c
            else:
                general_tile(w, ac, a, e, r, c, fmt, tiny, sp_scale, sp_floor, th3,
                             has_tol, tol_a, tol_r, counts, maxes, hist)
        blk = i // _BLOCK
        block_sums[:, blk : blk + lc // min(lc, _BLOCK)] = tree_sums(w, tmp, lc)

    starts = range(0, n, tile)
    if not identical and tiles_kernel.usable(a_flat, e_flat, dev):
        # the fused kernel takes the tiles it can (bit-identical); the rest come back here
        params = (tiny, sp_scale, sp_floor, th3, has_tol, tol_a, tol_r, fmt.max_finite, lvl1, lvl5)
        starts = [t * tile for t in tiles_kernel.run(a_flat, e_flat, n, tile, params,
                                                     block_sums, counts, maxes, hist)]
    for i in starts:
        torch_tile(i)

    # One read-back at the end.
    if n:
        sums = [math.fsum(row) for row in block_sums.tolist()]
        if n < _BLOCK:
            sums = [s + 0.0 for s in sums]  # the 4096-tree adds +0 above a short block
    else:
        sums = [0.0] * ROWS
    s_abs, s_e1, s_d2, s_e2, s_a2, s_ae, s_rel, s_ulp, s_ulperr = sums
    dev_counts = counts.tolist()
    (n_fin, n_ulp, n_nan, n_inf, n_out, n_r1, n_r5, n_diff, n_below) = [
        h + d for h, d in zip(host_counts, dev_counts)]
    mx_abs, mx_rel, mx_ulp, mx_ulperr, mx_d3 = maxes.tolist()
    nan = math.nan
    if n_fin == 0:
        mx_abs = mx_rel = mx_ulperr = mx_d3 = nan
    if n_ulp == 0:
        mx_ulp = nan
        p99 = nan
    else:
        p99 = hist.quantile(math.ceil(0.99 * n_ulp), lambda: tile_distances(
            a_flat, e_flat, dt, dev, tile))
    if n_fin == 0:
        cos = sqnr = nan
    else:
        na, ne = math.sqrt(s_a2), math.sqrt(s_e2)
        if na == 0 or ne == 0:
            cos = 1.0 if na == ne else 0.0
        else:
            cos = s_ae / na / ne
        if s_d2 == 0:
            sqnr = math.inf
        elif s_e2 == 0:
            sqnr = -math.inf
        else:
            sqnr = 10 * math.log10(s_e2 / s_d2)
    mean = (lambda s, c: s / c if c else nan)
    return TensorMetrics(
        numel=n,
        dtype_actual=_dtype_name(actual.dtype),
        dtype_expected=_dtype_name(expected.dtype),
        n_finite=n_fin,
        max_abs_err=mx_abs,
        mean_abs_err=mean(s_abs, n_fin),
        max_rel_err=mx_rel,
        mean_rel_err=mean(s_rel, n_fin),
        rel_floor=tiny,
        cosine_similarity=cos,
        sqnr_db=sqnr,
        max_ulp=mx_ulp,
        mean_ulp=mean(s_ulp, n_ulp),
        p99_ulp=p99,
        max_ulp_error=mx_ulperr,
        mean_ulp_error=mean(s_ulperr, n_fin),
        nan_mismatch=n_nan,
        inf_mismatch=n_inf,
        atol=float(atol) if atol is not None else None,
        rtol=float(rtol) if rtol is not None else None,
        frac_outside_tolerance=(mean(n_out, n) if has_tol else None),
        diff1=_ratio(s_abs, s_e1) if n_fin else nan,
        diff2=math.sqrt(_ratio(s_d2, s_e2)) if n_fin else nan,
        diff3=mx_d3,
        diff4=mean(n_below, n_diff),
        diff4_count=n_diff,
        frac_rel_err_gt_1e3=mean(n_r1, n),
        frac_rel_err_gt_5e3=mean(n_r5, n),
    )
