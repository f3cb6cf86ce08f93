"""The notebooks in notebooks/ run from top to bottom on the CPU (kernel: this interpreter, through
ipykernel) and are committed without outputs, so they cannot rot."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS] == ["01_capture_compare_bisect.ipynb", "02_parity_tests_for_a_model_zoo.ipynb",
                                           "03_numerics_card.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_without_outputs(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    dirty = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
             and (c.get("outputs") or c.get("execution_count") is not None)]
    assert dirty == [], (f"{path.name}: cells {dirty} hold outputs; strip them with "
                         f"`jupyter nbconvert --clear-output --inplace {path.relative_to(ROOT)}`")


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    """A kernel spec that runs this very interpreter (not whatever 'python3' is installed)."""
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / "precisiondiff-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "precisiondiff tests", "language": "python"}))
    return root


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # jupyter_client's own path migration notices
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, kernel_dir, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("JUPYTER_PATH", str(kernel_dir))
    # the kernel imports this checkout's precisiondiff, one thread per op as on CI's 2 cores
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(str(path), as_version=4)
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="precisiondiff-test",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on a failing cell
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert errors == []
