"""Accuracy in ULPs of element-wise transcendentals and row-wise kernels.

Element-wise (exp, log, tanh, erf, sigmoid, rsqrt, gelu, silu): every finite value of a 16-bit
dtype (65 280 inputs), or for float32 the bfloat16 grid plus 65 536 random float32 bit
patterns; then +inf, -inf and NaN. The reference is the function in float64 on the CPU; the error is
``|y - f64(x)| / ulp(f64(x))`` in the dtype (0.5 = correctly rounded). Results whose rounded
reference is subnormal are left out of the ULP figures and counted as flushed when the kernel
returns 0; results where one side is NaN or infinite and the other not are counted as special
value mismatches (overflow to inf is right when the rounded reference overflows).

Row-wise (softmax, layer_norm, rms_norm): 64 rows of 256 normal values (std 4) against the
family's float64 result on the CPU, same ULP measure. gelu and silu at -inf are referred to
their limit, -0 (float64 evaluates ``-inf * 0`` to NaN).
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch
import torch.nn.functional as F

from ..comparators.ulp import float_format, round_to_dtype, ulp_error
from .kernels import Kernels

__all__ = ["sweep_inputs", "elementwise_accuracy", "rowwise_accuracy", "REFERENCE"]


def _limit_at_minus_inf(fn):
    # x * (something -> 0) is NaN at -inf in float64; the function's limit there is -0
    return lambda x: torch.where(x == float("-inf"), -0.0, fn(x))


#: The float64 references, computed on the CPU.
REFERENCE = {
    "exp": torch.exp, "log": torch.log, "tanh": torch.tanh, "erf": torch.erf,
    "sigmoid": torch.sigmoid, "rsqrt": torch.rsqrt,
    "gelu": _limit_at_minus_inf(F.gelu), "silu": _limit_at_minus_inf(F.silu),
    "softmax": lambda x: torch.softmax(x, -1),
    "layer_norm": lambda x: F.layer_norm(x, (x.shape[-1],)),
    "rms_norm": lambda x: F.rms_norm(x, (x.shape[-1],)),
}


def sweep_inputs(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Every finite value of a 16-bit ``dtype`` (a sample for wider ones), then +inf, -inf, NaN
    (a float64 CPU tensor of values exact in ``dtype``)."""
    if dtype in (torch.bfloat16, torch.float16):
        grid = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    else:
        gen = torch.Generator().manual_seed(seed)
        bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (65536,), generator=gen, dtype=torch.int64)
        extra = bits.to(torch.int32).view(torch.float32).to(dtype)
        bf16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        grid = torch.cat([bf16.to(dtype), extra])
    x = grid.to(torch.float64)
    special = torch.tensor([float("inf"), float("-inf"), float("nan")], dtype=torch.float64)
    return torch.cat([x[torch.isfinite(x)], special])


def _stats(x: torch.Tensor, y: torch.Tensor, golden: torch.Tensor, dtype: torch.dtype) -> Dict[str, object]:
    fmt = float_format(dtype)
    rounded = round_to_dtype(golden, dtype).to(torch.float64)
    special = (torch.isnan(rounded) != torch.isnan(y)) | (torch.isinf(rounded) != torch.isinf(y)) | (
        torch.isinf(rounded) & torch.isinf(y) & (rounded != y))
    tiny = 2.0 ** fmt.emin
    sub = torch.isfinite(rounded) & (rounded.abs() < tiny) & (rounded != 0)
    flushed = sub & (y == 0)
    normal = torch.isfinite(rounded) & torch.isfinite(y) & ~sub & ~special
    err = ulp_error(y[normal], golden[normal], dtype)
    out: Dict[str, object] = {"max_ulp": 0.0, "mean_ulp": 0.0, "worst_input": None,
                              "special": int(special.sum()), "flushed": int(flushed.sum()),
                              "subnormal": int(sub.sum()), "n": int(y.numel()),
                              "not_correctly_rounded": 0.0}
    if err.numel():
        worst = int(err.argmax())
        out.update(max_ulp=round(float(err[worst]), 3), mean_ulp=round(float(err.mean()), 4),
                   worst_input=float(x[normal][worst]),
                   not_correctly_rounded=round(float((err > 0.5).double().mean()), 4))
    if out["special"]:
        i = int(special.nonzero()[0])
        out["special_example"] = f"f({float(x.flatten()[i]):g}) = {float(y.flatten()[i]):g}, " \
                                 f"reference {float(rounded.flatten()[i]):g}"
    return out


def elementwise_accuracy(k: Kernels, family: str, reference: str = "") -> Dict[str, object]:
    """ULP statistics of ``family``'s kernel over :func:`sweep_inputs`."""
    x = sweep_inputs(k.dtype)
    y = k.ops[family](k.put(x)).detach().to("cpu").to(torch.float64)
    golden = REFERENCE[reference or family](x)
    return _stats(x, y, golden, k.dtype)


def rowwise_accuracy(k: Kernels, family: str, reference: str = "", seed: int = 0) -> Dict[str, object]:
    """ULP statistics of a row-wise kernel on random rows."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(64, 256, generator=gen, dtype=torch.float64) * 4).to(k.dtype).to(torch.float64)
    y = k.ops[family](k.put(x)).detach().to("cpu").to(torch.float64)
    golden = REFERENCE[reference or family](x)
    return _stats(x, y, golden, k.dtype)


def summary(stats: Dict[str, object]) -> Tuple[float, str]:
    """The card's value (max ULP) and its evidence line."""
    text = (f"worst at x={stats['worst_input']:.6g}, mean {stats['mean_ulp']} ulp, "
            f"{stats['not_correctly_rounded']:.1%} not correctly rounded, {stats['n']} inputs"
            if stats["worst_input"] is not None else f"{stats['n']} inputs, none in the normal range")
    return float(stats["max_ulp"]), text  # type: ignore[arg-type]
