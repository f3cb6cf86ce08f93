"""Running a user's training script as ``__main__``, as ``python train.py ARGS`` would."""
from __future__ import annotations

import runpy
import sys
from typing import List

from ..errors import PrecisionDiffError, WorkloadError

__all__ = ["run_as_main"]


def run_as_main(script: str, args: List[str], kept: str) -> int:
    """Run ``script`` with ``sys.argv = [script, *args]`` (restored after) and return its exit
    status: 0 when it returns, its ``SystemExit`` code otherwise.

    Raises:
        WorkloadError: the script raised; the message ends with ``(kept)``, what of the run is kept.
    """
    saved_argv = sys.argv[:]
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except PrecisionDiffError:
        raise
    except Exception as err:
        raise WorkloadError(f"{script} raised {type(err).__name__}: {err} ({kept})") from err
    finally:
        sys.argv = saved_argv
    return 0
