"""Runs on different rank counts compare on global statistics: the ranks' shards combine into the
statistics of the whole tensor, and a 2-rank DDP job compares with one process on the whole batch."""
from __future__ import annotations

import math
import os
import signal
import subprocess
import tempfile
import sys

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from precisiondiff.capture.stats import StatsBatch
from precisiondiff.watch import compare_logs
from precisiondiff.watch.layouts import _combine_params, _combine_tensor
from precisiondiff.watch.log import FIELDS

from . import train

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _stats(t: torch.Tensor) -> list:
    batch = StatsBatch()
    handle = batch.add(t)
    batch.start()
    batch.resolve()
    return [{**batch.get(handle), "numel": t.numel()}[f] for f in FIELDS]


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.integers(1, 7), min_size=2, max_size=4), cols=st.integers(1, 9),
       seed=st.integers(0, 2 ** 16), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_shards_combine_into_the_whole_tensors_statistics(rows, cols, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    shards = [(torch.randn(r, cols, generator=g, dtype=torch.float64) * (i + 1)).to(dtype) for i, r in enumerate(rows)]
    whole = _stats(torch.cat(shards))
    combined = _combine_tensor([_stats(s) for s in shards])
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for f in ("min", "max", "mean", "abs_mean", "norm"):
        i = FIELDS.index(f)
        assert math.isclose(combined[i], whole[i], rel_tol=tol, abs_tol=tol * whole[FIELDS.index("abs_mean")]), f
    assert combined[FIELDS.index("numel")] == sum(s.numel() for s in shards)
    # a replicated tensor (bitwise equal on every rank) is one rank's, not counted twice
    assert _combine_tensor([_stats(shards[0])] * 3) == _stats(shards[0])


def test_sharded_parameter_norms_and_update_ratio_combine():
    w, d = torch.randn(10, dtype=torch.float64), torch.randn(10, dtype=torch.float64) * 1e-3
    parts = [{"p": {"weight": float(w[s].norm()), "grad": 1.0, "update_ratio": float(d[s].norm() / w[s].norm())}}
             for s in (slice(0, 4), slice(4, 10))]
    combined = _combine_params(parts)["p"]
    assert math.isclose(combined["weight"], float(w.norm()), rel_tol=1e-12)
    assert math.isclose(combined["update_ratio"], float(d.norm() / w.norm()), rel_tol=1e-12)
    assert combined["grad"] == 1.0  # equal on every rank: replicated


EXIT_WAIT_S = 240  # a run takes 10-60 s here under load


def _ddp(out, *args):
    """Run train_ddp.py under torchrun and watch. A job whose every rank's log holds its 4 steps but
    which has not exited after 240 s is the gloo exit deadlock watch now avoids (docs/watch.md, "A gloo
    DDP job's exit"), should it come back:
    its processes are killed (a note on stderr) and the logs are judged; any other hang fails."""
    # --standalone: a rendezvous on a free local port (other jobs on this machine use ports too);
    # gloo on the loopback interface. Output to files, not pipes: a hung rank would hold a pipe open.
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                "2", "-m", "precisiondiff.cli", "watch", "--script", os.path.join(HERE, "train_ddp.py"),
                                "-o", str(out), "--", "--steps", "4", "--dtype", "float32", *args],
                               stdout=stdout, stderr=stderr, text=True, cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": ROOT, "GLOO_SOCKET_IFNAME": "lo"})
        try:
            code = job.wait(timeout=EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            _kill_naming(str(out))  # the ranks: their command lines name the log directory
            job.kill()
            job.wait()
            from precisiondiff.watch import read_logs
            steps = {r: [s["step"] for s in lg.steps] for r, lg in read_logs(out).items()}
            assert steps == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}, f"the job hung before its end: {steps}"
            print("train_ddp.py hung at exit after its 4 steps: the gloo exit deadlock came back (docs/watch.md)",
                  file=sys.stderr)
            code = 0
        stdout.seek(0)
        stderr.seek(0)
        return subprocess.CompletedProcess(job.args, code, stdout.read(), _ranks_first(stderr.read()))


def _ranks_first(stderr: str) -> str:
    """The job's stderr with torchrun's report of a failed rank (a long traceback of its own)
    moved to the front and the ranks' own lines after it, so that the ranks' last words ("terminate
    called ...") are what a failed assertion's tail shows."""
    lines = stderr.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if "elastic/multiprocessing/api.py" in line), len(lines))
    return "".join(lines[start:] + lines[:start])


def _kill_naming(text: str) -> None:
    """SIGKILL every process of this machine whose command line contains ``text``."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    os.kill(int(pid), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue


def test_a_two_rank_ddp_job_compares_with_one_process(tmp_path):
    one, noise = tmp_path / "one", tmp_path / "noise"
    train.train(4, watch_dir=str(one), gelu_op=True)
    train.train(4, watch_dir=str(noise), gelu_op=True, perturb=True)
    for name, args in (("ddp", ()), ("bad", ("--broken-from", "2"))):
        run = _ddp(tmp_path / name, *args)
        assert run.returncode == 0, run.stderr[-2000:]
    clean = compare_logs(tmp_path / "ddp", one, noise=noise)
    assert clean.first_divergence is None, clean.first_divergence
    assert any("compared on global statistics" in n for n in clean.data["notes"])
    # the forward statistics of the two half batches make the whole batch's
    assert max(e for k, v in clean.data["errors"].items() if k.endswith(":output") for e in v) < 1e-6
    first = compare_logs(tmp_path / "bad", one, noise=noise).first_divergence
    assert (first["step"], first["scope"]) == (2, "blocks.1"), first
    # one rank alone is half the batch: far from the whole
    alone = compare_logs(tmp_path / "ddp" / "rank0", one, noise=noise).first_divergence
    assert alone is not None and alone["step"] == 0


def test_one_process_judged_live_against_a_ddp_reference(tmp_path):
    """watch --ref of a 2-rank job's log: a single process is judged against its global statistics."""
    run = _ddp(tmp_path / "ddp")
    assert run.returncode == 0, run.stderr[-2000:]
    train.train(4, watch_dir=str(tmp_path / "noise"), gelu_op=True, perturb=True)
    train.train(4, watch_dir=str(tmp_path / "dut"), gelu_op=True, broken_from=2,
                watch_options={"ref": str(tmp_path / "ddp"), "ref_noise": str(tmp_path / "noise")})
    from precisiondiff.watch import read_logs
    notes = [n for n in read_logs(tmp_path / "dut")[0].notes if n.startswith("trigger")]
    assert len(notes) == 1 and notes[0].startswith("trigger at step 2 (ref: blocks.1"), notes
