"""Findings the user has read: the known stock findings, and accepted ones (``--accept OP[@SCOPE]``).

Bisect reports every offending unit in execution order (``culprits``); the first is ``culprit``. A
unit whose op is in :data:`KNOWN_FINDINGS` for the DUT's device and dtype is annotated
``known: ...`` (a documented stock kernel behaviour, docs/bisect.md "Findings on stock kernels",
with the measurement behind it). Such a finding is accepted by default (:func:`known_accepts`): it
is the stock backend the DUT stands on, read and measured, not a culprit of the run, so a clean job
on that backend is not blamed for it; ``blame_known=True`` (``--blame-known``) makes it offend
again. An *accepted* op is judged as usual but does not offend: the
search goes on, so the next offending unit becomes ``culprit``; the accepted units are listed in
``accepted``. Accepts come from the call (``accept=[...]``, ``--accept``, ``--parity-accept``)
and from the project's configuration: ``accept = [...]`` in the ``[tool.precisiondiff]`` table of
``pyproject.toml`` or in ``precisiondiff.toml`` (top level or the same table), in the current
directory.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence

from ..errors import BisectError

__all__ = ["KNOWN_FINDINGS", "Accept", "parse_accepts", "configured_accepts", "resolve_accepts", "known_finding",
           "known_accepts", "CONFIG_FILES"]

#: op name -> {"device", "dtype", "finding", "measured"}: stock kernel behaviours verified by hand
#: against a float64 replay (benchmarks/stock_findings.py reproduces each).
KNOWN_FINDINGS: Dict[str, Dict[str, str]] = {
    "aten.native_layer_norm_backward.default": {
        "device": "cpu", "dtype": "bfloat16",
        "finding": "CPU bf16 reduces grad_weight/grad_bias with bf16 partial sums",
        "measured": "grad_bias rel-L2 4.9e-3 vs 1.5e-3 for float32 rounded once (24 rows x 64), 3.9e-2 vs 1.7e-3 "
                    "(2048 rows), same on AVX512/AVX2/DEFAULT, torch 2.13 (docs/bisect.md, Findings on stock kernels)",
    },
    "aten.embedding_dense_backward.default": {
        "device": "cpu", "dtype": "bfloat16",
        "finding": "CPU bf16 embedding backward sums the gradient rows of a repeated index with a bf16 running sum",
        "measured": "one index x24 rows of 128: bit for bit a sequential bf16 running sum (3 of 3 seeds), rel-L2 "
                    "5.7e-3 vs 1.6e-3 for float32 rounded once (BERT's token-type embedding: 0.0169 vs 0.00155), "
                    "same on AVX512/AVX2/DEFAULT, torch 2.13 (docs/bisect.md, Findings on stock kernels)",
    },
    "aten._foreach_mul_.Scalar": {
        "device": "cpu", "dtype": "bfloat16",
        "finding": "the in-place CPU bf16 foreach multiply rounds its scalar to bf16 first (SGD momentum 0.9 -> "
                   "0.8984375); out-of-place x * 0.9 does not",
        "measured": "4096 elements x 0.9: equal to x * bf16(0.9) rounded once, mean error 0.33 ULP toward zero "
                    "(SGD foreach momentum buffers: 0.30-0.35), same on AVX512/AVX2/DEFAULT, torch 2.13 "
                    "(docs/bisect.md, Findings on stock kernels)",
    },
    "aten._foreach_add.List": {
        "device": "cpu", "dtype": "bfloat16", "capability": "DEFAULT",
        "finding": "the portable (DEFAULT) CPU bf16 add with alpha rounds alpha and alpha * other to bf16 before "
                   "adding (SGD weight decay grad + wd * param); AVX2/AVX512 round once",
        "measured": "4096 elements, alpha 1e-3: equal to x + bf16(bf16(alpha) * y) bit for bit, 117 ULP on an element "
                    "where the sum cancels; AVX512 equals x + bf16(alpha) * y rounded once; torch 2.13 "
                    "(docs/bisect.md, Findings on stock kernels)",
    },
    "aten.addbmm.default": {
        "device": "cpu", "dtype": "bfloat16",
        "finding": "CPU bf16 addbmm rounds its running sum over the batch to bf16 after each batch's product",
        "measured": "4 batches of (5 x 6) @ (6 x 5) onto 5 x 5: bit for bit a per-batch bf16 running sum, worst 4.9 ULP "
                    "vs 0.47 for float32 rounded once, same on AVX512/AVX2/DEFAULT, torch 2.13 (docs/bisect.md, "
                    "Findings on stock kernels)",
    },
    "aten.linalg_matrix_exp.default": {
        "device": "cpu", "dtype": "bfloat16",
        "finding": "CPU bf16 matrix_exp of the identity returns -1.3e30 on the diagonal instead of e",
        "measured": "matrix_exp(eye(4), bf16)[0, 0] = -1.297e30 (float64 2.71828), same on AVX512/AVX2/DEFAULT, "
                    "torch 2.13 (docs/bisect.md, Findings on stock kernels)",
    },
    "aten.div.Tensor_mode": {
        "device": "cpu", "dtype": "bfloat16",
        "finding": "vectorised CPU bf16 div(rounding_mode='trunc') truncates the quotient after rounding it to bf16 "
                   "(288 / 17 = 16.94 -> 17 -> 17); a one-element call gives 16",
        "measured": "231 of 32193 integer pairs 1..511 / 1..63 wrong, same on AVX512/AVX2/DEFAULT, torch 2.13 "
                    "(docs/bisect.md, Findings on stock kernels)",
    },
    "aten.soft_margin_loss.default": {
        "device": "cpu", "dtype": "float16",
        "finding": "CPU fp16 soft_margin_loss computes exp(-y x) in fp16 and overflows (x = -20: inf, float64 20)",
        "measured": "soft_margin_loss(full(8, -20.), ones) = inf in fp16, 20.0 in float64, same on "
                    "AVX512/AVX2/DEFAULT, torch 2.13 (docs/bisect.md, Findings on stock kernels)",
    },
    "aten.grid_sampler_2d.default": {
        "device": "cpu", "dtype": "bfloat16",
        "finding": "CPU bf16 grid_sample computes its sampling coordinates in bf16",
        "measured": "64 x 64 map, 16 x 16 random points, bilinear: rel-L2 0.149 vs 0.00158 for float32 rounded once "
                    "(95x), same on AVX512/AVX2/DEFAULT, torch 2.13 (docs/bisect.md, Findings on stock kernels)",
    },
    "aten.grid_sampler_3d.default": {
        "device": "cpu", "dtype": "bfloat16",
        "finding": "CPU bf16 3-d grid_sample computes its sampling coordinates in bf16, as the 2-d one",
        "measured": "16^3 volume, 8^3 random points, trilinear: rel-L2 0.0475 vs 0.00169 for float32 rounded once "
                    "(28x), same on AVX512/DEFAULT, torch 2.13 (docs/bisect.md, Findings on stock kernels)",
    },
    "aten.convolution_backward.default": {
        "device": "cpu", "dtype": "bfloat16", "when": "no_onednn_bf16",
        "finding": "on a CPU without oneDNN bf16 (no AVX-512: torch.ops.mkldnn._is_mkldnn_bf16_supported() False) "
                   "the bf16 convolution backward adds the overlapping window contributions of grad_input (col2im) "
                   "into a bf16 buffer",
        "measured": "3x3 conv, 32 -> 32 channels, 2 x 8 x 8: grad_input bit for bit F.fold (bf16) of the bf16-rounded "
                    "columns, rel-L2 3.96e-3 vs 1.63e-3 for float32 rounded once, grad_weight 2.06e-3 vs 1.64e-3; same "
                    "under AVX2/DEFAULT on an AMD EPYC without AVX-512, torch 2.13 (docs/bisect.md, Findings on "
                    "stock kernels)",
    },
}

#: Conditions a finding may hold under besides the device and dtype ("when"): a CPU feature.
CONDITIONS: Dict[str, Any] = {
    # oneDNN's bf16 kernels need AVX-512 (avx512_core); without them ATen's own slow path runs
    "no_onednn_bf16": lambda: not _onednn_bf16(),
}


def _onednn_bf16() -> bool:
    import torch
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


#: The configuration files read, in the current directory, in this order.
CONFIG_FILES = ("pyproject.toml", "precisiondiff.toml")


@dataclass(frozen=True)
class Accept:
    """One accepted finding: an op name (exact, or a prefix before an overload) and optionally the
    module scope it is accepted in (exact, or an enclosing module path)."""

    op: str
    scope: Optional[str] = None

    def matches(self, name: str, scope: str) -> bool:
        """Whether an op call ``name`` in ``scope`` is accepted."""
        op_ok = name == self.op or name.startswith(self.op + ".")
        return op_ok and (self.scope is None or scope == self.scope or scope.startswith(self.scope + "."))

    def __str__(self) -> str:
        return self.op if self.scope is None else f"{self.op}@{self.scope}"


def parse_accepts(specs: Iterable[str]) -> List[Accept]:
    """``["OP", "OP@SCOPE", ...]`` -> accepts (``aten.native_layer_norm_backward``,
    ``aten.mm.default@model.layers.0``).

    Raises:
        BisectError: an empty op name or scope.
    """
    out = []
    for spec in specs:
        text = str(spec).strip()
        op, _, scope = text.partition("@")
        if not op or ("@" in text and not scope):
            raise BisectError(f"--accept {spec!r}: expected OP[@SCOPE], e.g. aten.native_layer_norm_backward "
                              "or aten.mm.default@model.layers.0")
        out.append(Accept(op, scope or None))
    return out


def configured_accepts(directory: Optional[str] = None) -> List[str]:
    """The ``accept`` list of ``[tool.precisiondiff]`` in ``pyproject.toml`` and of
    ``precisiondiff.toml`` (top level or ``[tool.precisiondiff]``) in ``directory`` (default: the
    current one).

    Raises:
        BisectError: a file that is not TOML, or an ``accept`` that is not a list of strings.
    """
    import tomllib
    found: List[str] = []
    for name in CONFIG_FILES:
        path = os.path.join(directory or os.getcwd(), name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise BisectError(f"{path}: not readable as TOML ({err})") from err
        table: Any = data.get("tool", {}).get("precisiondiff", {})
        values = table.get("accept") if isinstance(table, dict) else None
        if values is None and name == "precisiondiff.toml":
            values = data.get("accept")
        if values is None:
            continue
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise BisectError(f"{path}: accept must be a list of 'OP[@SCOPE]' strings")
        found.extend(values)
    return found


def resolve_accepts(accept: Optional[Sequence[str]], *, config: bool = True) -> List[Accept]:
    """The accepts of a bisect: those given, then the configured ones (:func:`configured_accepts`)."""
    if isinstance(accept, str):
        accept = [accept]
    return parse_accepts(list(accept or []) + (configured_accepts() if config else []))


def known_finding(name: str, device: str, dtype: str) -> Optional[str]:
    """``"known: <finding>"`` when ``name`` on ``device``/``dtype`` is a documented stock finding."""
    entry = KNOWN_FINDINGS.get(name)
    if entry is None or entry["device"] != device or entry["dtype"] != dtype:
        return None
    if "capability" in entry and device == "cpu":  # a finding of one vector path only
        import torch
        if torch.backends.cpu.get_cpu_capability() != entry["capability"]:
            return None
    if "when" in entry and not CONDITIONS[entry["when"]]():  # a finding of some CPUs only
        return None
    return f"known: {entry['finding']} ({entry['measured']})"


def known_accepts(device: str, dtype: str) -> List[Accept]:
    """The documented stock findings of ``device``/``dtype`` (this CPU's vector path for a
    capability-bound one) as accepts: bisect passes over them by default, listing each in
    ``accepted`` with its ``known`` note."""
    return [Accept(name) for name in KNOWN_FINDINGS if known_finding(name, device, dtype) is not None]
