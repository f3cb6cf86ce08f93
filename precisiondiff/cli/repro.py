"""``precisiondiff repro``: a bisect result's culprit as a standalone reproducer."""
from __future__ import annotations

import json

import click

from ..errors import PrecisionDiffError

__all__ = ["repro", "echo_repro_files"]


def echo_repro_files(files, out_dir, notes=()) -> None:
    """One line per written file with its size, then the repro's notes."""
    click.echo(f"repro written to {out_dir} (run: python {out_dir}/repro.py; exit 1 while the kernel is wrong):")
    for path, size in files:
        click.echo(f"  {path}  {size} bytes")
    for note in notes:
        click.echo(f"  note: {note}")


@click.command("repro")
@click.argument("result", type=click.Path(dir_okay=False))
@click.option("-o", "--out", "out", required=True, type=click.Path(file_okay=False), help="repro directory")
@click.option("--max-elements", "max_elements", type=int, default=None,
              help="slice the culprit's tensors to about this many elements, keeping its failing rows")
def repro(result, out, max_elements) -> None:
    """Write the culprit of a bisect RESULT.json (bisect --format json of a replay dump) as a repro."""
    from ..bisect.handoff import repro_from_result
    try:
        with open(result, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as err:
        raise PrecisionDiffError(f"cannot read {result} as a bisect result (precisiondiff bisect ... --format json "
                                 f"-o {result}): {err}") from err
    if not isinstance(data, dict) or "verdict" not in data:
        raise PrecisionDiffError(f"{result} is not a bisect result (no verdict)")
    files = repro_from_result(data, out, max_elements=max_elements)
    with open(next(p for p, _ in files if p.endswith("case.json")), encoding="utf-8") as fh:
        notes = json.load(fh).get("notes", [])
    echo_repro_files(files, out, notes)
