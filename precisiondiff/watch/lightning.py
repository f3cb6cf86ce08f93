"""A Lightning ``Callback`` that watches a ``Trainer``'s run (an optional extra).

    from precisiondiff.watch.lightning import watch_callback
    trainer = lightning.Trainer(max_steps=1000, callbacks=[watch_callback("runs/w")])

The watch starts at ``on_train_start`` on the LightningModule and the trainer's optimizers; an
optimizer step ends a watch step (at the end of the batch that stepped, gradient accumulation
included; the gradients are read when Lightning's closure has run the backward, capture/closure.py),
and the loss is what ``backward()`` was called on (the mean over the step's micro-batches).
``on_train_end`` (or an exception) closes the log. The callback is a ``Callback`` of each
Lightning package installed (``lightning.pytorch``, ``pytorch_lightning``).
"""
from __future__ import annotations

import os
from typing import Any

from .callbacks import TrainingWatch

__all__ = ["watch_callback"]


def watch_callback(out: "str | os.PathLike", **options: Any) -> Any:
    """A Lightning ``Callback`` writing a watch log to ``out``.

    Args:
        out: the log directory.
        **options: :class:`~precisiondiff.watch.monitor.Watch` options (``level``, ``modules``,
            ``every``, ``param_every``, ``meta``, ``overwrite``).

    Raises:
        PrecisionDiffError: Lightning is not installed.
    """
    from ..capture.lightning import lightning_callback_bases

    class WatchCallback(TrainingWatch, *lightning_callback_bases()):  # type: ignore[misc]
        """Watches the LightningModule and the trainer's optimizers; one step per optimizer step."""

        _global_step = 0

        def on_train_start(self, trainer, pl_module):
            self._start(pl_module, list(trainer.optimizers))
            self._global_step = trainer.global_step

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step != self._global_step:  # an optimizer stepped in this batch
                self._global_step = trainer.global_step
                self._step()

        def on_train_end(self, trainer, pl_module):
            self._close()

        def on_exception(self, trainer, pl_module, exception):
            self._close(complete=False)

    return WatchCallback(out, options)
