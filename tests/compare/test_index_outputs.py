"""Integer outputs that are positions chosen among floating values (argmax, the indices of
``max.dim``, ``topk``) tie differently at different precisions: compare passes them with a note
and judges the values they select; any other integer output that differs still fails."""
from __future__ import annotations

import textwrap

import pytest

from precisiondiff.capture.runner import capture_workload
from precisiondiff.compare import compare

WORKLOAD = '''
import torch
from torch import nn
import precisiondiff

class Select(nn.Module):
    def __init__(self, truncate):
        super().__init__()
        self.truncate = truncate
    def forward(self, x):
        values, _ = x.max(dim=-1)
        top, _ = x.topk(2, dim=-1)
        torch.argmax(x, dim=-1)  # computed and left unused, as Megatron's cross-entropy does
        out = values + top.sum(-1)
        if self.truncate:  # an integer result that is not a position: must still be compared
            out = out + 0 * (x * 1000).long().sum(-1).to(x.dtype)
        return out

def _x():
    # neighbours 1 + 2**-12 apart: distinct in float64, one bf16 value (1.0): argmax/topk pick
    # the last one in float64 and the first one in bf16
    base = torch.arange(8, dtype=torch.float64).unsqueeze(1) * 4
    return base + 1 + torch.tensor([0.0, 2.0 ** -12, 0.0, 2.0 ** -13]).expand(8, 4)

def build():
    return precisiondiff.Workload(Select(False), _x())

def build_truncating():
    return precisiondiff.Workload(Select(True), _x())
'''


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("index")
    (root / "select_wl.py").write_text(textwrap.dedent(WORKLOAD))
    out = {}
    for fn in ("build", "build_truncating"):
        for mode in ("tensors", "stats"):
            for target in ("cpu/bf16", "cpu/float64"):
                d = root / f"{fn}-{mode}-{target.split('/')[1]}"
                capture_workload(f"{root / 'select_wl.py'}:{fn}", d, target=target, level="op", mode=mode)
                out[fn, mode, target] = d
    return out


@pytest.mark.parametrize("mode", ["tensors", "stats"])
def test_indices_that_tie_at_bf16_pass_with_a_note(dumps, mode):
    cmp = compare(dumps["build", mode, "cpu/bf16"], dumps["build", mode, "cpu/float64"])
    index_rows = [r for r in cmp.rows if r.dtype_a == "int64"]
    assert {r.name for r in index_rows} >= {"aten.max.dim", "aten.topk.default", "aten.argmax.default"}
    noted = [r for r in index_rows if r.note and "positions chosen among floating values" in r.note]
    assert noted, [(r.name, r.key, r.verdict, r.message) for r in index_rows]
    assert all(r.verdict == "pass" for r in index_rows)
    assert cmp.first_divergence is None, cmp.first_divergence


@pytest.mark.parametrize("mode", ["tensors", "stats"])
def test_an_integer_output_that_is_not_a_position_still_fails(dumps, mode):
    cmp = compare(dumps["build_truncating", mode, "cpu/bf16"], dumps["build_truncating", mode, "cpu/float64"])
    failed = [r for r in cmp.rows if r.verdict == "fail"]
    assert failed and failed[0].name == "aten._to_copy.default", [(r.name, r.key) for r in failed]
    assert all(r.dtype_a == "int64" and r.name in ("aten._to_copy.default", "aten.sum.dim_IntList")
               for r in failed), [(r.name, r.key, r.message) for r in failed]
    assert cmp.first_divergence["name"] == "aten._to_copy.default"
