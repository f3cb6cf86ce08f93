"""Bisect of a real 2-rank tensor-parallel job (gloo on 127.0.0.1, torch.multiprocessing.spawn).

One job captures the scenarios of workers_tp_bisect.py in replay mode: the Megatron-style TP MLP
clean, with a planted GEMM wrong on rank 1 only, and with a planted all-reduce that sums the
ranks' float32 partial sums in bf16; and a clean DTensor MLP (parallelize_module). Every fault
is planted (a custom op, a replaced collective kernel); nothing here pins a stock kernel's rounding. The collective judge itself is checked on synthetic
units with hypothesis.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from precisiondiff.bisect.collectives import CollectiveUnit, judge_collective
from precisiondiff.bisect.ranks import bisect_ranks
from tests.conftest import pd_cli
from tests.distributed.conftest import free_port
from tests.distributed import workers_tp_bisect as workers

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")

GEMM = "pdtest_tp.linear.default"
ALL_REDUCE = "_c10d_functional.all_reduce.default"
WORKER = str(Path(workers.__file__))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    mp.spawn(workers.run, args=(2, free_port(), str(out), list(workers.SCENARIOS)), nprocs=2)
    return out


def test_a_kernel_wrong_on_one_rank_is_named_on_that_rank(job):
    r = bisect_ranks(job / "kernel")
    assert r.verdict == "kernel", r.notes
    c = r.culprit
    assert (c["kind"], c["name"], c["scope"], c["direction"], c["rank"]) == ("op", GEMM, "fc1", "forward", 1)
    assert c["found_on_ranks"] == [1] and not c["peer"]["passed"]
    # rank 0 runs the same op on its own shard, correctly: no op of rank 0 is named
    assert r.ranks[0]["verdict"] == "parity" and r.ranks[0]["culprit"] is None
    assert r.ranks[1]["culprit"]["name"] == GEMM
    assert not any(cand.get("rank") == 0 for cand in r.candidates)
    # rank 1's wrong activations reach the all-reduce, which reduces what it was given correctly
    assert r.collectives["judged"] == 2 and r.collectives["wrong"] == []
    assert any("rank(s) [1] only" in n for n in r.notes)


def test_every_offender_is_listed_and_an_accepted_one_gives_way(job):
    r = bisect_ranks(job / "kernel")
    assert r.culprits and r.culprits[0] == r.culprit
    assert r.culprits[1:1 + len(r.candidates)] == r.candidates and r.accepted == []
    accepted = bisect_ranks(job / "kernel", accept=[f"{GEMM}@fc1"])
    assert [(a["name"], a["scope"], a["rank"]) for a in accepted.accepted][:1] == [(GEMM, "fc1", 1)]
    assert all(c["name"] != GEMM or c["scope"] != "fc1" for c in accepted.culprits)
    assert accepted.ranks[1]["culprit"] is None or accepted.ranks[1]["culprit"]["name"] != GEMM


def test_a_collective_that_accumulates_in_bf16_is_named(job):
    r = bisect_ranks(job / "collective")
    assert r.verdict == "kernel"
    c = r.culprit
    assert (c["kind"], c["name"], c["scope"], c["direction"]) == ("collective", ALL_REDUCE, "fc2", "forward")
    assert c["ranks"] == [0, 1] and c["group"] == {"name": "WORLD", "ranks": [0, 1]}
    assert c["reduce_op"] == "sum" and c["budget"]["k"] == 2
    # bf16 accumulation of float32 partial sums: ~2^-9 relative, far above one float32 rounding
    assert c["peer"]["error"] > 100 * c["peer"]["bound"]
    assert all(info["verdict"] == "parity" for info in r.ranks.values())  # every op is right
    backward = [p for p in r.collectives["passed"] if p["name"] == "c10d.allreduce_.default"]
    assert backward and backward[0]["direction"] == "backward" and backward[0]["reduce_op"] == "sum"


def test_the_clean_job_is_at_parity(job):
    r = bisect_ranks(job / "clean")
    assert r.verdict == "parity" and r.culprit is None and r.exit_code == 0
    assert set(r.ranks) == {0, 1} and all(info["verdict"] == "parity" for info in r.ranks.values())
    names = {p["name"] for p in r.collectives["passed"]}
    assert names == {ALL_REDUCE, "c10d.allreduce_.default"} and not r.collectives["not_judged"]
    assert r.unreplayable == []  # every op of both ranks was judged


def test_a_dtensor_tp_job_is_judged_on_its_local_shards(job):
    """parallelize_module: the row-parallel addmm ran on its replicated bias divided by the mesh
    size (Replicate -> Partial); replayed the same way, every op call is judged and passes."""
    r = bisect_ranks(job / "dtensor")
    assert r.verdict == "parity", (r.culprit, r.notes)
    assert r.cost["dtensor_ops_not_judged"] == 0 and r.unreplayable == []
    assert {p["direction"] for p in r.collectives["passed"]} == {"forward", "backward"}
    assert r.ranks[0]["verdict"] == r.ranks[1]["verdict"] == "parity"


def test_cli_names_the_rank_of_a_kernel_in_a_script_capture(job, tmp_path):
    """``torchrun ... capture --script`` writes target ``script`` (the script places its model):
    bisect reads the DUT dtype from the op outputs."""
    import shutil
    run = tmp_path / "run"
    shutil.copytree(job / "kernel", run)
    for rank in (0, 1):
        meta = json.loads((run / f"rank{rank}" / "meta.json").read_text())
        (run / f"rank{rank}" / "meta.json").write_text(json.dumps(dict(meta, target="script")))
    out = tmp_path / "bisect.json"
    r = pd_cli("bisect", str(run), "--workload", WORKER, "--format", "json", "-o", str(out),
               env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 1, r.stdout + r.stderr
    report = json.loads(out.read_text())
    assert report["dut"] == "cpu/bf16"
    c = report["culprit"]
    assert (c["name"], c["scope"], c["direction"], c["rank"]) == (GEMM, "fc1", "forward", 1)
    assert report["ranks"]["0"]["verdict"] == "parity" and report["ranks"]["1"]["verdict"] == "kernel"


def test_cli_names_a_wrong_collective(job):
    r = pd_cli("bisect", str(job / "collective"), env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"culprit: collective {ALL_REDUCE} in fc2" in r.stdout and "on 2 ranks" in r.stdout
    # without --workload the planted op is unknown in the CLI's process: said, never silently judged
    assert f"WARNING: 1 op(s) could not be judged on the reference: {GEMM}" in r.stdout
    r = pd_cli("bisect", str(job / "clean"), str(job / "clean"))
    assert r.returncode == 2 and "REF_DUMP" in r.stderr and "Traceback" not in r.stderr


# -- the collective judge on synthetic units ----------------------------------------------------

def _unit(name: str, kind: str, inputs, outputs, args=None) -> tuple:
    ranks = list(range(len(inputs)))
    unit = CollectiveUnit("", name, "forward", 0, kind, "WORLD", ranks)
    store = {}
    for r in ranks:
        unit.seq[r] = 0
        unit.args[r] = args
        unit.records[r] = {"input.0": {"key": f"{r}/in", "dtype": str(inputs[r].dtype).split(".")[1], "data_key": 1},
                           "output.0": {"key": f"{r}/out", "dtype": str(outputs[r].dtype).split(".")[1],
                                        "data_key": 1}}
        store[(r, f"{r}/in")], store[(r, f"{r}/out")] = inputs[r], outputs[r]
    return unit, lambda rank, key: store[(rank, key)]


@settings(max_examples=25, deadline=None)
@given(k=st.integers(2, 4), seed=st.integers(0, 2 ** 16), scale=st.sampled_from([1e-3, 1.0, 1e3]),
       op=st.sampled_from(["sum", "avg"]))
def test_a_correct_float32_all_reduce_passes_and_a_bf16_accumulating_one_fails(k, seed, scale, op):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(64, generator=g) * scale for _ in range(k)]
    order = torch.randperm(k, generator=g).tolist()  # any summation order is a correct all-reduce
    good = xs[order[0]].clone()
    for i in order[1:]:
        good = good + xs[i]
    bad = xs[0].bfloat16()
    for x in xs[1:]:
        bad = bad + x.bfloat16()
    bad = bad.float()
    if op == "avg":
        good, bad = good / k, bad / k
    unit, load = _unit(ALL_REDUCE, "all_reduce", xs, [good] * k, {"args": [{"t": "input.0"}, op, "0"]})
    v = judge_collective(unit, load)
    assert v.judged and v.passed and v.reduce_op == op, v.message
    unit, load = _unit(ALL_REDUCE, "all_reduce", xs, [bad] * k, {"args": [{"t": "input.0"}, op, "0"]})
    v = judge_collective(unit, load)
    assert not v.passed and v.wrong_ranks == list(range(k)) and v.reduce_op == op


def test_the_reduce_op_is_inferred_when_not_recorded_and_an_all_gather_must_be_exact():
    xs = [torch.tensor([1.0, -2.0, 3.0]), torch.tensor([0.5, 4.0, -1.0])]
    unit, load = _unit("c10d.allreduce_.default", "all_reduce", xs, [torch.maximum(*xs)] * 2)
    v = judge_collective(unit, load)
    assert v.passed and v.reduce_op == "max"
    gathered = torch.cat(xs)
    unit, load = _unit("c10d._allgather_base_.default", "all_gather", xs, [gathered, gathered])
    assert judge_collective(unit, load).passed
    broken = gathered.clone()
    broken[4] = torch.nextafter(broken[4], torch.tensor(10.0))  # one ULP off on rank 1
    unit, load = _unit("c10d._allgather_base_.default", "all_gather", xs, [gathered, broken])
    v = judge_collective(unit, load)
    assert not v.passed and v.wrong_ranks == [1] and v.peer["mismatched"] == 1


def test_inside_a_process_group_each_process_bisects_its_ranks_and_process_0_reports(job):
    """across_processes (torchrun ... bisect RUN_DIR): process i bisects ranks i, i+W...; process
    0 gets the merged result, the same as one process bisecting every rank."""
    merged = json.loads((job / "across-0.json").read_text())
    assert json.loads((job / "across-1.json").read_text()) is None
    sequential = bisect_ranks(job / "kernel").to_json()
    for key in ("verdict", "culprit", "ranks", "collectives", "candidates"):
        assert merged[key] == sequential[key], key
    assert merged["culprit"]["rank"] == 1


def test_without_shared_storage_each_process_bisects_the_ranks_it_holds(job):
    """As on two hosts without shared storage (each process's RUN_DIR holds its own rank only): the
    same result as one process reading both dumps, the wrong all-reduce included, which is judged
    from both ranks' inputs: process 1 sent rank 1's collective tensors to process 0."""
    merged = json.loads((job / "hosts-0.json").read_text())
    assert json.loads((job / "hosts-1.json").read_text()) is None
    assert not (job / "hosts" / "host0" / "collective" / "rank1").exists()
    sequential = bisect_ranks(job / "collective").to_json()
    for key in ("verdict", "culprit", "ranks", "collectives", "candidates", "notes"):
        assert merged[key] == sequential[key], key
    assert merged["culprit"]["kind"] == "collective" and merged["culprit"]["ranks"] == [0, 1]


def test_a_process_whose_host_holds_no_rank_still_joins_the_job(job, tmp_path):
    """``python -m precisiondiff bisect RUN_DIR`` in the two processes of a job (torchrun's
    environment), as on two hosts: one holds both ranks' dumps, the other an empty RUN_DIR. The
    empty one joins instead of failing alone (which would leave the other waiting on the group)."""
    import os
    import shutil
    import subprocess
    import sys
    from tests.conftest import ROOT
    shutil.copytree(job / "collective", tmp_path / "h0" / "job")
    (tmp_path / "h1" / "job").mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": ROOT, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "precisiondiff", "bisect", "job", "--workload",
                               f"{WORKER}:run"], cwd=tmp_path / f"h{r}", env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:  # a process left waiting on the group (what this test guards against) is not left behind
        for p in procs:
            p.kill()
    assert procs[0].returncode == 1, outs[0]
    assert f"culprit: collective {ALL_REDUCE} in fc2" in outs[0][0] and "on 2 ranks" in outs[0][0]
    assert procs[1].returncode == 0 and not outs[1][0].strip(), outs[1]


def test_each_rank_goes_to_a_process_that_holds_its_dump():
    from precisiondiff.bisect.ranks import _owners
    # shared storage: process i of W bisects ranks i, i+W... (as before dumps could lie apart)
    assert _owners([[0, 1, 2, 3], [0, 1, 2, 3]]) == {0: 0, 1: 1, 2: 0, 3: 1}
    # each host holds its own ranks: they stay there
    assert _owners([[0, 1], [2, 3]]) == {0: 0, 1: 0, 2: 1, 3: 1}
    assert _owners([[1], [0]]) == {0: 1, 1: 0}
    # a process holding nothing bisects nothing
    assert _owners([[0, 1], []]) == {0: 0, 1: 0}
    # 16 ranks captured on 2 hosts of 8, bisected by 2 processes per host: 4 ranks each, on their host
    host_a, host_b = list(range(8)), list(range(8, 16))
    owners = _owners([host_a, host_a, host_b, host_b])
    assert all(owners[r] in (0, 1) for r in host_a) and all(owners[r] in (2, 3) for r in host_b)
    assert sorted(list(owners.values()).count(p) for p in range(4)) == [4, 4, 4, 4]


def test_a_broadcast_must_deliver_the_roots_input():
    root, other = torch.tensor([1.0, 2.0]), torch.tensor([5.0, 6.0])
    unit, load = _unit("c10d.broadcast_.default", "broadcast", [root, other], [root, root])
    assert judge_collective(unit, load).passed
    unit, load = _unit("c10d.broadcast_.default", "broadcast", [root, other], [root * 1.5, root * 1.5])
    v = judge_collective(unit, load)
    assert not v.passed and v.wrong_ranks == [0, 1]


def test_live_bisect_in_every_process_gives_every_process_the_merged_verdict(job):
    """bisect_script in each process of the job (the script keeps the job's group): each captures
    its step, the ranks are bisected across the processes, every process gets the same result."""
    got = [json.loads((job / f"live-{rank}.json").read_text()) for rank in (0, 1)]
    assert got[0] == got[1]
    c = got[0]["culprit"]
    assert (c["kind"], c["name"], c["scope"], c["ranks"]) == ("collective", ALL_REDUCE, "fc2", [0, 1])
    assert sorted(p.name for p in (job / "live").iterdir()) == ["rank0", "rank1"]  # --keep: the dumps stay
    offline = bisect_ranks(job / "live").to_json()
    assert offline["culprit"] == got[0]["culprit"] and offline["ranks"] == got[0]["ranks"]


def _unit_lists(name: str, kind: str, inputs, outputs, args=None) -> tuple:
    """A unit whose ranks recorded several input/output slots (the list forms)."""
    ranks = list(range(len(inputs)))
    unit = CollectiveUnit("", name, "forward", 0, kind, "WORLD", ranks)
    store = {}
    for r in ranks:
        unit.seq[r], unit.args[r], unit.records[r] = 0, (args[r] if args else None), {}
        for prefix, tensors in (("input", inputs[r]), ("output", outputs[r])):
            for i, t in enumerate(tensors):
                key = f"{r}/{prefix}.{i}"
                unit.records[r][f"{prefix}.{i}"] = {"key": key, "dtype": str(t.dtype).split(".")[1], "data_key": 1}
                store[(r, key)] = t
    return unit, lambda rank, key: store[(rank, key)]


@settings(max_examples=25, deadline=None)
@given(k=st.integers(2, 4), seed=st.integers(0, 2 ** 16), data=st.data())
def test_an_all_to_all_must_deliver_every_chunk_bit_for_bit(k, seed, data):
    """all_to_all_single with uneven input splits: rank r receives, in group order, the rows every
    rank addressed to it; one element one ULP off on one rank names that rank only."""
    g = torch.Generator().manual_seed(seed)
    splits = [[data.draw(st.integers(0, 3)) for _ in range(k)] for _ in range(k)]  # splits[src][dst]
    xs = [torch.randn(sum(splits[src]), 3, generator=g) for src in range(k)]
    outs = [torch.cat([xs[src].split(splits[src])[dst] for src in range(k)]) for dst in range(k)]
    args = [{"args": [{"t": "input.0"}, [splits[s][r] for s in range(k)], splits[r], "0"]} for r in range(k)]
    name = "_c10d_functional.all_to_all_single.default"
    unit, load = _unit_lists(name, "all_to_all", [[x] for x in xs], [[o] for o in outs], args)
    v = judge_collective(unit, load)
    assert v.judged and v.passed, v.reason
    victims = [r for r in range(k) if outs[r].numel()]
    if victims:
        r = data.draw(st.sampled_from(victims))
        broken = [o.clone() for o in outs]
        flat = broken[r].view(-1)
        i = data.draw(st.integers(0, flat.numel() - 1))
        flat[i] = torch.nextafter(flat[i], torch.tensor(float("inf")))
        unit, load = _unit_lists(name, "all_to_all", [[x] for x in xs], [[o] for o in broken], args)
        v = judge_collective(unit, load)
        assert v.judged and not v.passed and v.wrong_ranks == [r] and v.peer["mismatched"] == 1


def test_the_list_forms_of_all_to_all_and_reduce_scatter_are_judged():
    a, b = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([10.0, 20.0, 30.0, 40.0])
    # c10d.alltoall_: one tensor per destination; rank 0 gets [a0, b0], rank 1 [a1, b1]
    ins = [list(a.chunk(2)), list(b.chunk(2))]
    outs = [[ins[0][0], ins[1][0]], [ins[0][1], ins[1][1]]]
    assert judge_collective(*_unit_lists("c10d.alltoall_.default", "all_to_all", ins, outs)).passed
    swapped = [[ins[1][0], ins[0][0]], outs[1]]  # rank 0's chunks in the wrong order
    v = judge_collective(*_unit_lists("c10d.alltoall_.default", "all_to_all", ins, swapped))
    assert not v.passed and v.wrong_ranks == [0]
    # c10d.reduce_scatter_: rank r's chunk j is reduced onto the group's j-th rank
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(128, generator=g) for _ in range(2)]
    good = [[xs[0][:64] + xs[1][:64]], [xs[0][64:] + xs[1][64:]]]
    unit, load = _unit_lists("c10d.reduce_scatter_.default", "reduce_scatter", [list(x.chunk(2)) for x in xs], good)
    v = judge_collective(unit, load)
    assert v.judged and v.passed and v.reduce_op == "sum", v.reason
    bf16 = [[(xs[0][:64].bfloat16() + xs[1][:64].bfloat16()).float()], good[1]]  # rank 0 summed in bf16
    unit, load = _unit_lists("c10d.reduce_scatter_.default", "reduce_scatter", [list(x.chunk(2)) for x in xs], bf16)
    v = judge_collective(unit, load)
    assert not v.passed and v.wrong_ranks == [0]
