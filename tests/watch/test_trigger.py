"""watch --ref and --on-anomaly: the first step that crosses is decided in the running job, the
next step is captured there in replay mode, and offline bisect of that dump names the planted
kernel (a custom op, or a vendor optimizer) that went wrong mid-run. The job is never rerun."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

import precisiondiff
from precisiondiff.bisect import bisect_dump
from precisiondiff.errors import PrecisionDiffError
from precisiondiff.watch import compare_logs, read_logs
from precisiondiff.watch.trigger import AnomalyRule

from . import train
from ..bisect.planted_optim import VendorAdamW
from .test_replay import HERE, ROOT, _culprit

GELU = ("blocks.1.mlp", "pdwatch.fused_gelu.default")


def _trigger_notes(out):
    return [n for n in read_logs(out)[0].notes if n.startswith("trigger at step")]


def test_python_api_ref_captures_the_step_after_the_first_divergence(tmp_path):
    ref, out = tmp_path / "ref", tmp_path / "dut"
    train.train(6, watch_dir=str(ref), gelu_op=True)
    unwatched = train.train(6, broken_from=3)
    final = train.train(6, watch_dir=str(out), broken_from=3, watch_options={"ref": str(ref)})
    assert all(torch.equal(unwatched[k], v) for k, v in final.items())  # watch and its capture change nothing
    # the trigger and compare of the finished logs agree: one rule
    first = compare_logs(out, ref).first_divergence
    assert (first["step"], first["scope"]) == (3, "blocks.1")
    notes = _trigger_notes(out)
    assert len(notes) == 1 and notes[0].startswith("trigger at step 3 (ref: blocks.1:output")
    assert [r["step"] for r in read_logs(out)[0].steps] == list(range(6))  # watching went on, once through
    dump = precisiondiff.load(out / "replay")
    assert {e.step for e in dump.events()} == {4} and dump.meta["complete"]
    assert dump.meta["trigger"]["step"] == 3 and dump.meta["trigger"]["captured_step"] == 4
    r = bisect_dump(out / "replay", direction="forward")
    assert r.verdict == "kernel" and _culprit(r) == GELU


def test_a_clean_run_against_its_reference_captures_nothing(tmp_path):
    train.train(4, watch_dir=str(tmp_path / "ref"))
    train.train(4, watch_dir=str(tmp_path / "dut"), watch_options={"ref": str(tmp_path / "ref"), "on_anomaly": True})
    assert not _trigger_notes(tmp_path / "dut") and not (tmp_path / "dut" / "replay").exists()


def test_watch_script_bf16_against_float64_ref_and_bisect_names_the_plant(tmp_path):
    """The Done-when case: a bf16 run whose fused GELU goes wrong from step 4, watched against a
    float64 reference with a noise run; compare names step 4, watch --ref captured step 5 in the
    running job, and bisect of that dump names the op."""
    fp64, noise, out = tmp_path / "fp64", tmp_path / "noise", tmp_path / "dut"
    train.train(8, watch_dir=str(fp64), dtype=torch.float64, gelu_op=True)
    train.train(8, watch_dir=str(noise), dtype=torch.bfloat16, perturb=True, gelu_op=True)
    run = subprocess.run([sys.executable, "-m", "precisiondiff.cli", "watch", "--script",
                          os.path.join(HERE, "train.py"), "-o", str(out), "--ref", str(fp64), "--ref-noise", str(noise),
                          "--", "--steps", "8", "--dtype", "bfloat16", "--broken-from", "4"],
                         capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr
    assert "step 4 crossed (ref: " in run.stdout and "step 5 captured in replay mode" in run.stdout, run.stdout
    first = compare_logs(out, fp64, noise=noise).first_divergence
    assert first["step"] == 4 and first["scope"].startswith("blocks.1"), first
    assert [r["step"] for r in read_logs(out)[0].steps] == list(range(8))
    assert {e.step for e in precisiondiff.load(out / "replay").events()} == {5}
    r = bisect_dump(out / "replay", direction="forward")
    assert r.verdict == "kernel" and _culprit(r) == GELU


def test_an_optimizer_that_goes_wrong_mid_run_is_captured_and_named(tmp_path):
    """A vendor fused AdamW (bf16 parameters, float32 master weights) that drops the bias
    correction from step 2: that step's update leaves the clean run's (update/weight ratio, with
    state norms every step), the next step is captured, and bisect names the optimizer op."""
    def run(out, bug_from, options=None):
        model, _, tokens = train.build(dtype=torch.bfloat16, layers=2)
        opt = VendorAdamW(model.parameters(), lr=3e-3)
        with precisiondiff.watch(out, model=model, optimizer=opt, param_every=1, **(options or {})) as w:
            for step in range(5):
                opt.bug = "bias" if bug_from is not None and step >= bug_from else ""
                w.step(loss=train.train_step(model, opt, tokens))
    run(tmp_path / "ref", None)
    run(tmp_path / "dut", 2, {"ref": str(tmp_path / "ref")})
    notes = _trigger_notes(tmp_path / "dut")
    assert len(notes) == 1 and notes[0].startswith("trigger at step 2 "), notes
    dump = precisiondiff.load(tmp_path / "dut" / "replay")
    assert {e.step for e in dump.events()} == {3}
    r = bisect_dump(tmp_path / "dut" / "replay", direction="optimizer")
    assert r.verdict == "kernel" and r.culprit["name"] == "pdtest.vendor_adamw_.default", r.culprit
    assert r.culprit["direction"] == "optimizer"


def test_on_anomaly_captures_the_step_after_a_nan(tmp_path):
    model, opt, tokens = train.build(gelu_op=True)
    with precisiondiff.watch(tmp_path, model=model, optimizer=opt, on_anomaly=True) as w:
        for step in range(5):
            train.BROKEN["on"], train.BROKEN["scale"] = step >= 2, math.nan
            try:
                w.step(loss=train.train_step(model, opt, tokens))
            finally:
                train.BROKEN["on"], train.BROKEN["scale"] = False, 1.125
    notes = _trigger_notes(tmp_path)
    assert len(notes) == 1 and notes[0].startswith("trigger at step 2 (nan: "), notes
    assert {e.step for e in precisiondiff.load(tmp_path / "replay").events()} == {3}


def test_watch_script_on_anomaly(tmp_path):
    run = _cli("-o", str(tmp_path), "--on-anomaly", "--", "--steps", "4", "--broken-from", "2", "--broken-scale", "nan")
    assert run.returncode == 0, run.stderr
    assert "step 2 crossed (nan: " in run.stdout and "step 3 captured in replay mode" in run.stdout, run.stdout
    assert {e.step for e in precisiondiff.load(tmp_path / "replay").events()} == {3}


def _record(step, loss, grads=(1.0,), nan=0, inf=0):
    return {"step": step, "loss": loss, "params": {f"p{i}": {"grad": g, "weight": 1.0} for i, g in enumerate(grads)},
            "tensors": {"a:output": [-1.0, 1.0, 0.0, 0.5, 2.0, nan, inf, "f"]}}


@pytest.mark.parametrize("records, rule, step", [
    ([_record(0, 2.0), _record(1, 1.8), _record(2, 25.0)], "loss_spike", 2),       # > 10x the first steps' max
    ([_record(0, 2.0), _record(1, 0.01), _record(2, 0.15)], "loss_spike", 2),      # > 10x the previous step's
    ([_record(0, 2.0, (3.0, 4.0)), _record(1, 1.9, (30.0, 45.0))], "grad_norm_jump", 1),  # global norm 5 -> 54
    ([_record(0, 2.0), _record(1, math.inf)], "nan", 1),
    ([_record(0, 2.0), _record(1, 1.9, (math.nan,))], "nan", 1),
    ([_record(0, 2.0), _record(1, 1.9, nan=3)], "nan", 1),
    ([_record(0, 2.0, inf=4), _record(1, 1.9, inf=4), _record(2, 1.8, inf=5)], "nan", 2),  # a mask's infinities stay
])
def test_anomaly_rules(records, rule, step):
    a = AnomalyRule()
    hits = [a.judge({}, r) for r in records]
    assert all(h is None for h in hits[:-1]) and hits[-1]["rule"] == rule and hits[-1]["step"] == step


def test_a_steady_run_is_no_anomaly():
    a = AnomalyRule()
    losses = [2.0 + 3.0 * 0.97 ** i + 0.05 * (-1) ** i for i in range(300)]
    assert all(a.judge({}, _record(i, x, (1.0 + 0.5 * (-1) ** i,))) is None for i, x in enumerate(losses))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "precisiondiff.cli", "watch", "--script", os.path.join(HERE, "train.py"),
                           *args], capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})


def test_bad_references_are_one_line_and_exit_2(tmp_path):
    other = tmp_path / "other"
    train.train(2, watch_dir=str(other), layers=2)
    run = _cli("-o", str(tmp_path / "w"), "--ref", str(other), "--", "--steps", "2")
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "another model" in run.stderr, run.stderr
    assert len(read_logs(tmp_path / "w")[0].steps) == 2  # the run itself was watched
    for args, message in ((("--ref", str(tmp_path)), "holds no watch log"),
                          (("--ref", str(other), "--replay-steps", "1"), "not both"),
                          (("--ref-noise", str(other)), "goes with --ref")):
        run = _cli("-o", str(tmp_path / "x"), *args, "--", "--steps", "1")
        assert run.returncode == 2 and run.stderr.count("\n") == 1 and message in run.stderr, run.stderr
    model, opt, _ = train.build()
    with pytest.raises(PrecisionDiffError, match="another model"):
        with precisiondiff.watch(tmp_path / "api", model=model, optimizer=opt, ref=str(other)):
            pass


def test_bisect_of_a_dump_without_the_optimizer_is_one_line_and_exit_2(tmp_path, capsys):
    from precisiondiff.cli.app import main
    model = torch.nn.Linear(8, 4)
    with precisiondiff.capture(tmp_path / "d", model=model, mode="replay") as cap:
        model(torch.randn(2, 8)).sum().backward()
        cap.step()
    with pytest.raises(SystemExit) as exit_:
        main(["bisect", str(tmp_path / "d"), "--direction", "optimizer"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "holds no optimizer events" in err
