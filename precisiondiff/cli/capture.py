"""``precisiondiff capture``: record a workload or a script into a dump."""
from __future__ import annotations

import sys

import click

from ..errors import PrecisionDiffError
from .options import CAPTURE_OPTIONS, click_options

__all__ = ["capture", "refuse_workload_with_script"]


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("argv", nargs=-1, type=click.UNPROCESSED, metavar="WORKLOAD | --script FILE -- ARGS")
@click.option("-o", "--out", "out", required=True, type=click.Path(file_okay=False), help="dump directory")
@click_options(*CAPTURE_OPTIONS)
@click.option("--script", type=click.Path(), default=None, help="run this Python script under capture")
@click.option("--views", is_flag=True, help="also record view/alias ops (they do no arithmetic)")
@click.option("--train", is_flag=True, help="keep training mode (dropout active); default: eval mode")
@click.option("--repeat", type=int, default=1, show_default=True,
              help="capture N times into OUT/run0..run{N-1} to measure run-to-run determinism")
@click.option("--overwrite", is_flag=True,
              help="replace an existing dump in OUT once the capture succeeded (under torchrun: once, "
                   "by one process, after every rank finished)")
@click.option("--allow-narrowed", "allow_narrowed", is_flag=True,
              help="run a float64 target on a device that holds float64 as float32 (torch_mlu) as the "
                   "float32 target it is, recorded so, instead of refusing it")
@click.option("--max-host-memory", "max_host_memory", default="2GiB", show_default=True, metavar="SIZE",
              help="host memory for tensor copies waiting to be written (tensors/replay modes), e.g. 512MiB")
@click.option("--gather-full", "gather_full", is_flag=True,
              help="also record DTensors' full tensors, gathered at each step's end (default: local shards)")
@click.option("--gather-full-only", "gather_only", default=None, metavar="REGEX",
              help="--gather-full for the DTensors whose record key matches REGEX only")
@click.option("--durable", is_flag=True,
              help="fsync the dump at every batch, not only at close (survives a power loss, costs a few ms each)")
@click.option("--engine", type=click.Choice(["python", "compiled"]), default=None,
              help="how op-level calls are recorded: the Python dispatch mode, or a C++ dispatcher hook for the "
                   "common call (statistics mode; built on first use; the same events). Default: "
                   "$PRECISIONDIFF_CAPTURE_ENGINE, else python")
def capture(argv, out, target, level, mode, format, seed, scope, scope_exclude, op, op_exclude,
            steps, ranks, script, views, train, repeat, overwrite, max_host_memory, gather_full,
            gather_only, durable, engine, allow_narrowed) -> None:
    """Capture a workload (path/file.py:fn, package.module:fn or hf:PATH) or a script into a dump."""
    from ..capture.runner import capture_script, capture_workload
    filters = dict(scope=scope, scope_exclude=scope_exclude, op=op, op_exclude=op_exclude,
                   ranks=ranks, views=views, max_host_memory=parse_size(max_host_memory),
                   gather_full=gather_only or gather_full, durable=durable, engine=engine)
    if script:
        if target:
            raise PrecisionDiffError("--target has no effect with --script: the script places its model "
                                     "itself; capture a WORKLOAD to choose the target")
        if repeat != 1:
            raise PrecisionDiffError("--repeat works with a WORKLOAD, not with --script")
        if allow_narrowed:
            raise PrecisionDiffError("--allow-narrowed goes with --target, which --script does not take")
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
                                   overwrite=overwrite, allow_narrowed=allow_narrowed, **filters)
    click.echo(summary)


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000 ** 2,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1000 ** 3, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """``"512MiB"``, ``"2G"``, ``"1000000"`` -> bytes; a malformed size is a one-line error."""
    import re
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise PrecisionDiffError(f"bad size {text!r}: use a number of bytes or e.g. 512MiB, 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


_VALUED = {"-o", "--out", "-t", "--target", "--level", "--mode", "--format", "--seed", "--scope",
           "--scope-exclude", "--op", "--op-exclude", "--steps", "--ranks", "--script", "--repeat",
           "--max-host-memory", "--gather-full-only"}


def refuse_workload_with_script(args: list) -> None:
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
