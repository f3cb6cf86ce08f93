"""pytest plugin for a session "on an MLU machine": ``pytest -p tests.mlu_backend.plugin tests/mlu``.

Builds (once per machine: the build directory is a cache) and registers the stand-in before
collection, and reports the build time in the header. A failed build ends the session with the
compiler's message: nothing is skipped.
"""
from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    from . import BUILD_DIR, build, register

    try:
        seconds = build()
    except Exception as err:  # the compiler's output is in the message
        raise pytest.UsageError(f"the mlu stand-in failed to build in {BUILD_DIR}:\n{err}") from err
    register()
    config.stash[_SECONDS] = seconds


_SECONDS = pytest.StashKey[float]()


def pytest_report_header(config: pytest.Config) -> str:
    return _line(config)


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    terminalreporter.write_line(_line(config))


def _line(config: pytest.Config) -> str:
    from . import BUILD_DIR

    return f"mlu stand-in: built or loaded in {config.stash[_SECONDS]:.1f} s ({BUILD_DIR})"
