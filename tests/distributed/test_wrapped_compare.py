"""A DDP job's dump (paths ``module.0``...) compares with a single-process reference of the
unwrapped model (precisiondiff/compare/unwrap.py)."""
from __future__ import annotations

import precisiondiff
from precisiondiff.compare import compare
from tests.distributed import workers


def test_a_ddp_rank_compares_with_the_unwrapped_model(job, tmp_path):
    model = workers._model()
    with precisiondiff.capture(tmp_path / "ref", model=model, mode="stats") as cap:
        model(workers._inputs(0)).square().mean().backward()
        cap.step()
    # forward only: DDP averages the gradients over both ranks' batches, the reference has one
    cmp = compare(job / "ddp" / "rank0", tmp_path / "ref", direction="forward")
    assert cmp.exit_code == 0, [r.message for r in cmp.rows if r.verdict == "fail"]
    assert any("wrapper prefix 'module.'" in n and "DistributedDataParallel" in n for n in cmp.notes)
    matched = {(r.scope, r.name) for r in cmp.rows if r.verdict == "pass" and r.kind == "module"}
    assert {("module", "Sequential"), ("module.0", "Linear"), ("module.2", "Linear")} <= matched
    assert all(r.scope == "" for r in cmp.rows if r.verdict == "unmatched")
