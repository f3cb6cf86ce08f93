"""A ``transformers`` ``TrainerCallback`` that watches a ``Trainer``'s run (an optional extra).

    from precisiondiff.watch.hf import watch_callback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[watch_callback("runs/w")])

The watch starts at ``on_train_begin`` on the trainer's model and optimizer (the optimizer
inside accelerate's wrapper), each ``on_step_end`` (after an optimizer step, gradient
accumulation included) ends a step, and the loss is what ``backward()`` was called on (the
mean over the step's micro-batches). ``on_train_end`` closes the log.
"""
from __future__ import annotations

import os
from typing import Any

from .callbacks import TrainingWatch

__all__ = ["watch_callback"]


def watch_callback(out: "str | os.PathLike", **options: Any) -> Any:
    """A ``transformers.TrainerCallback`` writing a watch log to ``out``.

    Args:
        out: the log directory.
        **options: :class:`~precisiondiff.watch.monitor.Watch` options (``level``, ``modules``,
            ``every``, ``param_every``, ``meta``, ``overwrite``).

    Raises:
        PrecisionDiffError: transformers is not installed.
    """
    try:
        from transformers import TrainerCallback
    except ImportError as err:
        from ..errors import PrecisionDiffError
        raise PrecisionDiffError("the watch callback needs transformers: pip install transformers") from err

    class WatchCallback(TrainingWatch, TrainerCallback):
        """Watches the Trainer's model and optimizer; one step per optimizer step."""

        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            self._start(model, getattr(optimizer, "optimizer", optimizer))  # accelerate's AcceleratedOptimizer

        def on_step_end(self, args, state, control, **kwargs):
            self._step()

        def on_train_end(self, args, state, control, **kwargs):
            self._close()

    return WatchCallback(out, options)
