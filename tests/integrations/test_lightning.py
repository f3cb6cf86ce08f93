"""Capture and watch inside a Lightning ``Trainer`` (precisiondiff/capture/lightning.py,
precisiondiff/watch/lightning.py): a tiny LightningModule trained a few steps on the CPU with
each callback, against the same training without it. Skipped without Lightning."""
from __future__ import annotations

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning.pytorch")

import precisiondiff  # noqa: E402
from precisiondiff.capture.lightning import CaptureCallback  # noqa: E402
from precisiondiff.store import verify  # noqa: E402
from precisiondiff.watch import read_logs  # noqa: E402
from precisiondiff.watch.lightning import watch_callback  # noqa: E402

# Lightning's advice for real jobs (dataloader workers, logging intervals) is not about these
pytestmark = pytest.mark.filterwarnings("ignore::Warning:lightning", "ignore::Warning:pytorch_lightning")


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(callbacks=(), *, steps=3, accumulate=1, precision="32-true"):
    torch.manual_seed(0)
    module = Tiny()
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(24, 6, generator=g), torch.randn(24, 3, generator=g))
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=accumulate,
                        precision=precision,
                        callbacks=list(callbacks))
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    return module, {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.fixture(scope="module")
def plain():
    return _fit()[1]


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_capture_records_each_optimizer_step_without_changing_the_training(tmp_path, plain):
    callback = CaptureCallback(tmp_path / "dump", level="all")
    _, trained = _fit([callback])
    assert callback.error is None and callback.session is None  # closed at on_train_end
    assert _equal(trained, plain)
    assert verify(tmp_path / "dump").ok
    dump = precisiondiff.load(tmp_path / "dump")
    assert dump.complete and dump.meta["workload"] == "lightning.Trainer (Tiny)"
    events = list(dump.events())
    assert {e.step for e in events} == {0, 1, 2}
    for step in (0, 1, 2):
        mine = [e for e in events if e.step == step]
        assert {e.direction for e in mine if e.kind == "module" and e.scope == "net.0"} == {"forward", "backward"}
        # the forward runs inside Lightning's optimizer.step(closure): recorded as forward all the same
        assert any(e.kind == "op" and e.scope == "net.0" and e.direction == "forward" for e in mine)
        assert {e.scope for e in mine if e.kind == "param"} >= {"net.0", "net.2"}  # gradients
        updates = [e for e in mine if e.direction == "optimizer"]
        assert updates and all(e.scope.startswith("optimizer.param_groups.0/net.") for e in updates)


def test_with_gradient_accumulation_a_capture_step_is_an_optimizer_step(tmp_path, plain):
    callback = CaptureCallback(tmp_path / "dump", level="module")
    _fit([callback], steps=2, accumulate=2)
    events = list(precisiondiff.load(tmp_path / "dump").events())
    assert {e.step for e in events} == {0, 1}
    assert [e.call for e in events if e.step == 0 and e.scope == "net.0" and e.direction == "forward"] == [0, 1]


def test_a_dump_that_cannot_be_opened_leaves_the_training_running(tmp_path, plain):
    (tmp_path / "dump").mkdir()
    (tmp_path / "dump" / "meta.json").write_text("{}\n")  # already holds a dump, no overwrite
    callback = CaptureCallback(tmp_path / "dump")
    _, trained = _fit([callback])
    assert "already holds a dump" in callback.error and _equal(trained, plain)


def test_watch_logs_each_step_and_leaves_the_parameters_bitwise_equal(tmp_path, plain):
    module, trained = _fit([watch_callback(tmp_path / "w", param_every=1)])
    assert _equal(trained, plain)
    log = read_logs(tmp_path / "w")[0]
    assert log.complete and [r["step"] for r in log.steps] == [0, 1, 2]
    assert [r["loss"] for r in log.steps] == pytest.approx(module.losses, rel=1e-6)
    for record in log.steps:
        assert record["params"]["net.0.weight"]["grad"] > 0  # read after the closure's backward
        assert "net.0" in {key.split("#")[0].split(":")[0] for key in record["tensors"]}


def test_a_bf16_training_step_compares_with_the_float64_one_without_a_failing_row(tmp_path):
    """Lightning's own precisions: ``bf16-true`` against ``64-true``, the first step, every event."""
    for name, precision in (("bf16", "bf16-true"), ("f64", "64-true")):
        callback = CaptureCallback(tmp_path / name, level="all", steps="0")
        _fit([callback], steps=1, precision=precision)
        assert callback.error is None, callback.error
    result = precisiondiff.compare(str(tmp_path / "bf16"), str(tmp_path / "f64"))
    s = result.summary
    assert s["failed"] == 0 and s["unmatched_a"] == 0 and s["tensors"] > 20, s
    assert {r.direction for r in result.rows if r.match != "none"} >= {"forward", "backward", "optimizer"}
