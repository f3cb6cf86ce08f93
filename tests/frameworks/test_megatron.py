"""megatron-core as a user runs it: its own ``GPTModel`` and tensor-parallel layers (tiny, random
weights), TP=1 and TP=2 on gloo, Megatron's ``Float16Module`` for bf16 and its vocab-parallel
cross entropy (examples/frameworks/megatron_gpt.py, megatron's code unchanged). On this CPU
machine the example installs tests/frameworks/megatron_shim.py (megatron-core hard-wires CUDA
in four places). Skipped without megatron-core.

Process starts are few (each imports megatron, ~6 s of CPU): the float64 reference and the
script capture through the CLI, one plain run, one API capture, and two 2-rank ``torchrun``
bisects; the workload bisects run in this process (a 1-process gloo group, destroyed after).
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

pytest.importorskip("megatron.core")
# megatron warns when apex / Transformer Engine are missing and about its own deprecations
pytestmark = pytest.mark.filterwarnings("ignore::Warning:megatron")

import precisiondiff  # noqa: E402
from precisiondiff.compare.ranks import check_replicas  # noqa: E402
from tests.conftest import pd_cli  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SPEC = str(ROOT / "examples" / "frameworks" / "megatron_gpt.py")
ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
PLANT = "pdframeworks.rough_gelu_mg.default"


def _losses(stdout: str) -> list:
    return re.findall(r"^step \d+ loss (\S+)$", stdout, flags=re.M)


def _python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **ENV}, timeout=600)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single-process float64 reference, through the ``file.py:fn`` path: its model holds
    Megatron's ProcessGroup handles, which copy.deepcopy cannot copy."""
    out = tmp_path_factory.mktemp("mg") / "ref"
    r = pd_cli("capture", f"{SPEC}:build", "--target", "cpu/float64", "-o", str(out), env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def script_dump(tmp_path_factory):
    """TP=1, bf16 through Float16Module, every level in replay mode, the first of 2 steps."""
    out = tmp_path_factory.mktemp("mg") / "script"
    r = pd_cli("capture", "--script", SPEC, "-o", str(out), "--level", "all", "--mode", "replay",
               "--steps", "0", "--", "--bf16", env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, _losses(r.stdout)


def test_the_reference_is_the_model_in_float64(reference):
    dump = precisiondiff.load(reference)
    linear = [t for ev in dump.events() for t in ev.tensors
              if ev.kind == "module" and ev.scope == "decoder.layers.1.mlp.linear_fc1" and ev.direction == "forward"]
    assert linear and {t.dtype for t in linear if t.slot.startswith("output")} == {"float64"}


def test_script_capture_keeps_the_losses_and_records_modules_and_ops(script_dump):
    out, captured = script_dump
    plain = _python(SPEC, "--bf16")
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert captured == _losses(plain.stdout) and len(captured) == 2
    events = list(precisiondiff.load(out).events())
    fc1 = "module.decoder.layers.1.mlp.linear_fc1"
    assert {ev.direction for ev in events if ev.kind == "module" and ev.scope == fc1} == {"forward", "backward"}
    assert any(ev.kind == "op" and ev.scope == fc1 and ev.direction == "forward" and ev.name.startswith("aten.")
               for ev in events)
    assert pd_cli("verify", str(out)).returncode == 0


def test_compare_with_the_float64_reference_sees_through_float16module(script_dump, reference):
    out, _ = script_dump
    result = precisiondiff.compare(str(out), str(reference), kind="module")
    assert result.exit_code == 0, [r.message for r in result.rows if r.verdict == "fail"]
    assert any("'module.'" in n and "Float16Module" in n for n in result.notes), result.notes
    aligned = [row for row in result.rows if row.match and row.scope == "module.decoder.layers.1.mlp"]
    assert aligned and all((row.dtype_a, row.dtype_b) == ("bfloat16", "float64") for row in aligned)
    # the op level aligns as well (the script's optimizer updates and its own ops stay unmatched)
    ops = precisiondiff.compare(str(out), str(reference))
    matched = {row.scope for row in ops.rows if row.match and row.kind == "op"}
    assert "module.decoder.layers.1.mlp.linear_fc1" in matched, sorted(matched)[:10]


@pytest.fixture(scope="module")
def in_process():
    """The workload bisects below build the model here, in a 1-process gloo group: destroyed after."""
    yield
    import torch.distributed as dist
    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_bisect_of_the_clean_workload_gets_no_kernel_verdict(in_process):
    """Parity or accumulated; a documented stock finding on the way is listed in ``accepted``."""
    result = precisiondiff.bisect(f"{SPEC}:build", target="cpu/bf16")
    assert result.verdict in ("parity", "accumulated") and result.culprits == [], result.culprit
    assert all(a.get("known") for a in result.accepted), result.accepted


def test_bisect_of_the_planted_workload_names_the_plant(in_process):
    result = precisiondiff.bisect(f"{SPEC}:build_planted", target="cpu/bf16")
    c = result.culprit
    assert result.verdict == "kernel" and (c["kind"], c["name"], c["scope"], c["direction"]) == \
        ("op", PLANT, "decoder.layers.1.mlp", "forward"), c


def test_bisect_of_an_api_capture_names_the_plant(tmp_path, in_process):
    out = tmp_path / "api"
    r = _python(SPEC, "--bf16", "--plant", "--steps", "1", "--capture", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    result = precisiondiff.bisect_dump(str(out), workload=f"{SPEC}:build_planted_wrapped")
    c = result.culprit
    assert (c["kind"], c["name"], c["scope"], c["direction"]) == \
        ("op", PLANT, "module.decoder.layers.1.mlp", "forward"), c


def _torchrun_bisect(tmp_path, *script_args: str) -> tuple:
    keep, report = tmp_path / "tp2", tmp_path / "bisect.json"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                        "-m", "precisiondiff", "bisect", "--script", SPEC, "--keep", str(keep),
                        "--format", "json", "-o", str(report), "--", "--bf16", *script_args],
                       capture_output=True, text=True, cwd=ROOT, env={**os.environ, **ENV}, timeout=600)
    assert report.exists(), (r.returncode, r.stderr[-3000:])
    return r.returncode, json.loads(report.read_text()), keep


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tp2_bisect_names_the_plant_on_both_ranks(tmp_path):
    code, report, _ = _torchrun_bisect(tmp_path, "--plant")
    c = report["culprit"]
    assert code == 1 and (c["kind"], c["name"], c["scope"], c["direction"]) == \
        ("op", PLANT, "module.decoder.layers.1.mlp", "forward"), c
    assert c["found_on_ranks"] == [0, 1]
    assert report["collectives"]["judged"] > 0 and not report["collectives"]["wrong"], report["collectives"]


def test_tp2_clean_job_bisect_ranks_and_compare_with_the_single_process_reference(tmp_path, reference):
    code, report, keep = _torchrun_bisect(tmp_path)
    assert report["verdict"] in ("parity", "accumulated") and report["culprit"] is None, report["culprit"]
    assert code == (0 if report["verdict"] == "parity" else 1)
    for rank in report["ranks"].values():
        assert rank["verdict"] in ("parity", "accumulated"), rank
    assert all(a.get("known") and a["rank"] in (0, 1) for a in report["accepted"]), report["accepted"]
    replicas = check_replicas(keep)  # every all-reduce's output is the same on both ranks
    assert replicas.ok and replicas.checked > 0, replicas
    # each rank against the one float64 reference: the TP layers' shards are listed, not compared
    result = precisiondiff.compare(str(keep), str(reference), kind="module")
    assert result.exit_code == 0, [r.message for r in result.rows if r.verdict == "fail"]
    compared = {(row.rank, row.scope) for row in result.rows if row.verdict == "pass"}
    for rank in (0, 1):
        assert (rank, "module.decoder.layers.1.mlp.linear_fc2") in compared, sorted(compared)[:10]
