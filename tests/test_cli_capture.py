"""`precisiondiff capture`, `ls`, `verify` as a user runs them: real processes, real exit codes."""
import json
import signal
import textwrap


import precisiondiff.store as store
from tests.conftest import pd_cli


def test_capture_ls_verify(tmp_path, example_spec):
    out = tmp_path / "d1"
    r = pd_cli("capture", example_spec, "--target", "cpu/bf16", "-o", str(out), "--mode", "tensors")
    assert r.returncode == 0, r.stderr
    assert "on cpu/bf16 (all/tensors" in r.stdout
    ls = pd_cli("ls", str(out), "--limit", "400")
    assert ls.returncode == 0, ls.stderr
    for word in ("Linear", "aten.addmm.default", "fwd", "bwd", "param_grad.weight", "grad_input.0", "complete"):
        assert word in ls.stdout, word
    filtered = pd_cli("ls", str(out), "--kind", "module", "--direction", "backward", "--scope", "fc1")
    assert "Linear" in filtered.stdout and "aten." not in filtered.stdout
    v = pd_cli("verify", str(out))
    assert v.returncode == 0 and "DAMAGED" not in v.stdout
    meta = json.loads((out / "meta.json").read_text())
    assert meta["target"] == "cpu/bf16" and meta["seed"] == 0 and meta["complete"] is True


def test_verify_reports_damage_with_exit_1(tmp_path, example_spec):
    out = tmp_path / "d"
    assert pd_cli("capture", example_spec, "-o", str(out), "--mode", "tensors", "--level", "module").returncode == 0
    shard = next(out.glob("shard-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    v = pd_cli("verify", str(out))
    assert v.returncode == 1 and "DAMAGED" in v.stdout and "fingerprint" in v.stdout


def _one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_bad_inputs_exit_2_with_one_line(tmp_path, example_spec):
    out = str(tmp_path / "o")
    _one_line_error(pd_cli("capture", "nope.py:build", "-o", out), "workload file not found")
    _one_line_error(pd_cli("capture", example_spec.replace(":build", ":nope"), "-o", out), "has no function 'nope'")
    _one_line_error(pd_cli("capture", example_spec, "--target", "tpu9/bf16", "-o", out), "unknown device")
    _one_line_error(pd_cli("capture", example_spec, "--target", "mlu/bf16", "-o", out), "torch_mlu is not installed")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    _one_line_error(pd_cli("capture", example_spec, "-o", str(blocker / "sub")), str(blocker))
    _one_line_error(pd_cli("ls", str(tmp_path / "missing")))
    _one_line_error(pd_cli("capture", "-o", out), "needs one WORKLOAD")


def test_existing_dump_is_not_overwritten(tmp_path, example_spec):
    out = str(tmp_path / "d")
    assert pd_cli("capture", example_spec, "-o", out, "--level", "module").returncode == 0
    _one_line_error(pd_cli("capture", example_spec, "-o", out, "--level", "module"), "--overwrite")
    assert pd_cli("capture", example_spec, "-o", out, "--level", "module", "--overwrite").returncode == 0


TRAIN = """
import sys, os, signal, torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
steps = int(sys.argv[1])
for step in range(steps):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    if os.environ.get("KILL_AT") == str(step):
        os.kill(os.getpid(), signal.SIGKILL)
print("trained", steps)
"""


def test_script_capture(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN))
    out = tmp_path / "s"
    r = pd_cli("capture", "--script", str(script), "-o", str(out), "--mode", "tensors", "--", "3")
    assert r.returncode == 0, r.stderr
    assert "trained 3" in r.stdout
    dump = store.load(out)
    events = list(dump.events())
    assert {e.step for e in events} == {0, 1, 2}
    linear = [e for e in events if e.kind == "module" and e.scope == "0" and e.direction == "forward"]
    assert len(linear) == 3
    assert linear[1].tensors[0].key.startswith("step1/0/Linear#0:forward:")
    grads = [e for e in events if e.kind == "param" and e.scope == "2"]
    assert len(grads) == 3
    # the optimizer's update is recorded as its own events (direction optimizer), not as model ops
    assert {e.step for e in events if e.direction == "optimizer"} == {0, 1, 2}
    assert not any(("foreach" in e.name or e.name.startswith("aten.add_")) and e.direction != "optimizer"
                   for e in events)


def test_killed_capture_leaves_a_readable_partial_dump(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN))
    out = tmp_path / "k"
    r = pd_cli("capture", "--script", str(script), "-o", str(out), "--mode", "tensors", "--", "5",
               env={"KILL_AT": "2"})
    assert r.returncode == -signal.SIGKILL
    dump = store.load(out)
    assert dump.complete is False
    events = list(dump.events())
    assert {e.step for e in events} >= {0, 1}
    for e in events:
        for t in e.tensors:
            assert dump.tensor(t.key).shape == tuple(t.shape)
    v = pd_cli("verify", str(out))
    assert v.returncode == 0 and "partial" in v.stdout.lower()


def test_full_disk_is_a_clear_error_and_keeps_data(tmp_path, example_spec, monkeypatch):
    """A capture whose disk fills up stops writing, keeps what it wrote, and says so."""
    from click.testing import CliRunner

    import precisiondiff.store.writer as writer
    from precisiondiff.cli import cli

    real = writer._save_safetensors
    calls = {"n": 0}

    def failing_save(tensors, path, *a, **k):
        calls["n"] += 1
        if calls["n"] >= 2:
            raise OSError(28, "No space left on device")
        return real(tensors, path, *a, **k)

    monkeypatch.setattr(writer, "_save_safetensors", failing_save)
    out = tmp_path / "full"
    r = CliRunner().invoke(cli, ["capture", example_spec, "-o", str(out), "--mode", "tensors",
                                 "--steps", "0-3"])
    assert r.exit_code == 2, r.output
    assert "disk full" in r.output and "Traceback" not in r.output
    dump = store.load(out)
    assert dump.complete is False
    kept = list(dump.events())
    assert kept and all(dump.tensor(t.key) is not None for e in kept for t in e.tensors if t.has_data)


def test_a_script_that_raises_keeps_what_it_recorded(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text(textwrap.dedent("""
        import torch
        from torch import nn
        model = nn.Linear(4, 2)
        for _ in range(3):
            model(torch.randn(2, 4))
        raise RuntimeError("data loader exploded")
    """))
    out = tmp_path / "b"
    r = pd_cli("capture", "--script", str(script), "-o", str(out), "--mode", "tensors", "--level", "module")
    assert r.returncode == 2 and "data loader exploded" in r.stderr and "kept" in r.stderr
    dump = store.load(out)
    assert dump.complete is False
    assert len([e for e in dump.events() if e.name == "Linear"]) == 3
    assert dump.meta["argv"][0].endswith(("__main__.py", "precisiondiff")) and "--script" in dump.meta["argv"]


def test_a_failed_overwrite_keeps_the_previous_dump(tmp_path, example_spec):
    bad = tmp_path / "wl.py"
    bad.write_text("import torch, precisiondiff\nfrom torch import nn\n"
                   "class M(nn.Module):\n    def forward(self, x):\n        raise ValueError('boom')\n"
                   "def build():\n    return precisiondiff.Workload(M(), torch.randn(2))\n")
    out = tmp_path / "d"
    assert pd_cli("capture", example_spec, "-o", str(out), "--level", "module").returncode == 0
    r = pd_cli("capture", f"{bad}:build", "-o", str(out), "--overwrite")
    assert r.returncode == 2 and "untouched" in r.stderr and "boom" in r.stderr
    dump = store.load(out)
    assert dump.complete and dump.meta["workload"] == example_spec
    assert (tmp_path / "d.failed" / "meta.json").is_file()
    ok = pd_cli("capture", example_spec, "-o", str(out), "--level", "op", "--overwrite")
    assert ok.returncode == 0 and store.load(out).meta["level"] == "op" and not (tmp_path / "d.new").exists()


def test_workload_and_script_together_are_refused(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    r = pd_cli("capture", "x.py:build", "--script", str(script), "-o", str(tmp_path / "o"))
    assert r.returncode == 2 and "not both" in r.stderr and not (tmp_path / "o").exists()
    ok = pd_cli("capture", "--script", str(script), "-o", str(tmp_path / "p"), "--", "x.py:build")
    assert ok.returncode == 0 and "ran" in ok.stdout
