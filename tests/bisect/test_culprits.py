"""Every offender, ranked: ``culprits`` in execution order, ``known`` stock findings, and accepted
findings (``accept=``, ``--accept``, ``--parity-accept``, ``[tool.precisiondiff] accept``)."""
from __future__ import annotations

import json
import os

import pytest

from precisiondiff.bisect import bisect
from precisiondiff.bisect import findings
from precisiondiff.errors import BisectError

from . import planted_pair

HERE = os.path.dirname(os.path.abspath(__file__))
SPEC = f"{os.path.join(HERE, 'planted_pair.py')}:two_bugs_workload"
FIRST, SECOND = "pdpair.first.default", "pdpair.second.default"


def _names(units):
    return [(u["name"], u["scope"]) for u in units]


@pytest.fixture(scope="module")
def plain():
    return bisect(planted_pair.two_bugs_workload, target="cpu/bf16")


def test_every_offender_is_listed_in_execution_order(plain):
    assert plain.verdict == "kernel"
    assert plain.culprit["name"] == FIRST and plain.culprit["scope"] == "a"
    assert _names(plain.culprits)[:2] == [(FIRST, "a"), (SECOND, "b")]
    assert plain.culprits[0] == plain.culprit and plain.culprits[1:] == plain.candidates
    assert all("peer" in u and u["peer"]["passed"] is False for u in plain.culprits[:2])
    data = json.loads(plain.dumps())
    assert _names(data["culprits"])[:2] == [(FIRST, "a"), (SECOND, "b")] and data["accepted"] == []
    from precisiondiff.bisect.render import summary_lines
    text = "\n".join(summary_lines(plain))
    assert "offending units" in text and f"2. op {SECOND} in b" in text


def test_an_accepted_finding_makes_the_next_the_culprit(plain):
    r = bisect(planted_pair.two_bugs_workload, target="cpu/bf16", accept=["pdpair.first"])
    assert r.culprit["name"] == SECOND and r.culprit["scope"] == "b"
    assert _names(r.accepted) == [(FIRST, "a")]
    assert FIRST not in [u["name"] for u in r.culprits]
    both = bisect(planted_pair.two_bugs_workload, target="cpu/bf16", accept=[FIRST, f"{SECOND}@b"])
    assert both.verdict != "kernel" and _names(both.accepted) == [(FIRST, "a"), (SECOND, "b")]


def test_an_accept_in_another_scope_does_not_apply():
    r = bisect(planted_pair.two_bugs_workload, target="cpu/bf16", accept=[f"{FIRST}@b"])
    assert r.culprit["name"] == FIRST and r.accepted == []


def test_accepts_from_pyproject_and_precisiondiff_toml(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text('[tool.precisiondiff]\naccept = ["pdpair.first"]\n')
    (tmp_path / "precisiondiff.toml").write_text('accept = ["pdpair.second@b"]\n')
    assert findings.configured_accepts() == ["pdpair.first", "pdpair.second@b"]
    r = bisect(planted_pair.two_bugs_workload, target="cpu/bf16")
    assert r.verdict != "kernel" and len(r.accepted) == 2
    (tmp_path / "precisiondiff.toml").write_text('accept = "pdpair.second"\n')
    with pytest.raises(BisectError, match="list of"):
        findings.configured_accepts()


@pytest.mark.parametrize("spec", ["", "@scope", "aten.mm@"])
def test_a_malformed_accept_is_one_clear_error(spec):
    with pytest.raises(BisectError, match="OP\\[@SCOPE\\]"):
        findings.parse_accepts([spec])


def test_a_documented_finding_is_annotated_known(monkeypatch):
    monkeypatch.setitem(findings.KNOWN_FINDINGS, FIRST, {
        "device": "cpu", "dtype": "bfloat16", "finding": "a stale scale on the bf16 path",
        "measured": "x(1 + 2^-4), planted"})
    r = bisect(planted_pair.two_bugs_workload, target="cpu/bf16", blame_known=True)
    assert r.culprit["known"].startswith("known: a stale scale") and "known" not in r.culprits[1]
    assert findings.known_finding(FIRST, "cuda", "bfloat16") is None


def test_a_documented_finding_is_passed_over_by_default(monkeypatch):
    """A documented stock finding of the DUT's backend is accepted, listed with its measurement: the
    next offender is the culprit; on another dtype the same op offends."""
    monkeypatch.setitem(findings.KNOWN_FINDINGS, FIRST, {
        "device": "cpu", "dtype": "bfloat16", "finding": "a stale scale on the bf16 path",
        "measured": "x(1 + 2^-4), planted"})
    r = bisect(planted_pair.two_bugs_workload, target="cpu/bf16")
    assert r.verdict == "kernel" and r.culprit["name"] == SECOND, r.culprit
    assert _names(r.accepted) == [(FIRST, "a")] and r.accepted[0]["known"].startswith("known: a stale scale")
    assert any("--blame-known" in n and FIRST in n for n in r.notes), r.notes
    monkeypatch.setitem(findings.KNOWN_FINDINGS, FIRST, dict(findings.KNOWN_FINDINGS[FIRST], dtype="float16"))
    assert bisect(planted_pair.two_bugs_workload, target="cpu/bf16").culprit["name"] == FIRST


def test_cli_accept_and_exit_codes(tmp_path):
    from click.testing import CliRunner
    from precisiondiff.cli import cli
    out = tmp_path / "r.json"
    res = CliRunner().invoke(cli, ["bisect", SPEC, "--target", "cpu/bf16", "--accept", "pdpair.first",
                                   "--format", "json", "-o", str(out)])
    assert res.exit_code == 1, res.output
    data = json.loads(out.read_text())
    assert data["culprit"]["name"] == SECOND and _names(data["accepted"]) == [(FIRST, "a")]
    bad = CliRunner().invoke(cli, ["bisect", SPEC, "--target", "cpu/bf16", "--accept", "@x"])
    assert bad.exit_code == 2 and "OP[@SCOPE]" in bad.output and "Traceback" not in bad.output


def test_parity_check_passes_accepts_to_bisect():
    from precisiondiff.testing import parity
    r = parity.check(planted_pair.two_bugs_workload, target="cpu/bf16", kernels=True, accept=["pdpair.first"])
    assert not r.passed and r.bisect["culprit"]["name"] == SECOND


def test_plugin_option_and_marker_accept(pytester):
    pytester.syspathinsert(os.path.dirname(os.path.dirname(HERE)))
    pytester.makepyfile(test_it=f'''
import pytest
from tests.bisect import planted_pair

@pytest.mark.parity(kernels=True, accept=["pdpair.second"])
def test_pair(parity):
    r = parity.check(planted_pair.two_bugs_workload, expect=False)
    print("CULPRIT", r.bisect["culprit"], "ACCEPTED", [a["name"] for a in r.bisect["accepted"]])
    assert r.bisect["verdict"] != "kernel"
''')
    res = pytester.runpytest("-p", "no:cacheprovider", "--parity-target", "cpu/bf16", "--parity-accept",
                             "pdpair.first", "-s")
    res.assert_outcomes(passed=1)


def test_a_float32_dut_on_the_reference_device_is_warned_that_its_peer_is_itself():
    """cpu/float32 against cpu/float64: the emulated float32 peer is the DUT's own kernel."""
    from precisiondiff.bisect.live import self_peer_notes
    from precisiondiff.runtime import Target
    r = bisect(planted_pair.two_bugs_workload, target="cpu/float32")
    assert any(n.startswith("WARNING: the emulated float32 peer") for n in r.notes), r.notes
    assert not any("emulated float32 peer" in n for n in bisect(planted_pair.two_bugs_workload,
                                                                  target="cpu/bf16").notes)
    assert self_peer_notes(Target.parse("cuda/float32"), Target.parse("cpu/float64")) == []
    assert self_peer_notes(Target.parse("cuda/float32"), Target.parse("cuda:1/float64")) != []
