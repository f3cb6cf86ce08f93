"""What to record: scope and op-name regexes, steps and ranks."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..errors import PrecisionDiffError

__all__ = ["CaptureFilter", "parse_selection", "compile_regex"]


def parse_selection(text: "str | Sequence[int] | None") -> Optional[frozenset]:
    """Parse ``"0,2-4"`` into {0, 2, 3, 4}; ``None``/``"all"`` means everything.

    Raises:
        PrecisionDiffError: malformed text.
    """
    if text is None:
        return None
    if not isinstance(text, str):
        return frozenset(int(v) for v in text)
    if text.strip().lower() in ("", "all"):
        return None
    chosen: set = set()
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(v) for v in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                chosen.update(range(lo, hi + 1))
            else:
                chosen.add(int(part))
        except ValueError as err:
            raise PrecisionDiffError(f"bad selection {text!r}: use N, N-M or a comma list like 0,2-4") from err
    return frozenset(chosen)


def compile_regex(pattern: Optional[str], what: str) -> "Optional[re.Pattern[str]]":
    """Compile a user's regex; a malformed one is a :class:`PrecisionDiffError` naming ``what``."""
    return _compile(pattern, what)


def _compile(pattern: Optional[str], what: str) -> "Optional[re.Pattern[str]]":
    if not pattern:
        return None
    try:
        return re.compile(pattern)
    except re.error as err:
        raise PrecisionDiffError(f"bad {what} regex {pattern!r}: {err}") from err


@dataclass
class CaptureFilter:
    """Include/exclude rules. Regexes use ``re.search`` on the scope (``blocks.0.attn``) or the
    op name (``aten.addmm.default``); ``views`` keeps view/alias ops, which do no arithmetic."""

    scope: Optional[str] = None
    scope_exclude: Optional[str] = None
    op: Optional[str] = None
    op_exclude: Optional[str] = None
    steps: Optional[frozenset] = None
    ranks: Optional[frozenset] = None
    views: bool = False
    _re: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._re = {k: _compile(getattr(self, k), k.replace("_", "-"))
                    for k in ("scope", "scope_exclude", "op", "op_exclude")}

    def want_scope(self, scope: str) -> bool:
        inc, exc = self._re["scope"], self._re["scope_exclude"]
        return (inc is None or inc.search(scope) is not None) and (exc is None or exc.search(scope) is None)

    def want_op(self, name: str) -> bool:
        inc, exc = self._re["op"], self._re["op_exclude"]
        return (inc is None or inc.search(name) is not None) and (exc is None or exc.search(name) is None)

    def want_step(self, step: int) -> bool:
        return self.steps is None or step in self.steps

    def want_rank(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks
