"""No observer effect: a workload capture checks its step against the same step without capture."""
from __future__ import annotations

import json
import textwrap

import precisiondiff.store as store
from precisiondiff.capture.runner import capture_workload
from precisiondiff.compare import compare
from tests.conftest import pd_cli

STATEFUL = textwrap.dedent('''
    import torch
    from torch import nn
    import precisiondiff

    CALLS = [0]  # outside the model: copies of the model share it

    class Drifting(nn.Module):
        """Each call scales by the call count: a step whose second run differs from its first,
        as a hook that changed an accumulation order would make it."""
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
        def forward(self, x):
            CALLS[0] += 1
            return self.fc(x) * CALLS[0]

    def build():
        torch.manual_seed(0)
        return precisiondiff.Workload(Drifting(), torch.randn(2, 4), loss=lambda y: y.square().mean())

    def build_dropout():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 4))
        return precisiondiff.Workload(model, torch.randn(8, 4), loss=lambda y: y.sum(), train=True)
''')


def test_a_captured_step_is_bitwise_the_uninstrumented_one(tmp_path, example_spec):
    capture_workload(example_spec, tmp_path / "d", target="cpu/float32", mode="tensors")
    observed = json.loads((tmp_path / "d" / "meta.json").read_text())["observer_effect"]
    assert observed["bitwise_equal"] is True and "loss" in observed["checked"]


def test_random_ops_draw_the_same_numbers_in_both_runs(tmp_path):
    (tmp_path / "w.py").write_text(STATEFUL)
    capture_workload(f"{tmp_path / 'w.py'}:build_dropout", tmp_path / "d", target="cpu/float32")
    assert json.loads((tmp_path / "d" / "meta.json").read_text())["observer_effect"]["bitwise_equal"] is True


def test_a_step_changed_under_capture_is_reported_with_its_size(tmp_path):
    (tmp_path / "w.py").write_text(STATEFUL)
    summary = capture_workload(f"{tmp_path / 'w.py'}:build", tmp_path / "d", target="cpu/float32")
    assert "differs from the same step without capture" in summary
    observed = store.load(tmp_path / "d").meta["observer_effect"]
    assert observed["bitwise_equal"] is False and observed["why"]
    differs = {d["what"]: d["max_abs_diff"] for d in observed["differs"]}
    assert {"output.0", "loss", "grad.fc.weight"} <= set(differs) and differs["output.0"] > 0
    ls = pd_cli("ls", str(tmp_path / "d"))
    assert "differs from the same step without capture" in ls.stdout
    c = compare(tmp_path / "d", tmp_path / "d")
    assert any("without capture" in n for n in c.notes)


def test_a_ready_workload_keeps_its_model_after_capture(tmp_path):
    """Capture frees its own reference to the original model, never the caller's object."""
    import torch

    from precisiondiff import Workload
    model = torch.nn.Linear(4, 2)
    wl = Workload(model, torch.randn(3, 4), loss=lambda y: y.sum())
    capture_workload(wl, tmp_path / "d", target="cpu/bf16", mode="stats")
    assert wl.model is model and model.weight.dtype == torch.float32
