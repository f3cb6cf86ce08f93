"""Chosen steps captured in replay mode inside a watched run, and bisected offline from that dump."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

import precisiondiff
from precisiondiff.bisect import bisect_dump
from precisiondiff.watch import read_logs

from . import train

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CULPRIT = ("blocks.0.norm1", "pdexample.fused_rms_norm.default")


def _culprit(r):
    return (r.culprit["scope"], r.culprit["name"]) if r.culprit else None


def test_python_api_replay_steps_capture_those_steps_only(tmp_path):
    plain = train.train(4)
    model, opt, tokens = train.build()
    with precisiondiff.watch(tmp_path, model=model, optimizer=opt, replay_steps="1,2") as w:
        for _ in range(4):
            w.step(loss=train.train_step(model, opt, tokens))
    assert all(torch.equal(plain[k], v) for k, v in model.state_dict().items())
    dump = precisiondiff.load(tmp_path / "replay")
    events = list(dump.events())
    assert {e.step for e in events} == {1, 2} and dump.meta["complete"]
    # watch's own statistics are not the model's ops
    assert not any(e.name.startswith(("aten.aminmax", "aten._foreach_norm", "aten.linalg_vector_norm"))
                   for e in events)
    assert len(read_logs(tmp_path)[0].steps) == 4


def test_watch_script_replay_step_is_bisected_offline(tmp_path):
    out = tmp_path / "w"
    run = subprocess.run([sys.executable, "-m", "precisiondiff.cli", "watch", "--script", os.path.join(HERE, "train.py"),
                          "-o", str(out), "--replay-steps", "3", "--", "--steps", "5", "--dtype", "bfloat16",
                          "--fused-norm"], capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr
    assert "steps 3 captured in replay mode" in run.stdout
    assert {e.step for e in precisiondiff.load(out / "replay").events()} == {3}
    assert [r["step"] for r in read_logs(out)[0].steps] == [0, 1, 2, 3, 4]
    r = bisect_dump(out / "replay", direction="forward")  # the op is registered: train imports the example
    assert r.verdict == "kernel" and _culprit(r) == CULPRIT
