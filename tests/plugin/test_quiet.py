"""Installing precisiondiff must not slow or change unrelated test suites: the plugin loads
neither torch nor click (nor numpy, safetensors, h5py, rich) until a test asks for parity."""
from __future__ import annotations

import os
import subprocess
import sys

UNRELATED = """
import sys

def test_unrelated(request):
    assert request.config.pluginmanager.hasplugin("precisiondiff")  # the plugin is active
    heavy = [m for m in ("torch", "torch_mlu", "numpy", "click", "safetensors", "h5py", "rich")
             if m in sys.modules]
    assert heavy == []
"""


def _pytest(path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__)))), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=path, capture_output=True, text=True, env=env, timeout=120)


def test_an_unrelated_suite_loads_no_torch(tmp_path):
    (tmp_path / "test_unrelated.py").write_text(UNRELATED)
    out = _pytest(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed" in out.stdout
