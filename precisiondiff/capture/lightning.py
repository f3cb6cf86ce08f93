"""Capture inside a Lightning ``Trainer``: :class:`CaptureCallback`.

``Trainer(callbacks=[CaptureCallback("runs/dut", steps="0-1")])`` records the LightningModule the
Trainer trains, from ``on_train_start`` to ``on_train_end``; each optimizer step ends a capture
step (at the end of the batch that stepped: gradient accumulation included). Lightning's automatic
optimization runs forward and backward inside ``optimizer.step(closure)``: they are recorded as
forward and backward, the parameter gradients when the closure returns, then the update
(capture/closure.py). Under DDP every process writes its ``rank{N}/``. Capture never raises into
the training: a dump that cannot be opened is logged and the training runs uncaptured
(``callback.error`` says why).

Importing this module imports Lightning: ``lightning.pytorch`` and/or the older
``pytorch_lightning`` (the callback is a ``Callback`` of each one installed, so either Trainer
takes it).
"""
from __future__ import annotations

import importlib
from typing import Any, Tuple

from ..errors import PrecisionDiffError
from .callbacks import TrainingCapture

__all__ = ["CaptureCallback", "lightning_callback_bases"]


def lightning_callback_bases() -> Tuple[type, ...]:
    """The ``Callback`` classes of the Lightning packages installed (``lightning.pytorch``,
    ``pytorch_lightning``).

    Raises:
        PrecisionDiffError: neither is installed.
    """
    bases = []
    for package in ("lightning.pytorch", "pytorch_lightning"):
        try:
            bases.append(importlib.import_module(package).Callback)
        except ImportError:
            continue
    if not bases:
        raise PrecisionDiffError("the Lightning callbacks need Lightning: pip install lightning")
    return tuple(dict.fromkeys(bases))


class CaptureCallback(TrainingCapture, *lightning_callback_bases()):  # type: ignore[misc]
    """A Lightning ``Callback`` that captures the trained LightningModule into a dump (module
    docstring).

    Args:
        out: the dump directory.
        **options: what :func:`precisiondiff.capture` takes besides ``model`` (``level``,
            ``mode``, ``steps``, ``scope``..., ``overwrite``).

    Raises:
        PrecisionDiffError: an option :func:`precisiondiff.capture` refuses (at construction,
            before the training starts).

    Example:
        >>> trainer = lightning.Trainer(max_steps=2, callbacks=[CaptureCallback("runs/dut")])  # doctest: +SKIP
        >>> trainer.fit(module, loader)  # doctest: +SKIP
    """

    _global_step = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._open(pl_module, f"lightning.Trainer ({type(pl_module).__name__})")
        self._global_step = trainer.global_step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != self._global_step:  # an optimizer stepped in this batch
            self._global_step = trainer.global_step
            self._step()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close(exception)
