"""A capture killed with SIGKILL in the middle of a step (inside a forward, with events queued
for the writer thread) leaves a dump that verify and compare accept as partial."""
from __future__ import annotations

import random
import signal
import textwrap

import pytest

import precisiondiff.store as store
from tests.conftest import pd_cli

SCRIPT = """
import os, signal, sys, torch
from torch import nn
kill_step, kill_layer = int(sys.argv[1]), int(sys.argv[2])

class Layer(nn.Module):
    def __init__(self, i):
        super().__init__()
        self.i, self.fc = i, nn.Linear(64, 64)
    def forward(self, x):
        if STEP[0] == kill_step and self.i == kill_layer:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-forward: ops and module calls half recorded
        return torch.tanh(self.fc(x))

STEP = [0]
torch.manual_seed(0)
model = nn.Sequential(*[Layer(i) for i in range(6)])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(4):
    STEP[0] = step
    model(torch.randn(32, 64)).square().mean().backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.parametrize("seed", [3])
def test_sigkill_mid_step_leaves_a_partial_dump_verify_and_compare_accept(tmp_path, seed):
    rng = random.Random(seed)
    kill_step, kill_layer = rng.randint(1, 3), rng.randint(0, 5)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    out = tmp_path / "k"
    r = pd_cli("capture", "--script", str(script), "-o", str(out), "--mode", "tensors", "--",
               str(kill_step), str(kill_layer))
    assert r.returncode == -signal.SIGKILL, r.stderr
    dump = store.load(out)
    assert dump.complete is False
    steps = {e.step for e in dump.events()}
    assert set(range(kill_step)) <= steps  # every finished step is on disk
    v = pd_cli("verify", str(out))
    assert v.returncode == 0 and "partial" in v.stdout.lower(), v.stdout + v.stderr
    c = pd_cli("compare", str(out), str(out))
    assert c.returncode == 0, c.stdout + c.stderr
    assert "partial" in c.stderr.lower() or "partial" in c.stdout.lower()
