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
    bit for bit across ranks, and recompute each all-reduce from its ranks' inputs (tensors
    mode); exit 1 when two replicas differ or a collective's output is no reduction of its inputs."""
    from ..compare.collectives import check_collectives
    from ..compare.ranks import check_replicas
    report = check_replicas(dump, replicated=replicated)
    collectives = check_collectives(dump)
    if as_json:
        click.echo(json.dumps({**report.to_dict(), "collectives": collectives.to_dict()}, indent=1))
    else:
        click.echo(report.summary())
        click.echo(collectives.summary())
    sys.exit(0 if report.ok and collectives.ok else 1)
