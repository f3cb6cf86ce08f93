"""Fixtures: the planted workload captured on cpu/bf16 and cpu/float64 (once per session)."""
from __future__ import annotations

import os

import pytest

PLANTED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "planted.py") + ":build"


@pytest.fixture(scope="session")
def planted_spec() -> str:
    return PLANTED


@pytest.fixture(scope="session")
def planted_dumps(tmp_path_factory):
    """(dut, ref): the planted workload captured in tensors mode on cpu/bf16 and cpu/float64."""
    from precisiondiff.capture.runner import capture_workload
    root = tmp_path_factory.mktemp("planted")
    paths = []
    for name, target in (("dut", "cpu/bf16"), ("ref", "cpu/float64")):
        capture_workload(PLANTED, root / name, target=target, level="all", mode="tensors")
        paths.append(str(root / name))
    return tuple(paths)
