"""torch_mlu's silent conversions on the stand-in: float64 held as float32, int64 narrowed to
int32 in some ops; precisiondiff refuses a float64 target there and records what was held."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

import precisiondiff
from precisiondiff.runtime import narrowing

from .test_cli import EXAMPLE, pd


@pytest.fixture
def narrowing_standin(standin):
    """The stand-in with float64 narrowing on; precisiondiff's probes forgotten before and after."""
    narrowing.forget_probes()
    standin.plant(narrow_float64=True)
    yield standin
    standin.plant(narrow_float64=False, narrow_int64=())
    narrowing.forget_probes()


def test_a_float64_copy_to_the_device_holds_float32_values_with_one_warning(narrowing_standin):
    x = torch.tensor([1 + 2 ** -40, 1e-300], dtype=torch.float64)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        on_device = [x.to("mlu") for _ in range(3)]
    assert on_device[0].dtype == torch.float64  # the dtype asked; the values are float32's
    assert on_device[0].cpu().tolist() == [1.0, 0.0]
    assert [str(w.message) for w in seen if "64-bit" in str(w.message)][:1] and \
        sum("64-bit" in str(w.message) for w in seen) == 1
    assert narrowing.held_dtype("mlu:0") == torch.float32


def test_without_the_conversion_the_device_holds_float64(standin):
    narrowing.forget_probes()
    assert narrowing.held_dtype("mlu:0") == torch.float64
    narrowing.forget_probes()


def test_a_float64_reference_on_a_narrowing_device_is_refused_with_the_reason(narrowing_standin, tmp_path):
    code, out = pd("bisect", EXAMPLE, "--target", "mlu/bf16", "--ref", "mlu/float64")
    assert code == 2
    line = out.strip()
    assert "\n" not in line and "mlu/float64" in line and "holds float64 tensors as float32" in line
    assert "cpu/float64" in line and "--allow-narrowed" in line
    code, out = pd("capture", EXAMPLE, "--target", "mlu/float64", "-o", str(tmp_path / "d"))
    assert code == 2 and "holds float64 tensors as float32" in out
    assert not (tmp_path / "d").exists()


def test_allow_narrowed_runs_and_records_the_target_it_really_is(narrowing_standin, tmp_path):
    code, out = pd("capture", EXAMPLE, "--target", "mlu/float64", "-o", str(tmp_path / "d"), "--allow-narrowed")
    assert code == 0, out
    assert "recorded as mlu/fp32" in out
    dump = precisiondiff.load(str(tmp_path / "d"))
    assert dump.meta["target"] == "mlu/fp32" and dump.meta["target_asked"] == "mlu/float64"
    assert {t.dtype for e in dump.events() for t in e.tensors if t.dtype.startswith("float")} == {"float32"}
    code, out = pd("ls", str(tmp_path / "d"), "--limit", "1")
    assert "mlu/float64 was asked" in out


def test_capture_records_float64_tensors_the_device_held_as_float32(narrowing_standin, tmp_path):
    with pytest.warns(UserWarning, match="64-bit calculation"):  # once, at the first copy
        model = nn.Linear(8, 4).to(device="mlu", dtype=torch.float64)
    x = torch.randn(3, 8, dtype=torch.float64)
    with precisiondiff.capture(str(tmp_path / "d"), model=model, mode="stats"):
        model(x.to("mlu"))
    dump = precisiondiff.load(str(tmp_path / "d"))
    held = {(e.name, t.slot) for e in dump.events() for t in e.tensors if t.held_dtype == "float32"}
    assert ("aten.addmm.default", "output.0") in held and ("Linear", "input.0") in held
    assert all(t.dtype == "float64" for e in dump.events() for t in e.tensors if t.held_dtype)
    code, out = pd("ls", str(tmp_path / "d"))
    assert "float64 (held float32)" in out
    assert "float64 tensors were held as float32 by the device" in out


def test_a_planted_int64_narrowing_wraps_and_its_input_beyond_int32_is_a_finding(standin, tmp_path):
    big = torch.tensor([3_000_000_000, 7], device="mlu")
    assert (big + 1).cpu().tolist() == [3_000_000_001, 8]
    standin.plant(narrow_int64=["add.Tensor"])
    assert (big + 1).cpu().tolist() == [3_000_000_001 - 2 ** 32, 8]  # wrapped, unchecked
    assert (big * 1).cpu().tolist() == [3_000_000_000, 7]  # ops outside the set keep int64
    with precisiondiff.capture(str(tmp_path / "d"), mode="stats"):
        big + 1
    dump = precisiondiff.load(str(tmp_path / "d"))
    flagged = {(e.name, t.slot): t.int32_overflow for e in dump.events() for t in e.tensors if t.int32_overflow}
    assert list(flagged) == [("aten.add.Tensor", "input.0")]
    assert flagged[("aten.add.Tensor", "input.0")]["max"] >= 3e9


def test_an_int64_input_beyond_int32_on_the_device_is_reported_by_ls_and_compare(standin, tmp_path):
    big = torch.tensor([3_000_000_000, 7], device="mlu")
    for name in ("a", "b"):
        with precisiondiff.capture(str(tmp_path / name), mode="stats"):
            big * 2
    dump = precisiondiff.load(str(tmp_path / "a"))
    records = [t for e in dump.events() for t in e.tensors if t.int32_overflow]
    assert records and records[0].int32_overflow["max"] >= 3e9
    code, out = pd("ls", str(tmp_path / "a"))
    assert "int64 beyond int32: (root) aten.mul.Tensor #0 input.0" in out.replace("\n", " ")
    code, out = pd("compare", str(tmp_path / "a"), str(tmp_path / "b"), "--format", "json")
    notes = json.loads(out)["notes"]
    assert any(n.startswith("A: int64 beyond int32") for n in notes), notes
