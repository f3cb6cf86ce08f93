"""The ``precisiondiff`` command line: thin commands over the library.

Exit codes: 0 ran, parity; 1 ran, divergence (or a damaged dump for ``verify``); 2 bad input.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Optional

import click

from .errors import PrecisionDiffError
from .options import CAPTURE_OPTIONS, click_options

__all__ = ["main", "cli"]


class _Group(click.Group):
    """Turns user-fixable errors into one line on stderr and exit code 2."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except PrecisionDiffError as err:
            click.echo(f"error: {err}", err=True)
            ctx.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="precisiondiff")
def cli() -> None:
    """Find where a model's numbers go wrong on an accelerator: capture, compare, bisect."""


def _console():
    """A rich console; wide when writing to a pipe or a file, so tables do not fold."""
    from rich.console import Console
    width = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", 0) or 200)
    return Console(highlight=False, soft_wrap=False, width=width)


@cli.command(context_settings={"ignore_unknown_options": True})
@click.argument("argv", nargs=-1, type=click.UNPROCESSED, metavar="WORKLOAD | --script FILE -- ARGS")
@click.option("-o", "--out", "out", required=True, type=click.Path(file_okay=False), help="dump directory")
@click_options(*CAPTURE_OPTIONS)
@click.option("--script", type=click.Path(), default=None, help="run this Python script under capture")
@click.option("--views", is_flag=True, help="also record view/alias ops (they do no arithmetic)")
@click.option("--train", is_flag=True, help="keep training mode (dropout active); default: eval mode")
@click.option("--repeat", type=int, default=1, show_default=True,
              help="capture N times into OUT/run0..run{N-1} to measure run-to-run determinism")
@click.option("--overwrite", is_flag=True, help="replace an existing dump in OUT")
def capture(argv, out, target, level, mode, format, seed, scope, scope_exclude, op, op_exclude,
            steps, ranks, script, views, train, repeat, overwrite) -> None:
    """Capture a workload (path/file.py:fn or package.module:fn) or a script into a dump."""
    from .capture_run import capture_script, capture_workload
    filters = dict(scope=scope, scope_exclude=scope_exclude, op=op, op_exclude=op_exclude,
                   ranks=ranks, views=views)
    if script:
        summary = capture_script(script, list(argv), out, level=level, mode=mode, format=format,
                                 steps=steps, seed=seed, overwrite=overwrite, **filters)
    else:
        if len(argv) != 1 or argv[0].startswith("-"):
            raise PrecisionDiffError("capture needs one WORKLOAD (path/to/file.py:fn or package.module:fn) "
                                     "or --script FILE -- ARGS")
        if repeat < 1:
            raise PrecisionDiffError("--repeat must be at least 1")
        summary = capture_workload(argv[0], out, target=target, level=level, mode=mode, format=format,
                                   seed=seed, steps=steps, train=train, repeat=repeat,
                                   overwrite=overwrite, **filters)
    click.echo(summary)


@cli.command("ls")
@click.argument("dump", type=click.Path())
@click.option("--kind", type=click.Choice(["module", "op", "param"]), default=None)
@click.option("--direction", type=click.Choice(["forward", "backward"]), default=None)
@click.option("--scope", default=None, help="regex on the module path")
@click.option("--name", default=None, help="regex on the op or module class name")
@click.option("--step", type=int, default=None)
@click.option("--limit", type=int, default=None, help="show at most N events")
def ls_command(dump, kind, direction, scope, name, step, limit) -> None:
    """List a dump's events and tensors with their statistics and sizes."""
    from .report.listing import render_listing
    render_listing(dump, _console(), kind=kind, direction=direction, scope=scope, name=name,
                   step=step, limit=limit)


@cli.command()
@click.argument("dump", type=click.Path())
def verify(dump) -> None:
    """Check every shard and index entry of a dump; exit 1 when it is damaged."""
    from .store import verify as verify_dump
    report = verify_dump(dump)
    for line in report.problems:
        click.echo(f"DAMAGED: {line}")
    for line in report.notes:
        click.echo(f"note: {line}")
    click.echo(str(report))
    if not report.ok:
        sys.exit(1)


from .cli_compare import compare as _compare, report as _report, scan as _scan  # noqa: E402

cli.add_command(_compare, "compare")
cli.add_command(_report, "report")
cli.add_command(_scan, "scan")


from .cli_bisect import bisect as _bisect; cli.add_command(_bisect)  # noqa: E402,E702


def main(argv: Optional[list] = None) -> None:
    """Console-script entry point."""
    cli.main(args=argv, prog_name="precisiondiff")


if __name__ == "__main__":
    main()
