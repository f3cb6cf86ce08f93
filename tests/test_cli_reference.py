"""docs/cli.md is generated from the click commands and kept in sync."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click

from precisiondiff.cli.reference import REGENERATE, render

DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def test_docs_cli_md_matches_the_commands():
    assert DOC.read_text(encoding="utf-8") == render(), \
        f"docs/cli.md is out of date with the click commands: regenerate it with `{REGENERATE}`"


def test_every_command_and_option_is_in_the_reference():
    from precisiondiff.cli import cli
    text = render()
    ctx = click.Context(cli, info_name="precisiondiff")
    for name in cli.list_commands(ctx):
        assert f"## `precisiondiff {name}`" in text
        for param in cli.get_command(ctx, name).params:
            for opt in getattr(param, "opts", []):
                if opt.startswith("-"):
                    assert opt in text, (name, opt)


def test_a_new_command_appears_with_its_help_and_options():
    @click.group(help="Top.")
    def group():
        pass

    @group.command(help="Do a thing | with a pipe.")
    @click.argument("path")
    @click.option("--size", type=int, default=3, show_default=True, help="how big")
    def thing(path, size):
        pass
    text = render(group)
    assert "## `precisiondiff thing`" in text and "Do a thing | with a pipe." in text
    assert "precisiondiff thing [OPTIONS] PATH" in text
    assert "| `--size INTEGER` | how big  [default: 3] |" in text


def test_the_module_prints_the_reference():
    out = subprocess.run([sys.executable, "-m", "precisiondiff.cli.reference"], capture_output=True,
                         text=True, check=True, cwd=DOC.parents[1])
    assert out.stdout == render()
