"""Offline bisect from a replay dump (filled in below)."""
from __future__ import annotations

__all__ = ["bisect_dump"]


def bisect_dump(*a, **k):  # replaced shortly
    raise NotImplementedError
