"""The product on an MLU, as a user types it: ``--target mlu/bf16`` through capture, ls, compare, bisect.

The commands run in this process (click's CliRunner), where the session registered the device;
``test_a_user_process_gets_the_device_from_precisiondiff_import`` runs the console entry point in a
fresh process the way a user on a machine without torch_mlu would.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

import precisiondiff
from precisiondiff.cli import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "tiny_transformer.py") + ":build"


def pd(*args: str) -> "tuple[int, str]":
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def _bytes(dump) -> int:
    return sum(math.prod(t.shape) * getattr(torch, t.dtype).itemsize for e in dump.events() for t in e.tensors)


@pytest.fixture(scope="module")
def stats_dump(tmp_path_factory):
    """A stats capture of the example on ``mlu/bf16``, and the bytes and copies it read back."""
    import tests.mlu_backend as backend

    if not backend.active():
        pytest.skip("read-back traffic is counted by the stand-in")
    backend.set_unimplemented(backend.DEFAULT_UNIMPLEMENTED)
    out_dir = str(tmp_path_factory.mktemp("stats") / "d")
    before = backend.to_host_traffic()
    code, out = pd("capture", EXAMPLE, "--target", "mlu/bf16", "-o", out_dir, "--mode", "stats")
    traffic = tuple(a - b for a, b in zip(backend.to_host_traffic(), before))
    assert code == 0, out
    assert "on mlu/bf16 (all/stats" in out
    return out_dir, traffic


def test_stats_capture_computes_on_the_device_and_reads_back_only_summaries(stats_dump):
    out_dir, (nbytes, copies) = stats_dump
    dump = precisiondiff.load(out_dir)
    assert dump.meta["target"] == "mlu/bf16"
    assert {e.device for e in dump.events() if e.name == "aten.addmm.default"} == {"mlu:0"}
    # a few batched read-backs of statistics, not the tensors (3.7 MB of them)
    assert nbytes < _bytes(dump) / 50 and copies < 20, (nbytes, copies, _bytes(dump))


def test_ops_the_device_lacks_are_recorded_as_run_on_the_cpu_and_ls_marks_them(stats_dump):
    out_dir, _ = stats_dump
    devices = {(e.name, e.device) for e in precisiondiff.load(out_dir).events() if e.kind == "op"}
    assert ("aten.gelu.default", "cpu") in devices and ("aten.gelu_backward.default", "cpu") in devices
    assert ("aten.addmm.default", "mlu:0") in devices
    code, listing = pd("ls", out_dir, "--kind", "op", "--limit", "1000")
    assert code == 0
    rows = [line for line in listing.splitlines() if line.startswith("│") and ("aten.gelu" in line or "aten.addmm" in line)]
    assert rows and all(("cpu (fallback)" in r) == ("gelu" in r) for r in rows), "\n".join(rows)
    assert "CPU fallback" in listing and "aten.gelu.default x2" in listing.split("CPU fallback")[1]


@pytest.mark.parametrize("mode", ["tensors", "replay"])
def test_tensor_dumps_on_the_device_hold_the_cpu_bf16_numbers(standin, tmp_path, mode):
    for target, name in (("mlu/bf16", "mlu"), ("cpu/bf16", "cpu")):
        code, out = pd("capture", EXAMPLE, "--target", target, "-o", str(tmp_path / name), "--mode", mode)
        assert code == 0, out
    mlu, cpu = precisiondiff.load(str(tmp_path / "mlu")), precisiondiff.load(str(tmp_path / "cpu"))
    cpu_keys = {t.key for e in cpu.events() for t in e.tensors if t.has_data}
    checked = 0
    for ev in mlu.events():
        if ev.kind == "module" and ev.direction == "forward":
            for t in ev.tensors:
                if t.has_data and t.key in cpu_keys:
                    assert torch.equal(mlu.tensor(t.key), cpu.tensor(t.key)), t.key
                    checked += 1
    assert checked > 20
    if mode == "replay":
        assert any(e.args for e in mlu.events() if e.kind == "op")


def test_compare_against_cpu_float64(standin, tmp_path):
    for target, name in (("mlu/bf16", "mlu"), ("cpu/float64", "ref")):
        assert pd("capture", EXAMPLE, "--target", target, "-o", str(tmp_path / name), "--mode", "tensors")[0] == 0
    code, out = pd("compare", str(tmp_path / "mlu"), str(tmp_path / "ref"), "--format", "json")
    report = json.loads(out)
    assert code == 0 and report["summary"]["failed"] == 0 and report["summary"]["tensors"] > 200
    standin.plant(gemm_chunk=1)
    assert pd("capture", EXAMPLE, "--target", "mlu/bf16", "-o", str(tmp_path / "bad"), "--mode", "tensors")[0] == 0
    code, out = pd("compare", str(tmp_path / "bad"), str(tmp_path / "ref"), "--format", "json")
    report = json.loads(out)
    assert code == 1 and report["summary"]["failed"] > 0


def test_bisect_names_the_planted_device_gemm(standin):
    standin.plant(gemm_chunk=1)
    code, out = pd("bisect", EXAMPLE, "--target", "mlu/bf16", "--format", "json")
    result = json.loads(out)
    assert code == 1 and result["verdict"] == "kernel", out
    assert (result["dut"], result["ref"]) == ("mlu/bf16", "cpu/float64")
    culprit = result["culprit"]
    assert (culprit["name"], culprit["scope"], culprit["direction"]) == ("aten.addmm.default", "blocks.0.attn.qkv", "forward")


def test_bisect_under_autocast_on_the_device(standin):
    standin.plant(gemm_chunk=1)
    code, out = pd("bisect", EXAMPLE, "--target", "mlu/bf16+autocast", "--format", "json", "--direction", "forward")
    result = json.loads(out)
    assert code == 1 and result["dut"] == "mlu/bf16+autocast"
    assert result["verdict"] == "kernel" and result["culprit"]["name"] in ("aten.addmm.default", "aten.mm.default")


def test_a_user_process_gets_the_device_from_precisiondiff_import(standin):
    env = {**os.environ, "PYTHONPATH": ROOT, "PRECISIONDIFF_IMPORT": "tests.mlu_backend.load",
           "MLU_STANDIN_PLANT": "gemm_chunk=1"}
    proc = subprocess.run([sys.executable, "-m", "precisiondiff.cli", "bisect", EXAMPLE, "--target", "mlu/bf16"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "bisect mlu/bf16 vs cpu/float64: KERNEL" in proc.stdout
    assert "culprit: op aten.addmm.default in blocks.0.attn.qkv (forward, call 0)" in proc.stdout


def test_a_replay_dump_from_the_device_bisects_on_a_machine_without_it(standin, tmp_path):
    standin.plant(gemm_chunk=1)
    dump = str(tmp_path / "mlu")
    assert pd("capture", EXAMPLE, "--target", "mlu/bf16", "-o", dump, "--mode", "replay")[0] == 0
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PRECISIONDIFF_IMPORT", "MLU_STANDIN"))}
    proc = subprocess.run([sys.executable, "-m", "precisiondiff.cli", "bisect", dump, "--workload", EXAMPLE,
                           "--format", "json"], capture_output=True, text=True, cwd=ROOT,
                          env={**env, "PYTHONPATH": ROOT}, timeout=300)
    result = json.loads(proc.stdout)
    assert proc.returncode == 1 and result["dut"] == "mlu/bf16" and result["verdict"] == "kernel", proc.stderr
    assert (result["culprit"]["name"], result["culprit"]["scope"]) == ("aten.addmm.default", "blocks.0.attn.qkv")
