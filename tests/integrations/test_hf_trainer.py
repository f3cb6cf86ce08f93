"""Capture inside a Hugging Face Trainer (precisiondiff/capture/hf_trainer.py): a tiny random
GPT-2 trained 2 steps with the callback, against the same training without it; a bf16 Trainer run
compared with a float64 one, and bisected from its replay dump (clean, and with a planted GELU)."""
from __future__ import annotations

import pytest
import torch

import precisiondiff.store as store
from precisiondiff.store import verify

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")

from precisiondiff.capture.hf_trainer import CaptureCallback  # noqa: E402
from precisiondiff.errors import PrecisionDiffError  # noqa: E402

PLANT = "pdtrainer.rough_gelu.default"


@torch.library.custom_op("pdtrainer::rough_gelu", mutates_args=())
def rough_gelu(x: torch.Tensor) -> torch.Tensor:
    """The planted kernel: GELU as x * sigmoid(x) in bf16 (a crude approximation), exact otherwise."""
    if x.dtype == torch.bfloat16:
        return x * torch.sigmoid(x)
    return torch.nn.functional.gelu(x)


@rough_gelu.register_fake
def _(x):
    return torch.empty_like(x)


def _gelu_grad(x, grad):
    cdf = 0.5 * (1 + torch.erf(x / 2 ** 0.5))
    return grad * (cdf + x * torch.exp(-0.5 * x * x) / (2 * torch.pi) ** 0.5)


rough_gelu.register_autograd(lambda ctx, grad: _gelu_grad(ctx.saved_tensors[0], grad),
                             setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]))


class _RoughGelu(torch.nn.Module):
    """GPT-2's activation replaced by the planted op."""

    def forward(self, x):
        return rough_gelu(x)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, 64, (8, 12), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _train(tmp_path, callback=None, dtype=None, plant=False):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                     bos_token_id=1, eos_token_id=2)
    model = transformers.GPT2LMHeadModel(config)
    if plant:
        model.transformer.h[1].mlp.act = _RoughGelu()
    if dtype is not None:
        model.to(dtype)
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


@pytest.fixture(scope="module")
def stats_pair(tmp_path_factory):
    """The first step of a bf16 and of a float64 Trainer run (same seed and data), module statistics."""
    where = tmp_path_factory.mktemp("trainer")
    for name, dtype in (("bf16", torch.bfloat16), ("f64", torch.float64)):
        callback = CaptureCallback(where / name, level="module", mode="stats", steps="0")
        _train(where / f"{name}-run", callback, dtype=dtype)
        assert callback.error is None, callback.error
    return where / "bf16", where / "f64"


def test_a_bf16_trainer_step_compares_with_the_float64_one_without_a_failing_row(stats_pair):
    import precisiondiff
    result = precisiondiff.compare(str(stats_pair[0]), str(stats_pair[1]))
    s = result.summary
    assert s["failed"] == 0 and s["unmatched_a"] == 0 and s["tensors"] > 20, s
    backward = [r for r in result.rows if r.direction == "backward" and r.match != "none"]
    assert backward, "the backward pass is compared too"


@pytest.mark.parametrize("plant", [False, True], ids=["clean", "planted"])
def test_bisect_of_a_trainer_replay_dump(tmp_path, plant):
    """The first optimizer step of a bf16 Trainer run captured in replay mode by the callback and
    bisected from the dump alone: clean, no kernel verdict; planted, the GELU of block 1, forward."""
    import precisiondiff
    callback = CaptureCallback(tmp_path / "dump", mode="replay", steps="0")
    _train(tmp_path, callback, dtype=torch.bfloat16, plant=plant)
    assert callback.error is None, callback.error
    result = precisiondiff.bisect_dump(str(tmp_path / "dump"))
    if not plant:
        assert result.verdict in ("parity", "accumulated") and result.culprits == [], result.culprit
        return
    c = result.culprit
    assert result.verdict == "kernel" and (c["kind"], c["name"], c["direction"]) == ("op", PLANT, "forward"), c
    assert c["scope"] == "transformer.h.1.mlp.act", c
