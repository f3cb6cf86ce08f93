"""``bisect --script`` takes ``--accept`` like the other forms: the accepted finding is listed
in ``accepted``, judged but no longer the culprit."""
from __future__ import annotations

import textwrap

from precisiondiff.bisect.script import bisect_script
from tests.compare.test_mixed_precision import SCRIPT

PLANT = "pdcompare.rough_gelu.default"


def test_an_accepted_finding_of_a_script_gives_way(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    found = bisect_script(script, ["--planted"])
    assert found.verdict == "kernel" and found.culprit["name"] == PLANT
    assert found.culprits[0] == found.culprit and found.accepted == []
    accepted = bisect_script(script, ["--planted"], accept=[f"{PLANT}@{found.culprit['scope']}"])
    assert PLANT not in [c["name"] for c in accepted.culprits]
    assert [(a["name"], a["scope"]) for a in accepted.accepted] == [(PLANT, found.culprit["scope"])]
