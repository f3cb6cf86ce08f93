"""Shared fixtures: the bundled example workload and small helpers."""
from __future__ import annotations

import os
import sys

import pytest

pytest_plugins = ["pytester"]  # the plugin's own tests (tests/plugin) drive throw-away pytest runs

# CI runs the property tests derandomized (each test's examples fixed by its name), so a red CI
# always reproduces; locally they explore new examples on every run.
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "tiny_transformer.py")


@pytest.fixture(scope="session")
def example_spec() -> str:
    """``examples/tiny_transformer.py:build`` as an absolute spec."""
    return f"{EXAMPLE}:build"


@pytest.fixture(scope="session")
def buggy_spec() -> str:
    return f"{EXAMPLE}:build_with_bug"


def pd_cli(*args: str, cwd: "str | None" = None, env: "dict | None" = None):
    """Run the real console entry point in a subprocess (exit codes and stderr as a user sees them)."""
    import subprocess
    return subprocess.run([sys.executable, "-m", "precisiondiff.cli", *args], capture_output=True,
                          text=True, cwd=cwd or ROOT, env={**os.environ, **(env or {})}, timeout=300)
