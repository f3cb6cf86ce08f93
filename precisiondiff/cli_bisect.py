"""``precisiondiff bisect``: a thin command over :mod:`precisiondiff.bisect`."""
from __future__ import annotations

import os
import sys

import click

__all__ = ["bisect"]


@click.command("bisect")
@click.argument("source")
@click.argument("ref_dump", required=False)
@click.option("--target", default=None, help="device under test, e.g. cpu/bf16 (default: mlu, cuda, cpu in bf16)")
@click.option("--ref", default="cpu/float64", show_default=True, help="reference target")
@click.option("--direction", type=click.Choice(["forward", "backward"]), default=None)
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
@click.option("-o", "--out", "out", type=click.Path(dir_okay=False), default=None, help="write the report here")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--workload", default=None, help="offline: the workload that rebuilds the modules")
def bisect(source, ref_dump, target, ref, direction, fmt, out, seed, workload) -> None:
    """Find the first op or module whose own arithmetic is wrong (WORKLOAD, or DUT_DUMP [REF_DUMP])."""
    from .bisect import bisect as run_live, bisect_dump
    from .bisect.render import summary_lines
    from .errors import BisectError
    if os.path.isdir(source) and os.path.isfile(os.path.join(source, "meta.json")):
        result = bisect_dump(source, ref_dump, ref=ref, workload=workload)
    else:
        if ref_dump is not None:
            raise BisectError(f"{source} is not a dump directory, so REF_DUMP makes no sense; "
                              "pass a WORKLOAD or DUT_DUMP [REF_DUMP]")
        progress = None
        if sys.stderr.isatty():
            def progress(done, total, label):
                click.echo(f"\r[{done}/{total}] {label[:70]:<70}", err=True, nl=False)
        result = run_live(source, target=target, ref=ref, direction=direction, seed=seed, progress=progress)
        if progress is not None:
            click.echo("", err=True)
    text = result.dumps() if fmt == "json" else "\n".join(summary_lines(result))
    if out:
        with open(out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    click.echo(text)
    sys.exit(result.exit_code)
