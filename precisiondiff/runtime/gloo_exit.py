"""A gloo job's exit: let gloo's worker threads go idle before the interpreter finalizes.

A gloo worker thread (``pt_gloo_runloop``) frees a finished collective's work after it has woken the
thread that waits for it. The work's ``at::ThreadLocalState`` holds a Python object (the
``contextvars`` context torch stashes for every ``backward``), so that free takes the GIL. When the
worker is slow to run (a loaded machine), the main thread can reach ``Py_Finalize`` first: the
worker's GIL request then ends the thread (``pthread_exit``), whose unwinding through a ``noexcept``
destructor calls ``std::terminate`` and the rank dies of SIGABRT after its work is done ("terminate
called without an active exception"). torchrun then reports the job failed and kills the other
ranks. destroy_process_group() does not prevent it (gloo's ``shutdown`` is a no-op, and a group's
C++ object outlives its Python handle). Seen under CI load; reproduced at will by giving the
workers the idle scheduling class (docs/watch.md, "A gloo job's exit").

:func:`guard_exit` registers, once per process, an ``atexit`` handler (``atexit`` runs before
finalization) that releases the GIL until every gloo worker is asleep and has not moved across a
few polls, for at most :data:`WAIT_S`. Linux only (``/proc/self/task``); elsewhere it does nothing.
"""
from __future__ import annotations

import atexit
import os
import time
from typing import Dict, Optional, Tuple

__all__ = ["guard_exit", "wait_for_idle_gloo_workers", "WAIT_S"]

WAIT_S = 5.0  # the longest an exit waits; an idle job waits ~3 polls
_POLL_S = 0.002
_STABLE_POLLS = 3
_WORKER_NAME = "pt_gloo_runloop"
_guarded = False


def guard_exit() -> None:
    """Make this process wait, at exit, until its gloo worker threads are idle (see the module
    docstring). Idempotent and cheap; call it wherever a process group is seen."""
    global _guarded
    if _guarded or not os.path.isdir("/proc/self/task"):
        return
    _guarded = True
    atexit.register(wait_for_idle_gloo_workers)


def _worker_states() -> Dict[str, Tuple[str, int]]:
    """tid -> (scheduler state letter, context switches so far) of each gloo worker thread."""
    out: Dict[str, Tuple[str, int]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != _WORKER_NAME:
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                # the state follows the parenthesized name, which may itself hold spaces
                state = f.read().rsplit(")", 1)[1].split()[0]
            switches = 0
            with open(f"/proc/self/task/{tid}/status") as f:
                for line in f:
                    if "ctxt_switches:" in line:  # voluntary and nonvoluntary
                        switches += int(line.split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the thread ended meanwhile
        out[tid] = (state, switches)
    return out


def wait_for_idle_gloo_workers(timeout_s: Optional[float] = None) -> bool:
    """Sleep (the GIL released) until every gloo worker thread of this process has been asleep,
    without running, for :data:`_STABLE_POLLS` polls in a row, or ``timeout_s`` (:data:`WAIT_S`)
    has passed. A worker waiting for the GIL runs while this sleeps, so it cannot look idle.

    Returns:
        Whether the workers were seen idle (``True`` at once when there are none). Never raises.
    """
    try:
        deadline = time.monotonic() + (WAIT_S if timeout_s is None else timeout_s)
        before = _worker_states()
        if not before:
            return True
        stable = 0
        while time.monotonic() < deadline:
            time.sleep(_POLL_S)
            now = _worker_states()
            asleep = all(state in "SDI" for state, _ in now.values())
            stable = stable + 1 if asleep and now == before else 0
            if stable >= _STABLE_POLLS:
                return True
            before = now
        return False
    except Exception:  # noqa: BLE001  (an exit aid: never in the way of the exit)
        return False
