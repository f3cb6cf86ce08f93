"""The click group and the console-script entry point: every command registered, user errors
turned into one line and exit code 2.
"""
from __future__ import annotations

import sys
from typing import Any, Optional

import click

from ..errors import PrecisionDiffError

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


from .bisect import bisect as _bisect  # noqa: E402
from .capture import capture as _capture, refuse_workload_with_script  # noqa: E402
from .compare import compare as _compare, report as _report, scan as _scan  # noqa: E402
from .inspect import ls_command as _ls, verify as _verify  # noqa: E402
from .probe import probe as _probe  # noqa: E402
from .ranks import ranks as _ranks  # noqa: E402
from .repro import repro as _repro  # noqa: E402
from .watch import watch as _watch  # noqa: E402

for _command in (_capture, _ls, _verify, _compare, _report, _scan, _bisect, _probe, _ranks, _repro, _watch):
    cli.add_command(_command)


def main(argv: Optional[list] = None) -> None:
    """Console-script entry point: usage errors are one line and exit code 2, like bad input."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args:
        click.echo(cli.get_help(click.Context(cli, info_name="precisiondiff")))
        sys.exit(2)
    if args[0] == "capture" and "--script" in args:
        refuse_workload_with_script(args[1:])
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

