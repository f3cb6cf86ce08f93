import textwrap

import pytest
import torch

from precisiondiff import Workload
from precisiondiff.errors import WorkloadError
from precisiondiff.runtime.targets import Target
from precisiondiff.runtime.workload import call_model, load_workload, run_workload


def test_load_from_file_is_seeded_and_repeatable(example_spec):
    a = load_workload(example_spec, seed=0)
    b = load_workload(example_spec, seed=0)
    c = load_workload(example_spec, seed=1)
    pa, pb, pc = (next(w.model.parameters()) for w in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)
    assert torch.equal(a.inputs, b.inputs)


def test_load_from_module_path(tmp_path, monkeypatch):
    pkg = tmp_path / "zoo_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text(textwrap.dedent("""
        import torch
        def mlp():
            return torch.nn.Linear(3, 2), torch.randn(4, 3)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    w = load_workload("zoo_pkg.models:mlp")
    assert isinstance(w, Workload) and w.loss is None and w.inputs.shape == (4, 3)


@pytest.mark.parametrize("body,spec_fn,message", [
    (None, "build", "workload file not found"),
    ("def other():\n    pass\n", "build", "has no function 'build'; callables there: other"),
    ("def build():\n    return 3\n", "build", "returned int"),
    ("def build(x):\n    return x\n", "build", "must take no required argument"),
    ("def build():\n    raise ValueError('boom')\n", "build", "raised ValueError: boom"),
    ("import torch\ndef build():\n    return 'm', torch.ones(1)\n", "build", "not a torch.nn.Module"),
    ("raise ImportError('no lib')\n", "build", "importing .* failed"),
])
def test_bad_workloads_are_clear_errors(tmp_path, body, spec_fn, message):
    path = tmp_path / "w.py"
    if body is not None:
        path.write_text(body)
    with pytest.raises(WorkloadError, match=message):
        load_workload(f"{path}:{spec_fn}")


@pytest.mark.parametrize("spec", ["nocolon", ":fn", "file.py:", "no_such_pkg_xyz.mod:fn"])
def test_malformed_specs(spec):
    with pytest.raises(WorkloadError):
        load_workload(spec)


def test_call_conventions():
    seen = []
    def f(*args, **kwargs):
        seen.append((args, kwargs))
    call_model(f, torch.ones(1)); call_model(f, (1, 2)); call_model(f, {"a": 1})
    assert [len(a) for a, _ in seen] == [1, 2, 0] and seen[2][1] == {"a": 1}


def test_eval_mode_by_default_makes_dropout_inert():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5))
    w = Workload(model, torch.randn(2, 8))
    t = Target.parse("cpu/float64")
    torch.manual_seed(1)
    out1 = run_workload(w, t).output
    torch.manual_seed(2)
    out2 = run_workload(w, t).output
    assert torch.equal(out1, out2)
    w.train = True
    torch.manual_seed(1)
    assert not torch.equal(run_workload(w, t).output, out1)


def test_same_weights_on_every_target(example_spec):
    w = load_workload(example_spec)
    ref = Target.parse("cpu/float64").prepare_model(w.model)
    dut = Target.parse("cpu/bf16").prepare_model(w.model)
    for (n, p64), (_, p16) in zip(ref.named_parameters(), dut.named_parameters()):
        assert torch.equal(p64.to(torch.bfloat16), p16), n


def test_a_loss_holding_a_tensor_on_another_device_says_what_to_move():
    """A target moves the model and its inputs, not the tensors a loss closes over (labels)."""
    labels = torch.zeros(3, dtype=torch.long, device="meta")
    wl = Workload(torch.nn.Linear(4, 2), torch.randn(3, 4),
                  loss=lambda out: torch.nn.functional.cross_entropy(out, labels))
    with pytest.raises(WorkloadError, match=r"the loss on cpu/fp32 raised .*move it to the output's device"):
        run_workload(wl, Target.parse("cpu/float32"))
