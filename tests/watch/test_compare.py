"""Two watch logs compared: the planted divergence is named by step, layer and tensor; a clean
low-precision run stays inside the noise band; bad input is one line and exit code 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from precisiondiff.cli.app import main
from precisiondiff.errors import PrecisionDiffError
from precisiondiff.watch import compare_logs
from precisiondiff.watch.compare import tensor_error

from . import train

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    d = tmp_path_factory.mktemp("watch")
    runs = {"clean": {}, "planted": {"planted_step": 4, "planted_layer": 1},
            "bf16": {"dtype": torch.bfloat16}, "fp64": {"dtype": torch.float64},
            "bf16_noise": {"dtype": torch.bfloat16, "perturb": True},
            "bf16_planted": {"dtype": torch.bfloat16, "planted_step": 4, "planted_layer": 1,
                             "planted_scale": 2.0 ** -3}}
    for name, options in runs.items():
        train.train(8, watch_dir=str(d / name), **options)
    return d


def test_the_planted_divergence_is_named_by_step_layer_and_tensor(logs):
    c = compare_logs(logs / "planted", logs / "clean")
    first = c.first_divergence
    assert (first["step"], first["scope"], first["tensor"]) == (4, "blocks.1", "output")
    steps = {e["step"]: e for e in c.data["per_step"]}
    assert all(steps[s]["bitwise"] for s in range(4)) and not steps[4]["bitwise"]
    growth = {g["key"]: g for g in c.data["growth"]}
    assert growth["blocks.0:output"]["error"] == 0 and growth["blocks.1:output"]["error"] > 0
    assert c.exit_code == 1


def test_the_same_run_twice_does_not_diverge(logs, tmp_path):
    train.train(8, watch_dir=str(tmp_path))
    c = compare_logs(tmp_path, logs / "clean")
    assert c.first_divergence is None and all(e["bitwise"] for e in c.data["per_step"])


def test_a_clean_bf16_run_stays_in_the_noise_band_of_another(logs):
    c = compare_logs(logs / "bf16", logs / "fp64", noise=logs / "bf16_noise")
    assert c.first_divergence is None, c.first_divergence
    assert max(e["max_error"] for e in c.data["per_step"]) > 1e-4  # bf16 is far from float64...
    # ...while a bug of 12.5% from step 4 in block 1 leaves the band at that step, in that block
    first = compare_logs(logs / "bf16_planted", logs / "fp64", noise=logs / "bf16_noise").first_divergence
    assert first is not None and first["step"] == 4 and first["scope"].startswith("blocks.1"), first


def test_tensor_error_rules():
    base = [-1.0, 2.0, 0.1, 0.5, 10.0, 0, 0, "aa"]
    assert tensor_error(base, list(base)) == 0
    assert tensor_error(base[:-1] + ["bb"], base) == 0  # same statistics, other bits: below resolution
    assert tensor_error([-1.0, 2.0, 0.1, 0.5, 10.1, 0, 0, "bb"], base) == pytest.approx(0.01)
    assert tensor_error([-1.0, 2.0, 0.15, 0.5, 10.0, 0, 0, "bb"], base) == pytest.approx(0.1)  # mean by abs-mean
    assert tensor_error([-1.0, 2.0, 0.1, 0.5, 10.0, 1, 0, "bb"], base) == float("inf")


def test_cli_table_and_json(logs, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["compare", str(logs / "planted"), str(logs / "clean")])
    out = capsys.readouterr().out
    assert exit_.value.code == 1
    assert "first divergence: step 4, blocks.1 output (blocks.1:output)" in out
    with pytest.raises(SystemExit) as exit_:
        main(["compare", str(logs / "planted"), str(logs / "clean"), "--format", "json"])
    data = json.loads(capsys.readouterr().out)
    assert exit_.value.code == 1 and data["kind"] == "watch"
    assert data["first_divergence"]["key"] == "blocks.1:output" and len(data["per_step"]) == 8


def test_cli_html_has_the_report_and_its_pictures(logs, tmp_path):
    out = tmp_path / "watch.html"
    with pytest.raises(SystemExit) as exit_:
        main(["compare", str(logs / "planted"), str(logs / "clean"), "--format", "html", "-o", str(out)])
    text = out.read_text()
    assert exit_.value.code == 1 and "first divergence: step 4, blocks.1 output" in text
    assert text.count("<svg") == 2  # the loss curves and the step x layer heat map


def test_logs_of_different_models_are_one_line_and_exit_2(logs, tmp_path, capsys):
    train.train(2, watch_dir=str(tmp_path), layers=2)
    with pytest.raises(PrecisionDiffError, match="different models"):
        compare_logs(tmp_path, logs / "clean")
    with pytest.raises(SystemExit) as exit_:
        main(["compare", str(tmp_path), str(logs / "clean")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "different models" in err


def test_a_watch_log_against_a_dump_is_refused(logs, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["compare", str(logs / "clean"), str(tmp_path)])
    assert exit_.value.code == 2 and "is not a watch log" in capsys.readouterr().err


def _watch_script(out, *args):
    return subprocess.run([sys.executable, "-m", "precisiondiff.cli", "watch", "--script",
                           os.path.join(HERE, "train.py"), "-o", str(out), "--", *args],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT})


def test_watch_script_and_a_killed_run_read_as_partial(tmp_path):
    done = _watch_script(tmp_path / "full", "--steps", "6")
    assert done.returncode == 0 and "watched 6 steps" in done.stdout, done.stderr
    killed = _watch_script(tmp_path / "killed", "--steps", "6", "--kill-after", "3")
    assert killed.returncode == -9
    c = compare_logs(tmp_path / "killed", tmp_path / "full")
    assert c.data["steps"] == 3 and c.data["partial"] == {"a": True, "b": False}
    assert any("is partial" in n for n in c.data["notes"])
    assert c.first_divergence is None and all(e["bitwise"] for e in c.data["per_step"])
    # the script's losses are what backward() was called on
    assert all(e["loss_a"] is not None for e in c.data["per_step"])


def test_report_writes_the_page_and_tensorboard_scalars(logs, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    page, tb = tmp_path / "w.html", tmp_path / "tb"
    with pytest.raises(SystemExit) as exit_:
        main(["report", str(logs / "planted"), str(logs / "clean"), "-o", str(page), "--tensorboard", str(tb)])
    assert exit_.value.code == 1 and page.read_text().count("<svg") == 2
    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    acc.Reload()
    losses = {tag: [e.value for e in acc.Scalars(tag)] for tag in ("loss/A", "loss/B")}
    expected = [e["loss_a"] for e in compare_logs(logs / "planted", logs / "clean").data["per_step"]]
    assert len(losses["loss/A"]) == 8 and losses["loss/A"] == pytest.approx(expected)
    block1 = {e.step: e.value for e in acc.Scalars("error/output/blocks.1")}
    assert all(block1[s] == 0 for s in range(4)) and block1[4] > 0
    assert [e.value for e in acc.Scalars("summary/first_divergence_step")] == [4]
