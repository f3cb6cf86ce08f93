"""The MLU suite (tests/mlu), run in a pytest session of its own on the stand-in accelerator.

Registering a PrivateUse1 backend cannot be undone, and once ``torch.mlu`` exists the default
device under test becomes ``mlu``; so the suite runs in a child session
(``pytest -p tests.mlu_backend.plugin tests/mlu``), the way it runs on a real MLU machine, and this
test asserts that every one of its tests ran and passed. A failed build fails this test with the
compiler's output; only a machine without a C++ compiler skips it.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def test_mlu_suite_runs_on_the_standin_accelerator(capsys):
    if not any(shutil.which(cc) for cc in (os.environ.get("CXX", "c++"), "c++", "g++")):
        pytest.skip("no C++ compiler: the stand-in accelerator cannot be built")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.mlu_backend.plugin", "tests/mlu",
                           "-q", "-rs"], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))})
    out = proc.stdout + proc.stderr
    tail = "\n".join(out.splitlines()[-60:])
    assert proc.returncode == 0, f"the MLU suite failed (exit {proc.returncode}):\n{tail}"
    summary = out.strip().splitlines()[-1]
    assert "skipped" not in summary and "deselected" not in summary, summary
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 20, summary
    header = next((line for line in out.splitlines() if line.startswith("mlu stand-in:")), "")
    with capsys.disabled():
        print(f"\n{header}; {summary}")
