"""Shared fixtures: the bundled example workload and small helpers."""
from __future__ import annotations

import os
import sys

import pytest

pytest_plugins = ["pytester"]  # the plugin's own tests (tests/plugin) drive throw-away pytest runs

# CI runs the property tests derandomized (each test's examples fixed by its name), so a red CI
# always reproduces; locally they explore new examples on every run.
from hypothesis import settings  # noqa: E402

# pytest-xdist's workers (`make test` runs two) inherit COLUMNS=80 from execnet; the CLI sizes its
# tables by COLUMNS when stdout is not a terminal, so a worker would see narrower tables (cut
# names) than a plain run. The suite runs as a plain run would.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.pop("COLUMNS", None)
    os.environ.pop("LINES", None)
    # numba's cache is not safe to fill from two processes at once (numba#4807: a worker loading
    # the other's half-written cache can crash; an xdist worker died so in CI on a fresh clone):
    # each xdist worker gets its own cache directory, kept between runs under build/
    os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__))), "build", "numba-cache", os.environ["PYTEST_XDIST_WORKER"]))

settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

# Tests whose verdicts run through stock PyTorch CPU kernels: bisect and the plugin over real
# models, property tests over stock ops, capture and compare of real runs. Their vectorized paths
# differ between instruction sets (AVX512, AVX2, the portable one), so CI runs these again with
# ATEN_CPU_CAPABILITY=default and =avx2 (the Makefile's `test`; PyTorch reads the variable at
# start-up): a verdict must not depend on the CPU. Two extra passes cost CI time: keep the set to
# what exercises stock kernels (about 40 s a pass on a 2-core machine).
STOCK_KERNEL_TESTS = (
    "tests/bisect/test_attention_references.py",
    "tests/bisect/test_live.py",
    "tests/bisect/test_noise.py",
    "tests/bisect/test_offline.py",
    "tests/bisect/test_optimizer.py",
    "tests/capture/test_capture.py",
    "tests/compare/test_compare.py",
    "tests/compare/test_constants.py",
    "tests/compare/test_suspects.py",
    "tests/plugin/test_assertions.py",
    "tests/plugin/test_plugin.py",
    "tests/test_testing.py",
    "examples/test_model_zoo.py",
)


# the longest tests, started first so that no xdist worker is left with one of them at the end
FIRST = ("tests/test_mlu_standin.py",)


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("::")[0] in STOCK_KERNEL_TESTS:
            item.add_marker(pytest.mark.stock_kernels)
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in FIRST)  # stable: the rest keep their order


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
