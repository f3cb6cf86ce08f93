"""Claims about this machine's own PyTorch CPU kernels that hold on every CPU capability.

Only what was checked by hand on the AVX512, AVX2 and default paths is asserted (docs/probe.md
lists what differs between them: erf, rsqrt, softmax and norm ULPs, fp16 NaN payloads), and each
capability runs in its own process because PyTorch picks it at start-up.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from precisiondiff.probe import Kernels, probe
from precisiondiff.probe.accumulator import SHORT, bits_kept, input_bits

CLAIMS = """
import json, torch
from precisiondiff.probe import Kernels
from precisiondiff.probe.accumulator import SHORT, bits_kept, input_bits
fp32, bf16 = Kernels.stock("cpu", torch.float32), Kernels.stock("cpu", torch.bfloat16)
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(),
                  "fp32_input_bits": input_bits(fp32, "gemm")[0],
                  "bf16_accumulator_bits": bits_kept(bf16, "gemm", SHORT)[0]}))
"""


def check(claims: dict) -> None:
    assert claims["fp32_input_bits"] == 24  # fp32 matmul inputs are not rounded to TF32
    assert claims["bf16_accumulator_bits"] >= 24  # bf16 GEMM accumulates in float32 or wider


def test_stock_gemm_claims_on_each_capability():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    runs = {}
    for capability in ("default", "avx2"):  # side by side: one process each, started together
        env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
        runs[capability] = subprocess.Popen([sys.executable, "-c", CLAIMS], stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, text=True, env=env)
    for capability, proc in runs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        claims = json.loads(out.strip().splitlines()[-1])
        assert claims["capability"] in (capability.upper(), "DEFAULT")  # a CPU without AVX2 falls back
        check(claims)


def test_stock_gemm_claims_here():
    fp32, bf16 = Kernels.stock("cpu", torch.float32), Kernels.stock("cpu", torch.bfloat16)
    check({"fp32_input_bits": input_bits(fp32, "gemm")[0],
           "bf16_accumulator_bits": bits_kept(bf16, "gemm", SHORT)[0]})


def test_the_card_of_this_cpu_states_them_too():
    card = probe("cpu/fp32", ["gemm"])
    assert card.get("gemm", "input_bits") == 24
    assert card.meta["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
