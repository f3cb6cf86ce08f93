"""A workload file is executed once per process: loading ``file.py:fn`` again, or loading a file
that is already imported as a module, reuses that module. A second execution would redefine its
``torch.library`` ops, which frees the dispatcher entries the first module's ops still call
(in the suite: std::bad_alloc and "Tried to access the schema" in later forwards)."""
from __future__ import annotations

from precisiondiff.runtime.workload import _load_module
from tests.bisect import planted


def test_a_file_already_imported_as_a_module_is_not_executed_again():
    assert _load_module("tests/bisect/planted.py") is planted
    assert planted.fused_softmax._opoverload is __import__("torch").ops.pdtest.fused_softmax.default


def test_a_workload_file_is_executed_once(tmp_path):
    path = tmp_path / "wl.py"
    path.write_text("TOKEN = object()\n")
    first = _load_module(str(path))
    again = _load_module(str(path))
    assert again is first and again.TOKEN is first.TOKEN
