"""report --model-explorer: the overlay is Model Explorer's own node-data format, keyed by the node
ids of Model Explorer's own ExportedProgram adapter, with the bisect culprit marked."""
from __future__ import annotations

import json
import sys

import pytest

import precisiondiff
from precisiondiff.errors import PrecisionDiffError
from precisiondiff.report.model_explorer import CULPRIT_COLOR, GRAPH_ID, export_graph, write_overlay

pytest.importorskip("model_explorer")
from model_explorer import node_data_builder as ndb  # noqa: E402
from model_explorer.consts import DEFAULT_SETTINGS  # noqa: E402
from model_explorer.pytorch_exported_program_adapter_impl import PytorchExportedProgramAdapterImpl  # noqa: E402

GELU = "pdeco.rough_gelu.default"


@pytest.fixture(scope="module")
def overlay(planted_dumps, planted_spec, tmp_path_factory):
    c = precisiondiff.compare(*planted_dumps)
    culprit = {"verdict": "kernel", "culprit": {"kind": "op", "scope": "blocks.0", "name": GELU,
                                                "direction": "forward", "call": 0}}
    out = tmp_path_factory.mktemp("me") / "overlay.json"
    written = write_overlay(c, out, bisect=culprit)
    return c, written, json.loads(out.read_text())


def _load_with_model_explorer(obj: dict) -> "ndb.GraphNodeData":
    """Rebuild the overlay with Model Explorer's dataclasses: unknown or missing fields raise."""
    data = dict(obj)
    data["results"] = {k: ndb.NodeDataResult(**v) for k, v in obj["results"].items()}
    data["thresholds"] = [ndb.ThresholdItem(**t) for t in obj.get("thresholds", [])]
    return ndb.GraphNodeData(**data)


def test_the_overlay_is_model_explorers_format_on_its_adapters_node_ids(overlay, planted_spec):
    c, written, obj = overlay
    assert list(obj) == [GRAPH_ID]
    data = _load_with_model_explorer(obj[GRAPH_ID])
    assert json.loads(ndb.ModelNodeData(graphsData={GRAPH_ID: data}).to_json_string()) == obj  # round trip
    graphs = PytorchExportedProgramAdapterImpl(export_graph(planted_spec), dict(DEFAULT_SETTINGS)).convert()
    node_ids = {n.id for n in graphs["graphs"][0].nodes}
    assert set(data.results) <= node_ids and len(data.results) == written["nodes"] > 0
    with open(written["graph"]) as fh:
        graph_file = json.load(fh)
    assert {n["id"] for n in graph_file["graphs"][0]["nodes"]} == node_ids


def test_each_op_node_carries_its_own_error_and_the_culprit_is_red(overlay):
    c, written, obj = overlay
    results = obj[GRAPH_ID]["results"]
    gelu_rows = sorted((r for r in c.rows if r.name == GELU and r.slot == "output.0"), key=lambda r: r.seq)
    assert [r.scope for r in gelu_rows] == ["blocks.0", "blocks.1"]
    # the export names the two custom-op nodes like its target; graph order = execution order
    gelu_nodes = [n for n in results if n.startswith("rough_gelu")]
    assert sorted(gelu_nodes) == ["rough_gelu", "rough_gelu_1"]
    assert [results[n]["value"] for n in sorted(gelu_nodes)] == pytest.approx([r.error for r in gelu_rows])
    assert written["culprit_nodes"] == ["rough_gelu"]
    assert results["rough_gelu"]["bgColor"] == CULPRIT_COLOR and "bgColor" not in results["rough_gelu_1"]
    addmm = [r for r in c.rows if r.name == "aten.addmm.default" and r.scope == "inp" and r.slot == "output.0"]
    assert results["addmm"]["value"] == pytest.approx(addmm[0].error)


def test_thresholds_are_in_units_of_the_dut_roundoff(overlay):
    thresholds = [t["value"] for t in overlay[2][GRAPH_ID]["thresholds"]]
    u = 2.0 ** -8  # bfloat16
    assert thresholds[:4] == pytest.approx([u, 4 * u, 16 * u, 64 * u])


def test_a_module_culprit_marks_every_node_of_its_module(planted_dumps, tmp_path):
    c = precisiondiff.compare(*planted_dumps)
    culprit = {"verdict": "kernel", "culprit": {"kind": "module", "scope": "blocks.1", "name": "Block"}}
    written = write_overlay(c, tmp_path / "o.json", bisect=culprit)
    assert "rough_gelu_1" in written["culprit_nodes"] and "rough_gelu" not in written["culprit_nodes"]
    assert len(written["culprit_nodes"]) >= 3  # fc1, gelu, fc2, the residual add


def test_without_a_recorded_workload_the_error_asks_for_one(planted_dumps, tmp_path):
    c = precisiondiff.compare(*planted_dumps)
    c.meta_a = {**c.meta_a, "workload": "--script train.py"}
    with pytest.raises(PrecisionDiffError, match="pass --workload"):
        write_overlay(c, tmp_path / "o.json")
    with pytest.raises(PrecisionDiffError, match="cannot read the bisect JSON"):
        write_overlay(c, tmp_path / "o.json", workload=c.meta_b["workload"], bisect=str(tmp_path / "none.json"))


def test_without_model_explorer_the_error_says_how_to_install_it(planted_dumps, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "model_explorer", None)
    with pytest.raises(PrecisionDiffError, match=r"pip install 'precisiondiff\[explorer\]'"):
        write_overlay(precisiondiff.compare(*planted_dumps), tmp_path / "o.json")


def test_report_cli_writes_the_overlay_and_marks_the_bisect_culprit(planted_dumps, tmp_path):
    from click.testing import CliRunner

    from precisiondiff.cli import cli
    bisect = tmp_path / "bisect.json"
    bisect.write_text(json.dumps({"verdict": "kernel", "culprit": {"kind": "op", "scope": "blocks.1", "name": GELU,
                                                                   "direction": "forward", "call": 0}}))
    out = tmp_path / "me" / "overlay.json"
    r = CliRunner().invoke(cli, ["report", *planted_dumps, "--model-explorer", str(out), "--bisect", str(bisect),
                                 "--no-progress"])
    assert r.exit_code == 1, r.output  # the planted GELU diverges
    assert f"model-explorer {tmp_path / 'me' / 'overlay.graph.json'} --node_data_paths={out}" in r.stderr
    results = json.loads(out.read_text())[GRAPH_ID]["results"]
    assert results["rough_gelu_1"]["bgColor"] == CULPRIT_COLOR and "bgColor" not in results["rough_gelu"]
    misuse = CliRunner().invoke(cli, ["report", *planted_dumps, "-o", str(tmp_path / "r.html"), "--bisect", str(bisect)])
    assert misuse.exit_code == 2 and "--workload and --bisect go with --model-explorer" in misuse.stderr
