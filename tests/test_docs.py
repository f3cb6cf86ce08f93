"""The README's Python example runs as written (with a small model and input defined)."""
import os
import re

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_python_example_runs(tmp_path, monkeypatch, capsys):
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        text = fh.read()
    block = re.search(r"```python\n(import precisiondiff\n.*?)```", text, re.S).group(1)
    os.symlink(os.path.join(ROOT, "examples"), tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    scope = {"model": torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh()), "x": torch.randn(2, 4)}
    exec(compile(block, "README.md", "exec"), scope)
    out = capsys.readouterr().out
    assert "kernel" in out and "pdexample.fused_rms_norm.default" in out
    assert scope["dump"].meta["mode"] == "tensors"
