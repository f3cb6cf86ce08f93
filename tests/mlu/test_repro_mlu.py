"""The hand-off on the stand-in: a repro of the planted device GEMM, written by ``bisect --repro``
on ``mlu/bf16``, exits 1 with the plant on and 0 with it off in an isolated process that has the
device's extension (a copy of the stand-in package) and no precisiondiff."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from precisiondiff.cli import cli
from tests.repro.isolated import run_repro

from .test_cli import EXAMPLE

BACKEND = ["tests/__init__.py", "tests/mlu_backend"]


@pytest.fixture(scope="module")
def planted_repro(tmp_path_factory):
    import tests.mlu_backend as backend

    if not backend.active():
        pytest.skip("the plant is the stand-in's")
    out = tmp_path_factory.mktemp("mlu") / "repro"
    with backend.planted(gemm_chunk=1):
        result = CliRunner().invoke(cli, ["bisect", EXAMPLE, "--target", "mlu/bf16", "--repro", str(out),
                                          "--max-elements", "6000"], catch_exceptions=False)
    assert result.exit_code == 1, result.output
    return out, result.output


def _run(out, tmp_path, plant: str):
    from tests.mlu_backend import BUILD_DIR
    return run_repro(str(out), str(tmp_path / "site"), packages=BACKEND, imports="tests.mlu_backend.load",
                     env={"MLU_STANDIN_PLANT": plant, "MLU_STANDIN_BUILD_DIR": BUILD_DIR})


def test_bisect_names_the_planted_gemm_and_writes_a_sliced_repro(planted_repro):
    out, text = planted_repro
    assert "culprit: op aten.addmm.default in blocks.0.attn.qkv" in text and f"repro: {out}" in text
    case = json.loads((out / "case.json").read_text())
    assert case["op"] == "aten.addmm.default" and case["device"] == "mlu" and case["target"] == "mlu/bf16"
    assert case["outputs"][0]["l2_judged"] is False and "sliced to" in case["notes"][0]
    from safetensors.torch import load_file
    data = load_file(str(out / "case.safetensors"))
    rows = data["input.1"].shape[0]
    assert rows < 32 and data["golden.output.0"].shape[0] == rows  # of the 32 rows of the whole GEMM


def test_the_device_repro_exits_1_with_the_plant_and_0_without(planted_repro, tmp_path):
    out, _ = planted_repro
    wrong = _run(out, tmp_path, "gemm_chunk=1")
    assert wrong.returncode == 1 and "aten.addmm.default on mlu (mlu/bf16)" in wrong.stdout, wrong.stdout + wrong.stderr
    fixed = _run(out, tmp_path, "")
    assert fixed.returncode == 0 and "fixed (exit 0)" in fixed.stdout, fixed.stdout + fixed.stderr
