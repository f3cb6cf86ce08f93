"""Live bisect of a script, one process or every process of a ``torchrun`` job, in one command.

``torchrun --nproc-per-node 2 -m precisiondiff.cli bisect --script train_tp.py -- ARGS`` or
:func:`bisect_script` in each process:

1. **Capture**: each process runs the unmodified script as ``__main__`` under capture in replay
   mode (:func:`precisiondiff.capture.runner.capture_script`), its first step only: the script
   is stopped (``SystemExit(0)``) when its first ``optimizer.step()`` returns, on every rank at
   the same point, so a training script does not train on. Each process writes into a directory
   of its own: ``KEEP/rank{N}`` with ``keep``, else a temporary one. The script creates the
   process group; its ``destroy_process_group()`` of the
   default group is deferred until the bisect is over, because the group cannot be created
   again under torchrun (the rendezvous keys of the first one are still in torchrun's store and
   a second gloo group connects to the old addresses).
2. **Agree on the run directory** over that group, after the script: with ``keep`` it is
   ``keep``; else process 0's temporary directory, broadcast, and every other process moves its
   ``rank{N}/`` dump into it (one machine; across machines give ``keep`` on a shared filesystem).
3. **Bisect** with :func:`precisiondiff.bisect.ranks.bisect_ranks` (``across_processes``: process
   ``i`` bisects ranks ``i, i+W...``, process 0 judges the collectives and merges); the merged
   result (or the first error) is broadcast, so every process returns the same verdict.
   Temporary dumps are removed at the end.

A single process (no process group) is bisected as one replay dump (:func:`bisect_dump`). The
script's custom ops are registered because the script runs in every process.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import time
from typing import Any, Callable, Iterator, List, Optional, Sequence

from ..errors import BisectError, PrecisionDiffError
from .result import BisectResult

__all__ = ["bisect_script", "wait_for_local_peers"]

# the other processes of the last multi-rank bisect_script that run on this machine (their pids)
_LOCAL_PEERS: List[int] = []


@contextlib.contextmanager
def _default_group_kept() -> Iterator[List[Any]]:
    """While the script runs, ``destroy_process_group()`` of the default group is recorded, not
    done (the bisect needs the group after the script); other groups are destroyed as asked. A
    script that initializes the default group again gets the deferred one destroyed first."""
    import torch.distributed as dist
    if not dist.is_available():
        yield []
        return
    from torch.distributed import distributed_c10d as c10d
    real_destroy, real_init = c10d.destroy_process_group, c10d.init_process_group
    deferred: List[Any] = []

    def destroy_process_group(group=None):
        if dist.is_initialized() and (group is None or group is c10d._get_default_group()):
            deferred.append(True)
            return None
        return real_destroy(group)

    def init_process_group(*args, **kwargs):
        if deferred and dist.is_initialized():
            deferred.clear()
            real_destroy()
        return real_init(*args, **kwargs)

    patched = [(mod, name) for mod in (dist, c10d) for name in ("destroy_process_group", "init_process_group")]
    saved = {(mod, name): getattr(mod, name) for mod, name in patched}
    dist.destroy_process_group = c10d.destroy_process_group = destroy_process_group
    dist.init_process_group = c10d.init_process_group = init_process_group
    try:
        yield deferred
    finally:
        for (mod, name), value in saved.items():
            setattr(mod, name, value)


@contextlib.contextmanager
def _first_step_only() -> Iterator[None]:
    """Stop the script when its first ``optimizer.step()`` returns. The stopping hook is added
    from a pre-step hook, so that it runs after capture's own post-step hook (which ends the
    captured step)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    handles: List[Any] = []

    def stop(optimizer: Any, args: Any, kwargs: Any) -> None:
        raise SystemExit(0)

    def arm(optimizer: Any, args: Any, kwargs: Any) -> None:
        if len(handles) == 1:
            handles.append(register_optimizer_step_post_hook(stop))
    handles.append(register_optimizer_step_pre_hook(arm))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _agree(group: Any, error: Optional[str]) -> None:
    """Every process raises the first process's error, if any (no process waits forever)."""
    import torch.distributed as dist
    errors: List[Optional[str]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise BisectError(first)


def _run_dir(group: Any, me: int, where: str, keep: Optional[str]) -> str:
    """The directory holding every rank's dump (module docstring, step 2)."""
    import torch.distributed as dist
    if keep is not None:
        _agree(group, None)
        return where
    box = [where if me == 0 else None]
    dist.broadcast_object_list(box, group_src=0, group=group)
    run_dir, error = box[0], None
    if me != 0:
        mine = f"rank{dist.get_rank()}"  # the dump is named by the global rank
        try:
            if not os.path.isdir(run_dir):
                raise OSError(f"process 0's directory {run_dir} is not on this machine")
            shutil.move(os.path.join(where, mine), os.path.join(run_dir, mine))
        except OSError as err:
            error = (f"{mine}: cannot put its dump beside the others ({err}); across machines give "
                     "--keep DIR on a filesystem every machine sees")
    _agree(group, error)
    return run_dir


def bisect_script(script: "str | os.PathLike", args: Sequence[str] = (), *, keep: "str | os.PathLike | None" = None,
                  ref: str = "cpu/float64", direction: Optional[str] = None, budgets: Any = None,
                  seed: int = 0, progress: Optional[Callable[[int, int, str], None]] = None,
                  max_candidates: int = 3, accept: Optional[Sequence[str]] = None,
                  blame_known: bool = False) -> BisectResult:
    """Capture a script's first step in replay mode and bisect it (module docstring).

    Call it in every process of the job (``torchrun``), before the job's process group exists
    (the script creates it), or inside a group the script then uses as it is.

    Args:
        script: the training script, run as ``__main__`` with ``args`` as its arguments.
        keep: keep the dumps in this directory (``keep/rank{N}``); default: a temporary one,
            removed at the end.
        ref, direction, budgets, max_candidates, accept, blame_known: as for
            :func:`precisiondiff.bisect.bisect_ranks`.
        seed: seeds Python's, NumPy's and torch's RNGs before the script runs.
        progress: called as ``progress(done, total, label)`` with this process's progress.

    Returns:
        A :class:`~precisiondiff.bisect.ranks.RanksBisectResult` for a multi-rank job (the same on
        every process: the culprit carries ``rank``), a :class:`BisectResult` for one process.

    Raises:
        WorkloadError: the script failed. BisectError: ``keep`` already holds this rank's dump, or
            the dumps cannot be bisected (the same error on every process).

    Example:
        >>> r = bisect_script("train_tp.py", ["--layers", "2"])  # doctest: +SKIP
        >>> r.culprit["rank"], r.culprit["name"]  # doctest: +SKIP
    """
    from ..capture.runner import capture_script
    from .offline import bisect_dump
    from .ranks import bisect_ranks

    rank = int(os.environ.get("RANK", "0"))
    if keep is not None:
        keep = os.fspath(keep)
        for taken in (os.path.join(keep, f"rank{rank}"), os.path.join(keep, "meta.json")):
            if os.path.exists(taken):
                raise BisectError(f"--keep {keep} already holds a dump ({taken}): choose a new directory")
        where = keep
    else:
        where = tempfile.mkdtemp(prefix="precisiondiff-bisect-")
    try:
        with _default_group_kept() as deferred, _first_step_only():
            capture_script(os.fspath(script), list(args), where, mode="replay", steps="0", seed=seed)
        import torch.distributed as dist
        alive = dist.is_available() and dist.is_initialized()
        if not (alive and dist.get_world_size() > 1):
            try:
                if os.path.isdir(os.path.join(where, f"rank{rank}")):  # a job whose group is gone
                    raise BisectError(f"{script} left no process group to bisect its ranks over (destroyed in a "
                                      "way bisect could not defer): capture with --keep DIR and run "
                                      "'torchrun ... precisiondiff bisect DIR'")
                return bisect_dump(where, ref=ref, direction=direction, budgets=budgets, progress=progress,
                                   max_candidates=max_candidates, accept=accept, blame_known=blame_known)
            finally:
                if alive and deferred:
                    dist.destroy_process_group()
        return _bisect_job(where, keep, deferred, bisect_ranks, ref=ref, direction=direction, budgets=budgets,
                           progress=progress, max_candidates=max_candidates, accept=accept,
                           blame_known=blame_known)
    finally:
        if keep is None:
            shutil.rmtree(where, ignore_errors=True)


def _bisect_job(where: str, keep: Optional[str], deferred: List[Any], bisect_ranks: Callable, **options: Any
                ) -> BisectResult:
    """Steps 2 and 3 over the script's process group, then its deferred destruction."""
    import torch.distributed as dist
    group = dist.new_group(backend="gloo")  # the script's group may be NCCL/CNCL: objects go by gloo
    me = dist.get_rank(group)
    try:
        run_dir = _run_dir(group, me, where, keep)
        result, error = None, None
        try:
            result = bisect_ranks(run_dir, across_processes=True, group=group, **options)
        except PrecisionDiffError as err:
            error = str(err)
        box = [(result, error) if me == 0 else None]
        dist.broadcast_object_list(box, group_src=0, group=group)
        result, error = box[0]
        here: List[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(here, (socket.gethostname(), os.getpid()), group=group)
        _LOCAL_PEERS[:] = [pid for host, pid in here if host == socket.gethostname() and pid != os.getpid()]
        if error is not None:
            raise BisectError(error)
        dist.barrier(group=group)  # process 0 has read every dump before the temporary ones go
        return result
    finally:
        dist.destroy_process_group(group)
        if deferred:
            dist.destroy_process_group()


def wait_for_local_peers(timeout: float = 10.0) -> None:
    """Wait (at most ``timeout`` seconds) until the other processes of the last multi-rank
    :func:`bisect_script` on this machine have exited. torchrun stops, and lists as failed, every
    process still running when one exits non-zero: process 0 exits with the verdict's code last."""
    deadline = time.monotonic() + timeout
    while _LOCAL_PEERS and time.monotonic() < deadline:
        _LOCAL_PEERS[:] = [pid for pid in _LOCAL_PEERS if _running(pid)]
        if _LOCAL_PEERS:
            time.sleep(0.05)


def _running(pid: int) -> bool:
    """Whether a process exists and is not a zombie waiting for its parent (torchrun's agent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True  # no /proc: it exists
