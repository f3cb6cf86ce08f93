"""``precisiondiff probe``: the numerics card of a device's kernels, and two cards side by side."""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import click

from ..errors import PrecisionDiffError

__all__ = ["probe"]

_SUFFIX_FORMATS = {".json": "json", ".html": "html", ".htm": "html"}


def _import(spec: str) -> None:
    """Import a module (``mylib.probe_ops``) or a file (``ops.py``) that registers custom ops."""
    try:
        if spec.endswith(".py"):
            loader_spec = importlib.util.spec_from_file_location(os.path.basename(spec)[:-3], spec)
            if loader_spec is None or not os.path.isfile(spec):
                raise PrecisionDiffError(f"--import {spec}: no such file")
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            importlib.import_module(spec)
    except ImportError as err:
        raise PrecisionDiffError(f"--import {spec}: {err}") from err


def _write(text: str, out: "str | None") -> None:
    if out is None:
        click.echo(text, nl=False)
        return
    try:
        with open(out, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError as err:
        raise PrecisionDiffError(f"cannot write {out}: {err.strerror}") from err


@click.command()
@click.option("--target", default=None, help="DEVICE/DTYPE to probe: cpu/bf16, cuda/fp32, mlu/bf16 "
              "(default: the first available of mlu, cuda, cpu, in bf16)")
@click.option("--ops", default=None, help="comma-separated op families or registered custom ops "
              "(default: every family)")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "html"]), default=None,
              help="output format (default: table; with -o, from the file's suffix)")
@click.option("-o", "--out", type=click.Path(dir_okay=False), default=None,
              help="write the card (or the diff) to FILE; the table still goes to the terminal")
@click.option("--diff", nargs=2, type=click.Path(), default=None, metavar="A.json B.json",
              help="put two saved cards side by side; exit 1 when they differ")
@click.option("--only-differences", is_flag=True, help="with --diff: list only what differs")
@click.option("--import", "imports", multiple=True, metavar="MODULE",
              help="import MODULE (or FILE.py) first: it registers custom ops with register_op")
def probe(target, ops, fmt, out, diff, only_differences, imports) -> None:
    """Measure how a device computes: accumulators, summation order, casts, special values, ULPs."""
    from ..probe import (load_card, probe as run_probe, render_diff_html, render_diff_table,
                         render_html, render_json, render_table)
    from ..probe.render import diff_rows
    if fmt is None:
        fmt = _SUFFIX_FORMATS.get(os.path.splitext(out)[1].lower(), "table") if out else "table"
    if diff:
        if target or ops or imports:
            raise PrecisionDiffError("--diff compares two saved cards: it takes no --target, --ops or --import")
        a, b = load_card(diff[0]), load_card(diff[1])
        rows = diff_rows(a, b)
        if fmt == "json":
            import json
            text = json.dumps({"a": diff[0], "b": diff[1], "rows": [
                {"op": op, "property": prop, "a": va, "b": vb, "differs": d} for op, prop, va, vb, d in rows
                if d or not only_differences]}, indent=1) + "\n"
        elif fmt == "html":
            text = render_diff_html(a, b)
        else:
            text = render_diff_table(a, b, only_differences=only_differences)
        _write(text, out)
        if out:
            click.echo(render_diff_table(a, b, only_differences=True), nl=False)
        sys.exit(1 if any(r[4] for r in rows) else 0)
    if only_differences:
        raise PrecisionDiffError("--only-differences goes with --diff A.json B.json")
    for spec in imports:
        _import(spec)
    if target is None:
        from ..runtime.targets import default_dut
        target = str(default_dut())
    wanted = [o for o in ops.split(",") if o.strip()] if ops else None
    card = run_probe(target, wanted)
    render = {"table": render_table, "json": render_json, "html": render_html}[fmt]
    _write(render(card), out)
    if out:
        click.echo(render_table(card), nl=False)
        click.echo(f"card written to {out}")
