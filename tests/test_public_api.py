import subprocess
import sys

import precisiondiff


def test_public_api_is_pinned():
    assert precisiondiff.__all__ == ["PrecisionDiffError", "Target", "Workload", "bisect", "bisect_dump",
                                     "capture", "compare", "load", "register_reference", "__version__"]
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
