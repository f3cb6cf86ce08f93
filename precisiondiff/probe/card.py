"""The numerics card: what a probe found, as plain JSON data.

A card is a list of :class:`Finding` rows, ``(op, property) -> value`` with the evidence in
words, plus where it was measured (target, torch version, CPU capability). Values are JSON
scalars (int, float, str, bool, None): a card is saved and loaded as JSON only, never pickled.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from ..errors import PrecisionDiffError

__all__ = ["Finding", "Card", "load_card", "CARD_FORMAT"]

CARD_FORMAT = "precisiondiff.probe/1"


@dataclass(frozen=True)
class Finding:
    """One measured property of one op.

    Attributes:
        op: the op probed: a family name (``gemm``) or a registered custom op's name.
        family: the op's family (``gemm``, ``sum``, ``cast``...).
        prop: the property (``accumulator_bits``, ``rounding``, ``order``...).
        value: a JSON scalar; ints for bit counts, strings for modes.
        detail: the evidence, in words (inputs used, counts, the worst input).
    """

    op: str
    family: str
    prop: str
    value: Any
    detail: str = ""


@dataclass
class Card:
    """A numerics card: the findings of one probe run on one target.

    Example:
        >>> card = Card("cpu/bf16", findings=[Finding("gemm", "gemm", "accumulator_bits", 24)])
        >>> card.get("gemm", "accumulator_bits")
        24
    """

    target: str
    meta: Dict[str, Any] = field(default_factory=dict)
    findings: List[Finding] = field(default_factory=list)

    def add(self, op: str, family: str, prop: str, value: Any, detail: str = "") -> None:
        """Append a finding (replacing an earlier one for the same op and property)."""
        self.findings = [f for f in self.findings if (f.op, f.prop) != (op, prop)]
        self.findings.append(Finding(op, family, prop, value, detail))

    def get(self, op: str, prop: str, default: Any = KeyError) -> Any:
        """The value found for ``(op, prop)``.

        Raises:
            KeyError: nothing was measured for it and no default was given.
        """
        finding = self.finding(op, prop)
        if finding is None:
            if default is KeyError:
                raise KeyError(f"{op}.{prop} is not on the card of {self.target}")
            return default
        return finding.value

    def finding(self, op: str, prop: str) -> Optional[Finding]:
        """The :class:`Finding` for ``(op, prop)``, or None."""
        for f in self.findings:
            if f.op == op and f.prop == prop:
                return f
        return None

    def ops(self) -> List[str]:
        """The ops on the card, in the order they were probed."""
        return list(dict.fromkeys(f.op for f in self.findings))

    def to_dict(self) -> Dict[str, Any]:
        """The card as JSON-ready data."""
        return {"format": CARD_FORMAT, "target": self.target, "meta": self.meta,
                "findings": [asdict(f) for f in self.findings]}

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "Card":
        """Rebuild a card from :meth:`to_dict` output.

        Raises:
            PrecisionDiffError: the data is not a probe card.
        """
        if not isinstance(data, dict) or data.get("format") != CARD_FORMAT:
            raise PrecisionDiffError(f"not a probe card (expected \"format\": \"{CARD_FORMAT}\")")
        try:
            findings = [Finding(**f) for f in data["findings"]]
            return cls(str(data["target"]), dict(data.get("meta", {})), findings)
        except (KeyError, TypeError) as err:
            raise PrecisionDiffError(f"malformed probe card: {err}") from err

    def save(self, path: str) -> None:
        """Write the card as JSON (atomically)."""
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=1, allow_nan=False)
        os.replace(tmp, path)


def load_card(path: str) -> Card:
    """Read a card written by :meth:`Card.save` (JSON only).

    Raises:
        PrecisionDiffError: the file is missing, not JSON, or not a card.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as err:
        raise PrecisionDiffError(f"cannot read card {path}: {err.strerror}") from err
    except ValueError as err:
        raise PrecisionDiffError(f"card {path} is not JSON: {err}") from err
    try:
        return Card.from_dict(data)
    except PrecisionDiffError as err:
        raise PrecisionDiffError(f"{path}: {err}") from err
