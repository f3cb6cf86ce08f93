"""Replacing an existing dump (``--overwrite``) without losing it, in one process or in a job.

A new dump is written beside the old one, in ``OUT.new``, and swapped in only when the capture
succeeds: a failed or killed capture never destroys the previous dump (a failed one is kept as
``OUT.failed``).

In a multi-rank job (``torchrun``: ``WORLD_SIZE > 1``) every process writes its ``rank{N}/``
into the same ``OUT.new``, and the swap is done **once, by one process, after every rank has
finished**: each process leaves a mark in ``OUT.new.ranks/`` (``ok`` or ``failed``); the process
that sees the marks of all ranks claims the swap by renaming that directory (an atomic rename:
exactly one process succeeds), then moves ``OUT.new`` to ``OUT`` (every rank succeeded) or to
``OUT.failed`` (one failed), leaving ``OUT`` untouched. No process group is needed — a script
creates and destroys its own — so the marks go through the filesystem: ``OUT`` must be on a
filesystem every rank sees (one machine, or a shared one across machines). A rank that is killed
leaves no mark: then nothing is swapped, ``OUT`` keeps the previous dump and ``OUT.new`` what the
ranks wrote. A mark left by a killed earlier job is told apart by the job it names (the launcher's
process id on this host, torchrun's run id and port).
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
from typing import Iterator

from ..errors import DumpError, PrecisionDiffError
from .distributed import rank_and_world

__all__ = ["replacing"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def replacing(out: "str | os.PathLike", overwrite: bool) -> Iterator[str]:
    """The directory to capture into: ``out`` itself, or with ``overwrite`` a staging directory
    swapped in when the capture succeeds (module docstring).

    Raises:
        PrecisionDiffError: as the capture raised it, with where the failed capture is kept.
    """
    out = os.fspath(out)
    rank, world = rank_and_world()
    if overwrite and world > 1:
        with _replacing_in_job(out, rank, world) as where:
            yield where
        return
    if not (overwrite and os.path.isdir(out)):
        yield out
        return
    fresh, failed = f"{out}.new", f"{out}.failed"
    shutil.rmtree(fresh, ignore_errors=True)
    try:
        yield fresh
    except BaseException as err:
        if os.path.isdir(fresh):
            shutil.rmtree(failed, ignore_errors=True)
            os.replace(fresh, failed)
        _reraise_with_where(err, out, failed)
    shutil.rmtree(out)
    os.replace(fresh, out)


def _reraise_with_where(err: BaseException, out: str, where: str) -> None:
    if isinstance(err, PrecisionDiffError):
        raise type(err)(f"{err} [the previous dump in {out} is untouched; this capture is in {where}]") from err
    raise err


def _job_id() -> str:
    """What tells this job's marks from a killed earlier job's: the launcher (torchrun's agent,
    the spawning process) on this host, and torchrun's run id and port."""
    env = os.environ
    return " ".join([socket.gethostname(), str(os.getppid()), env.get("TORCHELASTIC_RUN_ID", "-"),
                     env.get("MASTER_ADDR", "-"), env.get("MASTER_PORT", "-"),
                     env.get("TORCHELASTIC_RESTART_COUNT", "0")])


def _mark(marks: str, rank: int, outcome: str) -> None:
    os.makedirs(marks, exist_ok=True)
    path = os.path.join(marks, f"rank{rank}")
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        fh.write(f"{outcome} {_job_id()}\n")
    os.replace(path + ".tmp", path)


def _marks_of_this_job(marks: str, world: int) -> dict:
    """rank -> outcome of the marks this job left (stale ones from a killed job on this host are
    skipped); empty when the directory is gone (another process claimed the swap)."""
    host, job = socket.gethostname(), _job_id().split(" ", 1)[1]
    found = {}
    for rank in range(world):
        try:
            with open(os.path.join(marks, f"rank{rank}"), encoding="utf-8") as fh:
                outcome, mark_host, mark_job = (fh.read().strip().split(" ", 2) + ["", ""])[:3]
        except OSError:
            continue
        if mark_host != host or mark_job == job:  # another host's mark cannot be checked
            found[rank] = outcome
    return found


@contextlib.contextmanager
def _replacing_in_job(out: str, rank: int, world: int) -> Iterator[str]:
    fresh, failed, marks = f"{out}.new", f"{out}.failed", f"{out}.new.ranks"
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(marks, f"rank{rank}"))  # this rank's mark from an earlier job
    # only this rank's own staging directory is cleared (the writer empties it); the others'
    # are being written by now
    try:
        yield fresh
    except BaseException as err:
        try:
            _finish(out, fresh, failed, marks, rank, world, "failed")
        except OSError as swap_err:  # never hide the capture's own error
            log.error("setting the failed capture %s aside: %s", fresh, swap_err)
        _reraise_with_where(err, out, f"{fresh} (moved to {failed} when every rank has finished)")
    try:
        _finish(out, fresh, failed, marks, rank, world, "ok")
    except OSError as err:
        raise DumpError(f"cannot replace {out} with the new dump in {fresh}: {err.strerror or err}; "
                        "the new dump stays there") from err


def _finish(out: str, fresh: str, failed: str, marks: str, rank: int, world: int, outcome: str) -> None:
    """Leave this rank's mark; the process that sees every rank's does the swap, once."""
    _mark(marks, rank, outcome)
    outcomes = _marks_of_this_job(marks, world)
    if len(outcomes) < world:
        return  # a rank still running finishes the job
    claimed = f"{marks}.{rank}.{os.getpid()}"
    try:
        os.rename(marks, claimed)
    except OSError:
        return  # another process saw every mark too and claimed the swap first
    try:
        if os.path.isdir(fresh):
            for name in os.listdir(fresh):  # left by an earlier job with more ranks
                if name.startswith("rank") and name[4:].isdigit() and int(name[4:]) >= world:
                    shutil.rmtree(os.path.join(fresh, name), ignore_errors=True)
            target = out if all(o == "ok" for o in outcomes.values()) else failed
            if os.path.isdir(target):
                shutil.rmtree(target)
            os.replace(fresh, target)
    finally:
        shutil.rmtree(claimed, ignore_errors=True)
