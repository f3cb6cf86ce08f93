"""Bisect cost on the 12-layer example transformer: forward-equivalents and wall time / forward."""
from __future__ import annotations

import json
import sys
import time

from precisiondiff.bisect import bisect


def main() -> None:
    spec = sys.argv[1] if len(sys.argv) > 1 else "examples/tiny_transformer.py:build_12_layers"
    start = time.perf_counter()
    r = bisect(spec, target="cpu/bf16")
    wall = time.perf_counter() - start
    c = r.cost
    print(json.dumps({"workload": spec, "verdict": r.verdict, "forward_equivalents": c["forward_equivalents"],
                      "wall_s": round(wall, 2), "plain_forward_s": c["plain_forward_s"],
                      "wall_over_forward": c["wall_over_forward"], "units_isolated": c["units_isolated"],
                      "ops_replayed": c["ops_replayed"], "ops_per_forward": c["ops_per_forward"]}, indent=1))


if __name__ == "__main__":
    main()
