"""Run the probe's experiments on a target and collect a :class:`~.card.Card`."""
from __future__ import annotations

import logging
import platform
import time
from typing import Any, Callable, Iterable, Optional, Tuple

import torch

from .. import __version__
from ..comparators.ulp import float_format
from ..errors import PrecisionDiffError
from ..runtime.targets import Target, dtype_name
from . import accumulator, accuracy, determinism, ieee, order
from .card import Card
from .kernels import (ALL_FAMILIES, DOT_FAMILIES, ELEMENTWISE, PRODUCT_FAMILIES, ROW_FAMILIES,
                      Kernels)
from .registry import registered_ops

__all__ = ["probe", "resolve_ops"]

log = logging.getLogger(__name__)
_PROBED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def resolve_ops(ops: Optional[Iterable[str]]) -> Tuple[Tuple[str, str], ...]:
    """``(name, family)`` for each requested op: family names and registered custom ops.

    Raises:
        PrecisionDiffError: an unknown name.
    """
    if ops is None:
        return tuple((f, f) for f in ALL_FAMILIES)
    custom = registered_ops()
    out = []
    for name in ops:
        name = name.strip()
        if name in ALL_FAMILIES or name in ("conv_bwd_input", "conv_bwd_weight"):
            out.append((name, name))
        elif name in custom:
            out.append((name, custom[name].family))
        else:
            known = ", ".join(ALL_FAMILIES + tuple(custom))
            raise PrecisionDiffError(f"unknown op {name!r} in --ops: use one of {known} "
                                     "(custom ops: register_op, then --import their module)")
    return tuple(out)


def _safe(card: Card, op: str, family: str, prop: str, fn: Callable[[], Tuple[Any, str]]) -> Any:
    """Record one experiment; a kernel that fails is a finding too (``error``), not a crash."""
    try:
        value, detail = fn()
    except Exception as err:  # a device kernel may be missing or refuse the crafted inputs
        log.debug("probe %s.%s failed", op, prop, exc_info=True)
        message = str(err).strip().splitlines()[0][:160] if str(err).strip() else ""
        value, detail = "error", f"{type(err).__name__}: {message}"
    card.add(op, family, prop, value, detail)
    return value


def _dot(card: Card, op: str, family: str, k: Kernels) -> None:
    found = {}

    def bits(placements: Any, key: str) -> Tuple[Any, str]:
        p, place, evidence = accumulator.bits_kept(k, family, placements)
        found[key] = (p, place)
        return (p if p is not None else f">{accumulator.scale(k.dtype)[1]}"), evidence

    short = _safe(card, op, family, "accumulator_bits", lambda: bits(accumulator.SHORT, "short"))
    _safe(card, op, family, "long_sum_bits", lambda: bits(accumulator.LONG, "long"))
    p, place = found.get("short", (None, None))
    if isinstance(short, int) and p is not None:
        mode = _safe(card, op, family, "rounding", lambda: accumulator.rounding(k, family, p, place))
        if mode == "toward-zero":
            _safe(card, op, family, "extra_bits", lambda: accumulator.extra_bits(k, family, p, place))
    if family in PRODUCT_FAMILIES:
        _safe(card, op, family, "input_bits", lambda: _input_bits(k, family, p))
    _safe(card, op, family, "order", lambda: order.reveal(k, family, p))
    _safe(card, op, family, "deterministic", lambda: determinism.deterministic(k, family))
    _safe(card, op, family, "batch_invariant", lambda: determinism.batch_invariant(k, family))
    if family != "mean":  # a mean's division makes its own subnormals
        _safe(card, op, family, "subnormals", lambda: ieee.subnormals(k, family))
    _safe(card, op, family, "sum_of_negative_zeros", lambda: ieee.sum_of_negative_zeros(k, family))


def _input_bits(k: Kernels, family: str, acc_bits: Optional[int]) -> Tuple[Any, str]:
    bits, evidence = accumulator.input_bits(k, family)
    if bits < float_format(k.dtype).mant_bits + 1 and acc_bits is not None and bits >= acc_bits:
        # the output passes through the accumulator: inputs wider than it cannot show
        return f">={acc_bits}", f"{evidence}; not narrower than the {acc_bits}-bit accumulator"
    return bits, evidence


def _accuracy(card: Card, op: str, family: str, stats_fn: Callable[[], dict]) -> None:
    stats: dict = {}

    def run() -> Tuple[Any, str]:
        stats.update(stats_fn())
        return accuracy.summary(stats)

    if _safe(card, op, family, "max_ulp", run) == "error":
        return
    example = stats.get("special_example", "")
    card.add(op, family, "special_values", stats["special"],
             f"NaN/inf where the reference is not (or the reverse): {example}" if example else
             "NaN and inf exactly where the reference has them")
    if stats["subnormal"]:
        value = "kept" if not stats["flushed"] else "flushed"
        card.add(op, family, "subnormal_results", value,
                 f"{stats['flushed']} of {stats['subnormal']} subnormal results returned as 0")


def _family(card: Card, op: str, family: str, k: Kernels) -> None:
    if family in DOT_FAMILIES:
        _dot(card, op, family, k)
    elif family in ROW_FAMILIES:
        _accuracy(card, op, family, lambda: accuracy.rowwise_accuracy(k, family))
        _safe(card, op, family, "deterministic", lambda: determinism.deterministic(k, family))
        _safe(card, op, family, "batch_invariant", lambda: determinism.batch_invariant(k, family))
    elif family in ELEMENTWISE:
        _accuracy(card, op, family, lambda: accuracy.elementwise_accuracy(k, family))
    elif family == "cast":
        for dst in ieee.cast_targets(k.dtype):
            name = f"{op}:fp32->{dtype_name(dst)}"
            _safe(card, name, family, "rounding", lambda: ieee.cast_rounding(k, dst))
            _safe(card, name, family, "overflow", lambda: ieee.cast_overflow(k, dst))
            _safe(card, name, family, "subnormals", lambda: ieee.cast_subnormals(k, dst))
    elif family == "mul":
        _safe(card, op, family, "subnormals", lambda: ieee.subnormals(k, family))
        _safe(card, op, family, "nan_payload", lambda: ieee.nan_payload(k))
    elif family == "add":
        _safe(card, op, family, "subnormals", lambda: ieee.subnormals(k, family))
        _safe(card, op, family, "signed_zero", lambda: ieee.signed_zero(k))


def _meta(target: Target, k: Kernels) -> dict:
    meta: dict = {"precisiondiff": __version__, "torch": torch.__version__, "host": platform.node(),
                  "dtype": dtype_name(k.dtype)}
    if target.device_type == "cpu":
        meta["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        meta["device_name"] = platform.processor() or platform.machine()
    else:
        try:
            from ..runtime.targets import device_module
            meta["device_name"] = str(device_module(target.device_type).get_device_name())
        except Exception:  # not every backend names its devices
            meta["device_name"] = target.device
    custom = {f: k.label(f) for f in ALL_FAMILIES if k.label(f) != "stock"}
    if custom:
        meta["kernels"] = custom
    return meta


def probe(target: "str | Target" = "cpu/bf16", ops: Optional[Iterable[str]] = None, *,
          kernels: Optional[Kernels] = None) -> Card:
    """Measure how a device computes: accumulators, orders, casts, special values, accuracy.

    Args:
        target: ``DEVICE[/DTYPE]`` (``cpu/bf16``, ``cuda/fp32``, ``mlu/bf16``); autocast is refused.
        ops: family names (``gemm``, ``sum``, ``exp``...) or registered custom ops; None: every family.
        kernels: the kernels to probe (an emulated device); default PyTorch's own on ``target``.

    Returns:
        The numerics card.

    Raises:
        PrecisionDiffError: bad target, unavailable device, unknown op.

    Example:
        >>> card = probe("cpu/fp32", ["gemm"])  # doctest: +SKIP
        >>> card.get("gemm", "input_bits")       # doctest: +SKIP
        24
    """
    tgt = Target.parse(target)
    if tgt.autocast:
        raise PrecisionDiffError("probe measures kernels in one dtype: drop '+autocast' from the target")
    if tgt.dtype not in _PROBED_DTYPES:
        raise PrecisionDiffError(f"probe supports bf16, fp16, fp32 and fp64 targets, not {dtype_name(tgt.dtype)}")
    tgt.check_available()
    k = kernels if kernels is not None else Kernels.stock(tgt.device, tgt.dtype)
    if kernels is not None:
        tgt = Target(k.device, k.dtype)
    wanted = resolve_ops(ops)
    card = Card(str(tgt))
    start = time.perf_counter()
    custom = registered_ops()
    for name, family in wanted:
        kk = k.replace(**{family: custom[name]}) if name in custom else k
        _family(card, name, family, kk)
    card.meta = _meta(tgt, k)
    card.meta["seconds"] = round(time.perf_counter() - start, 2)
    return card
