"""Across machines, end to end (docs/mlu.md, "Machine A, machine B"): a replay capture on the
stand-in in one process ("machine A"), then bisect from that dump, with and without a real peer,
and compare against a CPU dump, in processes where the device is absent and cannot be imported
("machine B")."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from .test_cli import EXAMPLE, ROOT

# machine B: the stand-in cannot be imported, so nothing registers an `mlu` device
_MACHINE_B = ("import sys, torch; sys.modules['tests.mlu_backend'] = None; assert getattr(torch, 'mlu', None) is None; "
              "from precisiondiff.cli import main; main(sys.argv[1:])")


def _machine(argv, *, device: bool, env=None):
    base = {k: v for k, v in os.environ.items() if k not in ("PRECISIONDIFF_IMPORT", "MLU_STANDIN_PLANT")}
    base["PYTHONPATH"] = ROOT
    if device:
        base["PRECISIONDIFF_IMPORT"] = "tests.mlu_backend.load"
        cmd = [sys.executable, "-m", "precisiondiff.cli", *argv]
    else:
        cmd = [sys.executable, "-c", _MACHINE_B, *argv]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**base, **(env or {})}, timeout=600)


@pytest.fixture(scope="module")
def machine_a_dump(tmp_path_factory):
    import tests.mlu_backend as backend

    if not backend.active():
        pytest.skip("the plant is the stand-in's")
    out = str(tmp_path_factory.mktemp("machine_a") / "mlu")
    proc = _machine(["capture", EXAMPLE, "--target", "mlu/bf16", "--mode", "replay", "-o", out], device=True,
                    env={"MLU_STANDIN_PLANT": "gemm_chunk=1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, proc.stdout


def test_capture_says_what_to_copy_and_how_big_it_is(machine_a_dump):
    out, text = machine_a_dump
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(out) for f in files)
    line = next(x for x in text.splitlines() if x.startswith("to bisect on another machine"))
    assert f"copy {out} ({size / 2 ** 20:.1f} MiB" in line and f"precisiondiff bisect {out}" in line


def test_machine_b_bisects_with_a_real_peer_and_names_the_planted_gemm(machine_a_dump, tmp_path):
    out, _ = machine_a_dump
    proc = _machine(["bisect", out, "--peer", "cpu/bf16", "--format", "json", "-o", str(tmp_path / "r.json")],
                    device=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    culprit = result["culprit"]
    assert (culprit["name"], culprit["scope"]) == ("aten.addmm.default", "blocks.0.attn.qkv")
    peer = culprit["peer"]
    assert peer["real_peer"] == "cpu/bf16" and set(peer["peers"]) == {"float32", "decomposition", "cpu/bf16"}
    assert peer["error"] > 3 * peer["peers"]["cpu/bf16"]  # the DUT's error against the real peer's
    table = _machine(["bisect", out, "--peer", "cpu/bf16"], device=False)
    assert "errors (rel-L2): DUT " in table.stdout and "| real peer cpu/bf16 " in table.stdout


def test_machine_b_bisects_without_a_peer_too(machine_a_dump):
    out, _ = machine_a_dump
    proc = _machine(["bisect", out, "--format", "json"], device=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    culprit = json.loads(proc.stdout)["culprit"]
    assert culprit["name"] == "aten.addmm.default" and "cpu/bf16" not in culprit["peer"]["peers"]


def test_a_peer_must_run_in_the_duts_dtype(machine_a_dump):
    out, _ = machine_a_dump
    proc = _machine(["bisect", out, "--peer", "cpu/fp16"], device=False)
    assert proc.returncode == 2 and proc.stdout.count("\n") + proc.stderr.count("\n") <= 1
    assert "use cpu/bf16" in proc.stdout + proc.stderr


def test_compare_a_device_dump_with_a_cpu_dump_of_another_process(tmp_path):
    mlu, cpu = str(tmp_path / "mlu"), str(tmp_path / "cpu")
    a = _machine(["capture", EXAMPLE, "--target", "mlu/bf16", "--mode", "tensors", "-o", mlu], device=True)
    b = _machine(["capture", EXAMPLE, "--target", "cpu/float64", "--mode", "tensors", "-o", cpu], device=False)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    proc = _machine(["compare", mlu, cpu, "--format", "json"], device=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    rows = json.loads(proc.stdout)["rows"]
    assert rows and json.loads(proc.stdout)["target_a"] == "mlu/bf16"


def test_check_op_takes_a_real_peer(standin):
    from precisiondiff.testing import parity
    a, b, bias = torch.randn(32, 64), torch.randn(64, 48), torch.randn(48)
    with standin.planted(gemm_chunk=1):
        result = parity.check_op(torch.ops.aten.addmm.default, bias, a, b, target="mlu/bf16", peer="cpu/bf16")
    check = result.checks[0]
    assert not result.passed and "cpu/bf16" in check.message
    clean = parity.check_op(torch.ops.aten.addmm.default, bias, a, b, target="mlu/bf16", peer="cpu/bf16")
    assert clean.passed
