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
import os
from typing import Any, Optional

try:
    from transformers import TrainerCallback
except ImportError as err:  # pragma: no cover - the extra is missing
    from ..errors import PrecisionDiffError
    raise PrecisionDiffError("CaptureCallback needs transformers: pip install 'precisiondiff[hf]'") from err

from ..errors import PrecisionDiffError
from .session import CaptureSession, capture

__all__ = ["CaptureCallback"]

log = logging.getLogger(__name__)


class CaptureCallback(TrainerCallback):
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

    def __init__(self, out: "str | os.PathLike", **options: Any) -> None:
        if "model" in options:
            raise PrecisionDiffError("CaptureCallback captures the Trainer's own model: do not pass model=")
        capture(out, model=None, **options)  # validates the options (opens nothing)
        self.out, self.options = out, options
        self.session: Optional[CaptureSession] = None
        self.error: Optional[str] = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is None:
            self.error = "the Trainer passed no model to on_train_begin: nothing captured"
            log.error("precisiondiff: %s", self.error)
            return
        options = dict(self.options)
        meta = {"target": "script", "workload": f"transformers.Trainer ({type(model).__name__})",
                **(options.pop("meta", None) or {})}
        try:
            session = capture(self.out, model=model, meta=meta, **options)
            session.__enter__()
        except PrecisionDiffError as err:  # capture never raises into the training
            self.error = str(err)
            log.error("precisiondiff: capture not started: %s", err)
            return
        self.session = session

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.session is not None:
            self.session.step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        session, self.session = self.session, None
        if session is not None:
            session.__exit__(None, None, None)
