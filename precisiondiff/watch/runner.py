"""Watch an unmodified training script: what ``precisiondiff watch --script`` runs."""
from __future__ import annotations

import os
from typing import List, Optional

from ..errors import WorkloadError
from ..runtime.script import run_as_main
from .monitor import Watch, losses_from_backward

__all__ = ["watch_script"]


def watch_script(script: str, args: List[str], out: "str | os.PathLike", *, level: str = "default",
                 modules: Optional[str] = None, every: int = 1, param_every: int = 10, seed: int = 0,
                 overwrite: bool = False, replay_steps: Optional[str] = None, ref: Optional[str] = None,
                 ref_noise: Optional[str] = None, on_anomaly: bool = False) -> str:
    """Run ``script`` as ``__main__`` under a watch of every module and optimizer in the process.

    Each ``optimizer.step()`` ends a step; the loss is what ``backward()`` was called on (the mean
    when a step calls it several times). The script chooses its own devices and data. With
    ``replay_steps`` those steps are also captured in replay mode into ``out/replay``; with ``ref``
    (and ``ref_noise``) or ``on_anomaly``, the step after the first one that crosses.

    Returns:
        A one-line summary for the terminal.

    Raises:
        WorkloadError: the script is missing, raised, or exited with a non-zero status (the log
            keeps the steps watched before).
        PrecisionDiffError: ``ref`` turned out to be a log of another model once the script's
            model ran (the run was watched without the trigger).
    """
    if not os.path.isfile(script):
        raise WorkloadError(f"script not found: {script}")
    from ..runtime.workload import seed_everything
    seed_everything(seed)
    meta = {"workload": f"--script {script}", "script_args": list(args), "seed": seed}
    w = Watch(out, level=level, modules=modules, every=every, param_every=param_every, meta=meta,
              overwrite=overwrite, global_hooks=True, replay_steps=replay_steps, ref=ref, ref_noise=ref_noise,
              on_anomaly=on_anomaly)
    with w, losses_from_backward(w):
        code = run_as_main(script, list(args), f"the steps watched so far are kept in {out}")
    if code:
        raise WorkloadError(f"{script} exited with status {code}; the watch log in {out} is kept")
    if w.trigger_refused:
        from ..errors import PrecisionDiffError
        raise PrecisionDiffError(f"{w.trigger_error}; the run was watched into {out} without the trigger")
    stopped = f"; watch stopped early: {w.errors[0]}" if w.errors else ""
    if w.trigger_error is not None:
        stopped += f"; the trigger stopped: {w.trigger_error}"
    replay = f"; steps {replay_steps} captured in replay mode into {os.path.join(out, 'replay')}" \
        if replay_steps and os.path.isdir(os.path.join(out, "replay")) else ""
    if w.triggered is not None:
        t = w.triggered
        replay += (f"; step {t['step']} crossed ({t['rule']}: {t['reason']}): step {t['captured_step']} captured "
                   f"in replay mode into {os.path.join(out, 'replay')}"
                   + ("" if os.path.isfile(os.path.join(out, "replay", "meta.json")) else " (the run ended first)"))
    elif ref is not None or on_anomaly:
        replay += "; no step crossed the trigger's threshold"
    return f"watched {w.step_index} steps of {script} ({level}) into {out}{replay}{stopped}"
