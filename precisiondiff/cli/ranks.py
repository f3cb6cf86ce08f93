"""``precisiondiff ranks``: tensors that must be identical on every rank, checked across ranks."""
from __future__ import annotations

import json
import sys

import click

__all__ = ["ranks"]


@click.command()
@click.argument("dump", type=click.Path())
@click.option("--replicated", default=None, metavar="REGEX",
              help="tensor keys that must also be identical on every rank")
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
def ranks(dump, replicated, as_json) -> None:
    """Check a multi-rank dump's replicas (collective outputs, replicated DTensors, DDP gradients)
    bit for bit across ranks; exit 1 when two replicas differ."""
    from ..compare.ranks import check_replicas
    report = check_replicas(dump, replicated=replicated)
    click.echo(json.dumps(report.to_dict(), indent=1) if as_json else report.summary())
    sys.exit(0 if report.ok else 1)
