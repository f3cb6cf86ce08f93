"""Bisect's copies of a unit keep a complex buffer complex (a RoPE table): the unit copied for the
float64 replay holds complex128, never the real part alone (Module.to(dtype) would cast it)."""
from __future__ import annotations

import warnings

import torch

import precisiondiff
from tests.capture.test_framework_mechanics import HERE


def test_bisect_of_a_rope_workload_never_drops_the_imaginary_part():
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Casting complex values to real")
        result = precisiondiff.bisect(f"{HERE}:rotary_workload", target="cpu/bf16")
    assert result.verdict in ("parity", "accumulated"), result.culprit


def test_the_unit_copied_for_the_reference_holds_a_complex128_table():
    from precisiondiff.bisect.isolate import _module_copy
    from tests.capture.test_framework_mechanics import Rotary

    class NoSlots:
        slots: dict = {}
        args: dict = {}
        scope = "rotary"
    model = Rotary()
    copy = _module_copy(model, NoSlots(), "cpu", torch.float64)
    assert copy.freqs_cis.dtype == torch.complex128 and copy.proj.weight.dtype == torch.float64
    assert torch.equal(copy.freqs_cis, model.freqs_cis.to(torch.complex128))
