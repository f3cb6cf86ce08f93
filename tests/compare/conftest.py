"""Fixtures: the example captured on cpu/bf16 and cpu/float64 (cached per level and mode),
and synthetic dumps written with the DumpWriter."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import pytest

from precisiondiff.store import DumpWriter, tensor_key

_CACHE: Dict[tuple, str] = {}


@pytest.fixture(scope="session")
def capture_example(tmp_path_factory, example_spec):
    """capture_example(target, level, mode, spec=None) -> dump path (cached for the session)."""
    from precisiondiff.capture.runner import capture_workload

    def run(target: str, level: str = "all", mode: str = "tensors", spec: Optional[str] = None,
            repeat: int = 1) -> str:
        key = (target, level, mode, spec, repeat)
        if key not in _CACHE:
            out = tmp_path_factory.mktemp("dump") / target.replace("/", "_")
            capture_workload(spec or example_spec, out, target=target, level=level, mode=mode,
                             repeat=repeat)
            _CACHE[key] = str(out)
        return _CACHE[key]
    return run


def write_dump(path, events: List[Dict[str, Any]], *, target: str = "cpu/bf16",
               meta: Optional[Dict[str, Any]] = None) -> str:
    """Write a stats-only dump: each event dict has scope, name, kind, direction and
    ``tensors``: {slot: stats dict} (dtype bfloat16, shape [4])."""
    with DumpWriter(path, meta={"target": target, "level": "all", "mode": "stats", **(meta or {})}) as w:
        calls: Dict[tuple, int] = {}
        for seq, ev in enumerate(events):
            ident = (ev.get("scope", ""), ev["name"], ev.get("direction", "forward"))
            call = calls[ident] = calls.get(ident, -1) + 1
            recs = [{"key": tensor_key(ident[0], ident[1], call, ident[2], slot), "slot": slot,
                     "dtype": ev.get("dtype", "bfloat16"), "shape": [4], "stats": stats,
                     "data_key": None} for slot, stats in ev["tensors"].items()]
            w.write_event({"seq": seq, "step": ev.get("step", 0), "kind": ev.get("kind", "op"),
                           "scope": ident[0], "name": ident[1], "direction": ident[2],
                           "call": call, "device": "cpu", "tensors": recs}, {})
    return str(path)


def stats(norm: float = 1.0, nan: int = 0, inf: int = 0, fp: Optional[str] = None) -> Dict[str, Any]:
    """Statistics of a small tensor with the given norm."""
    s = {"min": -norm / 2, "max": norm / 2, "mean": 0.0, "abs_mean": norm / 2, "norm": norm,
         "nan": nan, "inf": inf}
    if fp is not None:
        s["fingerprint"] = fp
    return s


def has_budgets() -> bool:
    import precisiondiff.comparators as C
    return all(hasattr(C, n) for n in ("compare_tensors", "budget_for", "op_class"))


needs_budgets = pytest.mark.skipif(not has_budgets(), reason="comparators budgets not available yet")
