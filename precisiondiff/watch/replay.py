"""Capture chosen steps in replay mode inside a watched run (``watch --replay-steps 5,6``).

A capture session (:func:`precisiondiff.capture`, ``level="all"``, ``mode="replay"``) is opened
just before the first chosen step and closed after the last, into ``OUT/replay`` (the keys carry
``step{N}/`` of the run's own step numbers), so ``precisiondiff bisect OUT/replay`` can judge the
step offline without rerunning the job from step 0.

Where it opens and closes matters: PyTorch iterates its optimizer hook tables live, so a
session must not be opened or closed from inside an optimizer hook (which is where a script's
step ends). With a model (the Python API) the window opens and closes in ``w.step()``. For a
script it opens after the first ``backward()`` of the step before the first chosen one (outside
every hook; the step counter of the session is set so that nothing of that step is recorded, and
the session's own optimizer hook moves it on) and closes at the first ``backward()`` after the
last chosen step (or when the watch closes).
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Optional

__all__ = ["ReplayWindow"]


class ReplayWindow:
    """One capture session over the steps ``first..last`` (recording only ``steps``).

    Args:
        out: the dump directory.
        steps: the chosen step numbers.
        meta: extra fields for the dump's meta.json.
    """

    def __init__(self, out: str, steps: frozenset, meta: dict) -> None:
        self.out, self.steps, self.meta = out, steps, meta
        self.first, self.last = min(steps), max(steps)
        self.session: Any = None
        self.done = False

    def check(self) -> None:
        """Refuse an existing dump before the run starts (a user error, not watch's own)."""
        from ..errors import PrecisionDiffError
        if os.path.exists(os.path.join(self.out, "meta.json")):
            raise PrecisionDiffError(f"{self.out} holds a dump already: choose another -o or remove it")

    def open(self, model: Any, at_step: int) -> None:
        """Open the session; ``at_step`` is the step number its next events belong to."""
        from ..capture import capture
        selection = ",".join(str(s) for s in sorted(self.steps))
        self.session = capture(self.out, model=model, level="all", mode="replay", steps=selection,
                               meta=self.meta)
        self.session.__enter__()
        self.session.recorder.step = at_step

    def open_in_forward(self, module: Any, args: Any, at_step: int) -> None:
        """Open the session from inside the global forward pre-hook of ``module``'s call (a
        script's first module call of a step, when a trigger armed the window at the previous
        step's end, inside an optimizer hook). PyTorch took the list of pre-hooks of this call
        before the session's own was added, so it is called here for this call; its post-hook
        is in the list taken after the forward."""
        self.open(None, at_step)
        self.session._global_fwd_pre(module, args)

    @property
    def active(self) -> bool:
        return self.session is not None and not self.done

    def close(self) -> Optional[str]:
        """Close the session (what it recorded is written); its first error, or None."""
        if self.session is None or self.done:
            return None
        self.done = True
        self.session.__exit__(None, None, None)
        return self.session.errors[0] if self.session.errors else None

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Watch's own tensor work is not the model's: the session records none of it."""
        session = self.session if self.active else None
        if session is None:
            yield
            return
        was, session.paused = session.paused, True
        try:
            yield
        finally:
            session.paused = was
