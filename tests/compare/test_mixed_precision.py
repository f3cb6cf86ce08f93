"""A mixed-precision run (autocast, or an engine keeping float32 tensors around bf16 matmuls) is
judged by the precision it really ran at, not each float32 tensor's own dtype
(precisiondiff/compare/precision.py): no false first divergence on a clean model, a planted
kernel still found."""
from __future__ import annotations

import textwrap

import pytest

from precisiondiff.capture.runner import capture_script, capture_workload
from precisiondiff.compare import compare

SCRIPT = '''
import sys
import torch
from torch import nn
from tests.compare.planted import rough_gelu

class Block(nn.Module):
    def __init__(self, d, planted):
        super().__init__()
        self.norm, self.fc1, self.fc2, self.planted = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d), planted
    def forward(self, x):
        h = self.fc1(self.norm(x))
        return x + self.fc2(rough_gelu(h) if self.planted else nn.functional.gelu(h))

ref, planted = "--ref" in sys.argv, "--planted" in sys.argv
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), Block(32, False), Block(32, planted), nn.LayerNorm(32), nn.Linear(32, 8))
x = torch.randn(8, 16)
if ref:
    model, x = model.double(), x.double()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with torch.autocast("cpu", torch.bfloat16, enabled=not ref):
    out = model(x)
if not planted:  # the planted op has no autograd formula: its run is forward only
    out.to(x.dtype).square().mean().backward()
opt.step()
'''


@pytest.fixture(scope="module")
def script_dumps(tmp_path_factory):
    """A script's autocast-bf16 run (clean and planted) and its float64 run, in tensors mode."""
    root = tmp_path_factory.mktemp("mixed")
    script = root / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    out = {}
    for name, args in (("dut", []), ("planted", ["--planted"]), ("ref", ["--ref"])):
        out[name] = root / name
        capture_script(str(script), args, out[name], mode="tensors")
    return out


def test_a_clean_autocast_script_has_no_divergence(script_dumps):
    cmp = compare(script_dumps["dut"], script_dumps["ref"])
    assert cmp.first_divergence is None, cmp.first_divergence
    assert cmp.exit_code == 0
    fp32 = [r for r in cmp.rows if r.dtype_a == "float32" and r.verdict == "pass" and r.error]
    # float32 tensors downstream of the bf16 matmuls carry bf16-sized errors: far above float32's bound
    assert fp32 and max(r.error for r in fp32) > 1e-4
    assert any("computed in bfloat16" in n for n in cmp.notes), cmp.notes


def test_a_planted_kernel_in_an_autocast_script_is_still_found(script_dumps):
    cmp = compare(script_dumps["planted"], script_dumps["ref"], direction="forward")
    assert cmp.exit_code == 1
    assert cmp.first_divergence["scope"] == "2" and "rough_gelu" in cmp.first_divergence["name"]


def test_a_float32_stretch_before_the_low_precision_part_keeps_its_own_bound(tmp_path):
    from tests.compare.conftest import stats, write_dump
    off = stats(norm=1.001)  # 1e-3 off: over float32's statistics bound, within bfloat16's
    dut = [{"name": "aten.mul.default", "dtype": "float32", "tensors": {"output.0": off}},
           {"name": "aten.mm.default", "dtype": "bfloat16", "tensors": {"output.0": stats()}},
           {"name": "aten.add.default", "dtype": "float32", "tensors": {"output.0": off}}]
    ref = [dict(ev, dtype="float64", tensors={"output.0": stats()}) for ev in dut]
    cmp = compare(write_dump(tmp_path / "a", dut, target="script"),
                  write_dump(tmp_path / "b", ref, target="cpu/float64"))
    assert [r.verdict for r in cmp.rows] == ["fail", "pass", "pass"]
    assert cmp.first_divergence["name"] == "aten.mul.default"


def test_the_run_precision_only_goes_down():
    from precisiondiff.compare.precision import RunPrecision

    class Rec:
        def __init__(self, dtype):
            self.dtype = dtype

    class Ev:
        def __init__(self, seq, *dtypes):
            self.seq, self.scope, self.name, self.tensors = seq, "", "op", [Rec(d) for d in dtypes]
    p = RunPrecision(None)
    seen = [p.see(Ev(i, *d)) for i, d in enumerate([("float32",), ("int64",), ("float32", "bfloat16"),
                                                    ("float32",), ("float64",)])]
    assert seen == ["float32", "float32", "bfloat16", "bfloat16", "bfloat16"]
    assert "bfloat16 from seq 2" in p.note()
    plain = RunPrecision(None)
    plain.see(Ev(0, "float32"))
    assert RunPrecision("bfloat16").note() is None and plain.note() is None


def test_an_autocast_workload_against_float64(tmp_path, example_spec):
    for target in ("cpu/bf16+autocast", "cpu/float64"):
        capture_workload(example_spec, tmp_path / target.replace("/", "_"), target=target, mode="tensors")
    cmp = compare(tmp_path / "cpu_bf16+autocast", tmp_path / "cpu_float64")
    assert cmp.first_divergence is None and cmp.exit_code == 0, cmp.first_divergence
