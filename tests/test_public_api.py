import subprocess
import sys

import precisiondiff


def test_public_api_is_pinned():
    assert precisiondiff.__all__ == ["PrecisionDiffError", "Target", "Workload", "bisect", "bisect_dump",
                                     "capture", "compare", "load", "register_reference", "watch", "__version__"]
    for name in precisiondiff.__all__:
        assert getattr(precisiondiff, name) is not None, name


def test_import_stays_cheap():
    code = ("import sys, precisiondiff; heavy = [m for m in ('h5py', 'rich', 'matplotlib', 'torch_mlu', "
            "'hypothesis', 'safetensors', 'click') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_py_typed_is_shipped():
    import importlib.resources
    assert importlib.resources.files("precisiondiff").joinpath("py.typed").is_file()


def test_compare_and_bisect_are_callable_even_after_their_modules_are_imported(tmp_path):
    code = ("import precisiondiff.cli, precisiondiff, precisiondiff.compare, precisiondiff.bisect;"
            "import inspect;"
            "print(callable(precisiondiff.compare), callable(precisiondiff.bisect),"
            " callable(precisiondiff.compare.compare), callable(precisiondiff.bisect.bisect))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True"] * 4


def test_compare_through_the_package(tmp_path):
    from precisiondiff.store import DumpWriter
    import torch
    for side in ("a", "b"):
        with DumpWriter(tmp_path / side, meta={"target": "cpu/fp32"}) as w:
            t = torch.ones(3)
            w.write_event({"seq": 0, "step": 0, "kind": "op", "scope": "", "name": "aten.add.Tensor",
                           "direction": "forward", "call": 0, "device": "cpu", "args": None,
                           "tensors": [{"key": "/aten.add.Tensor#0:forward:output.0", "slot": "output.0",
                                        "dtype": "float32", "shape": [3], "stats": {},
                                        "data_key": "/aten.add.Tensor#0:forward:output.0"}]},
                          {"/aten.add.Tensor#0:forward:output.0": t})
    result = precisiondiff.compare(tmp_path / "a", tmp_path / "b")
    assert result.summary["tensors"] == 1 and result.summary["failed"] == 0
