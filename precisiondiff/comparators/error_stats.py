"""The statistics of a kernel's signed errors: bias, RMSE significance, tail, flushed subnormals.

The peer rule (:mod:`~precisiondiff.comparators.peers`) bounds the size of a kernel's error by its
peers'; these tests use the rest of the evidence, the *distribution* of the errors over the N
elements of the output (docs/comparators.md, "Error statistics"). Every error is measured in the
ULP of its element, ``z_i = (x_i - g_i) / sigma_i`` with
``sigma_i = spacing_T(max(|g_i|, SIGNIFICANCE * rms(g)))`` (the max rule's unit without the
accumulation allowance). A result rounded to nearest has ``z_i`` spread like a uniform on
``[-1/2, 1/2]``: mean 0, standard deviation ``1/sqrt(12)``. Over ``N_eff`` independent elements
(distinct golden values) a mean then has standard error ``sd / sqrt(N_eff)``, so:

* **bias**: ``b = mean z_i`` and ``b_dir = mean sign(g_i) z_i`` (over elements whose golden is not
  representable); a kernel fails when ``|b(d)| - max_p |b(p)| > max(BIAS_Z * SE, BIAS_MIN)``, either
  direction: round toward zero shifts ``b_dir`` by -1/2, a one-sided approximation ``b``;
* **RMSE**: ``rho = rms z(d) / max(rms z(p*), 1/sqrt(12))`` against the most lenient peer ``p*`` (and at
  least one correct rounding of every element); a kernel fails when
  ``rho > RMSE_RATIO_MIN`` and the paired excess ``D_i = z_i(d)^2 - z_i(p*)^2`` has
  ``mean D > RMSE_Z * sd(D) / sqrt(N_eff)``: the same ratio is noise on a few elements and many
  standard errors on thousands;
* **tail**: the elements beyond the peers' worst, ``|d_i - g_i| > max(W s_i, sigma_i / 2) + TAIL_SLACK sigma_i``
  with ``W = max_p max_j |p_j - g_j| / s_j`` the peers' worst in the max rule's unit ``s_i`` (``sigma_i``
  plus the op's accumulation allowance), the floor (one correct rounding) and the slack in the element's
  own ULP; if the kernel's errors were distributed like a peer's, each element would exceed
  the peer's maximum of N with probability at most ``1/(N+1)`` (exchangeability), so their count is
  at most Poisson(1); ``TAIL_COUNT`` of them (and ``TAIL_SHARE`` of the elements) is a sparse defect;
* **flushed**: elements whose rounded golden is subnormal and the kernel returns zero (flush to
  zero, a property of a device): counted and named in the notes, left out of the three tests; the
  size rules still see them, which matters only where they are above the significance floor.

The correctly rounded golden is the element-wise least error any result in ``T`` can have, so with
no peers computed yet these tests run against it (bias 0, worst 1/2) as a screen: a kernel that
passes them then passes them against any peer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

__all__ = ["DetSum", "ErrorStats", "StatsVerdict", "decide", "element_ulp", "error_stats", "judge_statistics",
           "tail_limit", "BIAS_Z", "BIAS_MIN", "RMSE_Z", "RMSE_RATIO_MIN", "CLIP", "TAIL_SLACK", "TAIL_COUNT",
           "TAIL_SHARE", "MIN_ELEMENTS", "ROUNDING_SD"]

#: Standard errors a bias must exceed (a one-sided Gaussian tail of 1e-9 per test).
BIAS_Z = 6.0
#: Least bias that counts, in ULP: below it a shift is too small to matter whatever N.
BIAS_MIN = 0.05
#: Standard errors the paired RMSE excess must exceed.
RMSE_Z = 6.0
#: Least RMSE ratio against the most lenient peer that counts (a correctly rounded peer has 1).
RMSE_RATIO_MIN = 2.0
#: ULP beyond the peers' worst (at least 1/2) an element must be to be in the tail.
TAIL_SLACK = 0.5
#: Elements in the tail that make a sparse defect (Poisson(1) reaches 6 with probability 6e-4).
TAIL_COUNT = 6
#: ... and the least share of the elements they must be.
TAIL_SHARE = 1e-3
#: Fewer elements than this carry no statistics: only the size rules judge them.
MIN_ELEMENTS = 8
#: Errors are winsorised at this many ULP for the bias and the RMSE's significance: an element that
#: cancels can be many ULP of itself off in a correct sum, and one such element would otherwise
#: swamp the standard error of all the others (the RMSE ratio itself is not clipped).
CLIP = 4.0
#: Standard deviation of a rounding error uniform on [-1/2, 1/2] ULP.
ROUNDING_SD = 1.0 / math.sqrt(12.0)


_BLOCK = 4096


def det_sum(x: torch.Tensor) -> float:
    """The sum of a float64 tensor, the same whatever the number of threads: ``torch.sum`` splits
    a long reduction among the threads, so its last bits depend on how many there are (a bisect's
    figures with ``--workers N``, whose processes have fewer threads each, differed at 1e-14 from one
    worker's). Fixed 4096-element blocks, each summed whole by one thread (a reduction over rows is
    shared out by rows; one block is below torch's grain size), the block sums added with
    :func:`math.fsum` (exactly rounded)."""
    acc = DetSum()
    acc.add(x)
    return acc.value()


class DetSum:
    """:func:`det_sum` of a tensor fed in pieces, in order: the same value as ``det_sum`` of their
    concatenation (the 4096-element blocks straddling two pieces are carried over), so an output
    judged a block of rows at a time has the figures of the whole."""

    def __init__(self) -> None:
        self._parts: List[float] = []
        self._carry: Optional[torch.Tensor] = None
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        """Append the elements of ``x`` (flattened)."""
        x = x.detach().reshape(-1)
        self.count += x.numel()
        if self._carry is not None:
            x = torch.cat([self._carry, x])
        n = x.numel()
        full = n - n % _BLOCK
        if full:
            self._parts.extend(x[:full].view(-1, _BLOCK).sum(dim=1).tolist())
        self._carry = x[full:].clone() if full < n else None

    def value(self) -> float:
        """The exactly rounded sum of the block sums."""
        tail = [float(self._carry.sum())] if self._carry is not None else []
        return math.fsum(self._parts + tail)

    def mean(self) -> float:
        """The sum / the number of elements (0 when none), :func:`det_mean`'s."""
        return self.value() / self.count if self.count else 0.0


def det_mean(x: torch.Tensor) -> float:
    """:func:`det_sum` / N (0 for an empty tensor)."""
    return det_sum(x) / x.numel() if x.numel() else 0.0


def det_std(x: torch.Tensor) -> float:
    """The unbiased standard deviation (``torch.std``'s), from :func:`det_sum`."""
    n = x.numel()
    if n < 2:
        return math.nan
    mean = det_sum(x) / n
    return math.sqrt(det_sum((x - mean) ** 2) / (n - 1))


def det_norm(x: torch.Tensor) -> float:
    """The L2 norm from :func:`det_sum` (``sqrt(sum x^2)``; infinite when that overflows)."""
    return math.sqrt(det_sum(x * x))


def element_ulp(golden: torch.Tensor, dtype: torch.dtype, significance: float) -> torch.Tensor:
    """``spacing_T(max(|g_i|, significance * rms(g)))`` in float64: the ULP of each element, or of
    the significance threshold for elements far below the tensor's size (``golden`` finite)."""
    from .ulp import ulp_spacing
    g = golden.abs()
    rms = math.sqrt(det_mean(g * g)) if g.numel() else 0.0
    return ulp_spacing(torch.clamp(g, min=significance * rms), dtype).to(torch.float64)


@dataclass(frozen=True)
class ErrorStats:
    """One result's signed-error figures, in ULP of the element (module docstring).

    Attributes:
        bias, bias_dir: ``mean z_i`` and ``mean sign(g_i) z_i`` over the non-representable goldens.
        rmse: ``sqrt(mean z_i^2)``.
    """

    bias: float
    bias_dir: float
    rmse: float


def _mean(x: torch.Tensor) -> float:
    return det_mean(x)


def error_stats(z: torch.Tensor, sign: torch.Tensor, informative: torch.Tensor) -> ErrorStats:
    """The figures of the scaled errors ``z`` (one per used element), with ``sign(g)`` and the
    mask of elements whose golden is not representable (the bias is measured over those)."""
    zi = z[informative].clamp(-CLIP, CLIP)
    return ErrorStats(_mean(zi), _mean(zi * sign[informative]), math.sqrt(_mean(z * z)))


@dataclass(frozen=True)
class StatsVerdict:
    """The three statistical tests of a result and its flushing note.

    Attributes:
        passed: no test fails.
        figures: JSON-safe numbers (``n``, ``n_eff``, ``bias``, ``bias_dir``, ``bias_se``,
            ``peer_bias``, ``rmse_ulp``, ``peer_rmse_ulp``, ``rmse_ratio``, ``rmse_z``,
            ``tail``, ``tail_threshold``, ``flushed``).
        failures: one phrase per failing test.
        notes: facts worth reporting that are not a verdict (flushed subnormals).
    """

    passed: bool
    figures: Dict[str, Any] = field(default_factory=dict)
    failures: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)


def _distinct(g: torch.Tensor) -> int:
    return int(torch.unique(g).numel()) if g.numel() else 0


def judge_statistics(dut: torch.Tensor, golden: torch.Tensor, rounded: torch.Tensor,
                     peers: Mapping[str, torch.Tensor], dtype: torch.dtype, *, significance: float,
                     scale: Optional[torch.Tensor] = None, ulp_floor: bool = True,
                     _shared: Optional[Dict[str, Any]] = None) -> StatsVerdict:
    """Run the bias, RMSE and tail tests of ``dut`` against ``golden`` (module docstring).

    Args:
        dut, golden, rounded: flat float64 tensors: the kernel's output, the golden, and the golden
            rounded to the DUT dtype.
        peers: flat float64 peer outputs; none (not computed, or none could run): the tests run
            against the correctly rounded golden, which bounds every peer's figures from below.
        dtype: the dtype whose ULP measures the errors.
        significance: the significance threshold as a fraction of ``rms(g)``.
        scale: the per-element unit (the ULP plus the op's accumulation allowance) in which the
            peers' worst is measured for the tail; default the ULP of the element.
        ulp_floor: the tail's floor (1/2) and slack in ULP of the element; False: in ``scale``
            (a scatter-add, whose partial sums may round: one such rounding is allowed).
        _shared: what the peer rule already computed from the same tensors (``finite``, ``finite_p``,
            ``unit`` = :func:`element_ulp` of the finite golden, ``diff`` = dut - golden, ``adiff``):
            reused instead of recomputed (the same values).
    """
    from .ulp import float_format
    sh = _shared or {}
    screen = not peers
    finite = sh["finite"] if "finite" in sh else torch.isfinite(dut) & torch.isfinite(golden)
    tiny = float_format(dtype).smallest_normal
    flushed = finite & (dut == 0) & (rounded != 0) & (rounded.abs() < tiny)
    n_flushed = int(flushed.sum())
    notes = [f"{n_flushed} subnormal outputs flushed to zero"] if n_flushed else []
    use = finite & ~flushed
    finite_p = sh.get("finite_p") or {}
    for name, p in peers.items():
        use &= finite_p[name] if name in finite_p else torch.isfinite(p)
    n = int(use.sum())
    figures: Dict[str, Any] = {"n": n, "flushed": n_flushed}
    if n < MIN_ELEMENTS:
        return StatsVerdict(True, figures, [], notes)
    # every element used (the common case): the masked copies would be the tensors themselves
    every = n == use.numel()
    pick = (lambda t: t) if every else (lambda t: t[use])  # noqa: E731
    g = pick(golden)
    # the golden over the used elements is then the finite golden the peer rule measured
    unit = sh["unit"] if every and "unit" in sh else element_ulp(g, dtype, significance)
    sign = torch.sign(g)
    informative = pick(rounded) != g
    all_informative = bool(informative.all())
    inf_pick = (lambda t: t) if all_informative else (lambda t: t[informative])  # noqa: E731
    sign_i = inf_pick(sign)
    d_diff = sh["diff"] if every and "diff" in sh else pick(dut) - g
    z_d = d_diff / unit
    zi_d = inf_pick(z_d).clamp(-CLIP, CLIP)
    s_d = _stats(z_d, zi_d, sign_i)
    # against the correctly rounded golden when no peer ran: the least any peer can err
    z_ps = {name: (pick(p) - g) / unit for name, p in peers.items()} or {"rounded": (pick(rounded) - g) / unit}
    s_ps = {name: _stats(z, inf_pick(z).clamp(-CLIP, CLIP), sign_i) for name, z in z_ps.items()}
    lenient = max(s_ps, key=lambda name: s_ps[name].rmse)
    n_inf = int(informative.sum())

    def paired_excess() -> Tuple[float, float]:
        diff = z_d.clamp(-CLIP, CLIP) ** 2 - z_ps[lenient].clamp(-CLIP, CLIP) ** 2
        return det_mean(diff), det_std(diff)

    # tail beyond the peers' worst, in the max rule's unit: a sum may round partial results as
    # large as its magnitude (a scatter-add), which the ULP of a cancelled element does not show.
    # The floor (one correct rounding) and the slack are in the element's own ULP: in the max
    # rule's unit, 1/2 of a long sum's allowance is many ULP, far beyond the peers' actual worst,
    # and a sparse defect of a few ULP hid under it (the exchangeability bound is the peers' worst)
    t_unit = unit if scale is None else pick(scale)
    err = sh["adiff"] if every and "adiff" in sh else d_diff.abs()
    worst = max(float(((pick(p) - g).abs() / t_unit).max()) for p in peers.values()) if peers else 0.0
    floor_unit = unit if ulp_floor else t_unit
    tail = int((err > tail_limit(worst, t_unit, floor_unit)).sum())
    failures = decide(figures, n=n, n_inf=n_inf, s_d=s_d, s_ps=s_ps, lenient=lenient,
                      sd_informative=det_std(zi_d) if n_inf > 1 else 0.0, paired_excess=paired_excess,
                      tail=tail, worst=worst, distinct=lambda: _distinct(g), screen=screen)
    return StatsVerdict(not failures, figures, failures, notes)


def tail_limit(worst: float, t_unit: torch.Tensor, floor_unit: torch.Tensor) -> torch.Tensor:
    """The error beyond which an element is in the tail: ``max(worst * s_i, sigma_i / 2) + TAIL_SLACK * sigma_i``."""
    return torch.maximum(worst * t_unit, 0.5 * floor_unit) + TAIL_SLACK * floor_unit


def decide(figures: Dict[str, Any], *, n: int, n_inf: int, s_d: ErrorStats, s_ps: Mapping[str, ErrorStats],
           lenient: str, sd_informative: float, paired_excess: Callable[[], Tuple[float, float]], tail: int,
           worst: float, distinct: Callable[[], int], screen: bool) -> List[str]:
    """The three tests from the figures of a result (:func:`judge_statistics`'s, measured whole or a
    block at a time); records them in ``figures`` and returns one phrase per failing test.
    ``paired_excess`` gives the mean and standard deviation of the paired squared-error excess
    over the most lenient peer, ``distinct`` the number of distinct golden values: both are asked
    for only when a test is near failing."""
    failures: List[str] = []
    n_eff: Optional[int] = None

    def effective() -> int:
        nonlocal n_eff
        if n_eff is None:
            n_eff = max(distinct(), 1)
            figures["n_eff"] = n_eff
        return n_eff

    # bias, both directions; the sd is floored at a uniform rounding's (a result with many exact
    # elements has a smaller one, which would overstate the evidence)
    sd = max(sd_informative, ROUNDING_SD)
    figures.update(bias=s_d.bias, bias_dir=s_d.bias_dir,
                   peer_bias={k: [s.bias, s.bias_dir] for k, s in s_ps.items()} if not screen else {})
    for label, b, b_peer in (("raw", s_d.bias, max(abs(s.bias) for s in s_ps.values())),
                             ("directed", s_d.bias_dir, max(abs(s.bias_dir) for s in s_ps.values()))):
        excess = abs(b) - (0.0 if screen else b_peer)
        if n_inf >= MIN_ELEMENTS and excess > BIAS_MIN:
            se = sd / math.sqrt(min(effective(), n_inf))
            figures["bias_se"] = se
            if excess > BIAS_Z * se:
                what = "away from zero" if label == "directed" and b > 0 else (
                    "toward zero" if label == "directed" else ("upward" if b > 0 else "downward"))
                failures.append(f"mean error {b:+.3g} ULP ({what}) is {excess / se:.3g} standard errors "
                                f"beyond the peers' {b_peer if not screen else 0.0:.3g} (N_eff {effective()})")
                break
    # RMSE against the most lenient peer, paired
    # against at least one correct rounding of every element (the size rule's floor): a float32
    # output of bf16 inputs is measured in bf16 ULP, where its peer's error is far below one
    p_rmse = max(s_ps[lenient].rmse, ROUNDING_SD)
    ratio = s_d.rmse / p_rmse
    figures.update(rmse_ulp=s_d.rmse, peer_rmse_ulp=p_rmse, rmse_ratio=_safe(ratio))
    if ratio > RMSE_RATIO_MIN:
        mean, std = paired_excess()
        se = max(std, 1e-300) / math.sqrt(effective())
        zscore = mean / se
        figures["rmse_z"] = zscore
        if zscore > RMSE_Z:
            failures.append(f"RMSE {s_d.rmse:.3g} ULP is {ratio:.3g}x the emulated peers' or one rounding's ({p_rmse:.3g}), "
                            f"{zscore:.3g} standard errors over N_eff {effective()}")
    threshold = max(worst, 0.5) + TAIL_SLACK  # as reported: at an element without allowance, in ULP
    figures.update(tail=tail, tail_threshold=threshold, tail_peer_worst=worst)
    if tail >= TAIL_COUNT and tail >= TAIL_SHARE * n:
        failures.append(f"{tail} of {n} elements ({100 * tail / n:.3g}%) are beyond the peers' worst "
                        f"({worst:.3g} of the max rule's unit, at least 1/2 ULP) + {TAIL_SLACK:g} ULP")
    return failures


def _stats(z: torch.Tensor, zi: torch.Tensor, sign_i: torch.Tensor) -> ErrorStats:
    """:func:`error_stats` from ``zi`` = the informative elements of ``z`` clamped to ``CLIP`` and
    ``sign_i`` their golden's sign (computed once for the kernel and its peers)."""
    return ErrorStats(_mean(zi), _mean(zi * sign_i), math.sqrt(_mean(z * z)))


def _safe(v: float) -> Any:
    return repr(v) if not math.isfinite(v) else v
