"""Verdicts on models nobody here wrote (the zoo), on random ops and aliased outputs: correct
kernels are not blamed, on any CPU path, and a planted kernel in a zoo model is named."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import precisiondiff
from precisiondiff.bisect import bisect
from tests.zoo import ZOO

from . import planted

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _culprit(r) -> tuple:
    c = r.culprit
    return (c["kind"], c["scope"], c["name"], c["direction"]) if c else None


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_zoo_model_on_stock_kernels_is_not_blamed(name):
    r = bisect(ZOO[name], target="cpu/bf16")
    assert r.verdict in ("parity", "accumulated"), r.culprit
    assert (r.verdict == "parity") == (r.final_error <= r.parity_bound)


def test_planted_rms_norm_in_one_layer_of_a_zoo_model_is_named():
    r = bisect(planted.llama_with_planted_norm, target="cpu/bf16")
    assert r.verdict == "kernel"
    assert _culprit(r) == ("op", "model.layers.1.post_attention_layernorm", "pdtest.zoo_rms_norm.default", "forward")
    assert r.culprit["peer"]["passed"] is False and r.culprit["peer"]["ratio"] > 1


def _dropout_model() -> precisiondiff.Workload:
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.3), nn.Linear(32, 8))
    return precisiondiff.Workload(model, torch.randn(8, 16), loss=lambda y: y.float().pow(2).mean(), train=True)


def test_random_ops_are_data_in_training_mode():
    """Dropout's mask is the DUT's, in every replay and in the reference run: nothing to blame."""
    r = bisect(_dropout_model, target="cpu/bf16")
    assert r.verdict == "parity", r.culprit
    assert r.final_error < r.parity_bound


class _OutAlias(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x):
        with torch.no_grad():
            h = self.a(x)
            torch.add(h, x, out=h)  # out= is also an input: read before it is overwritten
        return self.b(torch.tanh(h))


def test_out_argument_that_is_also_an_input_is_recorded_before_the_op():
    r = bisect(lambda: precisiondiff.Workload(_OutAlias(), torch.randn(8, 16)), target="cpu/bf16")
    assert r.verdict == "parity", r.culprit


def test_inplace_resnet_with_correct_planted_convolutions_is_not_blamed():
    r = bisect(lambda: planted.inplace_resnet_workload(False), target="cpu/bf16")
    assert r.verdict == "parity", r.culprit


def test_inplace_resnet_with_a_bf16_accumulating_convolution_names_it():
    r = bisect(lambda: planted.inplace_resnet_workload(True), target="cpu/bf16")
    assert _culprit(r) == ("op", "1.conv2", "pdtest.conv3x3.default", "forward")


_SCRIPT = """
import json, torch, torch.nn.functional as F
from precisiondiff.bisect import bisect
from precisiondiff.testing import parity
from tests.zoo import ZOO
out = {"capability": torch.backends.cpu.get_cpu_capability()}
for name in ("resnet", "convnext"):
    r = bisect(ZOO[name], target="cpu/bf16")
    c = r.culprit
    out[name] = [r.verdict, c and [c["kind"], c["scope"], c["name"], c["direction"]]]
out["gelu"] = parity.check_op(F.gelu, torch.linspace(-10, 10, 1000), target="cpu/bf16").passed
print(json.dumps(out))
"""


def _run_script(capability):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.pop("ATEN_CPU_CAPABILITY", None)
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", _SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def native_verdicts():
    return _run_script(None)


@pytest.mark.parametrize("capability", ["default", "avx2"])
def test_verdicts_are_the_same_on_every_cpu_path(capability, native_verdicts):
    """PyTorch picks its CPU kernels' vector path at start-up (ATEN_CPU_CAPABILITY): the
    verdicts on stock kernels must not depend on it."""
    got = _run_script(capability)
    assert got["capability"].lower() == capability
    for key in ("resnet", "convnext", "gelu"):
        assert got[key] == native_verdicts[key], (capability, key, got[key], native_verdicts[key])
    assert got["gelu"] is True and got["resnet"][0] in ("parity", "accumulated")
