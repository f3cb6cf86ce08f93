"""Print the CPU capabilities below this machine's own that PyTorch can be forced to take
(``ATEN_CPU_CAPABILITY``), one per line: ``make test-portability`` reruns the stock-kernel tests
under each, so a verdict is checked on every vector path this CPU can run, not only its widest.

On an AVX-512 machine: ``default`` and ``avx2``; on an AVX2 machine: ``default``; on a machine
without a vector path (or another architecture's widest path): ``default`` unless that is the
native one. A capability that does not take effect when forced is left out.
"""
from __future__ import annotations

import os
import subprocess
import sys

#: PyTorch's CPU capabilities, narrowest first, per architecture family.
ORDERS = (("default", "avx2", "avx512"), ("default", "sve256"), ("default", "vsx"), ("default", "zvector"))


def _forced(capability: str) -> str:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                         env=env, capture_output=True, text=True, check=False)
    return out.stdout.strip().lower()


def below_native() -> list:
    """The capabilities narrower than the native one that take effect when forced."""
    import torch
    native = torch.backends.cpu.get_cpu_capability().lower()
    order = next((o for o in ORDERS if native in o), ("default",))
    narrower = order[:order.index(native)] if native in order else ["default"]
    return [c for c in narrower if _forced(c) == c]


if __name__ == "__main__":
    print("\n".join(below_native()))
