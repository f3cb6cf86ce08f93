"""The HTML report: self-contained, escaped, plots, and rendered by headless Chromium."""
from __future__ import annotations

import os
import re
import subprocess

import pytest

from precisiondiff.compare import compare
from precisiondiff.report import plots
from precisiondiff.report.html import render_html

from .conftest import needs_budgets, stats, write_dump

CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def report_file(capture_example, tmp_path_factory):
    if not plots.available():
        pytest.skip("matplotlib is not installed")
    spec = os.path.join(os.path.dirname(__file__), "planted.py") + ":build_drift"
    a = capture_example("cpu/bf16", "all", "tensors", spec=spec)
    b = capture_example("cpu/float64", "all", "tensors", spec=spec)
    path = tmp_path_factory.mktemp("report") / "report.html"
    path.write_text(render_html(compare(a, b), worst=3), encoding="utf-8")
    return path


@needs_budgets
def test_report_is_self_contained_with_plots(report_file):
    text = report_file.read_text()
    assert text.count("<svg") >= 3 and '<table id="rows">' in text
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", text), "the report must not load anything"
    assert "first divergence" in text and "ULP distance histograms" in text


def test_strings_are_escaped_and_plots_are_optional(tmp_path, monkeypatch):
    evil = "<script>alert(1)</script>"
    a = write_dump(tmp_path / "a", [{"name": evil, "scope": "x&y", "tensors": {"output.0": stats(1.0)}}])
    b = write_dump(tmp_path / "b", [{"name": evil, "scope": "x&y", "tensors": {"output.0": stats(1.0)}}],
                   target="cpu/float64")
    monkeypatch.setattr(plots, "available", lambda: False)
    text = render_html(compare(a, b))
    assert evil not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text and "x&amp;y" in text
    assert "matplotlib is not installed" in text and "<svg" not in text


@needs_budgets
@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed")
def test_chromium_renders_table_and_plots_without_console_errors(report_file, tmp_path):
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
           f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", report_file.as_uri()]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    dom = res.stdout
    assert '<table id="rows">' in dom and dom.count("<tr") >= 20 and dom.count("<svg") >= 3
    console = [l for l in res.stderr.splitlines() if "CONSOLE" in l or "Uncaught" in l]
    assert not console, console
