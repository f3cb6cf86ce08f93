"""Training steps of a workload: its optimizer, LR scheduler and GradScaler on one target.

A :class:`~precisiondiff.runtime.workload.Workload` with ``optimizer=`` is a training workload:
each step is forward, loss, backward, then the optimizer step (through the GradScaler when one
is given) and the scheduler step. Every prepared copy of the model (the DUT's, the reference's,
the observer's rerun) gets its own :class:`Trainer`, built by the workload's factories from that
copy's parameters, so the optimizer state lives on the target in the target's dtypes.
"""
from __future__ import annotations

import copy
from typing import Any, Optional

import torch

from ..errors import PrecisionDiffError, WorkloadError
from .targets import Target
from .workload import RunResult, Workload, run_workload

__all__ = ["Trainer", "train_step"]


def _build(factory: Any, arg: Any, what: str, workload: Workload) -> Any:
    try:
        return factory(arg)
    except PrecisionDiffError:
        raise
    except Exception as err:  # the user's factory
        raise WorkloadError(f"{workload.name}: the {what} factory raised {type(err).__name__}: "
                            f"{str(err).splitlines()[0] if str(err) else ''}") from err


class Trainer:
    """The optimizer, scheduler and scaler of one prepared model.

    Args:
        workload: a workload with ``optimizer=`` (else the trainer does nothing).
        model: the prepared copy whose parameters it updates.

    Example:
        >>> t = Trainer(wl, model)                   # doctest: +SKIP
        >>> train_step(wl, target, model, inputs, t)  # doctest: +SKIP
    """

    def __init__(self, workload: Workload, model: torch.nn.Module) -> None:
        self.workload = workload
        self.optimizer = self.scheduler = self.scaler = None
        if workload.optimizer is None:
            return
        self.optimizer = _build(workload.optimizer, [p for p in model.parameters() if p.requires_grad],
                                "optimizer", workload)
        if workload.scheduler is not None:
            self.scheduler = _build(workload.scheduler, self.optimizer, "scheduler", workload)
        if workload.scaler is not None:
            scaler = workload.scaler
            # an instance is copied: each target keeps its own scale and growth tracker
            self.scaler = copy.deepcopy(scaler) if hasattr(scaler, "scale") else _build(
                lambda _: scaler(), None, "scaler", workload)

    @property
    def trains(self) -> bool:
        """Whether steps end with an optimizer step."""
        return self.optimizer is not None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss as backward sees it (scaled by the GradScaler, if any)."""
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def update(self) -> None:
        """The optimizer step (through the scaler), then the scheduler's."""
        if self.optimizer is None:
            return
        try:
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
        except PrecisionDiffError:
            raise
        except Exception as err:  # the user's optimizer (or a dtype it cannot run in)
            raise WorkloadError(f"{self.workload.name}: the optimizer step raised {type(err).__name__}: "
                                f"{str(err).splitlines()[0] if str(err) else ''}") from err

    def zero_grad(self, model: torch.nn.Module) -> None:
        """Gradients to None before the next step."""
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)


def train_step(workload: Workload, target: Target, model: torch.nn.Module, inputs: Any,
               trainer: Optional[Trainer] = None) -> RunResult:
    """One step: :func:`~precisiondiff.runtime.workload.run_workload`'s forward, loss and
    backward (the loss scaled by the trainer's scaler), then the trainer's optimizer step."""
    scale = trainer.scale if trainer is not None and trainer.scaler is not None else None
    result = run_workload(workload, target, model=model, inputs=inputs, scale=scale)
    if trainer is not None:
        trainer.update()
    return result
