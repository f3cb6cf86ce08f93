"""``precisiondiff probe --target mlu/bf16`` reports the device's planted numerics, and only them."""
from __future__ import annotations

import json

from click.testing import CliRunner

from precisiondiff.cli import cli

PROPERTIES = [("gemm", "accumulator_bits"), ("gemm", "subnormals"), ("cast:fp32->bf16", "rounding"),
              ("cast:fp32->bf16", "overflow"), ("mul", "subnormals")]


def _card(target: str) -> dict:
    result = CliRunner().invoke(cli, ["probe", "--target", target, "--ops", "gemm,cast,mul", "--format", "json"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return {(f["op"], f["prop"]): f["value"] for f in json.loads(result.output)["findings"]}


def test_probe_reports_the_planted_properties(standin):
    standin.plant(gemm_chunk=1, truncate_cast=True, ftz=True)
    card = _card("mlu/bf16")
    assert [card[p] for p in PROPERTIES] == [8, "flushed", "toward-zero", "saturate", "flushed"]


def test_without_plants_the_device_card_is_the_cpu_card(standin):
    mlu, cpu = _card("mlu/bf16"), _card("cpu/bf16")
    assert [mlu[p] for p in PROPERTIES] == [cpu[p] for p in PROPERTIES]
    assert mlu[("gemm", "accumulator_bits")] != 8 and mlu[("cast:fp32->bf16", "rounding")] != "toward-zero"
