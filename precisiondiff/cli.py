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
        if target:
            raise PrecisionDiffError("--target has no effect with --script: the script places its model "
                                     "itself; capture a WORKLOAD to choose the target")
        if repeat != 1:
            raise PrecisionDiffError("--repeat works with a WORKLOAD, not with --script")
        summary = capture_script(script, list(argv), out, level=level, mode=mode, format=format,
                                 steps=steps, seed=seed, overwrite=overwrite, **filters)
    else:
        unknown = [a for a in argv if a.startswith("-")]
        if unknown:
            raise PrecisionDiffError(f"unknown option {unknown[0]} (see 'precisiondiff capture --help')")
        if len(argv) != 1:
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
@click.option("--limit", type=click.IntRange(min=1), default=None, help="show at most N events")
def ls_command(dump, kind, direction, scope, name, step, limit) -> None:
    """List a dump's events and tensors with their statistics and sizes."""
    from .report.listing import render_listing
    render_listing(dump, _console(), kind=kind, direction=direction, scope=scope, name=name,
                   step=step, limit=limit)


@cli.command()
@click.argument("dump", type=click.Path())
@click.option("--all", "show_all", is_flag=True, help="list every problem (default: the first 20)")
def verify(dump, show_all) -> None:
    """Check every shard and index entry of a dump; exit 1 when it is damaged."""
    from pathlib import Path

    from .errors import DumpError
    from .store import verify as verify_dump
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


from .cli_bisect import bisect as _bisect  # noqa: E402
from .cli_compare import compare as _compare, report as _report, scan as _scan  # noqa: E402

for _command in (_compare, _report, _scan, _bisect):
    cli.add_command(_command)


_VALUED = {"-o", "--out", "-t", "--target", "--level", "--mode", "--format", "--seed", "--scope",
           "--scope-exclude", "--op", "--op-exclude", "--steps", "--ranks", "--script", "--repeat"}


def _refuse_workload_with_script(args: list) -> None:
    """``capture WORKLOAD --script FILE`` would hand WORKLOAD to the script as an argument."""
    before = args[: args.index("--")] if "--" in args else args
    expect_value = False
    for token in before:
        if expect_value:
            expect_value = False
        elif token in _VALUED:
            expect_value = True
        elif not token.startswith("-"):
            click.echo(f"error: give a WORKLOAD or --script FILE, not both ({token!r}); the script's own "
                       "arguments go after --", err=True)
            sys.exit(2)


def main(argv: Optional[list] = None) -> None:
    """Console-script entry point: usage errors are one line and exit code 2, like bad input."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args:
        click.echo(cli.get_help(click.Context(cli, info_name="precisiondiff")))
        sys.exit(2)
    if args[0] == "capture" and "--script" in args:
        _refuse_workload_with_script(args[1:])
    try:
        code = cli.main(args=args, prog_name="precisiondiff", standalone_mode=False)
    except click.UsageError as err:
        command = err.ctx.command_path if err.ctx is not None else "precisiondiff"
        click.echo(f"error: {err.format_message()} (see '{command} --help')", err=True)
        sys.exit(2)
    except click.Abort:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
