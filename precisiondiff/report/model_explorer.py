"""A comparison as a Google Model Explorer overlay (optional extra ``explorer``:
``ai-edge-model-explorer``).

``precisiondiff report A B --model-explorer out.json`` exports the workload's model with
``torch.export`` (core ATen, float32, on the CPU), converts it with Model Explorer's own adapter
for an ExportedProgram, and writes two files:

- ``out.json``: the node-data overlay (Model Explorer's ``ModelNodeData`` format): for every
  graph node, the normwise relative error ``||a - b|| / ||b||`` of the DUT (dump A) against the
  reference (dump B), coloured by thresholds in units of the DUT dtype's unit roundoff ``u``
  (``<= u``, ``<= 4u``, ``<= 16u``, ``<= 64u``, more). A node takes the error of the captured op
  it matches — same module scope, op name and call index, forward, ``output.0``, first step —
  and, when no captured op matches (ops that the export spells otherwise), the error of the
  output of the innermost layer it belongs to. With ``bisect=`` (a bisect JSON), the culprit's
  node (or, for a module culprit or a backward op, every node of its module) is painted red.
- ``out.graph.json``: the graph in Model Explorer's JSON graph format, so it opens in a fresh
  process without the workload's custom ops registered::

      model-explorer out.graph.json --node_data_paths=out.json

The workload is the one recorded in A's ``meta.json`` (``precisiondiff capture WORKLOAD``),
rebuilt with the same seed, or ``workload=`` (``--workload``) for a captured script.
"""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..errors import PrecisionDiffError

__all__ = ["write_overlay", "export_graph", "node_errors", "GRAPH_ID"]

GRAPH_ID = "graph"  # the id Model Explorer's ExportedProgram adapter gives its one graph
CULPRIT_COLOR = "#b2182b"
# colours for <= u, 4u, 16u, 64u and beyond, u the unit roundoff of the DUT's dtype
_COLORS = ("#1a9850", "#91cf60", "#fee08b", "#fc8d59", "#d73027")
_UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11,
                  "bfloat16": 2.0 ** -8, "float8_e4m3fn": 2.0 ** -4, "float8_e5m2": 2.0 ** -3}


def _require_explorer() -> Any:
    try:
        from model_explorer import node_data_builder
        from model_explorer.pytorch_exported_program_adapter_impl import PytorchExportedProgramAdapterImpl
    except ImportError as err:
        raise PrecisionDiffError("--model-explorer needs Model Explorer: pip install "
                                 "'precisiondiff[explorer]' (or pip install ai-edge-model-explorer)") from err
    return node_data_builder, PytorchExportedProgramAdapterImpl


def export_graph(spec: Any, *, seed: int = 0) -> Any:
    """Build the workload ``spec`` (seeded) and export its model: a core-ATen ExportedProgram.

    Raises:
        PrecisionDiffError: the workload cannot be built, or torch.export cannot export it.
    """
    import torch

    from ..runtime.workload import load_workload
    w = load_workload(spec, seed=seed)
    model = w.model.eval()
    args, kwargs = ((), dict(w.inputs)) if isinstance(w.inputs, dict) else \
        ((tuple(w.inputs) if isinstance(w.inputs, (tuple, list)) else (w.inputs,)), {})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch.export's own deprecations
            warnings.simplefilter("ignore", UserWarning)
            return torch.export.export(model, args, kwargs).run_decompositions()
    except Exception as err:  # the user's model: report it, not as our bug
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise PrecisionDiffError(f"torch.export could not export the model of {w.name} for the Model "
                                 f"Explorer graph: {type(err).__name__}: {first}") from err


def _node_scope(node: Any) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def _graph_ops(ep: Any) -> List[Tuple[str, str, str, int]]:
    """(node id, scope, op name, call index) of every call in the graph, in graph order."""
    calls: Dict[Tuple[str, str], int] = {}
    out = []
    for node in ep.graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        scope = _node_scope(node)
        # an OpOverload prints as the capture names it ("aten.addmm.default"); getitem by name
        name = str(node.target) if hasattr(node.target, "_schema") else getattr(node.target, "__name__", str(node.target))
        call = calls[(scope, name)] = calls.get((scope, name), -1) + 1
        out.append((node.name, scope, name, call))
    return out


def node_errors(comparison: Any, ep: Any) -> Dict[str, Dict[str, Any]]:
    """Node id -> ``{"error", "source"}``: the matched op row's error (``source: "op"``) or the
    innermost layer's output error (``source: "layer"``); nodes with neither are left out."""
    rows = [r for r in comparison.rows if r.direction == "forward" and r.slot == "output.0"
            and r.verdict != "unmatched" and r.error is not None and r.rank == 0]
    step = min((r.step for r in rows), default=0)
    ops = {(r.scope, r.name, r.call): r for r in rows if r.kind == "op" and r.step == step}
    layers = {r.scope: r for r in rows if r.kind == "module" and r.step == step and r.call == 0}
    out: Dict[str, Dict[str, Any]] = {}
    for node_id, scope, name, call in _graph_ops(ep):
        row = ops.get((scope, name, call))
        source = "op"
        if row is None:
            source, s = "layer", scope
            while row is None:
                row = layers.get(s)
                if not s:
                    break
                s = s.rpartition(".")[0]
        if row is not None:
            out[node_id] = {"error": row.error, "source": source, "key": row.key, "verdict": row.verdict}
    return out


def _culprit_nodes(culprit: Optional[Mapping[str, Any]], ep: Any) -> List[str]:
    if not culprit:
        return []
    graph = _graph_ops(ep)
    scope = culprit.get("scope") or ""
    if culprit.get("kind") == "op" and culprit.get("direction", "forward") == "forward":
        exact = [n for n, s, name, call in graph
                 if (s, name, call) == (scope, culprit.get("name"), int(culprit.get("call") or 0))]
        if exact:
            return exact
    return [n for n, s, _, _ in graph if s == scope or (scope and s.startswith(scope + ".")) or not scope]


def _bisect_culprit(bisect: Any) -> Optional[Mapping[str, Any]]:
    if bisect is None:
        return None
    if isinstance(bisect, (str, Path)):
        try:
            bisect = json.loads(Path(bisect).read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise PrecisionDiffError(f"cannot read the bisect JSON {bisect}: {err}; write one with "
                                     "`precisiondiff bisect ... --format json -o FILE`") from err
    if hasattr(bisect, "to_json"):
        bisect = bisect.to_json()
    if not isinstance(bisect, Mapping) or "verdict" not in bisect:
        raise PrecisionDiffError("the bisect JSON has no verdict: pass the output of "
                                 "`precisiondiff bisect ... --format json -o FILE`")
    return bisect.get("culprit")


def _unit_roundoff(comparison: Any) -> float:
    dtypes = [r.dtype_a for r in comparison.rows if r.dtype_a in _UNIT_ROUNDOFF]
    return _UNIT_ROUNDOFF[max(set(dtypes), key=dtypes.count)] if dtypes else 2.0 ** -8


def write_overlay(comparison: Any, out: "str | Path", *, workload: Any = None, bisect: Any = None,
                  ep: Any = None) -> Dict[str, Any]:
    """Write the Model Explorer overlay of ``comparison`` to ``out`` and the graph beside it.

    Args:
        comparison: a :class:`~precisiondiff.compare.comparison.Comparison` (A: the DUT).
        out: the overlay file (``.json``); the graph goes to ``<stem>.graph.json``.
        workload: the workload spec whose model is exported (default: A's recorded workload).
        bisect: a :class:`~precisiondiff.bisect.BisectResult`, its JSON dict, or a JSON file:
            its culprit is painted red.
        ep: an ExportedProgram to use instead of exporting the workload.

    Returns:
        ``{"overlay", "graph", "nodes", "graph_nodes", "culprit_nodes"}``.

    Raises:
        PrecisionDiffError: Model Explorer is missing, no workload is known, the export fails,
            or a file cannot be written.

    Example:
        >>> write_overlay(precisiondiff.compare("runs/dut", "runs/ref"), "runs/me.json")  # doctest: +SKIP
    """
    ndb, Adapter = _require_explorer()
    from model_explorer.consts import DEFAULT_SETTINGS
    from model_explorer.utils import convert_adapter_response, remove_none
    culprit = _bisect_culprit(bisect)
    spec = workload or comparison.meta_a.get("workload")
    label = spec or "model"
    if ep is None:
        if not spec or str(spec).startswith("--script"):
            raise PrecisionDiffError("--model-explorer needs the workload whose model to export: A records "
                                     f"none{' (a captured script)' if spec else ''}; pass --workload FILE.py:fn")
        try:
            ep = export_graph(spec, seed=int(comparison.meta_a.get("seed") or 0))
        except PrecisionDiffError as err:
            if workload:
                raise
            raise PrecisionDiffError(f"{err} (the workload recorded in A's meta.json: run from the directory "
                                     "it was captured in, or pass --workload)") from err
    graphs = Adapter(ep, dict(DEFAULT_SETTINGS)).convert()
    graph_nodes = {n.id for g in graphs["graphs"] for n in g.nodes}
    errors = node_errors(comparison, ep)
    marked = set(_culprit_nodes(culprit, ep))
    results = {}
    for node_id, e in errors.items():
        if math.isfinite(e["error"]):
            results[node_id] = ndb.NodeDataResult(value=float(e["error"]))
    for node_id in marked:
        value = results[node_id].value if node_id in results else 0.0
        results[node_id] = ndb.NodeDataResult(value=value, bgColor=CULPRIT_COLOR, textColor="white")
    u = _unit_roundoff(comparison)
    thresholds = [ndb.ThresholdItem(value=u * k, bgColor=c) for k, c in zip((1, 4, 16, 64), _COLORS)]
    thresholds.append(ndb.ThresholdItem(value=1e300, bgColor=_COLORS[-1]))
    data = ndb.GraphNodeData(results=results, name="precisiondiff: relative error", thresholds=thresholds)
    out = Path(out)
    graph_file = out.with_name(out.name[:-5] + ".graph.json" if out.name.endswith(".json") else out.name + ".graph.json")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        ndb.ModelNodeData(graphsData={GRAPH_ID: data}).save_to_file(str(out))
        # a GraphCollection ({"label", "graphs"}): the JSON graph format Model Explorer's web app loads
        collection = {"label": str(label), "graphs": remove_none(convert_adapter_response(graphs))["graphs"]}
        graph_file.write_text(json.dumps(collection), encoding="utf-8")
    except OSError as err:
        raise PrecisionDiffError(f"cannot write {out}: {err.strerror or err}; choose a writable path") from err
    return {"overlay": str(out), "graph": str(graph_file), "nodes": len(results),
            "graph_nodes": len(graph_nodes), "culprit_nodes": sorted(marked)}
