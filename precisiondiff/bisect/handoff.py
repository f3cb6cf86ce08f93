"""``precisiondiff repro RESULT.json -o DIR``: the repro of a bisect result's culprit, from the
replay dump the result names (``culprit.dump``, which offline bisect keeps)."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

from ..errors import BisectError
from ..runtime.targets import Target
from ..store import load
from .offline import events_from_dump
from .repro import case_from_event, write_repro

__all__ = ["repro_from_result"]


def repro_from_result(result_json: Dict[str, Any], out_dir: "str | os.PathLike", *,
                      max_elements: Optional[int] = None) -> List[Tuple[str, int]]:
    """``precisiondiff repro RESULT.json``: the culprit's repro from the replay dump the bisect read
    (``culprit.dump``, kept by offline bisect).

    Raises:
        BisectError: no op culprit, or a result that names no dump (live bisect: use ``--repro DIR``).
    """
    culprit = result_json.get("culprit") or {}
    if not culprit:
        raise BisectError(f"the result's verdict is {result_json.get('verdict')!r}: no culprit to reproduce")
    dump_path = culprit.get("dump")
    if not dump_path:
        raise BisectError("the result names no dump (a live bisect keeps its step in memory only): rerun it "
                          "with --repro DIR, or bisect a replay dump (capture --mode replay) and repro that result")
    if not os.path.isfile(os.path.join(dump_path, "meta.json")):
        raise BisectError(f"the culprit's dump {dump_path} is not there (moved?): bisect it again from where it lies")
    dump = load(dump_path)
    match = [e for e in events_from_dump(dump) if (e.kind, e.scope, e.name, e.direction, e.call) ==
             ("op", culprit.get("scope"), culprit.get("name"), culprit.get("direction"), culprit.get("call"))]
    if not match:
        raise BisectError(f"{dump_path} holds no event {culprit.get('name')} in {culprit.get('scope') or '<root>'} "
                          f"(call {culprit.get('call')}): not the dump this result came from")
    ref = str(result_json.get("ref") or "cpu/float64")
    ref_t = Target.parse(ref)
    case = case_from_event(match[0], culprit, target=str(result_json.get("dut")), ref_device=ref_t.device,
                           ref_dtype=ref_t.dtype)
    return write_repro(case, out_dir, max_elements=max_elements)
