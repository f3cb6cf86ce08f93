"""Capture inside real 2-rank gloo jobs (torch.multiprocessing.spawn on 127.0.0.1).

One job runs every scenario of workers.py (collectives, DDP, FSDP2, tensor parallel) once for
the module; each test reads the dumps it left. Values asserted are exact by construction
(sums of small integers, bitwise replicas), never a stock kernel's rounding.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import precisiondiff.store as store
from precisiondiff.compare.ranks import check_replicas
from tests.conftest import pd_cli
from tests.distributed import workers
from tests.distributed.conftest import free_port

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")


def _events(path):
    return [json.loads(line) for line in (path / "index.jsonl").read_text().splitlines()]


def _op(events, name, call=0):
    found = [e for e in events if e["name"] == name]
    return found[call]


def _slot(event, slot):
    return next(t for t in event["tensors"] if t["slot"] == slot)


def test_one_dump_per_rank_with_the_process_group_layout(job):
    for rank in (0, 1):
        meta = json.loads((job / "coll" / f"rank{rank}" / "meta.json").read_text())
        assert meta["rank"] == rank and meta["world_size"] == 2 and meta["complete"] is True
        assert meta["backend"] == "gloo"
        assert {"name": "WORLD", "ranks": [0, 1], "backend": "gloo"} in meta["groups"]
    dump = store.load(job / "coll")
    assert sorted(dump.ranks) == [0, 1] and dump.complete


@pytest.mark.parametrize("rank", [0, 1])
def test_collectives_are_recorded_when_their_result_is_ready(job, rank):
    events = _events(job / "coll" / f"rank{rank}")
    sync, async_ = (_op(events, "c10d.allreduce_.default", i) for i in (0, 1))
    for ev in (sync, async_):
        assert ev["collective"] == {"op": "allreduce_", "group": "WORLD", "ranks": [0, 1]}
        assert _slot(ev, "input.0")["stats"]["max"] == rank + 1  # before: this rank's value
        assert _slot(ev, "output.0")["stats"]["min"] == _slot(ev, "output.0")["stats"]["max"] == 3.0
    dump = store.load(job / "coll")
    assert torch.equal(dump.tensor(_slot(async_, "output.0")["key"], rank=rank), torch.full((3,), 3.0))
    functional = _op(events, "_c10d_functional.all_reduce.default")
    assert functional["collective"]["group"] == "WORLD"
    plain = torch.load(job / f"plain-coll-{rank}.pt", weights_only=True)
    # the functional all_reduce's output as the next op read it: (y0 + y1), then + 1
    reduced = dump.tensor(_slot(functional, "output.0")["key"], rank=rank)
    assert torch.equal(reduced + 1, plain["g"])
    gather = _op(events, "c10d.allgather_.default")
    assert [_slot(gather, f"output.{i}")["stats"]["max"] for i in (0, 1)] == [0.0, 1.0]
    assert not any(t["slot"].startswith("input.0") for t in gather["tensors"])  # destinations


def test_replicas_are_identical_across_ranks(job):
    for name, rules in (("coll", {"collective output"}), ("ddp", {"DDP gradient", "collective output"}),
                        ("tp", {"replicated DTensor", "collective output"})):
        report = check_replicas(job / name)
        assert report.ok, report.summary()
        assert rules <= set(report.by_rule), (name, report.by_rule)


def test_a_replica_that_differs_is_flagged(job, tmp_path):
    dump = tmp_path / "ddp"
    shutil.copytree(job / "ddp", dump)
    index = dump / "rank1" / "index.jsonl"
    events = _events(dump / "rank1")
    param = next(e for e in events if e["kind"] == "param")
    param["tensors"][0]["stats"]["fingerprint"] = "0" * 32  # rank 1 got another gradient
    index.write_text("".join(json.dumps(e) + "\n" for e in events))
    report = check_replicas(dump)
    assert [m.key for m in report.mismatches] == [param["tensors"][0]["key"]]
    assert report.mismatches[0].groups in ([[0], [1]], [[1], [0]])
    r = pd_cli("ranks", str(dump))
    assert r.returncode == 1 and "DIFFER" in r.stdout, r.stdout + r.stderr
    r = pd_cli("ranks", str(job / "ddp" / "rank0"))
    assert r.returncode == 2 and "one rank" in r.stderr


def test_ddp_capture_does_not_change_the_step(job):
    for rank in (0, 1):
        plain = torch.load(job / f"plain-ddp-{rank}.pt", weights_only=True)
        assert torch.equal(plain["loss"][0], plain["loss"][1])
        assert all(torch.equal(a, b) for a, b in zip(*plain["params"]))
    events = _events(job / "ddp" / "rank0")
    bucket = next(e for e in events if e["name"] == "c10d.allreduce_.default")
    assert bucket["direction"] == "backward" and bucket["collective"]["ranks"] == [0, 1]


def test_fsdp2_is_captured_on_local_shards(job):
    for rank in (0, 1):
        meta = json.loads((job / "fsdp" / f"rank{rank}" / "meta.json").read_text())
        assert meta["complete"] is True and "capture_errors" not in meta
        events = _events(job / "fsdp" / f"rank{rank}")
        grads = {t["slot"]: t for e in events if e["kind"] == "param" and e["scope"] == "0" for t in e["tensors"]}
        weight = grads["param_grad.weight"]
        assert weight["shape"] == [8, 8] and weight["global_shape"] == [16, 8]  # dim 0 sharded 2 ways
        assert weight["placements"] == ["S(0)"]
        gathers = [e for e in events if e["name"] == "c10d._allgather_base_.default"]
        assert gathers and all(e["collective"]["ranks"] == [0, 1] for e in gathers)
        # the all-gathered parameters are the unsharded model's (same seed): Linear 0's weight
        # and bias, 16*8 + 16 values, whatever the flat buffer's padding
        full = workers._model()[0]
        first = next(e for e in gathers if e["direction"] == "forward")
        assert _slot(first, "output.0")["stats"]["max"] == pytest.approx(
            max(full.weight.max().item(), full.bias.max().item()), abs=0)
    assert check_replicas(job / "fsdp").ok


def test_tensor_parallel_is_captured_with_placements(job):
    dump = store.load(job / "tp")
    full = workers._model()
    expected = full(workers._inputs(0))
    for rank in (0, 1):
        events = _events(job / "tp" / f"rank{rank}")
        colwise = next(e for e in events if e["kind"] == "param" and e["scope"] == "0")
        weight = _slot(colwise, "param_grad.weight")
        assert weight["placements"] == ["S(0)"] and weight["shape"] == [8, 8] and weight["global_shape"] == [16, 8]
        root = next(e for e in events if e["kind"] == "module" and e["scope"] == "" and e["direction"] == "forward")
        out = dump.tensor(_slot(root, "output.0")["key"], rank=rank)
        assert torch.allclose(out, expected, rtol=0, atol=1e-5)  # rowwise partial sums, reduced
        plain = torch.load(job / f"plain-tp-{rank}.pt", weights_only=True)
        assert torch.equal(out, plain["y"])


def test_compare_runs_rank_by_rank(job):
    r = pd_cli("compare", str(job / "tp"), str(job / "tp"))
    assert r.returncode == 0, r.stdout + r.stderr


def _torchrun(tmp_path, out, *script_args):
    import os
    import subprocess
    import sys
    script = os.path.join(os.path.dirname(__file__), "train_ddp.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "precisiondiff.cli", "capture", "--script", script,
           "-o", str(out)]
    if script_args:
        cmd += ["--", *script_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)


def test_torchrun_capture_script_writes_one_dump_per_rank(tmp_path):
    out = tmp_path / "run"
    r = _torchrun(tmp_path, out)
    assert r.returncode == 0, r.stderr[-3000:]
    dump = store.load(out)
    assert sorted(dump.ranks) == [0, 1] and dump.complete
    for rank in (0, 1):
        meta = dump.ranks[rank].meta
        assert meta["rank"] == rank and meta["world_size"] == 2 and meta["local_rank"] == rank
        assert meta["groups"] == [{"name": "WORLD", "ranks": [0, 1], "backend": "gloo"}]
        steps = {e.step for e in dump.ranks[rank].events()}
        assert steps == {0, 1, 2}  # each optimizer.step() ends a step
    report = check_replicas(out)
    assert report.ok and report.by_rule["DDP gradient"] == 3 * 4, report.summary()


def test_a_rank_that_dies_leaves_every_dump_usable(tmp_path):
    out = tmp_path / "run"
    r = _torchrun(tmp_path, out, "--die-at", "1")
    assert r.returncode != 0 and "SIGKILL" in r.stderr
    for rank in (0, 1):
        v = pd_cli("verify", str(out / f"rank{rank}"))
        assert v.returncode == 0 and "partial" in v.stdout, v.stdout + v.stderr
    # the rank that died had finished step 0 (flushed at its end); the survivor may be stopped by
    # torchrun before its own step 0 is on disk, and its dump is then partial and empty
    assert {e.step for e in store.load(out / "rank1").events()} == {0}
    assert check_replicas(out).ok  # what both ranks finished (step 0) still agrees
    c = pd_cli("compare", str(out), str(out))
    assert c.returncode == 0, c.stdout + c.stderr


def test_rank_parallel_compare_gives_the_sequential_rows(job, tmp_path):
    import os
    import subprocess
    import sys

    from precisiondiff.compare import compare

    def rows(c):
        return [(r.rank, r.key, r.verdict, r.error, r.mode) for r in c.rows]

    sequential = compare(job / "ddp", job / "ddp")
    pooled = compare(job / "ddp", job / "ddp", jobs=2)
    assert rows(pooled) == rows(sequential) and pooled.summary == sequential.summary
    assert sorted(pooled.ranks) == [0, 1]
    # under torchrun each process compares its share of the ranks; process 0 writes the report
    out = tmp_path / "c.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "precisiondiff.cli", "compare", str(job / "ddp"),
           str(job / "ddp"), "--format", "json", "-o", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0 and r.stderr.count("wrote") == 1, r.stderr[-2000:]
    merged = json.loads(out.read_text())
    assert merged["summary"] == sequential.summary and sorted(merged["ranks"]) == ["0", "1"]
    assert [(row["rank"], row["key"]) for row in merged["rows"]] == [(r.rank, r.key) for r in sequential.rows]


def test_a_collective_that_accumulates_in_bf16_is_named(job, tmp_path):
    """Plant the output a bf16-accumulating all-reduce gives, identically on every rank: the
    replicas agree, the recomputation from the ranks' inputs names the collective."""
    from safetensors.torch import load_file, save_file

    from precisiondiff.compare.collectives import check_collectives

    assert check_collectives(job / "coll").checked == 3 and check_collectives(job / "coll").ok
    dump = tmp_path / "coll"
    shutil.copytree(job / "coll", dump)
    key = None
    inputs = []
    for rank in (0, 1):
        ev = _op(_events(dump / f"rank{rank}"), "_c10d_functional.all_reduce.default")
        key = _slot(ev, "output.0")["key"]
        inputs.append(store.load(dump / f"rank{rank}").tensor(_slot(ev, "input.0")["key"]))
    planted = (inputs[0].bfloat16() + inputs[1].bfloat16()).float()  # bf16 accumulation
    assert not torch.equal(planted, inputs[0] + inputs[1])
    for rank in (0, 1):
        events = _events(dump / f"rank{rank}")
        rec = _slot(_op(events, "_c10d_functional.all_reduce.default"), "output.0")
        shard = dump / f"rank{rank}" / rec["shard"]
        tensors = load_file(shard)
        tensors[rec["data_key"]] = planted
        save_file(tensors, shard)
        rec["stats"]["fingerprint"] = store.fingerprint(planted)
        (dump / f"rank{rank}" / "index.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert check_replicas(dump).ok  # every rank got the same (wrong) output
    report = check_collectives(dump)
    assert [w.key for w in report.wrong] == [key] and report.wrong[0].ranks == [0, 1]
    r = pd_cli("ranks", str(dump))
    assert r.returncode == 1 and "WRONG COLLECTIVE" in r.stdout, r.stdout + r.stderr


def test_async_collectives_are_recorded_without_waiting_where_issued(job):
    """Two groups, opposite issue orders on the two ranks: the job finishes (capture waiting at
    each issue would hang until the groups' 10 s timeout and fail), and each output is recorded
    as reduced: before the first op that reads it, or at the step's end."""
    for rank in (0, 1):
        plain = torch.load(job / f"plain-async-{rank}.pt", weights_only=True)
        assert plain["a"].tolist() == [6.0] * 3 and plain["b"].tolist() == [30.0] * 3
        assert plain["late"].tolist() == [10.0, 10.0]
        events = _events(job / "async" / f"rank{rank}")
        reduces = [e for e in events if e["name"] == "c10d.allreduce_.default"]
        by_input = {_slot(e, "input.0")["stats"]["max"]: e for e in reduces}
        a, b = by_input[rank + 1.0], by_input[10.0 * (rank + 1)]
        assert _slot(a, "output.0")["stats"]["max"] == 3.0 and _slot(b, "output.0")["stats"]["max"] == 30.0
        mul = _op(events, "aten.mul_.Tensor")
        assert a["seq"] < mul["seq"] and _slot(mul, "output.0")["stats"]["max"] == 6.0
        assert a["collective"]["group"] != b["collective"]["group"]
    # rank 0's last all-reduce could not complete before its step ended: recorded without output
    late = [e for e in _events(job / "async" / "rank0") if e["name"] == "c10d.allreduce_.default"
            and _slot(e, "input.0")["stats"]["max"] == 5.0]
    assert len(late) == 1 and late[0]["collective"]["output"].startswith("not complete")
    assert [t["slot"] for t in late[0]["tensors"]] == ["input.0"]


def test_pipeline_stages_record_what_they_send_and_receive(job):
    """A 2-stage GPipe schedule (torch.distributed.pipelining on gloo): each stage's sends and
    receives are recorded (a receive's output when the stage reads it), and what stage 0 sends
    is what stage 1 receives, bit for bit, and back for the gradients."""
    def transfers(rank, name, slot):
        events = _events(job / "pipeline" / f"rank{rank}")
        return [_slot(e, slot)["stats"]["fingerprint"] for e in events
                if e["name"] == name and _slot(e, slot)["shape"] == [2, 16]]
    activations = transfers(0, "c10d.send.default", "input.0")
    assert len(activations) == 2  # one per microbatch
    assert transfers(1, "c10d.recv_.default", "output.0") == activations
    gradients = transfers(1, "c10d.send.default", "input.0")
    assert len(gradients) == 2 and transfers(0, "c10d.recv_.default", "output.0") == gradients
    # stage 1 computed on what it received: its Linear's inputs are the received activations
    events = _events(job / "pipeline" / "rank1")
    linear = [_slot(e, "input.0")["stats"]["fingerprint"] for e in events
              if e["kind"] == "module" and e["scope"] == "0" and e["direction"] == "forward"]
    assert linear[-2:] == activations
