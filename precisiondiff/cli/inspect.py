"""``precisiondiff ls`` and ``verify``: look inside one dump."""
from __future__ import annotations

import sys

import click

from .console import console as _console

__all__ = ["ls_command", "verify"]


@click.command("ls")
@click.argument("dump", type=click.Path())
@click.option("--kind", type=click.Choice(["module", "op", "param"]), default=None)
@click.option("--direction", type=click.Choice(["forward", "backward", "optimizer"]), default=None)
@click.option("--scope", default=None, help="regex on the module path")
@click.option("--name", default=None, help="regex on the op or module class name")
@click.option("--step", type=int, default=None)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="show at most N events")
def ls_command(dump, kind, direction, scope, name, step, limit) -> None:
    """List a dump's events and tensors with their statistics and sizes."""
    from ..report.listing import render_listing
    render_listing(dump, _console(), kind=kind, direction=direction, scope=scope, name=name,
                   step=step, limit=limit)


@click.command()
@click.argument("dump", type=click.Path())
@click.option("--all", "show_all", is_flag=True, help="list every problem (default: the first 20)")
def verify(dump, show_all) -> None:
    """Check every shard and index entry of a dump; exit 1 when it is damaged."""
    from pathlib import Path

    from ..errors import DumpError
    from ..store import verify as verify_dump
    path = Path(dump)
    if not path.is_dir():
        raise DumpError(f"no dump at {dump}: {'not a directory' if path.exists() else 'the directory does not exist'}; "
                        "check the path")
    if not (path / "meta.json").exists() and not any(p.name.startswith("rank") for p in path.iterdir()):
        raise DumpError(f"{dump} is not a dump (no meta.json and no rank*/ directories)")
    report = verify_dump(dump)
    shown = report.problems if show_all else report.problems[:20]
    state = "ok" if report.ok else f"DAMAGED: {len(report.problems)} problem(s)"
    counts = ", ".join(f"{k}={v}" for k, v in report.summary.items())
    click.echo(f"{dump}: {state}{', partial (the run did not finish)' if report.partial else ''} ({counts})")
    for line in shown:
        click.echo(f"  problem: {line}")
    if len(shown) < len(report.problems):
        click.echo(f"  ... {len(report.problems) - len(shown)} more (--all lists them)")
    for line in report.notes:
        click.echo(f"  note: {line}")
    if not report.ok:
        sys.exit(1)
