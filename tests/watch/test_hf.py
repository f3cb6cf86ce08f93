"""The transformers callback, driven as a Trainer drives it (accelerate, which Trainer needs, is
not a dependency here: the callback's events are called in the Trainer's order)."""
from __future__ import annotations

import pytest
import torch

from precisiondiff.watch import read_logs

from . import train

transformers = pytest.importorskip("transformers")


def test_the_callback_watches_each_optimizer_step_with_its_mean_loss(tmp_path):
    from precisiondiff.watch.hf import watch_callback
    model, opt, tokens = train.build()
    callback = watch_callback(tmp_path)
    assert isinstance(callback, transformers.TrainerCallback)
    callback.on_train_begin(None, None, None, model=model, optimizer=opt)
    means = []
    for _ in range(3):
        losses = []
        for micro in (tokens[:1], tokens[1:]):  # gradient accumulation: two backward() per step
            logits = model(micro).float()
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, train.VOCAB), micro[:, 1:].reshape(-1))
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        callback.on_step_end(None, None, None)
        means.append(sum(losses) / 2)
    callback.on_train_end(None, None, None)
    log = read_logs(tmp_path)[0]
    assert log.complete and [r["loss"] for r in log.steps] == pytest.approx(means, rel=1e-6)
    assert "blocks.0:output#1" not in log.steps[0]["tensors"] and "blocks.0#1:output" in log.steps[0]["tensors"]
    assert torch.autograd.backward.__module__ == "torch.autograd"  # restored


def test_a_real_trainer_run_is_watched_without_changing_it(tmp_path):
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    from precisiondiff.watch.hf import watch_callback
    from tests.integrations.test_hf_trainer import _train
    watched = _train(tmp_path, watch_callback(tmp_path / "w", param_every=1))
    plain = _train(tmp_path)
    assert all(torch.equal(watched[k], plain[k]) for k in plain)
    log = read_logs(tmp_path / "w")[0]
    assert log.complete and [r["step"] for r in log.steps] == [0, 1]
    assert all(r["params"]["transformer.h.0.mlp.c_fc.weight"]["grad"] > 0 for r in log.steps)  # before the Trainer's zero_grad
