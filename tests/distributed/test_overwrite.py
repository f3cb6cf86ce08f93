"""``--overwrite`` in a multi-rank job: the old dump is replaced once, by one process, after every
rank has finished; every rank's dump survives (precisiondiff/capture/replace.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp

import precisiondiff.store as store
from precisiondiff.capture.replace import replacing
from precisiondiff.errors import WorkloadError
from precisiondiff.store import verify
from tests.distributed.conftest import free_port

HERE = Path(__file__).parent
TINY = str(HERE / "train_tiny.py")


def _assert_every_rank_complete(out: Path, world: int, args: list) -> None:
    assert sorted(p.name for p in out.iterdir()) == [f"rank{r}" for r in range(world)]
    for rank in range(world):
        report = verify(out / f"rank{rank}")
        assert report.ok and not report.partial, (rank, report.problems, report.notes)
        meta = store.load(out / f"rank{rank}").meta
        assert meta["rank"] == rank and meta["world_size"] == world and meta["complete"]
        assert meta["script_args"] == args and meta["events"] > 0
    assert not any(Path(f"{out}{suffix}").exists() for suffix in (".new", ".new.ranks", ".failed"))


def _torchrun(tmp_path: Path, out: Path, nproc: int, *script_args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "precisiondiff", "capture", "--script", TINY, "-o", str(out), "--overwrite",
           "--level", "module", "--", *script_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)


def test_torchrun_overwrite_three_times_keeps_every_rank(tmp_path):
    out = tmp_path / "run"
    for run in range(3):
        args = ["--tag", str(run)]
        r = _torchrun(tmp_path, out, 2, *args)
        assert r.returncode == 0, r.stderr[-3000:]
        _assert_every_rank_complete(out, 2, args)


def _spawned(rank: int, world: int, port: int, out: str, runs: list) -> None:
    import torch.distributed as dist

    from precisiondiff.capture.runner import capture_script
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for args in runs:
            try:
                capture_script(TINY, args, out, level="module", overwrite=True)
            except WorkloadError as err:
                assert "--fail-rank" in args and f"rank {rank} failed" in str(err), err
                assert "is untouched" in str(err)
            dist.barrier()  # the next job starts after this one, as torchrun runs them
    finally:
        dist.destroy_process_group()


def test_four_ranks_overwrite_twice_then_a_failed_rank_leaves_the_dump(tmp_path):
    out = tmp_path / "run"
    runs = [["--tag", "1"], ["--tag", "2"], ["--tag", "3", "--fail-rank", "2"]]
    mp.spawn(_spawned, args=(4, free_port(), str(out), runs), nprocs=4)
    # the third job failed on rank 2: the second job's dump stays, the failed one is set aside
    assert sorted(p.name for p in out.iterdir()) == [f"rank{r}" for r in range(4)]
    for rank in range(4):
        assert verify(out / f"rank{rank}").ok
        assert store.load(out / f"rank{rank}").meta["script_args"] == ["--tag", "2"]
    failed = Path(f"{out}.failed")
    assert sorted(p.name for p in failed.iterdir()) == [f"rank{r}" for r in range(4)]
    assert store.load(failed / "rank2").meta["complete"] is False
    assert not Path(f"{out}.new").exists() and not Path(f"{out}.new.ranks").exists()


def _as_rank(monkeypatch, rank: int, world: int) -> None:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))


def _write_rank_dump(where: str, rank: int) -> None:
    (Path(where) / f"rank{rank}").mkdir(parents=True)
    (Path(where) / f"rank{rank}" / "meta.json").write_text("{}\n")


def test_the_swap_waits_for_the_last_rank(tmp_path, monkeypatch):
    out = tmp_path / "run"
    _write_rank_dump(str(out), 0)
    _write_rank_dump(str(out), 1)
    (out / "rank0" / "old").write_text("")
    _as_rank(monkeypatch, 0, 2)
    with replacing(out, True) as where:
        _write_rank_dump(where, 0)
    assert (out / "rank0" / "old").exists()  # rank 1 has not finished: nothing moved
    _as_rank(monkeypatch, 1, 2)
    with replacing(out, True) as where:
        _write_rank_dump(where, 1)
    assert sorted(p.name for p in out.iterdir()) == ["rank0", "rank1"]
    assert not (out / "rank0" / "old").exists()


def test_a_mark_left_by_a_killed_job_is_not_counted(tmp_path, monkeypatch):
    import socket
    out = tmp_path / "run"
    _write_rank_dump(str(out), 0)
    marks = Path(f"{out}.new.ranks")
    marks.mkdir()
    # rank 1 of an earlier job (another launcher on this host) finished before that job was killed
    (marks / "rank1").write_text(f"ok {socket.gethostname()} {os.getppid() + 1} - - - 0\n")
    _as_rank(monkeypatch, 0, 2)
    with replacing(out, True) as where:
        _write_rank_dump(where, 0)
    assert Path(f"{out}.new").exists()  # this job's rank 1 has not finished: no swap


@pytest.mark.parametrize("world", [1, 2])
def test_without_overwrite_the_output_directory_is_used_as_it_is(tmp_path, monkeypatch, world):
    _as_rank(monkeypatch, 0, world)
    with replacing(tmp_path / "run", False) as where:
        assert where == str(tmp_path / "run")
