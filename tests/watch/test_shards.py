"""combine_ranks: a sharded job's per-rank watch logs (each rank's norms of its own shards) turned
into the global statistics of the whole model (precisiondiff/watch/shards.py). The real FSDP2 job
is tests/frameworks/test_torchtitan_parallel.py; here the logs are built from real tensors cut as
torch.chunk cuts a Shard(0) parameter, so the combined norms can be checked against the whole."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from precisiondiff.errors import PrecisionDiffError
from precisiondiff.watch.log import WatchLog
from precisiondiff.watch.shards import combine_ranks


def _logs(weights, befores, grads, placements, world):
    """Per-rank logs of one step: each rank's norms of its chunk of every parameter."""
    logs = {}
    for r in range(world):
        params = {}
        for name, w in weights.items():
            sharded = placements[name] != ["R"]
            cut = (lambda t: torch.chunk(t, world)[r]) if sharded else (lambda t: t)
            wr, br, gr = cut(w), cut(befores[name]), cut(grads[name])
            params[name] = {"grad": float(gr.norm()), "weight": float(wr.norm()),
                            "update_ratio": float((wr - br).norm() / wr.norm())}
        header = {"model": {"signature": "s", "shards": {n: {"placements": p, "mesh": list(range(world))}
                                                         for n, p in placements.items()}},
                  "rank": r, "world_size": world}
        logs[r] = WatchLog(path=f"rank{r}", header=header, steps=[{"step": 0, "loss": 1.0, "params": params}],
                           complete=True)
    return logs


@settings(max_examples=25, deadline=None)
@given(world=st.sampled_from([2, 4]), rows=st.integers(4, 12), seed=st.integers(0, 2**16))
def test_shard_norms_combine_to_the_whole_tensors(world, rows, seed):
    g = torch.Generator().manual_seed(seed)
    weights = {"w": torch.randn(rows * world, 3, generator=g, dtype=torch.float64),
               "norm": torch.randn(5, generator=g, dtype=torch.float64)}
    befores = {n: w + 1e-3 * torch.randn(w.shape, generator=g, dtype=torch.float64) for n, w in weights.items()}
    grads = {n: torch.randn(w.shape, generator=g, dtype=torch.float64) for n, w in weights.items()}
    combined = combine_ranks(_logs(weights, befores, grads, {"w": ["S(0)"], "norm": ["R"]}, world))
    assert combined.header["world_size"] == 1 and combined.header["combined_from"] == list(range(world))
    step = combined.by_step()[0]["params"]
    for name, w in weights.items():
        assert math.isclose(step[name]["grad"], float(grads[name].norm()), rel_tol=1e-12)
        assert math.isclose(step[name]["weight"], float(w.norm()), rel_tol=1e-12)
        assert math.isclose(step[name]["update_ratio"], float((w - befores[name]).norm() / w.norm()), rel_tol=1e-9)


def test_partial_sums_are_left_out_with_a_note_and_other_models_are_refused():
    w = {"p": torch.ones(4, 2, dtype=torch.float64)}
    logs = _logs(w, {"p": torch.zeros(4, 2, dtype=torch.float64)}, w, {"p": ["P(sum)"]}, 2)
    combined = combine_ranks(logs)
    assert combined.by_step()[0]["params"] == {}
    assert any("p: not combined (placements ['P(sum)'] do not combine)" in n for n in combined.notes)
    logs[1].header["model"]["signature"] = "other"
    with pytest.raises(PrecisionDiffError, match="different models"):
        combine_ranks(logs)
