"""DeepSpeed as a user runs it: ``deepspeed.initialize`` on a tiny random GPT-2 of transformers'
own code, ZeRO 1 and 2, bf16, ``engine.backward`` / ``engine.step``, under ``precisiondiff
capture --script`` and ``bisect --script`` (examples/frameworks/deepspeed_gpt2.py, unmodified
framework code; DS_ACCELERATOR=cpu, gloo). Skipped without deepspeed. The first DeepSpeed start
on a machine compiles its shared-memory comm op (minutes); later starts reuse it.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # before deepspeed is imported: it picks its accelerator then
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

import precisiondiff  # noqa: E402
from tests.conftest import pd_cli  # noqa: E402

SCRIPT = str(Path(__file__).resolve().parents[2] / "examples" / "frameworks" / "deepspeed_gpt2.py")
ENV = {"OMP_NUM_THREADS": "1"}
PLANT = "pdframeworks.rough_gelu.default"


def _run(*args: str):
    return pd_cli(*args, env=ENV)


def _losses(stdout: str) -> list:
    return re.findall(r"^step \d+ loss (\S+)$", stdout, flags=re.M)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same model and step without DeepSpeed, captured in float64 (one process)."""
    out = tmp_path_factory.mktemp("ds") / "ref"
    r = _run("capture", f"{SCRIPT}:build", "--target", "cpu/float64", "-o", str(out), "--mode", "stats")
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def zero2_module(tmp_path_factory):
    """ZeRO-2 bf16, module level, stats mode, the first of 2 steps (the reference has one); and
    the losses the script printed."""
    out = tmp_path_factory.mktemp("ds") / "z2"
    r = _run("capture", "--script", SCRIPT, "-o", str(out), "--level", "module", "--mode", "stats",
             "--steps", "0", "--", "--zero", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    return out, _losses(r.stdout)


def test_module_capture_under_zero2_records_every_block_and_keeps_the_losses(zero2_module):
    out, captured = zero2_module
    plain = subprocess.run([sys.executable, SCRIPT, "--zero", "2"], capture_output=True, text=True,
                           env={**os.environ, **ENV}, timeout=600)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert captured == _losses(plain.stdout) and len(captured) == 2
    dump = precisiondiff.load(out)
    scopes = {ev.scope for ev in dump.events() if ev.kind == "module"}
    for block in ("transformer.h.0", "transformer.h.1.mlp", "lm_head"):
        assert any(s.endswith(block) for s in scopes), (block, sorted(scopes)[:20])
    assert {ev.direction for ev in dump.events() if ev.kind == "module"} == {"forward", "backward"}


def test_op_capture_in_replay_mode_under_zero1(tmp_path):
    out = tmp_path / "z1"
    r = _run("capture", "--script", SCRIPT, "-o", str(out), "--level", "op", "--mode", "replay",
             "--", "--zero", "1", "--steps", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    events = list(precisiondiff.load(out).events())
    mlp = [ev for ev in events if ev.kind == "op" and ev.scope.endswith("transformer.h.1.mlp.c_fc")]
    assert any(ev.name == "aten.addmm.default" and ev.direction == "forward" for ev in mlp), mlp[:5]
    assert pd_cli("verify", str(out)).returncode == 0


def test_compare_with_a_float64_reference_aligns_through_the_engine(zero2_module, reference):
    out, _ = zero2_module
    result = precisiondiff.compare(str(out), str(reference), kind="module")
    aligned = [row for row in result.rows if row.match and row.scope.endswith("transformer.h.1.mlp")]
    assert aligned, result.summary
    assert all(row.dtype_a == "bfloat16" and row.dtype_b == "float64" for row in aligned)


def _bisect(tmp_path, *script_args: str) -> tuple:
    report = tmp_path / "bisect.json"
    r = _run("bisect", "--script", SCRIPT, "--format", "json", "-o", str(report), "--", *script_args)
    assert report.exists(), (r.returncode, r.stderr[-3000:])
    return r.returncode, json.loads(report.read_text())


@pytest.mark.xfail(strict=True, reason="the stock CPU bf16 aten.native_layer_norm_backward of ln_f is blamed "
                   "(output.2, the bias gradient: 38.5 ULP against the peers' 0.48); the plain workload "
                   "without DeepSpeed gets the same verdict (`bisect deepspeed_gpt2.py:build --target cpu/bf16`)")
def test_bisect_of_a_clean_zero1_job_gets_no_kernel_verdict(tmp_path):
    code, report = _bisect(tmp_path, "--zero", "1")
    assert report["verdict"] in ("parity", "accumulated"), report.get("culprit")


def test_bisect_script_names_the_planted_gelu_in_block_1(tmp_path):
    code, report = _bisect(tmp_path, "--zero", "1", "--plant")
    c = report["culprit"]
    assert code == 1 and (c["kind"], c["name"], c["direction"]) == ("op", PLANT, "forward"), c
    assert c["scope"].endswith("transformer.h.1.mlp.act"), c


@pytest.fixture(scope="module")
def api_planted(tmp_path_factory):
    """One planted ZeRO-1 bf16 step captured with the Python API after deepspeed.initialize."""
    out = tmp_path_factory.mktemp("ds") / "api"
    r = subprocess.run([sys.executable, SCRIPT, "--zero", "1", "--plant", "--steps", "1", "--capture", str(out)],
                       capture_output=True, text=True, env={**os.environ, **ENV}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _bisect_dump(tmp_path, dump, *args: str) -> tuple:
    report = tmp_path / "bisect.json"
    r = _run("bisect", str(dump), "--format", "json", "-o", str(report), *args)
    assert report.exists(), (r.returncode, r.stderr[-3000:])
    return r.returncode, json.loads(report.read_text())


def test_bisect_of_an_api_capture_with_its_workload_names_the_plant(api_planted, tmp_path):
    code, report = _bisect_dump(tmp_path, api_planted, "--workload", f"{SCRIPT}:build_planted_engine_shaped")
    c = report["culprit"]
    assert code == 1 and (c["kind"], c["name"], c["scope"], c["direction"]) == \
        ("op", PLANT, "module.transformer.h.1.mlp.act", "forward"), c


@pytest.mark.xfail(strict=True, reason="without --workload the bisect blames the stock "
                   "aten.native_layer_norm_backward.default in module.transformer.ln_f (backward), as in the "
                   "clean job, not the forward plant")
def test_bisect_of_an_api_capture_without_workload_names_the_plant(api_planted, tmp_path):
    code, report = _bisect_dump(tmp_path, api_planted)
    assert (report["culprit"] or {}).get("name") == PLANT, report["culprit"]
