"""``precisiondiff bisect``: a thin command over :mod:`precisiondiff.bisect`."""
from __future__ import annotations

import contextlib
import os
import sys

import click

from .options import ACCEPT, REF, SEED, TARGET, click_options

__all__ = ["bisect"]


@contextlib.contextmanager
def _progress():
    """A rich progress bar on stderr when it is a terminal (rich loaded lazily); else None."""
    if not sys.stderr.isatty():
        yield None
        return
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:  # pragma: no cover - rich is optional
        def plain(done, total, label):
            click.echo(f"\r[{done}/{total}] {label[:70]:<70}", err=True, nl=False)
        yield plain
        click.echo("", err=True)
        return
    with Progress(TextColumn("bisect"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("", total=None)

        def update(done, total, label):
            bar.update(task, completed=done, total=total, description=label[:60])
        yield update


@click.command("bisect")
@click.argument("source", required=False)
@click.argument("ref_dump", required=False)
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- SCRIPT_ARGS]")
@click_options(TARGET, REF)
@click.option("--direction", type=click.Choice(["forward", "backward", "optimizer"]), default=None)
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
@click.option("-o", "--out", "out", type=click.Path(dir_okay=False), default=None, help="write the report here")
@click_options(SEED)
@click.option("--workload", default=None, help="offline: the workload that rebuilds the modules (a multi-rank "
              "dump: its module is only imported, for its custom ops)")
@click.option("--budget", "budgets", multiple=True, metavar="[KEY:]FIELD=VALUE",
              help="op budget override (repeatable), e.g. --budget aten.mm:max_ulp=4")
@click_options(ACCEPT)
@click.option("--blame-known", "blame_known", is_flag=True, default=False,
              help="judge the documented stock findings of the DUT's backend (docs/bisect.md, 'Findings on stock "
                   "kernels') as any other op; by default they are passed over and listed in accepted")
@click.option("--noise", is_flag=True, default=False,
              help="live: run the DUT twice; a nondeterministic op within 2x its run-to-run difference "
                   "is not a culprit")
@click.option("--confirm", is_flag=True, default=False,
              help="live: with a culprit, also run the reference (final error, the culprit's inputs against "
                   "it) and rerun the DUT with the culprit's golden output (substitution)")
@click.option("--card", "card_path", type=click.Path(dir_okay=False), default=None,
              help="a numerics card of the DUT (precisiondiff probe -o CARD.json): explain the culprit by it")
@click.option("--script", type=click.Path(dir_okay=False), default=None,
              help="live: capture this script's first step in replay mode (every process of a torchrun job) "
                   "and bisect it; the script's arguments go after --")
@click.option("--keep", type=click.Path(file_okay=False), default=None,
              help="with --script: keep the dumps in this directory (default: a temporary one, removed)")
@click.option("--allow-narrowed", "allow_narrowed", is_flag=True,
              help="a float64 target or reference on a device that holds float64 as float32 (torch_mlu) "
                   "runs as the float32 target it is, with a note, instead of being refused")
@click.option("--repro", "repro_dir", type=click.Path(file_okay=False), default=None,
              help="write an op culprit as a standalone repro into this directory (precisiondiff repro)")
@click.option("--max-elements", "max_elements", type=int, default=None,
              help="with --repro: slice the culprit's tensors to about this many elements, keeping its failing rows")
@click.option("--peer", default=None, metavar="DEVICE[/DTYPE]",
              help="a real second implementation (another device) in the DUT's dtype: judged ops are replayed "
                   "there too and its error joins the emulated peers' (e.g. cuda/bf16, cpu/bf16)")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="offline: judge the op replays on N processes of this host (the result is the same as "
                   "with one); a multi-rank dump: bisect N ranks at a time. Under torchrun the job's "
                   "processes share the replays instead")
@click.option("--modules-on-workers", "modules_on_workers", is_flag=True, default=False,
              help="with --workers: the module replays of the descent on the workers too (each builds the "
                   "model's templates on the meta device; pays on large models, not on small ones)")
@click.option("--max-replay-bytes", "max_replay_bytes", default="1GiB", show_default=True, metavar="SIZE",
              help="block-wise replay: a module larger than SIZE in the reference dtype is not replayed whole "
                   "(its blocks are), and with a culprit such a model's whole reference run is left out; "
                   "'none': replay every module whole")
@click.option("--rule", type=click.Choice(["peer", "mlu-ops"]), default="peer", show_default=True,
              help="how an op is judged: the peer rule, or Cambricon mlu-ops' acceptance rule (diff1/diff2/diff3 "
                   "<= max(10 x the baseline's, a static threshold per op class); the baseline is --peer, or "
                   "the emulated peers)")
def bisect(source, ref_dump, script_args, target, ref, direction, fmt, out, seed, workload, budgets, accept, noise,
           confirm, card_path, script, keep, allow_narrowed, repro_dir, max_elements, peer, workers,
           modules_on_workers, max_replay_bytes, rule, blame_known) -> None:
    """Find the first op or module whose own arithmetic is wrong (WORKLOAD, DUT_DUMP [REF_DUMP] or --script)."""
    from ..bisect import bisect as run_live, bisect_dump
    from ..bisect.ranks import bisect_ranks, is_multi_rank
    from ..errors import BisectError
    if script is not None and (peer is not None or rule != "peer"):
        raise BisectError("--peer and --rule work with a WORKLOAD or a single-rank DUT_DUMP, not --script")
    if script is not None:
        _bisect_script(script, [a for a in (source, ref_dump) if a is not None] + list(script_args), keep,
                       target=target, workload=workload, noise=noise, confirm=confirm, ref=ref,
                       direction=direction, budgets=list(budgets), seed=seed, fmt=fmt, out=out, card_path=card_path,
                       accept=list(accept), blame_known=blame_known)
    if keep is not None or script_args:
        raise BisectError("--keep and the arguments after -- go with --script FILE" if keep is not None else
                          f"too many arguments ({' '.join(script_args)}): bisect takes a WORKLOAD or DUT_DUMP "
                          "[REF_DUMP], or --script FILE -- ARGS")
    if source is None:
        raise BisectError("bisect needs a WORKLOAD, a DUT_DUMP [REF_DUMP] or --script FILE "
                          "(see 'precisiondiff bisect --help')")
    from ..compare.parallel import under_torchrun
    # under torchrun a host may hold none of a multi-rank job's dumps: its process still joins the job
    multi = is_multi_rank(source) or (under_torchrun() and os.path.isdir(source)
                                      and not os.path.isfile(os.path.join(source, "meta.json")))
    offline = multi or (os.path.isdir(source) and os.path.isfile(os.path.join(source, "meta.json")))
    if (repro_dir is not None or max_elements is not None or peer is not None or rule != "peer") and (
            multi or script is not None):
        raise BisectError("--repro, --peer and --rule work with a WORKLOAD or a single-rank DUT_DUMP")
    if max_elements is not None and repro_dir is None:
        raise BisectError("--max-elements goes with --repro DIR")
    if multi and ref_dump is not None:
        raise BisectError(f"{source} holds several ranks: REF_DUMP is not supported for a multi-rank job yet "
                          "(each rank's ops and the collectives are judged from the DUT's own inputs)")
    if not offline and ":" not in source:
        what = ("a directory without meta.json" if os.path.isdir(source) else
                "a file" if os.path.exists(source) else "no such path")
        raise BisectError(f"{source} is neither a dump ({what}) nor a workload (path/to/file.py:fn or "
                          "package.module:fn)")
    if not offline and ref_dump is not None:
        raise BisectError(f"{source} is not a dump directory, so REF_DUMP makes no sense; "
                          "pass a WORKLOAD or DUT_DUMP [REF_DUMP]")
    if offline and target is not None:
        raise BisectError("--target applies to live bisect; a dump says its own target")
    if offline and noise:
        raise BisectError("--noise applies to live bisect (it reruns the workload); for dumps, capture the DUT "
                          "twice and use precisiondiff compare --noise")
    if offline and confirm:
        raise BisectError("--confirm applies to live bisect (substitution reruns the DUT); offline bisect "
                          "compares with the reference (REF_DUMP or --workload) already")
    from .capture import parse_size
    replay_limit = None if str(max_replay_bytes).lower() == "none" else parse_size(max_replay_bytes)
    if workers > 1 and not offline:
        raise BisectError("--workers applies to a DUT_DUMP (offline bisect); capture the workload with "
                          "`precisiondiff capture WORKLOAD --mode replay -o DIR` and bisect DIR")
    if modules_on_workers and workers <= 1:
        raise BisectError("--modules-on-workers applies with --workers N (N > 1); under torchrun the job's "
                          "processes share the module replays already")
    card = None
    if card_path is not None:
        from ..probe.card import load_card
        card = load_card(card_path)
    distributed = offline and not multi and under_torchrun()
    with _progress() if not distributed or os.environ.get("RANK") == "0" else contextlib.nullcontext() as progress:
        if multi:
            result = bisect_ranks(source, ref=ref, workload=workload, direction=direction,
                                  budgets=list(budgets), progress=progress, across_processes=under_torchrun(),
                                  workers=workers, accept=list(accept), blame_known=blame_known)
            if result is None:  # a torchrun process other than 0: its verdicts went to process 0
                sys.exit(0)
            if result.exit_code == 1 and os.environ.get("TORCHELASTIC_ERROR_FILE"):
                _tell_torchrun(result)
        elif distributed:  # torchrun: the job's processes share the replays; process 0 reports
            from ..bisect.offline import bisect_dump_distributed
            result = bisect_dump_distributed(source, ref_dump, ref=ref, workload=workload, direction=direction,
                                             budgets=list(budgets), progress=progress, accept=list(accept),
                                             allow_narrowed=allow_narrowed, peer=peer,
                                             max_replay_bytes=replay_limit, blame_known=blame_known)
            if result is None:
                sys.exit(0)
            if result.exit_code == 1 and os.environ.get("TORCHELASTIC_ERROR_FILE"):
                _tell_torchrun(result)
        elif offline:
            result = bisect_dump(source, ref_dump, ref=ref, workload=workload, direction=direction,
                                 budgets=list(budgets), progress=progress, accept=list(accept),
                                 allow_narrowed=allow_narrowed, repro=repro_dir, max_elements=max_elements,
                                 peer=peer, workers=workers, max_replay_bytes=replay_limit,
                                 rule=rule, blame_known=blame_known, modules_on_workers=modules_on_workers)
        else:
            result = run_live(source, target=target, ref=ref, direction=direction, seed=seed,
                              budgets=list(budgets), progress=progress, noise=noise, confirm=confirm,
                              accept=list(accept), allow_narrowed=allow_narrowed, repro=repro_dir,
                              max_elements=max_elements, peer=peer, max_replay_bytes=replay_limit, rule=rule,
                              blame_known=blame_known)
    _emit(result, card, multi, fmt, out)


def _emit(result, card, multi: bool, fmt: str, out) -> None:
    """Print or write the report (with the card's explanation), then exit with the verdict's code."""
    from ..bisect.ranks import ranks_summary_lines
    from ..bisect.render import summary_lines
    from ..errors import PrecisionDiffError
    if card is not None and result.culprit:
        from ..probe.explain import explain_culprit
        sentence = explain_culprit(card, result.culprit, result.dut.split("/")[-1].split("+")[0])
        result.culprit["card"] = sentence or f"the card of {card.target} does not measure {result.culprit.get('name')}"
    render = ranks_summary_lines if multi else summary_lines
    text = result.dumps() if fmt == "json" else "\n".join(render(result))
    if card is not None and result.culprit and fmt != "json":
        text += f"\ndevice card: {result.culprit['card']}"
    if out:  # like compare -o: the file only, and a line on stderr saying where it went
        try:
            with open(out, "w", encoding="utf-8") as fh:
                fh.write(text + "\n")
        except OSError as err:
            raise PrecisionDiffError(f"cannot write {out}: {err.strerror or err}; choose a writable path") from err
        click.echo(f"wrote {out} (verdict {result.verdict})", err=True)
    else:
        click.echo(text)
    sys.exit(result.exit_code)


def _bisect_script(script: str, args: list, keep, *, target, workload, noise, confirm, fmt, out, card_path,
                   **options) -> None:
    """``bisect --script``: every process captures and bisects (precisiondiff/bisect/script.py);
    process 0 writes the report. Under torchrun only process 0 exits with the verdict's code, so
    that torchrun lists one failed process, whose message says it is the verdict."""
    from ..bisect.ranks import RanksBisectResult, is_multi_rank
    from ..bisect.script import bisect_script
    from ..errors import BisectError
    if confirm:
        raise BisectError("--confirm has no effect with --script: the culprit is judged from each rank's "
                          "recorded inputs (substitution would rerun the whole job)")
    for flag, given in (("--target", target), ("--workload", workload), ("--noise", noise)):
        if given:
            raise BisectError(f"{flag} has no effect with --script: the script places its model and registers "
                              "its ops itself")
    if args and (os.path.isfile(os.path.join(args[0], "meta.json")) or is_multi_rank(args[0])):
        raise BisectError(f"give a dump or --script FILE, not both ({args[0]!r}); the script's own "
                          "arguments go after --")
    card = None
    if card_path is not None:
        from ..probe.card import load_card
        card = load_card(card_path)
    process = int(os.environ.get("RANK", "0"))
    with (_progress() if process == 0 else contextlib.nullcontext()) as progress:
        result = bisect_script(script, args, keep=keep, progress=progress, **options)
    if process != 0:  # every process has the verdict; process 0 reports it
        sys.exit(0)
    if result.exit_code == 1 and os.environ.get("TORCHELASTIC_ERROR_FILE"):
        _tell_torchrun(result)
    try:
        _emit(result, card, isinstance(result, RanksBisectResult), fmt, out)
    finally:
        from ..bisect.script import wait_for_local_peers
        wait_for_local_peers()


def _tell_torchrun(result) -> None:
    """torchrun reports a process that exits 1 as failed; its error file says why: the verdict."""
    import json
    import time
    c = result.culprit or {}
    where = (f" on rank(s) {c['ranks']}" if c.get("kind") == "collective" else
             f" on rank {c['rank']}" if c.get("rank") is not None else "")
    message = (f"not a crash: precisiondiff bisect found a culprit, {c.get('kind')} {c.get('name')} in "
               f"{c.get('scope') or '<root>'}{where} (exit code 1; see its report)")
    try:
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w", encoding="utf-8") as fh:
            json.dump({"message": {"message": message, "extraInfo": {"py_callstack": message,
                                                                      "timestamp": str(int(time.time()))}}}, fh)
    except OSError:
        pass
