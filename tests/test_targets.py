import sys
import types

import pytest
import torch

from precisiondiff.errors import TargetError
from precisiondiff.runtime import targets
from precisiondiff.runtime.targets import Target, default_dut, default_ref, move_inputs, parse_dtype


@pytest.mark.parametrize("text,device,dtype,autocast", [
    ("cpu/float64", "cpu", torch.float64, False),
    ("cpu/bf16", "cpu", torch.bfloat16, False),
    ("cpu", "cpu", torch.bfloat16, False),
    ("cuda:0/fp16", "cuda:0", torch.float16, False),
    ("mlu/bf16+autocast", "mlu", torch.bfloat16, True),
    ("cpu/torch.float32", "cpu", torch.float32, False),
    ("cpu/float8_e4m3fn", "cpu", torch.float8_e4m3fn, False),
])
def test_parse(text, device, dtype, autocast):
    t = Target.parse(text)
    assert (t.device, t.dtype, t.autocast) == (device, dtype, autocast)
    assert Target.parse(str(t)) == t


def test_canonical_names():
    assert str(Target.parse("cpu/bfloat16")) == "cpu/bf16"
    assert str(Target.parse("cpu/fp64")) == "cpu/float64"
    assert str(Target.parse("cuda/half+autocast")) == "cuda/fp16+autocast"


@pytest.mark.parametrize("bad", ["", "cpu/int64", "cpu/bf17", "nodevice/bf16", "cpu+x", "cpu/bf16+autocast+x"])
def test_parse_errors_are_target_errors(bad):
    with pytest.raises(TargetError):
        Target.parse(bad)


def test_parse_dtype_rejects_integers():
    with pytest.raises(TargetError, match="unknown dtype"):
        parse_dtype("int32")


def test_prepare_model_casts_floating_params_and_keeps_original():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Embedding(5, 4))
    moved = Target.parse("cpu/bf16").prepare_model(model)
    assert all(p.dtype == torch.bfloat16 for p in moved.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    auto = Target.parse("cpu/bf16+autocast").prepare_model(model)
    assert all(p.dtype == torch.float32 for p in auto.parameters())


def test_prepare_inputs_never_casts_integers():
    inputs = {"ids": torch.arange(4), "mask": torch.ones(4, dtype=torch.bool), "x": torch.randn(2)}
    moved = Target.parse("cpu/fp16").prepare_inputs(inputs)
    assert moved["ids"].dtype == torch.int64 and moved["mask"].dtype == torch.bool
    assert moved["x"].dtype == torch.float16
    auto = Target.parse("cpu/fp16+autocast").prepare_inputs((inputs["x"], 3))
    assert auto[0].dtype == torch.float32 and auto[1] == 3


def test_autocast_context_runs_matmul_in_low_precision():
    t = Target.parse("cpu/bf16+autocast")
    lin = t.prepare_model(torch.nn.Linear(8, 8))
    with t.context():
        out = lin(torch.randn(2, 8))
    assert out.dtype == torch.bfloat16


def test_defaults_on_a_cpu_only_machine():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device exists here")
    assert str(default_dut()) == "cpu/bf16"
    assert str(default_ref()) == "cpu/float64"


def test_mlu_without_torch_mlu_says_how_to_install(monkeypatch):
    monkeypatch.delattr(torch, "mlu", raising=False)
    real_import = targets.importlib.import_module

    def fake_import(name, *a, **k):
        if name == "torch_mlu":
            raise ImportError("No module named 'torch_mlu'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(targets.importlib, "import_module", fake_import)
    with pytest.raises(TargetError, match="torch_mlu is not installed.*install"):
        Target.parse("mlu/bf16").check_available()
    assert not Target.parse("mlu/bf16").is_available()


def test_precisiondiff_import_that_fails_is_a_one_line_target_error(monkeypatch):
    monkeypatch.delattr(torch, "mlu", raising=False)
    monkeypatch.setenv("PRECISIONDIFF_IMPORT", "precisiondiff_no_such_backend")
    with pytest.raises(TargetError, match=r"PRECISIONDIFF_IMPORT: cannot import 'precisiondiff_no_such_backend' "
                                          r"\(ModuleNotFoundError: .*\); set PRECISIONDIFF_IMPORT to the module"):
        Target.parse("mlu/bf16").check_available()


def test_precisiondiff_import_runs_before_torch_mlu_is_tried(monkeypatch):
    """The named module registers ``torch.mlu`` (as a PrivateUse1 backend would); torch_mlu is never imported."""
    monkeypatch.delattr(torch, "mlu", raising=False)
    module = types.ModuleType("pd_fake_backend")
    device = _StandInDevice(is_available=lambda: True, device_count=lambda: 1)
    tried = []
    real_import = targets.importlib.import_module

    def fake_import(name, *a, **k):
        tried.append(name)
        if name == "pd_fake_backend":
            monkeypatch.setattr(torch, "mlu", device, raising=False)
            return module
        return real_import(name, *a, **k)

    monkeypatch.setattr(targets.importlib, "import_module", fake_import)
    monkeypatch.setattr(torch, "get_device_module", lambda name: getattr(torch, name))
    monkeypatch.setenv("PRECISIONDIFF_IMPORT", "pd_fake_backend")
    monkeypatch.delitem(sys.modules, "pd_fake_backend", raising=False)
    Target.parse("mlu/bf16").check_available()
    assert tried == ["pd_fake_backend"]


class _StandInDevice(types.SimpleNamespace):
    """A non-CUDA accelerator module as torch_mlu would register it."""


def test_non_cuda_accelerator_path_uses_the_device_module(monkeypatch):
    calls = []
    fake = _StandInDevice(is_available=lambda: True, device_count=lambda: 2,
                          synchronize=lambda: calls.append("sync"))
    monkeypatch.setattr(targets, "device_module", lambda device_type: fake)
    t = Target.parse("mlu:1/bf16")
    t.check_available()
    t.synchronize()
    assert calls == ["sync"]
    with pytest.raises(TargetError, match="out of range"):
        Target.parse("mlu:5/bf16").check_available()
    fake.is_available = lambda: False
    with pytest.raises(TargetError, match="no mlu device is available"):
        t.check_available()


def test_device_module_feature_detects(monkeypatch):
    monkeypatch.delattr(torch, "get_device_module", raising=False)
    assert targets.device_module("cuda") is torch.cuda


def test_move_inputs_keeps_structure():
    Point = __import__("collections").namedtuple("Point", "x y")
    out = move_inputs([Point(torch.zeros(1), 2), {"a": (torch.ones(1, dtype=torch.int8),)}], "cpu", torch.float64)
    assert isinstance(out[0], Point) and out[0].x.dtype == torch.float64
    assert out[1]["a"][0].dtype == torch.int8
