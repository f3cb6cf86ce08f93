"""The package tree reads like the data flow: no import cycles, nothing below imports the faces,
and every documented public name still imports from where the docs say."""
from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "precisiondiff"
FACES = {"cli", "testing"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict:
    """Module -> modules of the package it imports, at any depth of the file (functions included),
    leaving out imports under ``if TYPE_CHECKING:``."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        targets = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else (node.module or "")
                submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
                candidates = submodules if len(submodules) == len(node.names) else submodules + [base]
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            else:
                continue
            for target in candidates:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    targets.add(target)
        graph[name] = targets
    return graph


def _cycles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert _cycles(_import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_nothing_below_the_faces_imports_them():
    room = lambda module: (module.split(".") + [""])[1]  # noqa: E731
    offenders = [(m, t) for m, targets in _import_graph().items() for t in targets
                 if room(t) in FACES and room(m) not in FACES
                 and m not in ("precisiondiff.strategies", "precisiondiff.__main__")]  # a face itself
    assert offenders == []


def test_each_room_says_what_it_does_and_may_import():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "import" in doc.lower(), f"{init.parent.name}/__init__.py does not say what it may import"


@pytest.mark.parametrize("module, names", [
    ("precisiondiff", ["capture", "load", "compare", "bisect", "bisect_dump", "Workload", "Target",
                       "register_reference", "PrecisionDiffError"]),
    ("precisiondiff.testing", ["assert_ulp_close", "assert_parity", "assert_op_parity"]),
    ("precisiondiff.strategies", ["bit_format", "floats_of", "shapes", "broadcastable_shapes", "tensors",
                                  "special_values", "OpInputs"]),
    ("precisiondiff.compare", ["compare", "Comparison", "Row"]),
    ("precisiondiff.capture", ["capture", "CaptureSession"]),
    ("precisiondiff.store", ["load", "Dump", "tensor_key"]),
    ("precisiondiff.comparators", ["ulp_distance", "ulp_error", "compare_tensors"]),
    ("precisiondiff.cli", ["main", "cli"]),
    ("precisiondiff.watch", ["watch", "Watch", "compare_logs", "read_logs", "is_watch_log"]),
    ("precisiondiff.testing.plugin", ["ParityFixture"]),
])
def test_every_documented_name_imports(module, names):
    imported = importlib.import_module(module)
    missing = [n for n in names if getattr(imported, n, None) is None]
    assert missing == []


def test_strategies_is_the_testing_rooms_module():
    from precisiondiff import strategies
    from precisiondiff.testing import strategies as inner
    assert strategies.__all__ == inner.__all__ and strategies.tensors is inner.tensors


def test_capture_is_callable_after_its_package_is_imported():
    code = ("import precisiondiff.capture.session, precisiondiff;"
            "print(callable(precisiondiff.capture), precisiondiff.capture.capture is precisiondiff.capture.session.capture)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]


@pytest.mark.parametrize("module", ["precisiondiff.cli", "precisiondiff"])
def test_cli_runs_as_a_module(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "bisect" in out.stdout


def test_python_m_precisiondiff_passes_exit_codes_through(tmp_path):
    out = subprocess.run([sys.executable, "-m", "precisiondiff", "verify", str(tmp_path / "missing")],
                         capture_output=True, text=True)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
