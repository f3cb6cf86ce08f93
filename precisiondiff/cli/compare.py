"""CLI commands ``compare``, ``report`` and ``scan``: thin wrappers over the library.

Exit codes: 0 parity (no failing row / no anomaly), 1 divergence or anomaly, 2 bad input.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable, Optional

import click

from ..errors import PrecisionDiffError

__all__ = ["compare", "report", "scan"]

_FILTERS = [
    click.option("--scope", default=None, help="compare only events whose module path matches this regex"),
    click.option("--op", default=None, help="compare only events whose op or module name matches this regex"),
    click.option("--direction", type=click.Choice(["forward", "backward", "optimizer"]), default=None),
    click.option("--kind", type=click.Choice(["module", "op", "param"]), default=None),
    click.option("--inputs", is_flag=True, help="compare input slots too (default: outputs and gradients)"),
    click.option("--device", default=None, help="run the comparisons on this device (cuda, mlu:0, ...)"),
    click.option("--noise", type=click.Path(), default=None,
                 help="a second capture of the DUT: rows within its run-to-run noise are not divergence "
                      "(watch logs: a third run whose error against B is the band)"),
    click.option("--rel-l2", "rel_l2", type=float, default=None,
                 help="relative L2 error allowed per tensor (default: 8 unit roundoffs of the run's precision)"),
    click.option("--progress/--no-progress", default=True, show_default=True,
                 help="progress bar on stderr for comparisons that take over a second"),
]


def _filters(fn: Callable) -> Callable:
    for opt in reversed(_FILTERS):
        fn = opt(fn)
    return fn


_INTEGRATIONS = [
    click.option("--tensorboard", "tensorboard_dir", type=click.Path(file_okay=False), default=None,
                 help="also write per-layer error over training steps (scalars) and ULP histograms "
                      "as TensorBoard event files to DIR"),
    click.option("--model-explorer", "explorer_out", type=click.Path(dir_okay=False), default=None,
                 help="also write a Model Explorer node-data overlay (per-node error) to FILE.json, "
                      "and the exported graph beside it (FILE.graph.json)"),
    click.option("--workload", default=None,
                 help="with --model-explorer: the workload whose model is exported "
                      "(default: the one recorded in A's meta.json)"),
    click.option("--bisect", "bisect_json", type=click.Path(dir_okay=False), default=None,
                 help="with --model-explorer: a bisect JSON (bisect --format json -o FILE) whose culprit is marked"),
]


def _integration_options(fn: Callable) -> Callable:
    for opt in reversed(_INTEGRATIONS):
        fn = opt(fn)
    return fn


def _stderr_progress(enabled: bool):
    """A ``progress(done, total)`` callback that shows a rich bar once a second has passed."""
    if not enabled or not sys.stderr.isatty():
        return None, lambda: None
    state: dict = {"t0": time.monotonic(), "bar": None, "task": None}

    def update(done: int, total: int) -> None:
        if state["bar"] is None:
            if time.monotonic() - state["t0"] < 1.0:
                return
            from rich.console import Console
            from rich.progress import Progress
            state["bar"] = Progress(console=Console(stderr=True), transient=True)
            state["bar"].start()
            state["task"] = state["bar"].add_task("comparing", total=total)
        state["bar"].update(state["task"], completed=done)

    def stop() -> None:
        if state["bar"] is not None:
            state["bar"].stop()
    return update, stop


def _run_compare(a: str, b: str, scope, op, direction, kind, inputs, device, noise, rel_l2, progress,
                 only_failing: bool = False, jobs: int = 1):
    from ..compare.dumps import compare as run
    if rel_l2 is not None and not rel_l2 > 0:
        raise PrecisionDiffError("--rel-l2 must be a positive number")
    update, stop = _stderr_progress(progress)
    try:
        from ..compare.parallel import under_torchrun
        return run(a, b, scope=scope, op=op, direction=direction, kind=kind, inputs=inputs,
                   device=device, noise=noise, only_failing=only_failing, progress=update,
                   budgets={"rel_l2": rel_l2} if rel_l2 is not None else None, jobs=jobs,
                   across_processes=under_torchrun())
    finally:
        stop()


def _write(text: str, out: Optional[str]) -> None:
    if out is None:
        click.echo(text, nl=False)
        return
    try:
        Path(out).write_text(text, encoding="utf-8")
    except OSError as err:
        raise PrecisionDiffError(f"cannot write {out}: {err.strerror or err}; choose a writable path") from err
    click.echo(f"wrote {out}", err=True)


@click.command()
@click.argument("a", type=click.Path())
@click.argument("b", type=click.Path())
@click.option("--format", "fmt", type=click.Choice(["table", "json", "csv", "html"]), default="table",
              show_default=True)
@click.option("-o", "--out", default=None, type=click.Path(dir_okay=False), help="write to FILE")
@click.option("--only-failing", is_flag=True, help="show only failing rows")
@click.option("--top", type=int, default=None, help="show only the N rows with the largest error")
@click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="compare the ranks of a multi-rank dump in N processes (under torchrun: one per process)")
@_filters
@click.pass_context
def compare(ctx, a, b, fmt, out, only_failing, top, jobs, scope, op, direction, kind, inputs, device,
            noise, rel_l2, progress) -> None:
    """Compare dump A (the device under test) with dump B (the reference), or two watch logs
    (precisiondiff watch -o DIR): the first step, layer and tensor where the runs part."""
    from ..watch.log import is_watch_log
    if is_watch_log(a) or is_watch_log(b):
        ctx.exit(_compare_watch(a, b, fmt, out, noise))
    if top is not None and top < 1:
        raise PrecisionDiffError("--top must be at least 1")
    c = _run_compare(a, b, scope, op, direction, kind, inputs, device, noise, rel_l2, progress, only_failing,
                     jobs=jobs)
    if c is None:  # a torchrun process other than 0: its rows went to process 0's report
        ctx.exit(0)
    rows = c.rows
    if top is not None:
        worst = {id(r) for r in c.top(top)}
        rows = [r for r in rows if id(r) in worst]
    if fmt == "json":
        from ..report.csv_json import to_json
        _write(to_json(c, rows), out)
    elif fmt == "csv":
        from ..report.csv_json import to_csv
        _write(to_csv(c, rows), out)
    elif fmt == "html":
        from ..report.html import render_html
        _write(render_html(c, rows=rows), out)
    else:
        from .console import console as _console
        if out is None:
            from ..report.table import render_table
            render_table(c, _console(), rows=rows)
        else:
            from rich.console import Console

            from ..report.table import render_table
            try:
                with open(out, "w", encoding="utf-8") as fh:
                    render_table(c, Console(file=fh, width=200, highlight=False), rows=rows)
            except OSError as err:
                raise PrecisionDiffError(f"cannot write {out}: {err.strerror or err}; choose a writable path") from err
    ctx.exit(c.exit_code)


def _watch_comparison(a: str, b: str, noise: Optional[str]):
    from ..watch.log import is_watch_log
    for path in (a, b):
        if not is_watch_log(path):
            raise PrecisionDiffError(f"{path} is not a watch log while the other is: compare two watch logs "
                                     "(precisiondiff watch -o DIR) or two dumps")
    from ..watch.compare import compare_logs
    return compare_logs(a, b, noise=noise)


def _compare_watch(a: str, b: str, fmt: str, out: Optional[str], noise: Optional[str]) -> int:
    """``compare`` of two watch logs (docs/watch.md); returns the exit code."""
    c = _watch_comparison(a, b, noise)
    if fmt == "json":
        from ..watch.render import to_json
        _write(to_json(c), out)
    elif fmt == "table":
        from ..watch.render import render_text
        _write(render_text(c), out)
    elif fmt == "html":
        from ..watch.render import render_html
        _write(render_html(c), out)
    else:
        raise PrecisionDiffError(f"--format {fmt} is not available for watch logs: use table, json or html")
    return c.exit_code


@click.command()
@click.argument("a", type=click.Path())
@click.argument("b", type=click.Path())
@click.option("-o", "--out", default=None, type=click.Path(dir_okay=False), help="the HTML file")
@click.option("--worst", type=click.IntRange(min=0), default=6, show_default=True, help="ULP histograms of the N worst tensors")
@_filters
@_integration_options
@click.pass_context
def report(ctx, a, b, out, worst, scope, op, direction, kind, inputs, device, noise, rel_l2, progress,
           tensorboard_dir, explorer_out, workload, bisect_json) -> None:
    """Write a self-contained HTML report of the comparison of A (DUT) with B (reference),
    and/or TensorBoard event files (--tensorboard) and a Model Explorer overlay (--model-explorer)."""
    if out is None and tensorboard_dir is None and explorer_out is None:
        raise click.UsageError("report needs -o FILE.html, --tensorboard DIR or --model-explorer FILE.json")
    from ..watch.log import is_watch_log
    if is_watch_log(a) or is_watch_log(b):
        if explorer_out is not None:
            raise PrecisionDiffError("--model-explorer needs two dumps; for watch logs use -o FILE.html or --tensorboard DIR")
        ctx.exit(_report_watch(a, b, out, noise, tensorboard_dir))
    c = _run_compare(a, b, scope, op, direction, kind, inputs, device, noise, rel_l2, progress)
    if out is not None:
        from ..report.html import render_html
        _write(render_html(c, worst=worst, device=device), out)
    _write_integrations(c, tensorboard_dir, explorer_out, workload, bisect_json)
    ctx.exit(c.exit_code)


def _report_watch(a: str, b: str, out: Optional[str], noise: Optional[str], tensorboard_dir: Optional[str]) -> int:
    """``report`` of two watch logs: the HTML page and/or TensorBoard scalars; the exit code."""
    c = _watch_comparison(a, b, noise)
    if out is not None:
        from ..watch.render import render_html
        _write(render_html(c), out)
    if tensorboard_dir is not None:
        from ..report.tensorboard import write_watch_tensorboard
        n = write_watch_tensorboard(c.to_dict(), tensorboard_dir)
        click.echo(f"wrote {n['scalars']} scalars (both losses, {n['layers']} layers' errors) over {n['steps']} "
                   f"steps to {tensorboard_dir} (tensorboard --logdir {tensorboard_dir})", err=True)
    return c.exit_code


def _write_integrations(c, tensorboard_dir, explorer_out, workload, bisect_json) -> None:
    """The --tensorboard and --model-explorer outputs (each in its own report module)."""
    if (workload or bisect_json) and explorer_out is None:
        raise PrecisionDiffError("--workload and --bisect go with --model-explorer FILE.json")
    if tensorboard_dir is not None:
        from ..report.tensorboard import write_tensorboard
        n = write_tensorboard(c, tensorboard_dir)
        click.echo(f"wrote {n['scalars']} scalars and {n['histograms']} ULP histograms of {n['layers']} "
                   f"layers over {n['steps']} steps to {tensorboard_dir} (tensorboard --logdir {tensorboard_dir})",
                   err=True)
    if explorer_out is not None:
        from ..report.model_explorer import write_overlay
        written = write_overlay(c, explorer_out, workload=workload, bisect=bisect_json)
        click.echo(f"wrote {written['overlay']} ({written['nodes']} of {written['graph_nodes']} graph nodes "
                   f"with an error) and {written['graph']}; view: model-explorer {written['graph']} "
                   f"--node_data_paths={written['overlay']}", err=True)


@click.command()
@click.argument("dump", type=click.Path())
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--explode", type=float, default=None, help="gradient norm ratio called an explosion")
@click.option("--vanish", type=float, default=None, help="gradient norm ratio called vanishing")
@click.pass_context
def scan(ctx, dump, fmt, explode, vanish) -> None:
    """Find the first event that produced NaN/Inf from finite inputs, and exploding or
    vanishing gradients. Exit 1 when an anomaly is found."""
    from ..compare.scan import scan as run_scan
    kwargs = {k: v for k, v in (("explode", explode), ("vanish", vanish)) if v is not None}
    result = run_scan(dump, **kwargs)
    if fmt == "json":
        import json
        click.echo(json.dumps(result.to_dict(), indent=1))
    else:
        for line in result.lines():
            click.echo(line)
    ctx.exit(1 if result.anomalies else 0)
