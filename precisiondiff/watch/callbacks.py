"""What a training framework's watch callback does, whatever the framework: :class:`TrainingWatch`
(the HF ``Trainer`` callback in :mod:`.hf`, Lightning's in :mod:`.lightning`). No framework is
imported here.

The watch starts on the trainer's model and optimizer(s), the loss of a step is the mean of its
``backward()`` calls, each optimizer step ends a watch step, and the log is closed at the end of
the training (as partial when the training raised).
"""
from __future__ import annotations

import os
from typing import Any, Optional

from .monitor import Watch, losses_from_backward

__all__ = ["TrainingWatch"]


class TrainingWatch:
    """The watch of one training run (module docstring).

    Args:
        out: the log directory.
        options: :class:`~precisiondiff.watch.monitor.Watch` options.
    """

    def __init__(self, out: "str | os.PathLike", options: dict) -> None:
        self.out, self.options = out, options
        self.watch: Optional[Watch] = None
        self._losses: Any = None

    def _start(self, model: Any, optimizer: Any) -> None:
        self.watch = Watch(self.out, model=model, optimizer=optimizer, **self.options).__enter__()
        self._losses = losses_from_backward(self.watch)
        self._losses.__enter__()

    def _step(self) -> None:
        if self.watch is not None:
            self.watch.step()

    def _close(self, *, complete: bool = True) -> None:
        if self._losses is not None:
            self._losses.__exit__(None, None, None)
            self._losses = None
        if self.watch is not None:
            self.watch.close(complete=complete)
            self.watch = None
