"""runtime/gloo_exit.py: the exit waits while a gloo worker thread runs, not once it sleeps.

The workers are stand-ins: threads of this process given the name the wait looks for in /proc
(gloo's ``pt_gloo_runloop``, here a name of the test's own, so that the idle gloo threads other
tests' groups leave in this process, and another test's threads, are not counted). The SIGABRT itself (a starved worker freeing its last work
during Py_Finalize) is reproduced by hand in docs/watch.md, "A gloo job's exit"."""
from __future__ import annotations

import ctypes
import os
import threading
import uuid

import pytest

from precisiondiff.runtime import gloo_exit

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc/self/task (Linux)")

PR_SET_NAME = 15


@pytest.fixture(autouse=True)
def _stand_in_name(monkeypatch):
    # one name a test: a joined thread's /proc entry can outlive join() for a moment
    monkeypatch.setattr(gloo_exit, "_WORKER_NAME", f"pd_{uuid.uuid4().hex[:10]}")


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
    assert _named_workers() == 0
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
    assert gloo_exit.wait_for_idle_gloo_workers(timeout_s=0) is True


def test_the_guard_registers_one_exit_handler(monkeypatch):
    registered = []
    monkeypatch.setattr(gloo_exit, "_guarded", False)
    monkeypatch.setattr(gloo_exit.atexit, "register", registered.append)
    gloo_exit.guard_exit()
    gloo_exit.guard_exit()
    assert registered == [gloo_exit.wait_for_idle_gloo_workers]


def test_capture_and_watch_guard_the_exit_once_they_see_a_process_group(tmp_path, monkeypatch):
    import torch
    import torch.distributed as dist

    import precisiondiff
    from precisiondiff.capture import session as capture_session
    from precisiondiff.watch import monitor

    calls = []
    monkeypatch.setattr(capture_session, "guard_exit", lambda: calls.append("capture"))
    monkeypatch.setattr(monitor, "guard_exit", lambda: calls.append("watch"))
    model = torch.nn.Linear(4, 2)
    with precisiondiff.capture(tmp_path / "plain", model=model):
        model(torch.ones(3, 4)).sum().backward()
    assert calls == []  # not distributed: nothing to guard
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with precisiondiff.capture(tmp_path / "dist", model=model):
            model(torch.ones(3, 4)).sum().backward()
        assert "capture" in calls
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with precisiondiff.watch(tmp_path / "w", model=model, optimizer=opt) as w:
            model(torch.ones(3, 4)).sum().backward()
            opt.step()
            w.step()
        assert "watch" in calls
    finally:
        dist.destroy_process_group()
