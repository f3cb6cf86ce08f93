"""Offline bisect from a replay dump: not finished yet (see docs/bisect.md, "Status")."""
from __future__ import annotations

from typing import Any, Optional

from ..errors import BisectError

__all__ = ["bisect_dump"]


def bisect_dump(dut_dump: Any, ref_dump: Optional[Any] = None, *, ref: str = "cpu/float64",
                workload: Optional[str] = None) -> Any:
    """Bisect from a dump captured with ``--mode replay`` (not implemented yet).

    Raises:
        BisectError: always, for now; run ``precisiondiff bisect WORKLOAD`` live instead.
    """
    raise BisectError("offline bisect from a dump is not implemented yet: run "
                      "`precisiondiff bisect WORKLOAD --target T` live instead")
