"""The rich console the commands print through."""
from __future__ import annotations

import os
import sys

__all__ = ["console"]


def console():
    """A rich console; wide when writing to a pipe or a file, so tables do not fold."""
    from rich.console import Console
    width = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", 0) or 200)
    return Console(highlight=False, soft_wrap=False, width=width)
