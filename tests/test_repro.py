"""A repro the kernel team can run (precisiondiff/bisect/repro.py): written from a bisect of a
planted bf16 GEMM (a custom op), it exits 1 with the plant on and 0 with it off, in an isolated
process without precisiondiff; ``repro RESULT.json``, ``check_op`` and its pytest file do the same."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

import precisiondiff
from precisiondiff.cli import cli
from precisiondiff.testing import parity
from tests.repro import planted_gemm
from tests.repro.isolated import ROOT, run_repro

PLANT = ["tests/__init__.py", "tests/repro/__init__.py", "tests/repro/planted_gemm.py"]


def _isolated(repro_dir, tmp_path, plant: str):
    return run_repro(str(repro_dir), str(tmp_path / "site"), packages=PLANT, imports="tests.repro.planted_gemm",
                     env={"PDREPRO_PLANT": plant})


@pytest.fixture(scope="module")
def live_repro(tmp_path_factory):
    """A live bisect of the planted workload on cpu/bf16 with a repro written."""
    out = tmp_path_factory.mktemp("live") / "repro"
    result = precisiondiff.bisect(planted_gemm.workload, target="cpu/bf16", repro=str(out))
    return result, out


def test_bisect_names_the_planted_gemm_and_writes_its_repro(live_repro):
    result, out = live_repro
    assert result.verdict == "kernel" and result.culprit["name"] == "pdrepro.matmul.default"
    files = result.culprit["repro"]["files"]
    assert sorted(files) == ["case.json", "case.safetensors", "repro.py", "test_repro.py"]
    assert all(os.path.getsize(out / name) == size for name, size in files.items())
    case = json.loads((out / "case.json").read_text())
    assert case["op"] == "pdrepro.matmul.default" and case["target"] == "cpu/bf16" and case["ref"] == "cpu/float64"
    spec = case["outputs"][0]
    assert spec["bound"] == pytest.approx(result.culprit["peer"]["bound"]) and spec["error"] > spec["bound"]
    from safetensors.torch import load_file
    data = load_file(str(out / "case.safetensors"))
    # only the culprit's tensors: its two inputs, the golden, its scale and the DUT's output
    assert sorted(data) == ["dut.output.0", "golden.output.0", "input.0", "input.1", "scale.output.0"]
    assert data["golden.output.0"].dtype == torch.float64 and data["input.0"].dtype == torch.bfloat16
    assert "precisiondiff" not in (out / "repro.py").read_text().split('"""')[2]  # imports torch only


def test_the_repro_exits_1_while_the_kernel_is_wrong_and_0_once_fixed(live_repro, tmp_path):
    _, out = live_repro
    wrong = _isolated(out, tmp_path, "1")
    assert wrong.returncode == 1, wrong.stdout + wrong.stderr
    assert "output.0: WRONG" in wrong.stdout and "pdrepro.matmul.default on cpu" in wrong.stdout
    fixed = _isolated(out, tmp_path, "0")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "output.0: ok" in fixed.stdout and "fixed (exit 0)" in fixed.stdout


def test_the_isolated_process_cannot_import_precisiondiff(tmp_path):
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "repro.py").write_text("import precisiondiff\n")
    proc = run_repro(str(probe), str(tmp_path / "site"))
    assert proc.returncode == 1 and ("ModuleNotFoundError" in proc.stderr or "ImportError" in proc.stderr)


def test_a_repro_with_no_device_extension_says_so_in_one_line(live_repro, tmp_path):
    _, out = live_repro
    proc = run_repro(str(out), str(tmp_path / "site"))  # pdrepro never imported: the op is unknown
    assert proc.returncode == 2 and proc.stdout.strip().startswith("error: cannot run pdrepro.matmul.default")


def test_repro_of_a_replay_dump_bisect_result(tmp_path):
    model = planted_gemm.PlantedNet().to(torch.bfloat16)
    x = torch.randn(16, 32).to(torch.bfloat16)
    with precisiondiff.capture(str(tmp_path / "dut"), model=model, mode="replay"):
        model(x)
    result = precisiondiff.bisect_dump(str(tmp_path / "dut"))
    assert result.culprit["dump"] == str(tmp_path / "dut")
    assert set(result.culprit["keys"]) >= {"input.0", "input.1", "output.0"}
    (tmp_path / "result.json").write_text(result.dumps())
    out = CliRunner().invoke(cli, ["repro", str(tmp_path / "result.json"), "-o", str(tmp_path / "repro")])
    assert out.exit_code == 0, out.output
    assert "case.safetensors" in out.output and "bytes" in out.output
    wrong = _isolated(tmp_path / "repro", tmp_path, "1")
    assert wrong.returncode == 1 and "output.0: WRONG" in wrong.stdout, wrong.stdout + wrong.stderr


def test_repro_refuses_a_result_without_a_dump_in_one_line(live_repro, tmp_path):
    result, _ = live_repro
    data = result.to_json()
    data["culprit"].pop("dump", None)
    (tmp_path / "r.json").write_text(json.dumps(data))
    out = CliRunner().invoke(cli, ["repro", str(tmp_path / "r.json"), "-o", str(tmp_path / "x")])
    assert out.exit_code == 2 and len(out.output.strip().splitlines()) == 1
    assert "--repro DIR" in out.output
    out = CliRunner().invoke(cli, ["repro", str(tmp_path / "missing.json"), "-o", str(tmp_path / "x")])
    assert out.exit_code == 2 and "cannot read" in out.output


def test_a_failing_check_op_under_a_dump_dir_writes_the_repro(tmp_path):
    a, b = torch.randn(16, 32), torch.randn(32, 8)
    result = parity.check_op(torch.ops.pdrepro.matmul.default, a, b, target="cpu/bf16", dump_dir=str(tmp_path))
    assert not result.passed and result.dumps["repro"] == str(tmp_path / "repro")
    assert "repro of the failing op" in result.report()
    wrong, fixed = (_isolated(tmp_path / "repro", tmp_path, plant) for plant in "10")
    assert wrong.returncode == 1 and "output.0: WRONG" in wrong.stdout, wrong.stdout + wrong.stderr
    assert fixed.returncode == 0 and "output.0: ok" in fixed.stdout, fixed.stdout + fixed.stderr
    passing = parity.check_op(torch.ops.aten.mm.default, a, b, target="cpu/bf16", dump_dir=str(tmp_path / "ok"))
    assert passing.passed and not (tmp_path / "ok").exists()


def test_the_repros_pytest_file_fails_while_wrong_and_passes_once_fixed(live_repro):
    _, out = live_repro
    env = {**os.environ, "PYTHONPATH": ROOT, "REPRO_IMPORT": "tests.repro.planted_gemm"}
    runs = {}
    for plant in ("1", "0"):
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--parity-target",
                               "cpu/bf16", str(out / "test_repro.py")], capture_output=True, text=True,
                              cwd=str(out), env={**env, "PDREPRO_PLANT": plant}, timeout=300)
        runs[plant] = proc
    assert runs["1"].returncode == 1 and "1 failed" in runs["1"].stdout, runs["1"].stdout[-2000:]
    assert runs["0"].returncode == 0 and "1 passed" in runs["0"].stdout, runs["0"].stdout[-2000:]


def test_a_failing_check_under_a_dump_dir_writes_the_culprits_repro(tmp_path):
    result = parity.check(planted_gemm.workload, target="cpu/bf16", kernels=True, dump_dir=str(tmp_path))
    assert not result.passed and result.bisect["culprit"]["name"] == "pdrepro.matmul.default"
    assert result.dumps["repro"] == str(tmp_path / "repro")
    case = json.loads((tmp_path / "repro" / "case.json").read_text())
    assert case["op"] == "pdrepro.matmul.default" and case["finding"]["scope"] == ""
