"""Turning a card into a sentence a finding can quote (for bisect, the plugin, reports).

The bound is the classical one for recursive summation (Higham, *Accuracy and Stability of
Numerical Algorithms*, ch. 4): summing K terms whose additions nest ``d`` deep loses at most
``d * u * sum|terms|`` (u the accumulator's unit roundoff: ``2**-p`` rounding to nearest,
``2**(1-p)`` truncating), and typically ``sqrt(d) * u * sum|terms|`` when errors are random.
Depth: K for sequential or unknown orders, ``log2 K`` pairwise, ``B + K/B`` blocked by B,
``S + K/S`` with S splits.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..runtime.targets import dtype_name, parse_dtype
from .card import Card

__all__ = ["explain", "explain_culprit", "family_of_op", "summation_depth"]


def summation_depth(order: Optional[str], k: int) -> int:
    """How deep the additions of a K-term sum nest for an order named on a card."""
    text = (order or "").split(":")[0]
    words = text.split()
    if text == "pairwise":
        return max(1, math.ceil(math.log2(k)))
    if len(words) >= 2 and words[0] in ("blocked", "split-K") and words[1].rstrip(",").isdigit():
        n = int(words[1].rstrip(","))
        b = min(n, k) if words[0] == "blocked" else max(1, k // n)
        return b + math.ceil(k / b)
    return k


def explain(card: Card, op_family: str, dtype: "str | torch.dtype", k: int) -> str:
    """One sentence on what ``op_family``'s accumulator does to a sum of K terms on this device.

    Args:
        card: a probe card.
        op_family: an op on the card (``gemm``, ``sum``, a custom op's name).
        dtype: the dtype of the finding (must be the card's).
        k: the number of terms summed (GEMM's K, the reduced dimension's length).

    Returns:
        The sentence; it says so when the card lacks the measurement or is for another dtype.

    Example:
        >>> explain(card, "gemm", "bf16", 4096)  # doctest: +SKIP
        "this device's bf16 gemm accumulates in 14 bits (rounding toward-zero): ..."
    """
    name = dtype_name(dtype if isinstance(dtype, torch.dtype) else parse_dtype(dtype))
    card_dtype = card.target.split("/")[-1].split("+")[0]
    if card_dtype != name:
        return f"the card of {card.target} says nothing about {name}: probe the {name} target"
    bits = card.get(op_family, "accumulator_bits", None)
    if not isinstance(bits, int):
        return f"the card of {card.target} has no accumulator measurement for {op_family}"
    long_bits = card.get(op_family, "long_sum_bits", None)
    eff = min(bits, long_bits) if isinstance(long_bits, int) else bits
    mode = card.get(op_family, "rounding", "unknown")
    order = card.get(op_family, "order", None)
    u = 2.0 ** (1 - eff) if mode in ("toward-zero", "toward-negative", "toward-positive") else 2.0 ** -eff
    depth = summation_depth(order, k)
    worst, typical = depth * u, math.sqrt(depth) * u
    ref = depth * 2.0 ** -24
    parts = [f"this device's {name} {op_family} accumulates in {bits} bits (rounding {mode})"]
    if eff != bits:
        parts.append(f"and keeps partial sums of long reductions in {eff} bits")
    sentence = " ".join(parts) + (
        f": summing K={k} terms ({order or 'order unknown'}, {depth} additions deep) can lose up to "
        f"{worst:.2g} of sum|terms| (typically {typical:.2g}), against {ref:.2g} with a float32 accumulator")
    inputs = card.get(op_family, "input_bits", None)
    full = {"fp32": 24, "bf16": 8, "fp16": 11, "float64": 53}.get(name)
    if isinstance(inputs, int) and full and inputs < full:
        sentence += f"; its inputs are rounded to {inputs} bits before the product (TF32 is 11)"
    if card.get(op_family, "deterministic", True) is False:
        sentence += "; it is not deterministic run to run"
    if card.get(op_family, "batch_invariant", True) is False:
        sentence += "; a row's result depends on the batch it is computed in"
    return sentence


# ATen op (overload packet) -> the card's family that measures its accumulator
_FAMILY_OF_ATEN = {
    "mm": "gemm", "addmm": "gemm", "matmul": "gemm", "linear": "gemm", "_addmm_activation": "gemm",
    "bmm": "bmm", "baddbmm": "bmm",
    "convolution": "conv", "_convolution": "conv", "conv2d": "conv", "conv1d": "conv", "conv3d": "conv",
    "sum": "sum", "mean": "mean", "cumsum": "cumsum", "index_add": "index_add", "index_add_": "index_add",
    "embedding_dense_backward": "embedding_bwd", "_softmax": "softmax", "softmax": "softmax",
    "native_layer_norm": "layer_norm", "_fused_rms_norm": "rms_norm",
}


def family_of_op(name: str, card: Optional[Card] = None) -> Optional[str]:
    """The card family measuring op ``name`` (``aten.addmm.default`` -> ``gemm``): a custom op
    registered on the card under its own name is its own family; None when none measures it."""
    if card is not None and card.get(name, "accumulator_bits", None) is not None:
        return name
    parts = name.split(".")
    if len(parts) >= 2 and parts[0] == "aten":
        return _FAMILY_OF_ATEN.get(parts[1])
    return None


def explain_culprit(card: Card, culprit: dict, dtype: "str | torch.dtype") -> Optional[str]:
    """:func:`explain` for a bisect culprit (its op name and the K its budget records), or None
    when the culprit is not an op the card measures."""
    if not culprit or culprit.get("kind") != "op":
        return None
    family = family_of_op(str(culprit.get("name", "")), card)
    k = (culprit.get("budget") or {}).get("k")
    if family is None or not isinstance(k, int) or k < 1:
        return None
    return explain(card, family, dtype, k)
