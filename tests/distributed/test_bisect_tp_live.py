"""``torchrun ... -m precisiondiff.cli bisect --script``: live bisect of a real 2-rank tensor-parallel
job in one command (gloo on 127.0.0.1). The script (train_tp_bisect.py) plants a GEMM that
accumulates in bf16 on rank 1 only, runs a forward and backward and destroys its process group at
the end, as scripts do: bisect defers that (torchrun cannot create a second default group). A
script stopped after its first optimizer step is tested in one process below.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.conftest import free_port

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")

SCRIPT = str(Path(__file__).with_name("train_tp_bisect.py"))
GEMM = "pdtest_tp.linear.default"


def test_torchrun_bisect_script_names_the_gemm_wrong_on_rank_1(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "precisiondiff.cli", "bisect", "--script", SCRIPT,
           "--format", "json", "-o", str(tmp_path / "bisect.json"), "--", "--plant", "gemm", "--steps", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path), "TMPDIR": str(tmp)}
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    report = json.loads((tmp_path / "bisect.json").read_text())
    c = report["culprit"]
    assert (c["kind"], c["name"], c["scope"], c["direction"], c["rank"]) == ("op", GEMM, "fc1", "forward", 1)
    assert report["ranks"]["0"]["verdict"] == "parity" and report["ranks"]["1"]["verdict"] == "kernel"
    assert report["collectives"]["judged"] == 2 and report["collectives"]["wrong"] == []
    # one report, from process 0; torchrun lists that one process, with the verdict as its reason
    assert r.stderr.count("wrote ") == 1 and "[rank1]" not in r.stderr and "[rank0]" not in r.stderr
    assert "<NO_OTHER_FAILURES>" in r.stderr
    assert f"not a crash: precisiondiff bisect found a culprit, op {GEMM} in fc1 on rank 1" in r.stderr
    # the dumps went to a temporary directory, removed at the end
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("precisiondiff-bisect-")]


def _main(capsys, *args: str):
    from precisiondiff.cli import main
    with pytest.raises(SystemExit) as exc:
        main(["bisect", *args])
    return exc.value.code, capsys.readouterr().err


def test_bisect_script_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    code, err = _main(capsys, "--script", str(tmp_path / "missing.py"))
    assert code == 2 and err.startswith("error: script not found") and err.count("\n") == 1
    code, err = _main(capsys, "--script", SCRIPT, "--target", "cpu/bf16")
    assert code == 2 and "--target has no effect with --script" in err
    code, err = _main(capsys, str(tmp_path), "--keep", str(tmp_path / "k"))
    assert code == 2 and "go with --script" in err
    code, err = _main(capsys)
    assert code == 2 and err.count("\n") == 1 and "--script FILE" in err


def test_the_scripts_destroy_of_the_default_group_waits_for_the_bisect():
    """A script's destroy_process_group() is deferred (the bisect needs the group after it); one
    that then creates a group again gets the deferred one destroyed first; subgroups go as asked."""
    import torch.distributed as dist

    from precisiondiff.bisect.script import _default_group_kept

    def init():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with _default_group_kept() as deferred:
        init()
        sub = dist.new_group([0])
        dist.destroy_process_group(sub)
        assert not deferred
        dist.destroy_process_group()
        assert deferred and dist.is_initialized()
        init()  # again, as a script with two phases would
        assert dist.is_initialized() and not deferred
        dist.destroy_process_group()
    assert deferred and dist.is_initialized()
    dist.destroy_process_group()  # the real one again, outside
    assert not dist.is_initialized()


SINGLE = '''
import torch

@torch.library.custom_op("pdtest_live::rowsum", mutates_args=())
def rowsum(x: torch.Tensor) -> torch.Tensor:
    acc = torch.zeros(x.shape[0], dtype=x.dtype)  # a planted fault: accumulates in the input's bf16
    for k in range(x.shape[1]):
        acc = acc + x[:, k]
    return acc

@rowsum.register_fake
def _(x):
    return x.new_empty(x.shape[0])

import sys

w = torch.nn.Parameter(torch.rand(8, 512, generator=torch.Generator().manual_seed(0)).bfloat16())
opt = torch.optim.SGD([w], lr=0.0)
for step in range(3):
    with open(sys.argv[1], "a") as fh:
        fh.write(f"step {step}\\n")
    with torch.no_grad():
        rowsum(w)  # the only arithmetic: no stock kernel is judged here
    opt.step()
'''


def test_bisect_script_without_torchrun_bisects_the_one_dump(tmp_path, capsys):
    script = tmp_path / "single.py"
    script.write_text(SINGLE)
    report = tmp_path / "bisect.json"
    steps = tmp_path / "steps.txt"
    code, err = _main(capsys, "--script", str(script), "--keep", str(tmp_path / "kept"), "--format", "json",
                      "-o", str(report), "--", str(steps))
    assert code == 1, err
    assert steps.read_text() == "step 0\n"  # the script stopped when its first optimizer step returned
    c = json.loads(report.read_text())["culprit"]
    assert (c["kind"], c["name"]) == ("op", "pdtest_live.rowsum.default") and "rank" not in c
    assert (tmp_path / "kept" / "meta.json").exists()  # one process: one dump, no rank directories
