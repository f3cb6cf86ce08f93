"""A Hugging Face Trainer under DDP (2 processes started by torchrun, gloo, the CPU): capture and watch write one
dump / log per rank without changing the training (the Trainer's own DDP, gloo), ``ranks`` checks the gradient all-reduces, and
bisect of the ranks' replay dumps names a planted op on each rank (tests/integrations/hf_trainer_ddp.py).
Skipped without transformers."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")

from precisiondiff.store import verify  # noqa: E402
from precisiondiff.watch import read_logs  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tests/integrations/hf_trainer_ddp.py"
PLANT = "pdtrainerddp.rough_gelu.default"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*args: str, cwd: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(ROOT / SCRIPT),
                        "--out", str(cwd / "trainer-out"), *args],
                       capture_output=True, text=True, cwd=cwd, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "precisiondiff", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)


def _weights(path: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(path))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A plain DDP training and the same training with capture and watch callbacks, 2 steps each."""
    where = tmp_path_factory.mktemp("ddp")
    _torchrun("--save", str(where / "plain.safetensors"), cwd=where)
    _torchrun("--capture", str(where / "dump"), "--watch", str(where / "watch"), "--save", str(where / "seen.safetensors"),
              cwd=where)
    return where


def test_capture_and_watch_under_ddp_leave_the_training_bitwise_equal(runs):
    plain, seen = _weights(runs / "plain.safetensors"), _weights(runs / "seen.safetensors")
    assert plain.keys() == seen.keys() and all((plain[k] == seen[k]).all() for k in plain)


def test_each_rank_writes_its_dump_and_the_gradient_all_reduces_agree(runs):
    assert sorted(p.name for p in (runs / "dump").iterdir() if p.is_dir()) == ["rank0", "rank1"]
    for rank in (0, 1):
        assert verify(runs / "dump" / f"rank{rank}").ok
    r = _cli("ranks", str(runs / "dump"))
    assert r.returncode == 0 and "every replica is bitwise identical" in r.stdout, r.stdout + r.stderr
    checked = int(r.stdout.split(" replicated tensors checked")[0].split()[-1])
    assert checked > 0, r.stdout


def test_each_rank_writes_its_watch_log(runs):
    logs = read_logs(runs / "watch")
    assert sorted(logs) == [0, 1] and all(log.complete for log in logs.values())
    for log in logs.values():
        assert [s["step"] for s in log.steps] == [0, 1]
        assert all(s["loss"] > 0 for s in log.steps)
    assert logs[0].steps[0]["loss"] != logs[1].steps[0]["loss"]  # each rank's own batches


@pytest.mark.parametrize("plant", [False, True], ids=["clean", "planted"])
def test_bisect_of_the_ranks_replay_dumps(tmp_path, plant):
    _torchrun("--capture", str(tmp_path / "rep"), "--mode", "replay", "--steps", "1", "--bf16",
              *(["--plant"] if plant else []), cwd=tmp_path)
    report = tmp_path / "bisect.json"
    r = _cli("bisect", str(tmp_path / "rep"), "--workload", f"{SCRIPT}:main", "--format", "json", "-o", str(report))
    out = json.loads(report.read_text())
    assert out["collectives"]["judged"] > 0 and not out["collectives"]["wrong"], out["collectives"]
    if not plant:
        assert r.returncode == 0 and out["verdict"] == "parity" and out["culprits"] == [], out["culprits"]
        return
    c = out["culprit"]
    assert r.returncode == 1 and (c["kind"], c["name"], c["scope"], c["direction"]) == \
        ("op", PLANT, "transformer.h.1.mlp.act", "forward"), c
    assert {u["rank"] for u in out["culprits"] if u["name"] == PLANT} == {0, 1}, out["culprits"]
