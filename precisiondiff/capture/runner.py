"""Capture a workload or a script on a target: what ``precisiondiff capture`` runs."""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, List, Optional

from ..errors import CaptureError, PrecisionDiffError, WorkloadError
from . import capture
from .filters import parse_selection
from .replace import replacing
from .observer import compare_snapshots, restored_rng, rng_state, set_rng_state, snapshot
from ..runtime.copying import copy_model
from ..runtime.host_allocator import return_large_blocks
from ..runtime.script import run_as_main
from ..runtime.targets import Target, checked_held, default_dut
from ..runtime.training import Trainer, train_step
from ..runtime.workload import load_workload, run_workload

__all__ = ["capture_workload", "capture_script"]


def _check(cap, path: "str | os.PathLike") -> None:
    """A capture that stopped on its own error (a full disk) fails the command, in one line."""
    if cap.error is None:
        return
    reason = str(cap.error) if isinstance(cap.error, PrecisionDiffError) else cap.errors[0]
    raise CaptureError(f"capture stopped: {reason} (the partial dump is in {path})")


def _plain_step(workload, tgt: Target, plain_model, inputs, before) -> list:
    """Step 0 without capture on the untouched copy, from the RNG state ``before`` the captured
    step (which then starts from the same state): what it produced, to compare with the captured
    step. A training step runs with its own optimizer: the updated parameters are compared too."""
    with restored_rng(before, tgt.device):
        plain = train_step(workload, tgt, plain_model, inputs, Trainer(workload, plain_model))
        reference = snapshot(plain.output, plain.loss, plain_model) + _params(workload, plain_model)
    set_rng_state(before, tgt.device)  # the captured step draws as if the plain one had not run
    return reference


def _params(workload, model) -> list:
    """The parameters after a training step (none for a step without an optimizer)."""
    if workload.optimizer is None:
        return []
    return [(f"param.{name}", p.detach()) for name, p in model.named_parameters()]


def _handoff_line(path: "str | os.PathLike", spec: str) -> str:
    """What to copy to another machine to bisect this replay dump there, and how big it is."""
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
    return (f"to bisect on another machine (it needs neither the device nor its extension) copy {path} "
            f"({size / 2 ** 20:.1f} MiB, the whole directory) and run: precisiondiff bisect {path} "
            f"[--workload {spec}] [--peer DEVICE/DTYPE]")


def _spec_name(spec: Any) -> str:
    """What meta.json names a workload given as a callable or a ``Workload`` (not JSON itself)."""
    return getattr(spec, "__qualname__", None) or getattr(spec, "name", None) or type(spec).__name__


def capture_workload(spec: str, out: "str | os.PathLike", *, target: "str | Target | None" = None,
                     level: str = "all", mode: str = "stats", format: str = "safetensors",
                     seed: int = 0, steps: Optional[str] = None, train: bool = False, repeat: int = 1,
                     overwrite: bool = False, allow_narrowed: bool = False, **filters) -> str:
    """Build the workload (seeded), move it to ``target``, run and capture it.

    Steps after the first rerun the same forward/backward (gradients zeroed), which is how
    run-to-run determinism is observed within one dump. A training workload (``optimizer=``)
    runs ``workload.steps`` training steps by default, each ending with its optimizer step. With ``repeat > 1`` the whole capture is
    done ``repeat`` times into ``out/run0``... for ``precisiondiff compare`` to measure noise.

    Returns:
        A one-paragraph summary for the terminal.

    ``allow_narrowed``: a float64 target on a device that holds float64 as float32 (torch_mlu)
    runs, and is recorded, as the float32 target it is (``meta.target_asked`` keeps what was
    asked); without it such a target is refused.

    Raises:
        PrecisionDiffError: bad workload, target or output directory; disk full.
    """
    return_large_blocks()  # the host copies a step makes and frees stay resident otherwise
    asked = Target.parse(target) if target is not None else default_dut()
    tgt, held_note = checked_held(asked, allow_narrowed=allow_narrowed)
    workload = load_workload(spec, seed=seed)
    if steps is None:
        steps = "0" if workload.steps == 1 else f"0-{workload.steps - 1}"
    selection = parse_selection(steps)
    n_steps = (max(selection) + 1) if selection else 1
    lines = [f"warning: {held_note}"] if held_note else []
    for run in range(repeat):
        path = os.path.join(out, f"run{run}") if repeat > 1 else out
        model = tgt.prepare_model(workload.model)
        if run == repeat - 1:
            # the target's copy is all that is run from here: the original (float32, say) would
            # stay in host memory beside it for the whole capture. A copy of the workload without
            # it, not a change to the caller's object (a ready Workload is used as it is given).
            workload = dataclasses.replace(workload, model=None)
        model.train(train or workload.train)
        inputs = tgt.prepare_inputs(workload.inputs)
        observed = None
        meta = {"target": str(tgt), "seed": seed, "workload": spec if isinstance(spec, str) else _spec_name(spec), "steps": n_steps,
                "backward": workload.loss is not None, "repeat": run,
                "optimizer": workload.optimizer is not None}
        if held_note:
            meta["target_asked"] = str(asked)
        with replacing(path, overwrite) as target_dir:
            # observer effect: step 0 without capture too, from the same weights (a copy taken
            # before any hook) and the same RNG state. It runs first, so that the copy is freed
            # before the captured step: only what it produced is held beside the captured step
            # and capture's queue, not a second model (docs/capture.md, "Host memory")
            plain_model = copy_model(model)
            trainer = Trainer(workload, model)
            try:
                with capture(target_dir, model=model, level=level, mode=mode, format=format,
                             steps=steps, meta=meta, overwrite=overwrite, **filters) as cap:
                    for i in range(n_steps):
                        before = rng_state(tgt.device)
                        if i == 0:
                            with cap.suspended():
                                reference = _plain_step(workload, tgt, plain_model, inputs, before)
                            del plain_model
                        result = train_step(workload, tgt, model, inputs, trainer)
                        tgt.synchronize()
                        if i == 0:
                            with cap.suspended():
                                observed = compare_snapshots(
                                    reference, snapshot(result.output, result.loss, model) + _params(workload, model))
                            del reference
                            cap.update_meta(observer_effect=observed)
                        cap.step()
                        trainer.zero_grad(model)
            except WorkloadError as err:
                if overwrite and target_dir != os.fspath(path):
                    raise
                raise WorkloadError(f"{err}; what was recorded before is kept in {path} (partial)") from err
            _check(cap, target_dir)
        written = cap.recorder.events_written
        loss = f", loss {result.loss.item():.6g}" if result.loss is not None else ""
        lines.append(f"captured {written} events of {spec} on {tgt} ({level}/{mode}{loss}) into {path}")
        if mode == "replay":
            lines.append(_handoff_line(path, spec))
        if observed is not None and not observed["bitwise_equal"]:
            what = ", ".join(d["what"] for d in observed["differs"][:4])
            lines.append(f"warning: the captured step differs from the same step without capture ({what}); "
                         "see observer_effect in meta.json")
    return "\n".join(lines)


def capture_script(script: str, args: List[str], out: "str | os.PathLike", *, level: str = "all",
                   mode: str = "stats", format: str = "safetensors", steps: Optional[str] = None,
                   seed: int = 0, overwrite: bool = False, **filters) -> str:
    """Run an unmodified script as ``__main__`` under global capture hooks.

    Each ``optimizer.step()`` ends a capture step. The script chooses its own devices.
    """
    if not os.path.isfile(script):
        raise WorkloadError(f"script not found: {script}")
    from ..runtime.workload import seed_everything
    return_large_blocks()  # this process is ours: as for a workload capture
    seed_everything(seed)
    meta = {"target": "script", "seed": seed, "workload": f"--script {script}", "script_args": args,
            "argv": list(sys.argv)}  # precisiondiff's own command line, before the script's replaces it
    with replacing(out, overwrite) as target_dir, \
            capture(target_dir, model=None, level=level, mode=mode, format=format, steps=steps,
                    meta=meta, overwrite=overwrite, **filters) as cap:
        code = run_as_main(script, list(args), f"events recorded so far are kept in {out}")
    _check(cap, out)
    if code:
        raise WorkloadError(f"{script} exited with status {code}; the dump in {out} is kept")
    return f"captured {cap.recorder.events_written} events of {script} ({level}/{mode}) into {out}"
