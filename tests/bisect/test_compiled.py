"""Bisect of torch.compile'd models: the compiled region that diverges from eager is named.

Compile cost is kept low: the planted case uses a custom Dynamo backend (no code generation)
and bisect's own aot_eager narrowing; one real inductor compile of a tiny MLP checks that a
correct compiler is not blamed. Nothing here is skipped as slow: it runs in CI.
"""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from precisiondiff import Workload
from precisiondiff.bisect import bisect
from precisiondiff.bisect.compiled import backend_name, find_regions, strip_compiled

# Dynamo itself reads .grad of a non-leaf input while tracing a region fed by eager ops (torch
# 2.13, reproduced with a bare nn.Linear): a torch-internal warning, not ours.
pytestmark = pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")

PERTURB = 2.0 ** -6  # relative error the planted backend adds to bf16 outputs (4 ULP-ish)


def perturbing_backend(gm: torch.fx.GraphModule, example_inputs):
    """A planted compiler bug: run the graph, then scale its bf16 outputs by (1 + 2**-6)."""
    def run(*args):
        outs = gm(*args)
        return type(outs)(o * (1 + PERTURB) if isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16
                          else o for o in outs)
    return run


class Block(nn.Module):
    def __init__(self, dim: int = 32):
        super().__init__()
        self.fc1 = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, dim: int = 32):
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.block = Block(dim)
        self.head = nn.Linear(dim, 8)

        self.sloppy = False

    def forward(self, x):
        h = torch.tanh(self.embed(x))
        if self.sloppy:  # an eager kernel bug before the region (tests/bisect/planted.py)
            from tests.bisect.planted import sloppy_scale  # lazily: the CLI loads this file by path
            h = sloppy_scale(h, 1.0)
        return self.head(self.block(h))


def planted_workload() -> Workload:
    """``block`` compiled separately with the perturbing backend; the rest eager."""
    model = Net()
    model.block = torch.compile(model.block, backend=perturbing_backend)
    return Workload(model, torch.randn(4, 32))


def eager_bug_first_workload() -> Workload:
    wl = planted_workload()
    wl.model.sloppy = True
    return wl


def training_workload() -> Workload:
    wl = planted_workload()
    return Workload(wl.model, wl.inputs, loss=lambda y: y.float().pow(2).mean())


def inductor_workload() -> Workload:
    """A tiny MLP compiled whole with inductor (the default backend)."""
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    return Workload(torch.compile(model), torch.randn(4, 16))


def test_regions_are_found_and_stripped():
    wl = planted_workload()
    regions = find_regions(wl.model)
    assert [s for s, _ in regions] == ["block"]
    assert backend_name(regions[0][1]) == "perturbing_backend"
    eager = strip_compiled(wl.model)
    assert find_regions(eager) == [] and type(eager.block).__name__ == "Block"
    root = torch.compile(nn.Sequential(nn.Linear(2, 2)))
    assert [s for s, _ in find_regions(root)] == [""]
    assert type(strip_compiled(root)).__name__ == "Sequential"


@pytest.fixture(scope="module")
def planted_result():
    return bisect(planted_workload, target="cpu/bf16")


def test_planted_compiler_bug_names_the_region(planted_result):
    r = planted_result
    assert r.verdict == "kernel" and r.exit_code == 1
    c = r.culprit
    assert (c["kind"], c["scope"], c["name"], c["direction"], c["call"]) == (
        "compiled_region", "block", "Block", "forward", 0)
    assert c["backend"] == "perturbing_backend"
    # the eager region's ops, what the backend compiled
    assert {"aten.addmm.default", "aten.gelu.default", "aten.add.Tensor"} <= set(c["ops"])
    loc, bud = c["local"], c["budget"]
    assert loc["rel_l2_compiled"] > bud["bound"] >= bud["k"] * loc["rel_l2_eager"]
    assert loc["rel_l2_compiled"] == pytest.approx(PERTURB, rel=0.3)
    # aot_eager reproduces eager: the divergence is in the backend's code generation
    assert "code generation" in c["diagnosis"]
    region = r.compiled["regions"][0]
    assert region["narrowing"]["stage"] == "codegen"
    assert region["narrowing"]["backends"]["aot_eager"]["diverges"] is False
    assert [p["scope"] for p in r.path] == [""]
    ev = r.evidence
    assert ev["inputs_fine"] is True and ev["inputs"][0]["key"] == "block/Block#0:forward:input.0"
    assert ev["upstream_passed"] == ev["upstream_units"] > 0
    conf = r.confirmation
    assert conf["final_error_after_substitution"] < 0.5 * conf["final_error_before"]
    assert r.cost["dut_runs"] == 3  # the captured eager step, the compiled run, its substitution


def test_planted_result_renders_in_json_and_summary(planted_result):
    from precisiondiff.bisect.render import summary_lines
    data = json.loads(planted_result.dumps())
    assert data["culprit"]["kind"] == "compiled_region" and data["culprit"]["scope"] == "block"
    assert data["compiled"]["regions"][0]["diverges"] is True
    text = "\n".join(summary_lines(planted_result))
    assert "culprit: compiled_region Block in block (forward, call 0)" in text
    assert "aten.gelu.default" in text and "code generation" in text


def test_cli_json_shows_the_region():
    from precisiondiff.cli import cli
    res = CliRunner().invoke(cli, ["bisect", f"{__file__}:planted_workload", "--target", "cpu/bf16",
                                   "--format", "json"])
    assert res.exit_code == 1, res.output
    data = json.loads(res.output)
    assert data["verdict"] == "kernel" and data["culprit"]["kind"] == "compiled_region"


def test_eager_kernel_bug_before_the_region_stays_the_culprit():
    r = bisect(eager_bug_first_workload, target="cpu/bf16")
    assert (r.culprit["kind"], r.culprit["name"]) == ("op", "pdtest.sloppy_scale.default")
    assert r.candidates[0]["kind"] == "compiled_region" and r.candidates[0]["scope"] == "block"
    assert any("also diverges from eager" in n for n in r.notes)


def test_training_workload_names_the_region_forward():
    r = bisect(training_workload, target="cpu/bf16")
    assert (r.culprit["kind"], r.culprit["scope"], r.culprit["direction"]) == ("compiled_region", "block", "forward")
    assert any("forward only" in n for n in r.notes)


def test_real_inductor_mlp_is_not_blamed():
    r = bisect(inductor_workload, target="cpu/bf16")
    assert r.verdict == "parity", (r.culprit, r.compiled)
    regions = r.compiled["regions"]
    assert [g["scope"] for g in regions] == [""] and regions[0]["backend"] == "inductor"
    assert regions[0]["diverges"] is False


def test_module_compiled_in_place_is_bisected_eagerly_with_a_note():
    def factory() -> Workload:
        model = Net()
        model.block.compile(backend=perturbing_backend)
        return Workload(model, torch.randn(4, 32))
    r = bisect(factory, target="cpu/bf16")
    assert r.verdict == "parity" and r.compiled is None
    assert any("Module.compile() (block)" in n for n in r.notes)
