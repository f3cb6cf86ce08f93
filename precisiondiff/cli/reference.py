"""The CLI reference (docs/cli.md), generated from the click commands themselves.

Regenerate with::

    python -m precisiondiff.cli.reference > docs/cli.md

``tests/test_cli_reference.py`` fails when docs/cli.md and the commands disagree.
"""
from __future__ import annotations

import inspect
import sys
from typing import List

import click

__all__ = ["render", "REGENERATE"]

REGENERATE = "python -m precisiondiff.cli.reference > docs/cli.md"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _command(name: str, command: click.Command, parent: click.Context) -> List[str]:
    ctx = click.Context(command, info_name=name, parent=parent, **command.context_settings)
    pieces = " ".join(command.collect_usage_pieces(ctx))
    lines = [f"## `{ctx.command_path}`", ""]
    help_text = inspect.cleandoc(command.help or "")
    if help_text:
        lines += [help_text, ""]
    lines += ["```", f"{ctx.command_path} {pieces}".rstrip(), "```", ""]
    arguments = [p for p in command.params if isinstance(p, click.Argument)]
    if arguments:
        lines.append("Arguments: " + ", ".join(f"`{p.make_metavar(ctx)}`" for p in arguments) + ".")
        lines.append("")
    records = [p.get_help_record(ctx) for p in command.get_params(ctx) if not isinstance(p, click.Argument)]
    records = [r for r in records if r]
    if records:
        lines += ["| option | description |", "|---|---|"]
        lines += [f"| `{_cell(opts)}` | {_cell(help_) or ''} |" for opts, help_ in records]
        lines.append("")
    return lines


def render(group: "click.Group | None" = None) -> str:
    """The Markdown reference of every command of ``group`` (default: the ``precisiondiff`` CLI).

    Returns:
        The text of docs/cli.md.

    Example:
        >>> "## `precisiondiff capture`" in render()
        True
    """
    if group is None:
        from .app import cli as group
    root = click.Context(group, info_name="precisiondiff", **group.context_settings)
    lines = ["# Command-line reference", "",
             f"<!-- generated from the click commands: {REGENERATE}; do not edit by hand -->", "",
             inspect.cleandoc(group.help or ""), "",
             "Exit codes: 0 ran, parity; 1 ran, divergence found; 2 bad input or usage (one line on stderr).", "",
             "Run it as `precisiondiff`, `python -m precisiondiff` or, in every process of a job, "
             "`torchrun ... -m precisiondiff` (`-m precisiondiff.cli` works too).", ""]
    names = group.list_commands(root)
    lines += ["Commands: " + ", ".join(f"[`{n}`](#precisiondiff-{n})" for n in names) + ".", ""]
    for name in names:
        lines += _command(name, group.get_command(root, name), root)
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
