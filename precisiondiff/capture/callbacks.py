"""What a training framework's capture callback does, whatever the framework:
:class:`TrainingCapture` (the HF ``Trainer`` callback in :mod:`.hf_trainer`, Lightning's in
:mod:`.lightning`). No framework is imported here.

The options are checked when the callback is made (before the training); the capture opens on
the model the trainer trains, each optimizer step ends a capture step, and it closes at the end
of the training (or on its exception). Capture never raises into the training: a dump that cannot
be opened is logged and the training runs uncaptured (``error`` says why).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

from ..errors import PrecisionDiffError
from .session import CaptureSession, capture

__all__ = ["TrainingCapture"]

log = logging.getLogger(__name__)


class TrainingCapture:
    """The capture session of one training run (module docstring).

    Args:
        out: the dump directory.
        **options: what :func:`precisiondiff.capture` takes besides ``model``.

    Raises:
        PrecisionDiffError: ``model=`` given, or an option :func:`precisiondiff.capture` refuses.
    """

    def __init__(self, out: "str | os.PathLike", **options: Any) -> None:
        if "model" in options:
            raise PrecisionDiffError("the callback captures the trainer's own model: do not pass model=")
        capture(out, model=None, **options)  # validates the options (opens nothing)
        self.out, self.options = out, options
        self.session: Optional[CaptureSession] = None
        self.error: Optional[str] = None

    def _open(self, model: Any, workload: str) -> None:
        options = dict(self.options)
        meta = {"target": "script", "workload": workload, **(options.pop("meta", None) or {})}
        try:
            session = capture(self.out, model=model, meta=meta, **options)
            session.__enter__()
        except PrecisionDiffError as err:  # capture never raises into the training
            self.error = str(err)
            log.error("precisiondiff: capture not started: %s", err)
            return
        self.session = session

    def _step(self) -> None:
        if self.session is not None:
            self.session.step()

    def _close(self, exception: Optional[BaseException] = None) -> None:
        session, self.session = self.session, None
        if session is not None:
            session.__exit__(type(exception) if exception else None, exception,
                             exception.__traceback__ if exception else None)
