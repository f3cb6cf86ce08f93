"""runtime/gloo_exit.py: the exit waits while a gloo worker thread runs, not once it sleeps.

The workers are stand-ins: threads of this process given gloo's worker name (``pt_gloo_runloop``),
which is what the wait reads from /proc. The SIGABRT itself (a starved worker freeing its last work
during Py_Finalize) is reproduced by hand in docs/watch.md, "A gloo job's exit"."""
from __future__ import annotations

import ctypes
import os
import threading

import pytest

from precisiondiff.runtime import gloo_exit

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc/self/task (Linux)")

PR_SET_NAME = 15


def _as_gloo_worker(body):
    """A thread that names itself like gloo's worker, then runs ``body``."""
    def run():
        ctypes.CDLL(None).prctl(PR_SET_NAME, gloo_exit._WORKER_NAME.encode())
        body()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _named_workers() -> int:
    return len(gloo_exit._worker_states())


def test_the_exit_waits_while_a_worker_runs_and_goes_once_it_sleeps():
    stop, named = threading.Event(), threading.Event()

    def busy():  # a worker still freeing its work: it runs and takes the GIL
        named.set()
        total = 0
        while not stop.is_set():
            total += 1

    worker = _as_gloo_worker(busy)
    named.wait()
    try:
        assert _named_workers() == 1
        assert gloo_exit.wait_for_idle_gloo_workers(timeout_s=0.3) is False
    finally:
        stop.set()
        worker.join()

    idle = threading.Event()
    asleep = _as_gloo_worker(lambda: (named.set(), idle.wait()))
    try:
        assert gloo_exit.wait_for_idle_gloo_workers(timeout_s=10) is True
    finally:
        idle.set()
        asleep.join()


def test_without_gloo_workers_the_exit_does_not_wait():
    assert _named_workers() == 0
    assert gloo_exit.wait_for_idle_gloo_workers(timeout_s=0) is True


def test_the_guard_registers_one_exit_handler(monkeypatch):
    registered = []
    monkeypatch.setattr(gloo_exit, "_guarded", False)
    monkeypatch.setattr(gloo_exit.atexit, "register", registered.append)
    gloo_exit.guard_exit()
    gloo_exit.guard_exit()
    assert registered == [gloo_exit.wait_for_idle_gloo_workers]
