"""Capture inside a Hugging Face Trainer (precisiondiff/capture/hf_trainer.py): a tiny random
GPT-2 trained 2 steps with the callback, against the same training without it."""
from __future__ import annotations

import pytest
import torch

import precisiondiff.store as store
from precisiondiff.store import verify

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")

from precisiondiff.capture.hf_trainer import CaptureCallback  # noqa: E402
from precisiondiff.errors import PrecisionDiffError  # noqa: E402


class _Tokens(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, 64, (8, 12), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _train(tmp_path, callback=None):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                     bos_token_id=1, eos_token_id=2)
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), max_steps=2,
                                          per_device_train_batch_size=2, learning_rate=1e-3, report_to=[],
                                          use_cpu=True, save_strategy="no", logging_strategy="no",
                                          disable_tqdm=True, seed=0, dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(),
                                   callbacks=[callback] if callback else None)
    trainer.train()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_trainer_run_is_captured_step_by_step_without_changing_it(tmp_path):
    callback = CaptureCallback(tmp_path / "dump", level="module", mode="stats")
    captured = _train(tmp_path, callback)
    assert callback.error is None and callback.session is None  # closed at on_train_end
    plain = _train(tmp_path)
    assert all(torch.equal(captured[k], plain[k]) for k in plain)  # the training is the same
    assert verify(tmp_path / "dump").ok
    dump = store.load(tmp_path / "dump")
    assert dump.complete and dump.meta["workload"] == "transformers.Trainer (GPT2LMHeadModel)"
    events = list(dump.events())
    assert {e.step for e in events} == {0, 1}
    for step in (0, 1):
        grads = {t.slot for e in events if e.step == step and e.kind == "param" for t in e.tensors}
        assert "param_grad.weight" in grads  # taken before the Trainer's zero_grad
        scopes = {e.scope for e in events if e.step == step and e.kind == "module"}
        assert {"transformer.h.0.attn", "transformer.h.1.mlp", "lm_head"} <= scopes


def test_a_dump_that_cannot_be_opened_leaves_the_training_running(tmp_path):
    (tmp_path / "dump").mkdir()
    (tmp_path / "dump" / "meta.json").write_text("{}\n")  # already holds a dump, no overwrite
    callback = CaptureCallback(tmp_path / "dump")
    _train(tmp_path, callback)
    assert "already holds a dump" in callback.error


def test_bad_options_are_refused_before_training():
    with pytest.raises(PrecisionDiffError, match="unknown level"):
        CaptureCallback("runs/x", level="everything")
