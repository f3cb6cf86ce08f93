"""The CLI contract of DESIGN.md: command names and option names users script against."""
import pytest
from click.testing import CliRunner

from precisiondiff.cli import cli

CONTRACT = {
    "capture": ["-o", "--target", "--level", "--mode", "--format", "--seed", "--scope", "--op", "--steps", "--script",
                "--max-host-memory"],
    "ls": [],
    "verify": [],
    "scan": [],
    "compare": ["--format", "-o", "--jobs"],
    "report": ["-o"],
    "bisect": ["--target", "--ref", "--format", "-o", "--workload", "--repro", "--peer", "--allow-narrowed"],
    "probe": ["--target", "--ops", "--format", "-o", "--diff"],
    "ranks": ["--replicated", "--json"],
    "repro": ["-o", "--max-elements"],
    "watch": ["--script", "-o", "--level", "--every", "--replay-steps"],
}


def test_command_list_is_pinned():
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    listed = [line.split()[0] for line in result.output.split("Commands:")[1].strip().splitlines()]
    assert sorted(listed) == sorted(CONTRACT)


@pytest.mark.parametrize("command", sorted(CONTRACT))
def test_contract_options_exist(command):
    result = CliRunner().invoke(cli, [command, "--help"])
    assert result.exit_code == 0, result.output
    for option in CONTRACT[command]:
        assert f" {option}" in result.output, (command, option)


def test_choices_are_the_documented_ones():
    help_text = CliRunner().invoke(cli, ["capture", "--help"]).output
    for choice in ("module|op|all", "stats|tensors|replay", "safetensors|h5"):
        assert choice in help_text.replace(" ", ""), choice


def test_usage_error_is_exit_2_without_traceback():
    result = CliRunner().invoke(cli, ["compare", "only-one-arg"])
    assert result.exit_code == 2 and "Traceback" not in result.output
