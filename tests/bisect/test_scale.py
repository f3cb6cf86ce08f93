"""Block-wise replay (``max_replay_bytes``): no module larger than the limit is replayed whole, the
descent replays block by block, and the verdict and culprit are those of replaying every module
whole. Forced on small models here by a limit of one block's size (docs/bisect.md, "Host memory")."""
from __future__ import annotations

import pytest
import torch

from precisiondiff.bisect import bisect, bisect_dump
from precisiondiff.bisect import isolate
from precisiondiff.bisect.engine import replay_bytes
from precisiondiff.capture.runner import capture_workload
from tests.bisect import planted, planted_blocks

BLOCKS = "tests/bisect/planted_blocks.py:"


def _limit(model: torch.nn.Module) -> int:
    """The float64 bytes of the largest child of the root: the root is over it, each block is not."""
    return max(replay_bytes(m, torch.float64) for m in model.children())


def _copies(monkeypatch) -> list:
    """Record the float64 size of every module copy a replay makes."""
    sizes = []
    original = isolate._module_copy

    def spy(template, ev, device, dtype):
        sizes.append((ev.scope, replay_bytes(template, dtype)))
        return original(template, ev, device, dtype)
    monkeypatch.setattr(isolate, "_module_copy", spy)
    return sizes


def _unit(c):
    return None if c is None else {k: c.get(k) for k in ("kind", "scope", "name", "direction", "call", "peer",
                                                         "local", "budget", "reason")}


@pytest.mark.parametrize("workload, verdict, culprit", [
    (BLOCKS + "clean_workload", "parity", None),
    ("tests/bisect/planted.py:bad_backward_workload", "kernel", ("module", "scale", "backward")),
    (BLOCKS + "planted_workload", "kernel", ("op", f"layers.{planted_blocks.PLANTED_LAYER}", "forward")),
])
def test_block_wise_replay_gives_the_verdict_and_culprit_of_whole_replays(workload, verdict, culprit, monkeypatch):
    model = (planted.bad_backward_workload() if "bad_backward" in workload else planted_blocks.clean_workload()).model
    limit = _limit(model)
    whole = bisect(workload, target="cpu/bf16", max_replay_bytes=None)
    sizes = _copies(monkeypatch)
    blocks = bisect(workload, target="cpu/bf16", max_replay_bytes=limit)
    assert whole.verdict == blocks.verdict == verdict
    c = blocks.culprit
    assert (None if c is None else (c["kind"], c["scope"], c["direction"])) == culprit
    assert _unit(blocks.culprit) == _unit(whole.culprit)
    assert [_unit(u) for u in blocks.candidates] == [_unit(u) for u in whole.candidates]
    assert blocks.final_error == whole.final_error
    # no replay copied more than one block; the root was never copied
    assert sizes and max(s for _, s in sizes) <= limit and "" not in {scope for scope, _ in sizes}
    if verdict == "parity":  # replaying every module whole replays the root (the whole model)
        assert "<root> (forward)" in blocks.cost["block_wise"]["not_replayed_whole"]
        assert blocks.cost["block_wise"]["max_replay_bytes"] == limit


def test_whole_replay_copies_the_root_when_nothing_limits_it(monkeypatch):
    sizes = _copies(monkeypatch)
    r = bisect(BLOCKS + "clean_workload", target="cpu/bf16", max_replay_bytes=None)
    assert r.verdict == "parity" and "block_wise" not in r.cost
    assert "" in {scope for scope, _ in sizes}


@pytest.fixture(scope="module")
def planted_dump(tmp_path_factory):
    path = tmp_path_factory.mktemp("scale") / "dut"
    capture_workload(BLOCKS + "planted_workload", path, target="cpu/bf16", mode="replay")
    return str(path)


def test_offline_block_wise_leaves_out_the_reference_run_of_a_model_over_the_limit(planted_dump, monkeypatch):
    whole = bisect_dump(planted_dump, workload=BLOCKS + "planted_workload", max_replay_bytes=None)
    limit = _limit(planted_blocks.planted_workload().model)
    sizes = _copies(monkeypatch)
    blocks = bisect_dump(planted_dump, workload=BLOCKS + "planted_workload", max_replay_bytes=limit)
    assert whole.verdict == blocks.verdict == "kernel"
    assert _unit(blocks.culprit) == _unit(whole.culprit)
    assert blocks.culprit["name"] == "pdblocks.acc_linear.default"
    # whole: the float64 reference run gave the final error; block-wise it is left out, with a note
    assert whole.cost["ref_runs"] == 1 and whole.final_error is not None
    assert blocks.cost["ref_runs"] == 0 and any("reference run of the whole model was left out" in n
                                                for n in blocks.notes)
    assert max(s for _, s in sizes) <= limit


def test_cli_takes_a_replay_limit_and_refuses_a_bad_one(planted_dump, tmp_path):
    from tests.conftest import pd_cli
    bad = pd_cli("bisect", planted_dump, "--max-replay-bytes", "lots")
    assert bad.returncode == 2 and "bad size" in bad.stderr and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
