"""torchtitan on 2 gloo ranks through its own ``parallelize_llama`` (tests/frameworks/titan_workers.py,
examples/frameworks/torchtitan_parallel.py): FSDP2 and tensor parallel (sequence parallel on), one
training step each captured in replay mode; FSDP2 with torchtitan's full activation checkpointing
and a planted RMSNorm on rank 1; FSDP2 under watch with a planted vendor AdamW on rank 1. Against
a single-process float64 capture of the same model and batch: compare, bisect, ranks.
One spawned job (one torchtitan import per process) holds every scenario. Skipped without
torchtitan (which needs triton to import)."""
from __future__ import annotations

import math

import pytest

pytest.importorskip("torchtitan")

import torch.multiprocessing as mp  # noqa: E402

import precisiondiff  # noqa: E402
from precisiondiff.bisect.ranks import bisect_ranks  # noqa: E402
from precisiondiff.capture.runner import capture_workload  # noqa: E402
from precisiondiff.compare.ranks import check_replicas  # noqa: E402
from precisiondiff.compare.unwrap import WRAPPER_COMPONENTS  # noqa: E402
from precisiondiff.watch.compare import compare_logs  # noqa: E402
from precisiondiff.watch.log import read_logs  # noqa: E402
from precisiondiff.watch.shards import combine_ranks  # noqa: E402
from tests.distributed.conftest import free_port  # noqa: E402
from tests.frameworks import titan_workers as workers  # noqa: E402

tt = workers.tt
NORM = "pdframeworks.rough_rms_norm.default"
ADAMW = "pdframeworks.rough_adamw_.default"
SCENARIOS = ["fsdp", "tp", "tp_plant", "fsdp_ac_plant", "watch"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("titan")
    mp.spawn(workers.run, args=(2, free_port(), str(out), SCENARIOS), nprocs=2)
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("titan") / "ref"
    capture_workload(tt.build, out, target="cpu/float64", level="all", mode="stats")
    return out


_BISECTS: dict = {}


def _bisect(job, name):
    if name not in _BISECTS:
        _BISECTS[name] = bisect_ranks(job / name)
    return _BISECTS[name]


def _unwrapped(scope: str) -> str:
    return ".".join(p for p in scope.split(".") if p not in WRAPPER_COMPONENTS)


def test_fsdp2_capture_records_its_own_ops_and_compares_with_float64(job, reference):
    for rank in (0, 1):
        names = {ev.name for ev in precisiondiff.load(job / "fsdp" / f"rank{rank}").events()}
        assert {"fsdp.all_gather_copy_in.default", "c10d._allgather_base_.default",
                "c10d._reduce_scatter_base_.default", "aten._foreach_lerp_.Scalar"} <= names
    result = precisiondiff.compare(str(job / "fsdp"), str(reference), kind="module")
    s = result.summary
    assert s["failed"] == 0 and s["unmatched_a"] == 0 and s["passed"] == s["rows"] > 0, s
    assert {row.rank for row in result.rows} == {0, 1}


def test_fsdp2_bisect_clean_is_parity_with_all_gather_copy_in_judged(job):
    r = _bisect(job, "fsdp")
    assert r.verdict in ("parity", "accumulated"), r.culprit
    assert "fsdp.all_gather_copy_in.default" not in r.unreplayable
    assert r.collectives["judged"] > 0 and r.collectives["wrong"] == []


def test_fsdp2_replicas_agree_across_ranks(job):
    report = check_replicas(job / "fsdp")
    assert report.ok and report.checked > 0, report.mismatches


def test_tp_compares_with_float64_with_no_failed_row_and_every_unmatched_row_says_why(job, reference):
    result = precisiondiff.compare(str(job / "tp"), str(reference), kind="module")
    assert result.summary["failed"] == 0, [(row.rank, row.key) for row in result.rows if row.verdict == "fail"]
    assert {row.rank for row in result.rows} == {0, 1}
    assert all(row.message for row in result.rows if row.verdict == "unmatched")
    passed = {(row.scope, row.direction, row.slot) for row in result.rows if row.verdict == "pass"}
    assert ("layers.1.feed_forward", "forward", "output.0") in passed
    # the sequence-shard gradient leaving the attention block (torchtitan's FusedQKVLinear returns
    # q, k, v): its combined statistics match the reference's, whose grad_input was 3x too large
    # while capture counted the fused projection's edge once per output
    assert ("layers.0.attention", "backward", "grad_input.0") in passed


def test_tp_compare_finds_the_norm_planted_on_rank_0(job, reference):
    result = precisiondiff.compare(str(job / "tp_plant"), str(reference), kind="module")
    first = result.first_divergence
    assert (first["scope"], first["direction"], first["rank"]) == ("layers.1.ffn_norm", "forward", 0), first


def test_tp_bisect_clean_is_parity_and_lists_the_dtensor_ops_it_does_not_judge(job):
    r = _bisect(job, "tp")
    assert r.verdict in ("parity", "accumulated"), r.culprit
    skipped = r.cost["dtensor_ops_not_judged"]
    assert skipped > 0 and any(f"{skipped} DTensor op call(s) not judged" in n and "Partial input" in n
                               for n in r.notes), r.notes
    assert r.collectives["judged"] > 0 and r.collectives["wrong"] == []
    # the loss's aten.mul.Tensor(R (2, 16, 64), S(2) (2, 16, 32)): DTensor cut the replicated input
    # to this rank's chunk first; replayed on that chunk it is judged (it read as "could not be
    # replayed ... pass --workload" before), and no op of the job is left unjudged without a reason
    assert r.unreplayable == [] and not any("could not be judged" in n for n in r.notes), r.notes


def test_tp_bisect_names_the_norm_planted_on_rank_0(job):
    r = _bisect(job, "tp_plant")
    c = r.culprit
    assert r.verdict == "kernel" and (c["kind"], c["name"], c["scope"], c["direction"], c["rank"]) == \
        ("op", NORM, "layers.1.ffn_norm", "forward", 0), c
    assert r.ranks[1]["verdict"] in ("parity", "accumulated")


def test_activation_checkpointing_records_the_forward_once_and_the_plant_is_named(job):
    events = list(precisiondiff.load(job / "fsdp_ac_plant" / "rank1").events())
    plant = [ev for ev in events if ev.name == NORM]
    assert [ev.direction for ev in plant] == ["forward"]  # the recompute in backward is not recorded again
    wrappers = {ev.scope for ev in events if ev.kind == "module" and "_checkpoint_wrapped_module" in ev.scope}
    assert "layers.1._checkpoint_wrapped_module.ffn_norm" in wrappers
    r = _bisect(job, "fsdp_ac_plant")
    c = r.culprit
    assert r.verdict == "kernel" and (c["name"], _unwrapped(c["scope"]), c["direction"], c["rank"]) == \
        (NORM, "layers.1.ffn_norm", "forward", 1), c
    assert r.ranks[0]["verdict"] in ("parity", "accumulated")


@pytest.fixture(scope="module")
def single_watch(tmp_path_factory):
    """The same model, batch and stock AdamW in one process, float32, watched as the job is."""
    out = tmp_path_factory.mktemp("titan") / "watch1"
    model = tt.tiny_llama()
    opt = tt.optimizer(model.parameters())
    tokens, _ = tt.batch()
    with precisiondiff.watch(out, model=model, optimizer=opt, param_every=1) as w:
        for _ in range(workers.WATCH_STEPS):
            loss = tt.loss_of(model(tokens))
            loss.backward()
            opt.step()
            opt.zero_grad()
            w.step(loss=loss)
    return out


def test_watch_shard_norms_combine_to_the_single_process_ones(job, single_watch):
    logs = read_logs(job / "watch")
    assert sorted(logs) == [0, 1] and all(lg.complete for lg in logs.values())
    shards = logs[0].header["model"]["shards"]
    assert shards["layers.0.feed_forward.w1.weight"] == {"placements": ["S(0)"], "mesh": [0, 1]}
    combined = combine_ranks(logs).by_step()[0]["params"]
    single = read_logs(single_watch)[0].by_step()[0]["params"]
    rank0 = logs[0].by_step()[0]["params"]
    for name, fields in single.items():
        # the gradient before any update, float32, the same batch on both ranks: torchtitan turns
        # FSDP2's gradient division off (its trainer divides the loss by the global token count),
        # so with each rank's own mean loss the reduce-scattered gradient is the sum over ranks
        assert math.isclose(combined[name]["grad"], 2 * fields["grad"], rel_tol=1e-5), name
        assert rank0[name]["grad"] < combined[name]["grad"]  # one shard is not the whole
        assert set(combined[name]) >= {"grad", "weight", "update_ratio"}


def test_watch_compare_against_one_process_and_bisect_name_the_planted_optimizer(job, single_watch):
    c = compare_logs(job / "watch", single_watch)
    first = c.first_divergence
    # the forward of step 0 is the single process's; its gradients are 2x (above), then the plant
    assert first is not None and first["step"] == 0 and first["tensor"] != "output", first
    assert any("layouts differ (ranks 2 / 1): compared on global statistics" in n for n in c.data["notes"]), c.data["notes"]
    r = _bisect(job, "watch/replay")
    cul = r.culprit
    assert r.verdict == "kernel" and (cul["name"], cul["direction"], cul["rank"]) == (ADAMW, "optimizer", 1), cul
    assert cul["scope"].startswith("optimizer.param_groups.0/")
    assert r.ranks[0]["verdict"] in ("parity", "accumulated")  # stock foreach AdamW on FSDP2 shards
