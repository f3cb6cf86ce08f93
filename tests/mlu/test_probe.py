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


def test_bisect_explains_the_culprit_by_the_devices_card(standin, tmp_path):
    import os

    standin.plant(gemm_chunk=1)
    card = str(tmp_path / "mlu.json")
    probe = CliRunner().invoke(cli, ["probe", "--target", "mlu/bf16", "--ops", "gemm", "-o", card],
                               catch_exceptions=False)
    assert probe.exit_code == 0, probe.output
    example = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "examples", "tiny_transformer.py") + ":build"
    result = CliRunner().invoke(cli, ["bisect", example, "--target", "mlu/bf16", "--direction", "forward",
                                      "--card", card, "--format", "json"], catch_exceptions=False)
    culprit = json.loads(result.output)["culprit"]
    assert culprit["name"] == "aten.addmm.default"
    # the card's measured 8-bit GEMM accumulator, applied to this culprit's own K (the layer's width)
    assert culprit["card"].startswith("this device's bf16 gemm accumulates in 8 bits"), culprit["card"]
    assert f"K={culprit['budget']['k']}" in culprit["card"]
