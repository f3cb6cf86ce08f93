"""Capture inside a Hugging Face ``transformers.Trainer``: :class:`CaptureCallback`.

``trainer.add_callback(CaptureCallback("runs/dut", steps="0-1"))`` records the model the Trainer
trains, from ``on_train_begin`` to ``on_train_end``; each optimizer step ends a capture step
(parameter gradients are taken just before ``optimizer.step()``, by capture's optimizer hook, so
the Trainer's ``zero_grad`` does not hide them). Under ``torchrun`` every process writes its
``rank{N}/``. Capture never raises into the training: a dump that cannot be opened is logged
and the training runs uncaptured (``callback.error`` says why).

Importing this module imports transformers (the ``hf`` extra).
"""
from __future__ import annotations

import logging
from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as err:  # pragma: no cover - the extra is missing
    from ..errors import PrecisionDiffError
    raise PrecisionDiffError("CaptureCallback needs transformers: pip install 'precisiondiff[hf]'") from err

from .callbacks import TrainingCapture

__all__ = ["CaptureCallback"]

log = logging.getLogger(__name__)


class CaptureCallback(TrainingCapture, TrainerCallback):
    """A ``TrainerCallback`` that captures the Trainer's model into a dump (module docstring).

    Args:
        out: the dump directory.
        **options: what :func:`precisiondiff.capture` takes besides ``model`` (``level``,
            ``mode``, ``steps``, ``scope``..., ``overwrite``).

    Raises:
        PrecisionDiffError: an option :func:`precisiondiff.capture` refuses (at construction,
            before the training starts).

    Example:
        >>> trainer.add_callback(CaptureCallback("runs/dut", level="module", steps="0-1"))  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
    """

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is None:
            self.error = "the Trainer passed no model to on_train_begin: nothing captured"
            log.error("precisiondiff: %s", self.error)
            return
        self._open(model, f"transformers.Trainer ({type(model).__name__})")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close()
