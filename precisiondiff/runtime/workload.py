"""Workloads: a model, its inputs and an optional loss, built the same way for every target.

``precisiondiff capture|bisect WORKLOAD`` takes ``path/to/file.py:fn`` or ``package.module:fn``.
``fn()`` takes no required argument and returns :class:`Workload` (or ``(model, inputs)``).
Every RNG is seeded before ``fn`` runs, so the weights and inputs are identical for every
target; the model is built once on the CPU in float32 and a copy is moved to each target.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import random
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from ..errors import PrecisionDiffError, WorkloadError
from .targets import Target

__all__ = ["Workload", "load_workload", "seed_everything", "call_model", "RunResult", "run_workload"]


@dataclass
class Workload:
    """What to run: ``model(inputs)``, then ``loss(output).backward()`` when a loss is given.

    Attributes:
        model: an ``nn.Module`` built on the CPU in float32.
        inputs: a tensor, a tuple of positional arguments, or a dict of keyword arguments.
        loss: a callable on the model's output returning a scalar; enables the backward pass.
        train: keep training mode (dropout active). Off by default: eval mode makes random ops
            deterministic so two targets cannot differ by their RNG streams.
        optimizer: a factory of the parameters (``lambda ps: torch.optim.AdamW(ps, fused=True)``):
            each step then ends with ``optimizer.step()`` (a training step; needs a loss). Every
            target builds its own from its copy of the model (:mod:`precisiondiff.runtime.training`).
        steps: how many training steps capture and bisect run (forward, backward, optimizer step).
        scheduler: a factory of the optimizer (``lambda opt: StepLR(opt, 1)``): stepped after it.
        scaler: a factory of a ``torch.amp.GradScaler`` (or one, copied per target): the loss is
            scaled before backward, then ``scaler.step(optimizer)`` and ``scaler.update()``.

    Example:
        >>> Workload(torch.nn.Linear(4, 2), torch.randn(3, 4), loss=lambda y: y.sum())
    """

    model: torch.nn.Module
    inputs: Any
    loss: Optional[Callable[[Any], torch.Tensor]] = None
    train: bool = False
    name: str = field(default="workload")
    optimizer: Optional[Callable[[Any], Any]] = None
    steps: int = 1
    scheduler: Optional[Callable[[Any], Any]] = None
    scaler: Any = None


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's RNGs (every device torch knows)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def _already_imported(path: str, name: str) -> Any:
    """The module already imported from ``path`` (by us as ``name``, or by a plain import), or None."""
    if name in sys.modules:
        return sys.modules[name]
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and file.endswith(".py") and os.path.abspath(file) == path:
            return module
    return None


def _load_module(module_part: str) -> Any:
    if module_part.endswith(".py") or os.sep in module_part or "/" in module_part:
        path = os.path.abspath(module_part)
        if not os.path.isfile(path):
            raise WorkloadError(f"workload file not found: {module_part}")
        digest = hashlib.sha1(path.encode()).hexdigest()[:10]
        name = f"_precisiondiff_workload_{digest}"
        loaded = _already_imported(path, name)
        if loaded is not None:
            # never executed twice in one process: a second run redefines its torch.library ops,
            # which frees the dispatcher entries the first module's ops still point at
            return loaded
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise WorkloadError(f"cannot import {module_part}: not a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        directory = os.path.dirname(path)
        if directory not in sys.path:
            sys.path.insert(0, directory)
        try:
            spec.loader.exec_module(module)
        except Exception as err:  # user code: report it, not as our bug
            raise WorkloadError(f"importing {module_part} failed: {type(err).__name__}: {err}") from err
        return module
    try:
        return importlib.import_module(module_part)
    except ModuleNotFoundError as err:
        raise WorkloadError(f"workload module {module_part!r} not found ({err}); pass "
                            "path/to/file.py:fn or an importable package.module:fn") from err
    except Exception as err:
        raise WorkloadError(f"importing {module_part} failed: {type(err).__name__}: {err}") from err


def load_workload(spec: "str | Callable[[], Any] | Workload", *, seed: int = 0) -> Workload:
    """Seed every RNG, then build the workload from ``file.py:fn``, ``package.module:fn`` or
    ``hf:PATH`` (a transformers checkpoint or config, see :mod:`precisiondiff.runtime.hf`).

    Args:
        spec: the spec string, a factory callable, or a ready :class:`Workload`.
        seed: the seed applied before the factory runs.

    Returns:
        The workload, on the CPU in float32.

    Raises:
        WorkloadError: the file, module or function is missing, or it returns the wrong thing.

    Example:
        >>> w = load_workload("examples/tiny_transformer.py:build")
    """
    if isinstance(spec, Workload):
        return spec
    label = getattr(spec, "__name__", "workload")
    if isinstance(spec, str) and spec.startswith("hf:"):
        path = spec[3:]

        def factory() -> Workload:
            from .hf import build_hf  # transformers only when an hf: workload is asked for
            return Workload(*build_hf(path, seed=seed))
        label = spec
    elif isinstance(spec, str):
        module_part, sep, fn_name = spec.rpartition(":")
        if not sep or not module_part or not fn_name:
            raise WorkloadError(f"workload {spec!r} must be path/to/file.py:fn or package.module:fn")
        module = _load_module(module_part)
        factory = getattr(module, fn_name, None)
        if not callable(factory):
            names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            raise WorkloadError(f"{module_part} has no function {fn_name!r}; callables there: "
                                f"{', '.join(names[:12]) or 'none'}")
        label = spec
    elif callable(spec):
        factory = spec
    else:
        raise WorkloadError(f"a workload must be a spec string, a factory or a Workload, not {type(spec).__name__}")
    seed_everything(seed)
    try:
        built = factory()
    except PrecisionDiffError:  # already a one-line message for the user (hf: workloads)
        raise
    except TypeError as err:
        raise WorkloadError(f"{label}() failed: {err} (the function must take no required argument)") from err
    except Exception as err:
        raise WorkloadError(f"{label}() raised {type(err).__name__}: {err}") from err
    if isinstance(built, tuple) and len(built) == 2 and not isinstance(built, Workload):
        built = Workload(*built)
    if not isinstance(built, Workload):
        raise WorkloadError(f"{label}() returned {type(built).__name__}; it must return "
                            "precisiondiff.Workload(model, inputs, loss=None) or (model, inputs)")
    if not isinstance(built.model, torch.nn.Module):
        raise WorkloadError(f"{label}(): the model is a {type(built.model).__name__}, not a torch.nn.Module")
    _check_training(built, label)
    built.name = label
    return built


def _check_training(built: Workload, label: str) -> None:
    """A training workload's options, checked before anything runs (one-line errors)."""
    if not isinstance(built.steps, int) or isinstance(built.steps, bool) or built.steps < 1:
        raise WorkloadError(f"{label}(): steps must be a positive int, not {built.steps!r}")
    for what in ("optimizer", "scheduler"):
        value = getattr(built, what)
        if value is not None and not callable(value):
            raise WorkloadError(f"{label}(): {what} must be a factory (e.g. lambda ps: torch.optim.AdamW(ps)), "
                                f"not {type(value).__name__}")
    if built.optimizer is None and (built.scheduler is not None or built.scaler is not None):
        raise WorkloadError(f"{label}(): a scheduler or scaler needs an optimizer (Workload(..., optimizer=...))")
    if built.optimizer is not None and built.loss is None:
        raise WorkloadError(f"{label}(): an optimizer needs a loss to train on (Workload(..., loss=...))")


def call_model(model: Callable[..., Any], inputs: Any) -> Any:
    """Call ``model`` with a tensor, a tuple of positional arguments or a dict of kwargs."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


@dataclass
class RunResult:
    """The model and inputs as placed on a target, and what one step produced."""

    model: torch.nn.Module
    inputs: Any
    output: Any
    loss: Optional[torch.Tensor]


def run_workload(workload: Workload, target: Target, *, model: Optional[torch.nn.Module] = None,
                 inputs: Any = None, backward: bool = True,
                 scale: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> RunResult:
    """Run one step of ``workload`` on ``target``: forward, then loss and backward if any.

    ``model``/``inputs`` reuse an already prepared copy (hooks may be attached to it);
    ``scale`` maps the loss before backward (a GradScaler's ``scale``). The optimizer step of a
    training workload is :func:`precisiondiff.runtime.training.train_step`'s.
    """
    if model is None:
        model = target.prepare_model(workload.model)
        model.train(workload.train)
    if inputs is None:
        inputs = target.prepare_inputs(workload.inputs)
    loss = None
    stage = "forward"
    try:
        with target.context():
            output = call_model(model, inputs)
            if workload.loss is not None and backward:
                stage = "loss"
                loss = workload.loss(output)
        if loss is not None:
            stage = "backward"
            (scale(loss) if scale is not None else loss).backward()
    except PrecisionDiffError:
        raise
    except Exception as err:  # the user's model or loss (or a dtype it cannot run in) failed
        where = _user_frame(err)
        hint = ""
        if stage == "loss" and ("same device" in str(err) or "expected device" in str(err)):
            # the loss closes over tensors of its own (labels): a target moves the model and inputs only
            hint = ("; a tensor the loss holds stays where it was made: move it to the output's device "
                    "in the loss (labels.to(out.device))")
        raise WorkloadError(f"{workload.name}: the {stage} on {target} raised {type(err).__name__}: "
                            f"{str(err).splitlines()[0] if str(err) else ''}{where}{hint}") from err
    return RunResult(model, inputs, output, loss)


def _user_frame(err: BaseException) -> str:
    """`` (file.py:line)`` of the innermost frame outside torch and precisiondiff, if any."""
    import traceback
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if "/torch/" not in f.filename and "/precisiondiff/" not in f.filename]
    return f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
