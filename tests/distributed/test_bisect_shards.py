"""The DTensor op calls of a rank as its bisect replays them (precisiondiff/bisect/shards.py), on
synthetic events: a pointwise op whose replicated input DTensor cut to the output's shard
(Replicate -> Shard) is replayed on this rank's chunk; an op whose recorded local shapes do not
go together is left out with that reason (not replayed, which read as a missing library)."""
from __future__ import annotations

import pickle

import torch

from precisiondiff.bisect.isolate import UnitEvent
from precisiondiff.bisect.shards import REDISTRIBUTED, Placed, prepare_events

ARGS = {"args": [{"t": "input.0"}, {"t": "input.1"}], "kwargs": {"dict": {}}, "replayable": True}


def _event(seq, name, tensors):
    slots = {slot: (str(t.dtype).split(".")[1], tuple(t.shape), True) for slot, t in tensors.items()}
    return UnitEvent(seq=seq, kind="op", scope="blk", name=name, direction="backward", call=0, slots=slots,
                     args=ARGS, load=lambda slot: tensors[slot])


def test_a_replicated_input_of_a_pointwise_op_is_cut_to_the_ranks_chunk():
    torch.manual_seed(0)
    whole, shard = torch.randn(2, 4, 6), torch.randn(2, 4, 3)
    weight = torch.randn(3)
    mul = _event(1, "aten.mul.Tensor", {"input.0": whole, "input.1": shard, "output.0": whole.chunk(2, 2)[1] * shard})
    # a broadcast replicated input along the sharded dimension stays as it is (its size there is 1)
    scale = _event(2, "aten.mul.Tensor", {"input.0": shard, "input.1": torch.randn(2, 4, 1), "output.0": shard})
    bias = _event(3, "aten.add.Tensor", {"input.0": shard, "input.1": weight, "output.0": shard + weight})
    r, s = Placed(["R"], [0, 1], [2, 4, 6]), Placed(["S(2)"], [0, 1], [2, 4, 6])
    placements = {1: {"input.0": r, "input.1": s, "output.0": s},
                  2: {"input.0": s, "input.1": Placed(["R"], [0, 1], [2, 4, 1]), "output.0": s},
                  3: {"input.0": s, "input.1": Placed(["R"], [0, 1], [3]), "output.0": s}}
    left: list = []
    kept = prepare_events(placements, left, rank=1)([mul, scale, bias])
    assert left == [] and [ev.seq for ev in kept] == [1, 2, 3]
    cut = kept[0]
    assert torch.equal(cut.load("input.0"), whole.chunk(2, 2)[1]) and cut.slots["input.0"][1] == (2, 4, 3)
    assert torch.equal(cut.load("input.1"), shard)
    assert kept[1] is scale and kept[2] is bias  # nothing to cut: the events as they were
    assert pickle.loads(pickle.dumps(r)) == r and pickle.loads(pickle.dumps(r)).mesh == [0, 1]


def test_an_op_whose_recorded_shard_shapes_disagree_is_left_out_with_the_reason():
    a, b = torch.randn(4, 6), torch.randn(3, 5)  # replicated whole (4, 6) against a (3, 5) shard
    mm = _event(7, "aten.mm.default", {"input.0": a, "input.1": b, "output.0": torch.randn(4, 5)})
    placements = {7: {"input.0": Placed(["R"], [0, 1], [4, 6]), "input.1": Placed(["S(0)"], [0, 1], [6, 5]),
                      "output.0": Placed(["S(1)"], [0, 1], [4, 10])}}
    left: list = []
    assert prepare_events(placements, left, rank=0)([mm]) == []
    assert left == [{"scope": "blk", "name": "aten.mm.default", "direction": "backward", "call": 0,
                     "reason": REDISTRIBUTED}]
    assert "redistributed by DTensor" in REDISTRIBUTED and "library" not in REDISTRIBUTED
