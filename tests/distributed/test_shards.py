"""DTensor shards of the 2-rank tensor-parallel job (workers.py, ColwiseParallel then
RowwiseParallel) against a single-process float64 reference: reassembled in tensors mode,
statistics combined in stats mode, full tensors gathered at capture when asked; and the
reassembly rules themselves on random layouts (hypothesis)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from hypothesis import given, settings, strategies as st

import precisiondiff
from precisiondiff.compare import compare
from precisiondiff.compare.ranks import check_replicas
from precisiondiff.compare.shards import combine_stats, local_slice, reassemble
from tests.conftest import pd_cli
from tests.distributed import workers

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")

COLWISE = "0/aten.addmm.default#0:forward:output.0"   # S(1) of [4, 16]
ROWWISE = "2/aten.addmm.default#0:forward:output.0"   # P(sum) of [4, 8], before its all-reduce
WEIGHT_GRAD = "0/Linear#0:backward:param_grad.weight"  # S(0) of [16, 8]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same model and batch in one process, float64, tensors and stats modes."""
    out = tmp_path_factory.mktemp("ref")
    for mode in ("tensors", "stats"):
        model = workers._model().double()
        with precisiondiff.capture(out / mode, model=model, mode=mode) as cap:
            model(workers._inputs(0).double()).sum().backward()
            cap.step()
    return out


def _rows(c, key):
    return {r.rank: r for r in c.rows if r.key == key}


def test_tensors_mode_shards_are_reassembled_against_the_reference(job, reference):
    c = compare(job / "tp", reference / "tensors")
    assert c.summary["failed"] == 0, c.first_divergence
    colwise = _rows(c, COLWISE)
    assert colwise[0].mode == "tensors" and colwise[0].verdict == "pass" and colwise[0].shape == [4, 16]
    assert colwise[0].note.startswith("reassembled from ranks [0, 1] (S(1))")
    assert colwise[1].mode == "tensors" and colwise[1].shape == [4, 8] and "slice" in colwise[1].note
    rowwise = _rows(c, ROWWISE)  # partial sums: summed on rank 0, no slice for rank 1
    assert rowwise[0].verdict == "pass" and "P(sum)" in rowwise[0].note
    assert rowwise[1].verdict == "unmatched" and rowwise[1].mode == "shard"
    grad = _rows(c, WEIGHT_GRAD)
    assert grad[0].verdict == "pass" and grad[0].shape == [16, 8] and grad[0].error < 1e-6
    # a module output the TP plan turns into a plain local tensor (use_local_output) takes the
    # placements of the DTensor shard of the same content: every module output is compared
    linear = _rows(c, "0/Linear#0:forward:output.0")
    assert linear[0].verdict == "pass" and linear[0].shape == [4, 16]
    assert f"the local tensor of DTensor {COLWISE}" in linear[0].note
    assert not [r for r in c.rows if r.kind == "module" and r.verdict == "unmatched"]


def _plant(dump, rank, key, scale):
    """Scale ``key``'s stored data on ``rank`` (a kernel wrong on that rank only)."""
    from safetensors.torch import load_file, save_file
    events = [json.loads(line) for line in (dump / f"rank{rank}" / "index.jsonl").read_text().splitlines()]
    rec = next(t for e in events for t in e["tensors"] if t["key"] == key)
    path = dump / f"rank{rank}" / rec["shard"]
    tensors = load_file(path)
    tensors[rec["data_key"]] = tensors[rec["data_key"]] * scale
    save_file(tensors, path)


def test_a_shard_wrong_on_one_rank_fails_the_reassembled_tensor_and_that_rank(job, reference, tmp_path):
    dump = tmp_path / "tp"
    shutil.copytree(job / "tp", dump)
    _plant(dump, 1, COLWISE, 1.01)
    c = compare(dump, reference / "tensors", op="addmm")
    colwise = _rows(c, COLWISE)
    assert colwise[0].verdict == "fail" and colwise[1].verdict == "fail"  # the whole, and rank 1's part
    assert c.first_divergence["key"].endswith(COLWISE)
    r = pd_cli("compare", str(dump), str(reference / "tensors"), "--op", "addmm")
    assert r.returncode == 1, r.stdout + r.stderr


def test_stats_mode_combines_shard_statistics_and_uses_gathered_full_tensors(job, reference):
    c = compare(job / "tp-stats", reference / "stats")
    assert c.summary["failed"] == 0, c.first_divergence
    colwise = _rows(c, COLWISE)
    assert colwise[0].mode == "stats" and colwise[0].verdict == "pass" and "combined" in colwise[0].note
    assert colwise[1].verdict == "unmatched" and "on rank 0" in colwise[1].message
    rowwise = _rows(c, ROWWISE)
    assert all(r.verdict == "unmatched" and "do not combine" in r.message for r in rowwise.values())
    grad = _rows(c, WEIGHT_GRAD)  # gathered at capture: compared on every rank
    assert all(r.verdict == "pass" and "gathered" in r.note for r in grad.values()), grad


def test_full_tensors_are_gathered_only_when_asked(job):
    full = workers._model()
    full(workers._inputs(0)).sum().backward()
    for rank in (0, 1):
        events = [json.loads(line) for line in (job / "tp-stats" / f"rank{rank}" / "index.jsonl").read_text()
                  .splitlines()]
        gathered = {e["full_of"]: e["tensors"][0] for e in events if e["kind"] == "gathered"}
        # the regex asked for parameter gradients; replicated ones (Rowwise bias) are whole already
        assert sorted(gathered) == ["0/Linear#0:backward:param_grad.bias", "0/Linear#0:backward:param_grad.weight",
                                    "2/Linear#0:backward:param_grad.weight"]
        weight = gathered[WEIGHT_GRAD]
        assert weight["shape"] == [16, 8] and weight["slot"] == "param_grad.weight.full"
        assert weight["stats"]["max"] == pytest.approx(full[0].weight.grad.max().item(), rel=1e-6)
        assert weight["stats"]["min"] == pytest.approx(full[0].weight.grad.min().item(), rel=1e-6)
    assert not any(json.loads(line)["kind"] == "gathered"
                   for line in (job / "tp" / "rank0" / "index.jsonl").read_text().splitlines())
    report = check_replicas(job / "tp-stats")  # a gathered tensor is the same on every rank of its mesh
    assert report.ok and report.by_rule["gathered full tensor"] == 3, report.summary()
    # a --ranks selection: rank 1 noted nothing, so nothing was gathered, and no rank hung
    for rank, present in ((0, True), (1, False)):
        index = job / "tp-rank0" / f"rank{rank}" / "index.jsonl"
        assert index.exists() == present or not index.read_text().strip()
    assert not any(json.loads(line)["kind"] == "gathered"
                   for line in (job / "tp-rank0" / "rank0" / "index.jsonl").read_text().splitlines())


def test_gather_full_only_takes_a_regex(tmp_path):
    r = pd_cli("capture", "examples/tiny_transformer.py:build", "-o", str(tmp_path / "d"),
               "--gather-full-only", "(")
    assert r.returncode == 2 and "--gather-full" in r.stderr and "Traceback" not in r.stderr, r.stderr


_PLACEMENT = st.sampled_from(["R", "S(0)", "S(1)", "P(sum)", "P(avg)"])


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 7), cols=st.integers(1, 6), mesh_shape=st.sampled_from([(2,), (3,), (2, 2), (1, 3)]),
       data=st.data())
def test_reassembly_inverts_the_dtensor_layout(rows, cols, mesh_shape, data):
    """Cut a global tensor as DTensor does (torch.chunk per mesh dim, partial sums as random
    addends); reassembling the parts gives it back, and each rank's slice is its part."""
    placements = [data.draw(_PLACEMENT) for _ in mesh_shape]
    full = torch.randn(rows, cols, dtype=torch.float64)
    ranks = list(range(len(torch.zeros(mesh_shape).flatten())))
    coords = {r: tuple(int(c) for c in torch.unravel_index(torch.tensor(r), mesh_shape)) for r in ranks}
    fields = {"placements": placements, "global_shape": [rows, cols], "mesh": ranks, "mesh_shape": list(mesh_shape)}
    parts = {}
    for r in ranks:
        part = full
        for p, c, n in zip(placements, coords[r], mesh_shape):
            if p.startswith("S("):
                chunks = part.chunk(n, dim=int(p[2]))
                part = chunks[c] if c < len(chunks) else part.narrow(int(p[2]), 0, 0)
        parts[r] = part.clone()
    for md, (p, n) in enumerate(zip(placements, mesh_shape)):
        if p.startswith("P("):  # split each rank's part into addends along this mesh dim
            for r in ranks:
                share = torch.full_like(parts[r], 1.0 / n) if p == "P(sum)" else torch.ones_like(parts[r])
                parts[r] = parts[r] * share
    assert torch.allclose(reassemble(fields, parts), full, rtol=1e-12, atol=1e-12)
    if not any(p.startswith("P(") for p in placements):
        for r in ranks:
            assert torch.equal(local_slice(full, placements, coords[r], mesh_shape), parts[r])


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 9), min_size=1, max_size=4).filter(lambda s: sum(s) > 0), nan=st.booleans())
def test_combined_statistics_are_those_of_the_whole(sizes, nan):
    from precisiondiff.capture.stats import StatsBatch
    whole = torch.randn(sum(sizes), dtype=torch.float64)
    if nan:
        whole[0] = float("nan")
    parts = list(whole.split(sizes))
    batch = StatsBatch()
    handles = [batch.add(t) for t in parts + [whole]]
    batch.resolve()
    stats = [batch.get(h) for h in handles]
    combined = combine_stats(stats[:-1], sizes)
    expected = stats[-1]
    for name in ("nan", "inf"):
        assert combined[name] == expected[name]
    for name in ("min", "max", "mean", "abs_mean", "norm"):
        a, b = combined[name], expected[name]
        assert (a is None and b is None) or a == pytest.approx(b, rel=1e-12, nan_ok=True), name


def test_a_rank_past_both_short_dimensions_holds_an_empty_shard():
    """[S(0), S(1)] of a 1x1 tensor on a 2x2 mesh: rank (1, 1) holds 0 rows and 0 columns, as
    DTensor gives it (found by the property above)."""
    full = torch.ones(1, 1)
    assert local_slice(full, ["S(0)", "S(1)"], (1, 1), (2, 2)).shape == (0, 0)
    assert local_slice(full, ["S(0)", "S(1)"], (0, 0), (2, 2)).shape == (1, 1)
