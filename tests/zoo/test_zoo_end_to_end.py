"""Every zoo model through capture (the level/mode combinations spread over the models), compare
against the float64 reference, and the HTML report, with no crash; a training step with an optimizer
on GPT-2 (tied weights) and ResNet (buffers); bisect on one model. CI keeps to the cheapest
combination per model: each model is captured twice (DUT and reference) in one process."""
from __future__ import annotations

import os

import pytest
import torch

import precisiondiff
import precisiondiff.store as store
from precisiondiff.capture.runner import capture_workload
from precisiondiff.compare import compare
from tests.zoo import ZOO

pytest.importorskip("transformers")

MODELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models.py")
# each model one (level, mode); together they cover every level and every mode
PLAN = {"llama": ("all", "replay"), "gpt2": ("all", "tensors"), "bert": ("module", "stats"),
        "t5": ("op", "stats"), "vit": ("all", "stats"), "mixtral": ("op", "tensors"),
        "resnet": ("all", "stats"), "convnext": ("module", "tensors")}


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_model_captures_compares_and_reports(tmp_path, name):
    from precisiondiff.report.html import render_html

    level, mode = PLAN[name]
    spec = f"{MODELS}:build_{name}"
    for target, out in (("cpu/bf16", "dut"), ("cpu/float64", "ref")):
        capture_workload(spec, tmp_path / out, target=target, level=level, mode=mode)
        meta = store.load(tmp_path / out).meta
        assert meta["complete"] and "capture_errors" not in meta
        assert meta["observer_effect"]["bitwise_equal"], meta["observer_effect"]
    assert store.verify(tmp_path / "dut").ok
    c = compare(tmp_path / "dut", tmp_path / "ref")
    assert c.summary["tensors"] > 0 and c.rows
    html = render_html(c)
    assert "<html" in html.lower()


@pytest.mark.parametrize("name", ["gpt2", "resnet"])
def test_zoo_training_steps_with_an_optimizer(tmp_path, name):
    """Two AdamW steps under the Python API: step-prefixed keys, gradients of tied weights and
    models with buffers recorded, the optimizer's own update recorded as its events, not as model ops."""
    torch.manual_seed(0)
    workload = ZOO[name]()
    model = workload.model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with precisiondiff.capture(tmp_path / "d", model=model, steps="0-1") as cap:
        for _ in range(2):
            loss = workload.loss(model(**workload.inputs))
            loss.backward()
            opt.step()
            opt.zero_grad()
            cap.step()
    assert not cap.errors
    dump = store.load(tmp_path / "d")
    events = list(dump.events())
    assert {e.step for e in events} == {0, 1}
    updates = [e for e in events if e.direction == "optimizer"]
    assert {e.step for e in updates} == {0, 1}
    assert all(e.scope.startswith("optimizer") for e in updates)
    assert not any(("_foreach" in e.name or "adam" in e.name.lower() or e.name.startswith("aten.lerp_"))
                   and e.direction != "optimizer" for e in events)
    grads = {t.slot for e in events if e.kind == "param" and e.step == 1 for t in e.tensors}
    if name == "gpt2":  # lm_head.weight is transformer.wte.weight: one parameter, one gradient
        assert model.lm_head.weight is model.transformer.wte.weight
        assert "param_grad.weight" in grads
    assert store.verify(tmp_path / "d").ok


def test_bisect_runs_on_a_zoo_model():
    result = precisiondiff.bisect(ZOO["gpt2"](), target="cpu/bf16", ref="cpu/float64")
    assert result.verdict in ("parity", "kernel", "accumulated")
