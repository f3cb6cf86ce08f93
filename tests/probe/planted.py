"""Emulated devices: custom ops (namespace ``pdprobe_test``) that plant one known behaviour each.

Arithmetic is emulated exactly in float64 (products of bf16/fp16/fp32 values and the sums
below are exact there) and rounded to the planted precision after every addition, so each op
has precisely the property the probe must recover and the IEEE default for everything else.
"""
from __future__ import annotations

import torch

NS = "pdprobe_test"


def round_bits(x: torch.Tensor, bits: int, mode: str = "nearest-even") -> torch.Tensor:
    """Round float64 values to ``bits`` significand bits (unbounded exponent)."""
    m, e = torch.frexp(x)
    scaled = torch.ldexp(m, torch.full_like(e, bits))
    if mode == "nearest-even":
        scaled = torch.round(scaled)
    elif mode == "stochastic":  # up with probability equal to the discarded fraction
        low = torch.floor(scaled)
        scaled = low + (torch.rand(scaled.shape, dtype=torch.float64) < scaled - low)
    else:
        scaled = torch.trunc(scaled)
    return torch.ldexp(scaled, e - bits)


def _ulp(acc: torch.Tensor, bits: int) -> torch.Tensor:
    _, e = torch.frexp(acc)
    return torch.ldexp(torch.ones_like(acc), e - bits)


def accumulate(terms: torch.Tensor, bits: int, mode: str = "nearest-even", extra: "int | None" = None) -> torch.Tensor:
    """Sum ``terms`` [..., K] in order with a ``bits``-bit accumulator rounded after each add;
    ``extra``: an addend is first cut (toward zero) ``extra`` bits below the accumulator's last place."""
    acc = torch.zeros(terms.shape[:-1], dtype=torch.float64)
    for i in range(terms.shape[-1]):
        term = terms[..., i]
        if extra is not None:
            q = torch.where(acc == 0, torch.zeros_like(acc), _ulp(acc, bits) * 2.0 ** -extra)
            term = torch.where(q == 0, term, torch.trunc(term / torch.where(q == 0, 1.0, q)) * q)
        acc = round_bits(acc + term, bits, mode)
    return acc


def _mm_terms(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.double()[:, None, :] * b.double().T[None, :, :]  # [M, N, K]


@torch.library.custom_op(f"{NS}::bf16acc_mm", mutates_args=())
def bf16acc_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A GEMM whose accumulator is bfloat16 (8 bits, nearest-even)."""
    return accumulate(_mm_terms(a, b), 8).to(a.dtype)


@torch.library.custom_op(f"{NS}::trunc14_mm", mutates_args=())
def trunc14_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A GEMM with a 14-bit accumulator truncating exactly (toward zero)."""
    return accumulate(_mm_terms(a, b), 14, "toward-zero").to(a.dtype)


@torch.library.custom_op(f"{NS}::trunc14x3_mm", mutates_args=())
def trunc14x3_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A 14-bit truncating accumulator that keeps 3 bits of an addend below its last place."""
    return accumulate(_mm_terms(a, b), 14, "toward-zero", extra=3).to(a.dtype)


@torch.library.custom_op(f"{NS}::stochastic12_mm", mutates_args=())
def stochastic12_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A GEMM with a 12-bit accumulator rounded stochastically after each add."""
    return accumulate(_mm_terms(a, b), 12, "stochastic").to(a.dtype)


@torch.library.custom_op(f"{NS}::tf32_mm", mutates_args=())
def tf32_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A float32 GEMM that rounds its inputs to TF32 (11 bits) and accumulates in float32."""
    a11, b11 = round_bits(a.double(), 11), round_bits(b.double(), 11)
    return accumulate(_mm_terms(a11, b11), 24).to(a.dtype)


@torch.library.custom_op(f"{NS}::splitk_mm", mutates_args=())
def splitk_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Split-K GEMM: K >= 64 in 4 slices, float32 inside, partial sums stored in bfloat16."""
    terms = _mm_terms(a, b)
    k = terms.shape[-1]
    if k < 64:
        return accumulate(terms, 24).to(a.dtype)
    parts = [round_bits(accumulate(terms[..., s:s + k // 4], 24), 8) for s in range(0, k, k // 4)]
    return accumulate(torch.stack(parts, -1), 24).to(a.dtype)


@torch.library.custom_op(f"{NS}::blocked128_sum", mutates_args=())
def blocked128_sum(x: torch.Tensor) -> torch.Tensor:
    """A last-dim sum in blocks of 128 (float32 inside), block sums added in order in float32."""
    t = x.double()
    parts = [accumulate(t[..., s:s + 128], 24) for s in range(0, t.shape[-1], 128)]
    return accumulate(torch.stack(parts, -1), 24).to(x.dtype)


@torch.library.custom_op(f"{NS}::atomic_sum", mutates_args=())
def atomic_sum(x: torch.Tensor) -> torch.Tensor:
    """Blocks of 32 summed in order; block sums added in a random order each call (atomics)."""
    t = x.double()
    parts = torch.stack([accumulate(t[..., s:s + 32], 24) for s in range(0, t.shape[-1], 32)], -1)
    order = torch.randperm(parts.shape[-1])  # the global RNG: a different order each call
    return accumulate(parts[..., order], 24).to(x.dtype)


@torch.library.custom_op(f"{NS}::batch_variant_sum", mutates_args=())
def batch_variant_sum(x: torch.Tensor) -> torch.Tensor:
    """In order for big batches; small batches (< 32 rows) split each row in 4 (more parallelism)."""
    t = x.double()
    if t.shape[0] >= 32 or t.shape[-1] < 4:
        return accumulate(t, 24).to(x.dtype)
    q = t.shape[-1] // 4
    parts = [accumulate(t[..., s:s + q], 24) for s in range(0, t.shape[-1], q)]
    return accumulate(torch.stack(parts, -1), 24).to(x.dtype)


@torch.library.custom_op(f"{NS}::ftz_mul", mutates_args=())
def ftz_mul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Multiplication that flushes subnormal results to (signed) zero."""
    out = x * y
    tiny = torch.finfo(out.dtype).tiny
    return torch.where(out.abs() < tiny, out * 0, out)


@torch.library.custom_op(f"{NS}::trunc_cast", mutates_args=())
def trunc_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 -> bfloat16 by dropping the low 16 bits (truncation); other casts are torch's."""
    if dtype != torch.bfloat16:
        return x.to(dtype)
    cut = x.to(torch.float32).view(torch.int32) & -65536
    return cut.view(torch.float32).to(torch.bfloat16)


@torch.library.custom_op(f"{NS}::fused_rms_norm", mutates_args=())
def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A fused RMSNorm computed in float64 and rounded once: accurate."""
    t = x.double()
    out = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    return out.to(x.dtype)


@torch.library.custom_op(f"{NS}::sloppy_rms_norm", mutates_args=())
def sloppy_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A fused RMSNorm that sums the squares in bfloat16: inaccurate."""
    sq = (x.double() ** 2)
    ms = accumulate(round_bits(sq, 8), 8) / x.shape[-1]
    out = x.double() * torch.rsqrt(ms[..., None] + eps) * weight.double()
    return out.to(x.dtype)
