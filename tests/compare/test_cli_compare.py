"""The compare, report and scan commands: formats, exit codes, one-line errors."""
from __future__ import annotations

import json
import shutil
import textwrap

import pytest
from click.testing import CliRunner

from precisiondiff.cli import cli

from .conftest import stats, write_dump


def _run(*args):
    return CliRunner().invoke(cli, list(map(str, args)))


@pytest.fixture(scope="module")
def pair(capture_example):
    return capture_example("cpu/bf16", "all", "stats"), capture_example("cpu/float64", "all", "stats")


def test_table_json_csv(pair, tmp_path):
    a, b = pair
    res = _run("compare", a, b)
    assert res.exit_code == 0, res.output
    assert "tensors compared" in res.output and "blocks.0.attn.qkv" in res.output
    res = _run("compare", a, b, "--format", "json", "-o", tmp_path / "c.json")
    doc = json.loads((tmp_path / "c.json").read_text())
    assert doc["summary"]["tensors"] > 100 and doc["summary"]["unmatched_a"] == 2
    res = _run("compare", a, b, "--format", "csv", "--top", "5")
    lines = res.output.strip().splitlines()
    assert lines[0].startswith("rank,seq,step,direction") and len(lines) == 6


def test_failing_rows_exit_1(tmp_path):
    a = write_dump(tmp_path / "a", [{"name": "aten.mm", "tensors": {"output.0": stats(1.0)}}])
    b = write_dump(tmp_path / "b", [{"name": "aten.mm", "tensors": {"output.0": stats(2.0)}}],
                   target="cpu/float64")
    res = _run("compare", a, b, "--only-failing")
    assert res.exit_code == 1 and "FIRST DIVERGENCE" in res.output


@pytest.mark.parametrize("case", ["missing", "not-a-dump", "corrupted", "mismatched"])
def test_bad_input_exits_2_with_one_line(case, pair, tmp_path):
    a, b = pair
    if case == "missing":
        b, want = tmp_path / "nope", "does not exist"
    elif case == "not-a-dump":
        (tmp_path / "d").mkdir()
        b, want = tmp_path / "d", "not a precisiondiff dump"
    elif case == "corrupted":
        shutil.copytree(b, tmp_path / "c")
        with open(tmp_path / "c" / "index.jsonl", "r+b") as fh:
            fh.seek(200)
            fh.write(b"}}garbage{{\n")
        b, want = tmp_path / "c", "corrupted"
    else:
        b = write_dump(tmp_path / "m", [{"name": "aten.mm", "scope": f"enc.{i}", "tensors": {"output.0": stats()}}
                                        for i in range(5)])
        want = "different models"
    res = _run("compare", a, b)
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and want in lines[0], res.output
    assert "Traceback" not in res.output


OVERFLOW = textwrap.dedent('''
    import torch
    from torch import nn
    import precisiondiff

    class Boom(nn.Module):
        def forward(self, x):
            return x * 1e38          # planted overflow: finite in float64, inf in bf16

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(8, 8)
            self.boom = Boom()
            self.fc2 = nn.Linear(8, 4)
        def forward(self, x):
            return self.fc2(torch.tanh(self.boom(self.fc1(x))))

    def build():
        return precisiondiff.Workload(Net(), torch.randn(4, 8) * 10, loss=lambda y: y.float().sum())
''')


def test_scan_finds_the_planted_overflow(tmp_path):
    from precisiondiff.capture.runner import capture_workload
    from precisiondiff.compare.scan import scan
    (tmp_path / "net.py").write_text(OVERFLOW)
    capture_workload(f"{tmp_path / 'net.py'}:build", tmp_path / "d", target="cpu/bf16", mode="stats")
    result = scan(tmp_path / "d")
    first = result.first("nonfinite")
    assert (first["scope"], first["name"], first["direction"]) == ("boom", "aten.mul.Tensor", "forward")
    res = _run("scan", tmp_path / "d")
    assert res.exit_code == 1 and "first NaN/Inf from finite inputs" in res.output and "boom" in res.output
    capture_workload(f"{tmp_path / 'net.py'}:build", tmp_path / "ref", target="cpu/float64", mode="stats")
    ref = scan(tmp_path / "ref")
    # float64 does not overflow, but tanh saturates on 1e38-sized inputs: the gradient vanishes
    assert ref.first("nonfinite") is None
    assert ref.first("vanish")["scope"] == "boom"


def test_scan_of_the_clean_example_and_vanishing_gradients(pair, tmp_path):
    res = _run("scan", pair[0])
    assert res.exit_code == 0 and "no anomaly" in res.output and "deliberately" in res.output
    g = lambda n: {"kind": "module", "direction": "backward", "name": "Block",  # noqa: E731
                   "tensors": {"grad_input.0": stats(n)}}
    evs = [dict(g(1.0), scope="blocks.2"), dict(g(0.8), scope="blocks.1"), dict(g(1e-5), scope="blocks.0")]
    d = write_dump(tmp_path / "v", evs)
    res = _run("scan", d, "--format", "json")
    doc = json.loads(res.output)
    assert res.exit_code == 1 and doc["first_vanish"]["scope"] == "blocks.0"


def test_more_bad_input_is_one_line_exit_2(capture_example, tmp_path):
    from click.testing import CliRunner

    from precisiondiff.cli import cli
    a, b = capture_example("cpu/bf16", "all", "tensors"), capture_example("cpu/float64", "all", "tensors")
    cases = [
        (["compare", a, b, "--scope", "("], "bad --scope regex"),
        (["ls", a, "--name", "["], "bad --name regex"),
        (["compare", a, b, "-o", str(tmp_path / "missing" / "x.txt")], "cannot write"),
        (["compare", a, b, "--device", "cuda:9"], "--device cuda:9"),
    ]
    for argv, needle in cases:
        r = CliRunner().invoke(cli, argv)
        assert r.exit_code == 2, (argv, r.output)
        assert needle in r.output and "Traceback" not in r.output, (argv, r.output)
