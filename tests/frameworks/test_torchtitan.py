"""torchtitan's own Llama 3 (tiny, random weights, SDPA attention, its complex64 RoPE table) as
``file.py:fn`` workloads (examples/frameworks/torchtitan_llama.py), one process: capture at the
module and op levels in stats and replay modes, compare with float64, bisect clean and with a
planted RMSNorm in block 1. Skipped without torchtitan (which needs triton to import)."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

import precisiondiff  # noqa: E402
from precisiondiff.capture.runner import capture_workload  # noqa: E402

# eager FlexAttention on the CPU (torchtitan compiles it on GPUs) warns that it is unfused
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
SPEC = str(Path(__file__).resolve().parents[2] / "examples" / "frameworks" / "torchtitan_llama.py")
PLANT = "pdframeworks.rough_rms_norm.default"


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    out = tmp_path_factory.mktemp("tt")
    for name, target, level, mode in [("ref", "cpu/float64", "all", "stats"), ("mod", "cpu/bf16", "module", "stats"),
                                      ("op", "cpu/bf16", "op", "replay")]:
        capture_workload(f"{SPEC}:build", out / name, target=target, level=level, mode=mode)
    return out


def test_capture_keeps_the_complex_rope_table_and_records_both_levels(dumps):
    op = precisiondiff.load(dumps / "op")
    rotations = {t.dtype for ev in op.events() for t in ev.tensors
                 if ev.scope.endswith("attention.rope") and t.dtype.startswith("complex")}
    assert rotations == {"complex64"}  # the table is not cast to a real dtype
    assert any(ev.kind == "op" and ev.scope == "layers.1.feed_forward.w1" for ev in op.events())
    mod = precisiondiff.load(dumps / "mod")
    assert {ev.direction for ev in mod.events() if ev.scope == "layers.1.attention"} == {"forward", "backward"}


def test_compare_with_float64_aligns_every_block(dumps):
    result = precisiondiff.compare(str(dumps / "mod"), str(dumps / "ref"), kind="module")
    assert result.summary["unmatched_a"] == 0, result.summary
    assert any(row.match and row.scope == "layers.1.feed_forward" for row in result.rows)


def test_bisect_clean_gets_no_kernel_verdict():
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Casting complex values to real")
        result = precisiondiff.bisect(f"{SPEC}:build", target="cpu/bf16")
    assert result.verdict in ("parity", "accumulated"), result.culprit


def test_bisect_names_the_planted_rms_norm():
    result = precisiondiff.bisect(f"{SPEC}:build_planted", target="cpu/bf16")
    c = result.culprit
    assert result.verdict == "kernel" and (c["kind"], c["name"], c["scope"], c["direction"]) == \
        ("op", PLANT, "layers.1.ffn_norm", "forward"), c


# -- FlexAttention (forward only: no CPU backward in torch 2.13) and activation checkpointing --

@pytest.fixture(scope="module")
def flex_dump(tmp_path_factory):
    out = tmp_path_factory.mktemp("tt") / "flex"
    capture_workload(f"{SPEC}:build_flex", out, target="cpu/bf16", level="all", mode="replay")
    return out


def test_flex_attention_is_recorded_as_a_unit_inside_its_module(flex_dump):
    events = list(precisiondiff.load(flex_dump).events())
    hops = [ev for ev in events if ev.name == "higher_order.flex_attention"]
    assert [ev.scope for ev in hops] == ["layers.0.attention.inner_attention", "layers.1.attention.inner_attention"]
    assert {ev.direction for ev in events} == {"forward"}


def test_bisect_of_a_flex_inference_step_judges_it_and_names_the_plant():
    clean = precisiondiff.bisect(f"{SPEC}:build_flex", target="cpu/bf16")
    assert clean.verdict in ("parity", "accumulated"), clean.culprit
    planted = precisiondiff.bisect(f"{SPEC}:build_flex_planted", target="cpu/bf16")
    c = planted.culprit
    assert planted.verdict == "kernel" and (c["name"], c["scope"], c["direction"]) == \
        (PLANT, "layers.1.ffn_norm", "forward"), c


def test_activation_checkpointing_records_each_op_once_and_bisect_is_clean(tmp_path):
    capture_workload(f"{SPEC}:build_ac_planted", tmp_path / "ac", target="cpu/bf16", level="all", mode="replay")
    events = list(precisiondiff.load(tmp_path / "ac").events())
    assert [ev.direction for ev in events if ev.name == PLANT] == ["forward"]  # not again in the recompute
    mods = [(ev.scope, ev.direction) for ev in events if ev.kind == "module"]
    assert mods.count(("layers.1._checkpoint_wrapped_module.ffn_norm", "forward")) == 1
    result = precisiondiff.bisect(f"{SPEC}:build_ac", target="cpu/bf16")
    assert result.verdict in ("parity", "accumulated"), result.culprit


def test_bisect_names_the_plant_under_activation_checkpointing():
    result = precisiondiff.bisect(f"{SPEC}:build_ac_planted", target="cpu/bf16")
    c = result.culprit
    assert result.verdict == "kernel" and (c["name"], c["scope"], c["direction"]) == \
        (PLANT, "layers.1._checkpoint_wrapped_module.ffn_norm", "forward"), c
