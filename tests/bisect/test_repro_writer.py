"""The repro's pieces on their own: the script's safetensors reader (no safetensors package)
against the library's writer, and ``--max-elements`` slicing keeping the failing elements."""
from __future__ import annotations

import json

import torch
from hypothesis import given, settings, strategies as st
from safetensors.torch import save_file

from precisiondiff.bisect.repro import ReproCase, ReproOutput, write_repro
from precisiondiff.bisect.repro_script import SCRIPT

_READER: dict = {"__file__": "repro.py"}
exec(compile(SCRIPT.split('\nif __name__ == "__main__":')[0], "repro.py", "exec"), _READER)

_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool]


@st.composite
def _named_tensors(draw):
    out = {}
    for i in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(_DTYPES))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        bits = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size(),),
                             generator=torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16))), dtype=torch.uint8)
        flat = bits.view(dtype) if dtype != torch.bool else bits.remainder(2).bool()
        out[f"t{i}"] = flat[: torch.Size(shape).numel()].reshape(shape).clone()
    return out


@settings(max_examples=40, deadline=None)
@given(_named_tensors())
def test_the_scripts_reader_reads_what_safetensors_writes(tmp_path_factory, named):
    path = str(tmp_path_factory.mktemp("st") / "case.safetensors")
    save_file(named, path)
    back = _READER["read_safetensors"](path)
    assert sorted(back) == sorted(named)
    for name, t in named.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape
        bytes_of = (lambda v: v) if t.dtype == torch.bool else (lambda v: v.reshape(-1).view(torch.uint8))
        assert torch.equal(bytes_of(back[name]), bytes_of(t))  # bit for bit, NaN payloads included


def _case(op: str, tensors: dict, dut: torch.Tensor, golden: torch.Tensor) -> ReproCase:
    verdict = {"bound": 1e-3, "factor": 3.0, "peer_max_error": 0.2, "error": 0.1, "max_error": 5.0,
               "peer_error": 1e-4, "floor": 1e-4, "peers": {"float32": 1e-4}}
    slots = [{"t": s} for s in tensors]
    return ReproCase(op, slots, {"dict": {}}, dict(tensors),
                     [ReproOutput("output.0", 0, golden, torch.full((golden.numel(),), 0.1, dtype=torch.float64),
                                  dut, verdict)], "cpu/bf16", "cpu/float64", {"name": op})


def test_max_elements_keeps_the_failing_rows_of_a_gemm(tmp_path):
    a, b = torch.randn(64, 16).bfloat16(), torch.randn(16, 8).bfloat16()
    golden = a.double() @ b.double()
    dut = golden.clone().bfloat16()
    dut[[5, 40]] += 1.0  # two wrong rows, far beyond one ULP
    write_repro(_case("aten.mm.default", {"input.0": a, "input.1": b}, dut, golden), tmp_path, max_elements=300)
    from safetensors.torch import load_file
    data = load_file(str(tmp_path / "case.safetensors"))
    assert torch.equal(data["input.0"], a[[5, 40]]) and torch.equal(data["input.1"], b)
    assert torch.equal(data["golden.output.0"], golden[[5, 40]]) and data["scale.output.0"].shape == (2, 8)
    case = json.loads((tmp_path / "case.json").read_text())
    assert case["outputs"][0]["l2_judged"] is False and "2 of the 2 failing rows" in case["notes"][0]


def test_max_elements_cuts_an_elementwise_op_to_its_failing_elements(tmp_path):
    x, y = torch.randn(1000).bfloat16(), torch.randn(1000).bfloat16()
    golden = x.double() * y.double()
    dut = golden.bfloat16()
    dut[[3, 999]] = 7.0
    write_repro(_case("aten.mul.Tensor", {"input.0": x, "input.1": y}, dut, golden), tmp_path, max_elements=100)
    from safetensors.torch import load_file
    data = load_file(str(tmp_path / "case.safetensors"))
    assert torch.equal(data["input.0"], x[[3, 999]]) and torch.equal(data["dut.output.0"], dut[[3, 999]])


def test_an_op_without_a_slicing_rule_is_written_whole_with_a_note(tmp_path):
    x = torch.randn(4, 100).bfloat16()
    golden = x.double().sum(1)
    dut = golden.bfloat16() + 1
    write_repro(_case("aten.sum.dim_IntList", {"input.0": x}, dut, golden), tmp_path, max_elements=10)
    case = json.loads((tmp_path / "case.json").read_text())
    assert case["outputs"][0]["l2_judged"] is True and "no slicing rule for aten.sum.dim_IntList" in case["notes"][0]
