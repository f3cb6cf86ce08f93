"""Options defined once, shared by the CLI and the pytest plugin.

The table is plain data: click loads only when a command is decorated (:func:`click_options`),
so the pytest plugin reads it at start-up without loading click.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Tuple

__all__ = ["Option", "CAPTURE_OPTIONS", "PYTEST_OPTIONS", "click_options", "pytest_options"]


@dataclass(frozen=True)
class Option:
    """One option: its flag(s), default, help and choices."""

    flags: Tuple[str, ...]
    default: Any = None
    help: str = ""
    choices: Tuple[str, ...] = ()
    type: Any = str
    is_flag: bool = False
    negatable: bool = False  # a boolean flag with a ``--no-`` form: --bisect/--no-bisect
    multiple: bool = False  # repeatable: its values are collected in a list

    @property
    def dest(self) -> str:
        return self.flags[0].lstrip("-").replace("-", "_")

    def renamed(self, flag: str, **changes: Any) -> "Option":
        """The same option under another long flag (the pytest plugin prefixes ``--parity-``)."""
        from dataclasses import replace
        return replace(self, flags=(flag,), **changes)


TARGET = Option(("--target", "-t"), None, "device under test, DEVICE[/DTYPE][+autocast]; default: first "
                "available of mlu, cuda, cpu in bf16")
REF = Option(("--ref",), "cpu/float64", "reference target (the golden run)")
LEVEL = Option(("--level",), "all", "record modules, ops, or both", ("module", "op", "all"))
MODE = Option(("--mode",), "stats", "statistics only, full tensors, or everything needed to replay",
              ("stats", "tensors", "replay"))
FORMAT = Option(("--format",), "safetensors", "dump format", ("safetensors", "h5"))
SEED = Option(("--seed",), 0, "seed applied to every RNG before the workload is built", type=int)
SCOPE = Option(("--scope",), None, "record only modules whose path matches this regex")
SCOPE_EXCLUDE = Option(("--scope-exclude",), None, "skip modules whose path matches this regex")
OP = Option(("--op",), None, "record only ops whose name matches this regex (aten.addmm.default)")
OP_EXCLUDE = Option(("--op-exclude",), None, "skip ops whose name matches this regex")
STEPS = Option(("--steps",), None, "steps to record, e.g. 0 or 0,2-4 (default: step 0 of a workload, "
               "every step of a script)")
RANKS = Option(("--ranks",), None, "ranks to record, e.g. 0 or 0-3 (default: all)")

DUMP_DIR = Option(("--dump-dir",), None, "keep the dumps (DUT and reference) of failing checks here, "
                  "for `precisiondiff report`")
BISECT = Option(("--bisect",), True, "on a parity failure, bisect to the culprit op and report it",
                type=bool, is_flag=True, negatable=True)
ACCEPT = Option(("--accept",), None, "accept a finding you have read, OP[@SCOPE] (repeatable; also "
                "[tool.precisiondiff] accept in pyproject.toml or precisiondiff.toml): that op does not "
                "offend and the next offending unit becomes the culprit", multiple=True)
KERNELS = Option(("--kernels",), False, "judge every op against its own budget (kernels=True) in every "
                 "parity check, even when the final output is within its bound: a kernel CI's switch",
                 type=bool, is_flag=True)

CAPTURE_OPTIONS = (TARGET, LEVEL, MODE, FORMAT, SEED, SCOPE, SCOPE_EXCLUDE, OP, OP_EXCLUDE, STEPS, RANKS)


# The pytest plugin's options: the shared ones under the --parity- prefix, in one option group.
PYTEST_OPTIONS = (
    TARGET.renamed("--parity-target"),
    REF.renamed("--parity-ref"),
    DUMP_DIR.renamed("--parity-dump-dir"),
    BISECT.renamed("--parity-bisect"),
    SEED.renamed("--parity-seed"),
    KERNELS.renamed("--parity-kernels"),
    ACCEPT.renamed("--parity-accept"),
)


def pytest_options(group: Any, *options: Option) -> None:
    """Add options to a pytest option group (``parser.getgroup(...)``)."""
    for opt in options:
        if opt.is_flag:
            group.addoption(*opt.flags, action="store_true", dest=opt.dest, default=opt.default,
                            help=opt.help)
            if opt.negatable:
                group.addoption("--no-" + opt.flags[0].lstrip("-"), action="store_false",
                                dest=opt.dest, help=f"do not: {opt.help}")
            continue
        kwargs: dict = {"dest": opt.dest, "default": opt.default, "help": opt.help}
        if opt.multiple:
            kwargs["action"] = "append"
        if opt.choices:
            kwargs["choices"] = opt.choices
        if opt.type is not str:
            kwargs["type"] = opt.type
        group.addoption(*opt.flags, **kwargs)


def click_options(*options: Option) -> Callable[[Callable], Callable]:
    """Decorate a click command with the given options."""
    import click

    def decorate(fn: Callable) -> Callable:
        for opt in reversed(options):
            kwargs: dict = {"default": opt.default, "help": opt.help, "show_default": opt.default is not None}
            if opt.choices:
                kwargs["type"] = click.Choice(opt.choices)
            elif opt.is_flag and opt.negatable:
                name = opt.flags[0].lstrip("-")
                fn = click.option(f"--{name}/--no-{name}", opt.dest, **kwargs)(fn)
                continue
            elif opt.is_flag:
                kwargs["is_flag"] = True
            elif opt.multiple:
                kwargs.update(multiple=True, show_default=False, metavar="OP[@SCOPE]")
            else:
                kwargs["type"] = opt.type
            fn = click.option(*opt.flags, opt.dest, **kwargs)(fn)
        return fn
    return decorate
