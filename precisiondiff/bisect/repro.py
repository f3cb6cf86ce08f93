"""A repro the kernel team can run: the culprit op as a standalone script and its data.

:func:`write_repro` writes a directory::

    repro.py          needs only torch (and the device's extension); exits 1 while wrong, 0 once fixed
    test_repro.py     the same finding through the pytest plugin's ``check_op``
    case.json         the op, its encoded arguments, the target, the finding and the bounds
    case.safetensors  the recorded inputs (``input.N``), the float64 golden (``golden.output.N``),
                      the per-element unit of the max rule (``scale.output.N``), the DUT's outputs

The bounds are the peer rule's (docs/comparators.md, "The peer rule"), measured when the verdict
was made: the relative L2 bound ``factor * peer_error + floor`` and the max bound
``factor * peer_max_error + 1`` in units of ``scale``. A fixed kernel meets both. With
``max_elements`` a GEMM (``mm``, ``addmm``, ``bmm``) or an element-wise op is cut to the rows
(or elements) holding its failing elements; a slice is judged by the max rule only (the L2
bound belongs to the whole tensor).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..capture.serialize import encode_call
from ..comparators.peers import MAX_FLOOR, element_scale
from ..errors import BisectError
from .repro_script import PYTEST, SCRIPT

__all__ = ["ReproOutput", "ReproCase", "write_repro", "case_from_event", "case_from_call", "write_culprit_repro"]

_GEMMS = {"aten.mm.default": 0, "aten.addmm.default": 1, "aten.bmm.default": 0}  # op -> index of the row operand


@dataclass
class ReproOutput:
    """One judged output of the culprit: its golden, its scale and the verdict's numbers."""

    slot: str
    index: int
    golden: torch.Tensor
    scale: torch.Tensor
    dut: torch.Tensor
    verdict: Dict[str, Any]  # the peer verdict (PeerVerdict.as_dict())


@dataclass
class ReproCase:
    """Everything a repro holds (see the module docstring)."""

    op: str
    args: Any
    kwargs: Any
    tensors: Dict[str, torch.Tensor]
    outputs: List[ReproOutput]
    target: str
    ref: str
    finding: Dict[str, Any] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)


def _bounds(v: Dict[str, Any]) -> Dict[str, Any]:
    f = float(v.get("factor") or 0.0)
    return {"bound": float(v.get("bound") or 0.0), "max_bound": f * float(v.get("peer_max_error") or 0.0) + MAX_FLOOR,
            "error": float(v.get("error") or 0.0), "max_error": float(v.get("max_error") or 0.0),
            "peer_error": float(v.get("peer_error") or 0.0), "factor": f, "floor": float(v.get("floor") or 0.0),
            "peers": {k: (float(x) if isinstance(x, (int, float)) else None) for k, x in (v.get("peers") or {}).items()}}


def _slots_used(encoded: Any) -> List[str]:
    """The tensor slots an encoded argument list refers to, in argument order."""
    if isinstance(encoded, dict):
        return [encoded["t"]] if "t" in encoded else [s for v in encoded.values() for s in _slots_used(v)]
    if isinstance(encoded, list):
        return [s for v in encoded for s in _slots_used(v)]
    return []


def _contiguous(encoded: Any, slots: "set[str]") -> None:
    """A sliced argument cannot keep the recorded layout of the whole: drop it (contiguous)."""
    if isinstance(encoded, dict):
        if encoded.get("t") in slots:
            for key in ("stride", "offset", "s"):
                encoded.pop(key, None)
        else:
            for v in encoded.values():
                _contiguous(v, slots)
    elif isinstance(encoded, list):
        for v in encoded:
            _contiguous(v, slots)


def _failing_rows(out: ReproOutput, scale: torch.Tensor) -> torch.Tensor:
    """Indices along dim 0 of the output holding elements over the max bound."""
    d = out.dut.to(torch.float64)
    err = ((d - out.golden.to(torch.float64)).abs() / scale).nan_to_num(nan=float("inf"))
    bad = err > _bounds(out.verdict)["max_bound"]
    return (bad.flatten(1).any(dim=1) if bad.dim() > 1 else bad).nonzero().flatten()


def _slice(case: ReproCase, max_elements: int) -> bool:
    """Cut the case to its failing rows (GEMMs: rows of the row operand, batches of bmm) or
    elements (same-shape element-wise ops); whether it was cut (a note says why not)."""
    if sum(t.numel() for t in case.tensors.values()) <= max_elements:
        return False
    if len(case.outputs) != 1:
        case.notes.append(f"not sliced: {case.op} has several judged outputs")
        return False
    out = case.outputs[0]
    slots = _slots_used(case.args)
    if case.op in _GEMMS:
        rows_of = {slots[_GEMMS[case.op]]} if case.op != "aten.bmm.default" else set(slots)
        rows_of |= {s for s in slots if case.op == "aten.addmm.default" and case.tensors[s].dim() == 2
                    and case.tensors[s].shape[0] == out.dut.shape[0] and s != slots[2]}
    elif all(t.shape == out.dut.shape for t in case.tensors.values()):
        rows_of = set(case.tensors)
    else:
        case.notes.append(f"not sliced: no slicing rule for {case.op} (only GEMMs and same-shape element-wise ops)")
        return False
    flat = case.op not in _GEMMS  # an element-wise op is cut element by element
    shape = (out.dut.numel(),) if flat else out.dut.shape
    scale = out.scale.reshape(shape)
    failing = _failing_rows(ReproOutput(out.slot, out.index, out.golden.reshape(shape), scale,
                                        out.dut.reshape(shape), out.verdict), scale)
    if failing.numel() == 0:
        case.notes.append("not sliced: no element exceeds the max bound (the L2 rule decided, on the whole tensor)")
        return False
    if flat:
        for name in rows_of:
            case.tensors[name] = case.tensors[name].flatten()
        out.dut, out.golden = out.dut.flatten(), out.golden.flatten()
    per_row = sum(case.tensors[s][0].numel() for s in rows_of)
    fixed = sum(t.numel() for s, t in case.tensors.items() if s not in rows_of)
    rows = failing[: max(1, (max_elements - fixed) // max(per_row, 1))]
    for name in rows_of:
        case.tensors[name] = case.tensors[name].index_select(0, rows)
    _contiguous(case.args, rows_of)
    out.dut, out.golden, out.scale = (t.index_select(0, rows) for t in (out.dut, out.golden, scale))
    written = sum(t.numel() for t in case.tensors.values())
    case.notes.append(f"sliced to {rows.numel()} of the {failing.numel()} failing rows ({written} input elements for "
                      f"max_elements {max_elements}): judged by the max rule only (the L2 bound belongs to the whole tensor)")
    return True


def write_repro(case: ReproCase, out_dir: "str | os.PathLike", *, max_elements: Optional[int] = None
                ) -> List[Tuple[str, int]]:
    """Write the repro directory; returns ``[(path, bytes)]`` of its files.

    Raises:
        BisectError: the directory cannot be written.
    """
    from safetensors.torch import save_file
    sliced = max_elements is not None and _slice(case, max_elements)
    data: Dict[str, torch.Tensor] = {slot: t.detach().cpu().contiguous() for slot, t in case.tensors.items()}
    outputs = []
    for o in case.outputs:
        data[f"golden.{o.slot}"] = o.golden.detach().cpu().to(torch.float64).contiguous()
        data[f"scale.{o.slot}"] = o.scale.detach().cpu().to(torch.float64).reshape(o.dut.shape).contiguous()
        data[f"dut.{o.slot}"] = o.dut.detach().cpu().contiguous()
        outputs.append({"slot": o.slot, "index": o.index, "l2_judged": not sliced, **_bounds(o.verdict)})
    device = case.target.partition("/")[0]
    meta = {"op": case.op, "args": case.args, "kwargs": case.kwargs, "target": case.target, "device": device,
            "ref": case.ref, "finding": case.finding, "outputs": outputs, "notes": case.notes,
            "written_by": "precisiondiff repro"}
    try:
        os.makedirs(out_dir, exist_ok=True)
        paths = {name: os.path.join(out_dir, name) for name in ("repro.py", "test_repro.py", "case.json", "case.safetensors")}
        save_file(data, paths["case.safetensors"])
        with open(paths["case.json"], "w", encoding="utf-8") as fh:
            json.dump(meta, fh, indent=1, default=str)
        for name, text in (("repro.py", SCRIPT), ("test_repro.py", PYTEST)):
            with open(paths[name], "w", encoding="utf-8") as fh:
                fh.write(text)
    except OSError as err:
        raise BisectError(f"cannot write the repro into {out_dir}: {err.strerror or err}") from err
    return [(p, os.path.getsize(p)) for p in paths.values()]


def _outputs_from(verdicts: Dict[str, Dict[str, Any]], golden: List[torch.Tensor], dut: Dict[str, torch.Tensor],
                  magnitudes: Optional[List[torch.Tensor]], ks: List[Optional[int]], dtype: torch.dtype
                  ) -> List[ReproOutput]:
    outs = []
    for slot, verdict in verdicts.items():
        i = int(slot.rpartition(".")[2]) if slot.rpartition(".")[2].isdigit() else 0
        g = golden[i]
        mag = magnitudes[i] if magnitudes is not None and i < len(magnitudes) else None
        k = ks[i] if i < len(ks) else None
        flat = g.detach().to(torch.float64).flatten()
        # the unit of judge_against_peers: non-finite golden elements count as 0
        scale = element_scale(torch.where(torch.isfinite(flat), flat, torch.zeros_like(flat)), dtype,
                              magnitude=mag.flatten() if mag is not None else None, k=k)
        outs.append(ReproOutput(slot, i, g.detach().cpu(), scale.cpu(), dut[slot].detach().cpu(), verdict))
    return outs


def case_from_event(ev: Any, culprit: Dict[str, Any], *, target: str, ref_device: str = "cpu",
                    ref_dtype: torch.dtype = torch.float64) -> ReproCase:
    """The repro of an op culprit from its recorded event (a :class:`~.isolate.UnitEvent`).

    Raises:
        BisectError: the culprit is not an op judged by the peer rule, or was not recorded in replay mode.
    """
    from ..comparators.accumulation import magnitude_op
    from ..comparators.peers import compute_dtype
    from .isolate import Unreplayable, replay_op
    if culprit.get("kind") != "op" or not culprit.get("peer"):
        raise BisectError(f"a repro needs an op culprit judged by the peer rule; this culprit is a "
                          f"{culprit.get('kind')} ({culprit.get('name')})")
    try:
        # the op on |inputs| widens the unit only for the ops the judge used it for
        rep = replay_op(ev, device=ref_device, dtype=ref_dtype, magnitude=magnitude_op(ev.name))
    except Unreplayable as err:
        raise BisectError(f"cannot write a repro of {ev.name}: {err}") from err
    slot = culprit.get("slot") or "output.0"
    dut_out = ev.load(slot).detach().cpu()
    in_dtypes = [getattr(torch, info[0]) for s, info in ev.slots.items()
                 if s.startswith("input.") and getattr(getattr(torch, info[0], None), "is_floating_point", False)]
    cdt = compute_dtype(dut_out.dtype, in_dtypes)
    outputs = _outputs_from({slot: culprit["peer"]}, rep.golden, {slot: dut_out}, rep.magnitudes, rep.ks, cdt)
    tensors = {s: ev.load(s).detach().cpu() for s in _slots_used(ev.args.get("args", [])) +
               _slots_used(ev.args.get("kwargs", {}))}
    finding = {k: culprit.get(k) for k in ("kind", "scope", "name", "direction", "call", "message")}
    return ReproCase(ev.name, ev.args.get("args", []), ev.args.get("kwargs", {}), tensors, outputs, target,
                     f"{ref_device}/{str(ref_dtype).removeprefix('torch.')}", finding)


def case_from_call(op: Any, args: Any, kwargs: Any, actual: List[torch.Tensor], golden: List[torch.Tensor],
                   verdicts: Dict[int, Dict[str, Any]], magnitudes: Optional[List[torch.Tensor]],
                   ks: List[Optional[int]], *, target: str, ref: str, dtype: torch.dtype) -> ReproCase:
    """The repro of a failing ``check_op`` call: an ATen overload ``op`` on the DUT's inputs."""
    tensors: Dict[str, torch.Tensor] = {}

    def slot_of(t: torch.Tensor) -> str:
        name = f"input.{len(tensors)}"
        tensors[name] = t.detach().cpu()
        return name
    encoded = encode_call(list(args), dict(kwargs), slot_of)
    enc_args, enc_kwargs = encoded["args"], encoded["kwargs"]
    name = str(op)
    outputs = _outputs_from({f"output.{i}": v for i, v in verdicts.items()}, golden,
                            {f"output.{i}": actual[i] for i in verdicts}, magnitudes, ks, dtype)
    finding = {"kind": "op", "scope": "", "name": name, "direction": "forward", "call": 0,
               "message": "; ".join(v.get("message", "") for v in verdicts.values())}
    return ReproCase(name, enc_args, enc_kwargs, tensors, outputs, target, ref, finding)


def write_culprit_repro(result: Any, ev: Any, out_dir: "str | os.PathLike", ref: Any,
                        max_elements: Optional[int] = None) -> None:
    """``bisect --repro DIR``: write the culprit's repro and say so in the result
    (``culprit.repro``: the directory and its files' sizes); a culprit that cannot have one (a
    module) gets a note instead."""
    try:
        case = case_from_event(ev, result.culprit, target=result.dut, ref_device=ref.device, ref_dtype=ref.dtype)
        files = write_repro(case, out_dir, max_elements=max_elements)
    except BisectError as err:
        result.notes.append(f"no repro written: {err}")
        return
    result.culprit["repro"] = {"dir": os.path.abspath(os.fspath(out_dir)),
                               "files": {os.path.basename(p): n for p, n in files}, "notes": case.notes}
