"""``precisiondiff watch``: a cheap monitor of a training script's steps (docs/watch.md)."""
from __future__ import annotations

import click

__all__ = ["watch"]


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("argv", nargs=-1, type=click.UNPROCESSED, metavar="-- SCRIPT_ARGS")
@click.option("--script", required=True, type=click.Path(), help="run this Python script under watch")
@click.option("-o", "--out", "out", required=True, type=click.Path(file_okay=False), help="log directory")
@click.option("--level", type=click.Choice(["default", "all"]), default="default", show_default=True,
              help="default: the layers (the root, its children, members of module lists); all: every module")
@click.option("--modules", default=None, metavar="REGEX", help="watch the modules whose path matches REGEX instead")
@click.option("--every", type=int, default=1, show_default=True, help="watch every N-th step")
@click.option("--param-every", "param_every", type=int, default=10, show_default=True,
              help="weight norms, optimizer state norms and update/weight ratios every N-th watched step")
@click.option("--seed", type=int, default=0, show_default=True, help="seed every RNG before the script runs")
@click.option("--overwrite", is_flag=True, help="replace an existing log in OUT")
@click.option("--replay-steps", "replay_steps", default=None, metavar="STEPS",
              help="also capture these steps (e.g. 1200,1201) in replay mode into OUT/replay, for "
                   "'precisiondiff bisect OUT/replay'")
@click.option("--ref", default=None, type=click.Path(), metavar="WATCH_REF",
              help="a reference watch log (e.g. the GPU or float64 run): each step is compared with its same step "
                   "as compare does, and the step after the first that crosses is captured in replay mode into OUT/replay")
@click.option("--ref-noise", "ref_noise", default=None, type=click.Path(), metavar="WATCH_C",
              help="with --ref: a noise run's log (the reference's run again with another seed) that gives the band")
@click.option("--on-anomaly", "on_anomaly", is_flag=True,
              help="capture the step after the first NaN/Inf, loss spike or gradient norm jump the same way")
def watch(argv, script, out, level, modules, every, param_every, seed, overwrite, replay_steps, ref, ref_noise,
          on_anomaly) -> None:
    """Watch a training script: per step, statistics of every layer's output and gradient, every
    parameter's weight, gradient, optimizer state and update ratio, and the loss, into OUT.
    Compare two runs with 'precisiondiff compare WATCH_A WATCH_B'."""
    from ..watch.runner import watch_script
    click.echo(watch_script(script, list(argv), out, level=level, modules=modules, every=every,
                            param_every=param_every, seed=seed, overwrite=overwrite,
                            replay_steps=replay_steps, ref=ref, ref_noise=ref_noise, on_anomaly=on_anomaly))
