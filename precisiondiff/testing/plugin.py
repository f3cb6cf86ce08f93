"""The pytest plugin: numerical parity as a one-line test.

Installed through the ``pytest11`` entry point, so installing precisiondiff enables it.

* the ``parity`` fixture: ``parity.check(workload, ...)`` and ``parity.check_op(fn, *inputs, ...)``
  run on the DUT and the reference, fail the test with a compact report (first divergence,
  culprit found by bisect, its local error against its budget) and return the result;
* the ``parity`` marker: ``@pytest.mark.parity(target=..., ref=..., max_ulp=..., ...)`` sets
  defaults for a test, class or module; unknown keywords are a usage error;
* options (one group): ``--parity-target`` (comma-separated: one test per target),
  ``--parity-ref``, ``--parity-dump-dir``, ``--parity-bisect/--no-parity-bisect``, ``--parity-seed``,
  ``--parity-kernels`` (every ``check`` runs with ``kernels=True``: a kernel CI's switch),
  ``--parity-accept OP[@SCOPE]`` (repeatable: findings bisect passes over, as ``--accept``).

Tests using ``parity`` are parametrized by target, so ``pytest -v`` shows ``test_x[cpu/bf16]``;
a target whose device is missing skips the test with the reason, whether the target came from
the command line, a marker or the call itself.

The plugin is quiet: installing precisiondiff enables it in every pytest run, so at start-up it
loads neither torch nor click; torch (and a device) is touched only by a test that uses the
``parity`` fixture or marker, or by an explicit ``--parity-target``/``--parity-ref``.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest

from ..errors import PrecisionDiffError

if TYPE_CHECKING:
    from ..runtime.targets import Target

__all__ = ["MARKER_KEYS", "ParitySettings", "ParityFixture"]

# Keywords the marker accepts, and what they set (documented in docs/pytest.md).
MARKER_KEYS = ("target", "ref", "rel_l2", "max_ulp", "min_cosine", "kernels", "direction", "bisect", "seed",
               "accept")
_BUDGETS = ("rel_l2", "max_ulp", "min_cosine")


@dataclass(frozen=True)
class ParitySettings:
    """Where and how parity checks run: command line, then markers (closest wins), then calls."""

    target: Optional[str] = None
    ref: str = "cpu/float64"
    dump_dir: Optional[str] = None
    bisect: bool = True
    seed: int = 0
    kernels: bool = False
    direction: Optional[str] = None
    budgets: Dict[str, float] = field(default_factory=dict)
    accept: Tuple[str, ...] = ()

    def merged(self, **values: Any) -> "ParitySettings":
        budgets = dict(self.budgets)
        budgets.update({k: values.pop(k) for k in list(values) if k in _BUDGETS})
        if "accept" in values:  # accepts add up: command line, markers, the call
            more = values.pop("accept")
            values["accept"] = self.accept + ((more,) if isinstance(more, str) else tuple(more))
        return replace(self, budgets=budgets, **values)


_SETTINGS = pytest.StashKey[ParitySettings]()


def _option_table() -> ModuleType:
    """The shared option table (plain data: importing it loads neither click nor torch)."""
    from ..cli import options
    return options


def _target(text: str) -> "Target":
    from ..runtime.targets import Target
    return Target.parse(text)


def _default_dut() -> "Target":
    from ..runtime.targets import default_dut
    return default_dut()


def pytest_addoption(parser: pytest.Parser) -> None:
    options = _option_table()
    group = parser.getgroup("precisiondiff", "numerical parity (precisiondiff)")
    options.pytest_options(group, *options.PYTEST_OPTIONS)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "parity(target=None, ref=None, rel_l2=None, max_ulp=None, min_cosine=None, kernels=False, "
        "direction=None, bisect=True, seed=0, accept=()): defaults for the parity fixture in this test, class "
        "or module (precisiondiff)")
    config.stash[_SETTINGS] = ParitySettings(
        target=config.getoption("parity_target"), ref=config.getoption("parity_ref"),
        dump_dir=config.getoption("parity_dump_dir"), bisect=config.getoption("parity_bisect"),
        seed=config.getoption("parity_seed"), kernels=config.getoption("parity_kernels"),
        accept=tuple(config.getoption("parity_accept") or ()))
    _check_targets(config)


def _check_targets(config: pytest.Config) -> None:
    """A bad ``--parity-target``/``--parity-ref`` is a usage error before anything runs (only
    when given: parsing a target loads torch)."""
    s = config.stash[_SETTINGS]
    default_ref = _option_table().REF.default
    given = [("--parity-target", s.target)] + ([("--parity-ref", s.ref)] if s.ref != default_ref else [])
    for flag, text in given:
        for part in (text or "").split(","):
            if part.strip():
                try:
                    _target(part)
                except PrecisionDiffError as err:
                    raise pytest.UsageError(f"{flag}: {err}") from None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    """Validate every parity marker once, before anything runs: a typo is a usage error."""
    for item in items:
        for mark in item.iter_markers("parity"):
            _validate(mark, item)


def pytest_report_header(config: pytest.Config) -> str:
    s = config.stash[_SETTINGS]  # the default DUT is not resolved here: that would probe devices
    return (f"precisiondiff: parity target {s.target or 'default (first available of mlu, cuda, cpu in bf16)'}, "
            f"ref {s.ref}, bisect {'on' if s.bisect else 'off'}" + (", kernels on" if s.kernels else "")
            + (f", dumps in {s.dump_dir}" if s.dump_dir else ""))


def _marker_values(node: Any) -> Dict[str, Any]:
    """Marker keywords for a node, the closest marker winning (function over class over module)."""
    values: Dict[str, Any] = {}
    for mark in reversed(list(node.iter_markers("parity"))):  # validated at collection's end
        values.update({k: v for k, v in mark.kwargs.items() if k in MARKER_KEYS})
    return values


def _validate(mark: pytest.Mark, node: Any) -> None:
    where = getattr(node, "nodeid", "")
    if mark.args:
        raise pytest.UsageError(f"{where}: @pytest.mark.parity takes keyword arguments only "
                                f"({', '.join(MARKER_KEYS)}), got positional {mark.args!r}")
    unknown = sorted(set(mark.kwargs) - set(MARKER_KEYS))
    if unknown:
        raise pytest.UsageError(f"{where}: unknown @pytest.mark.parity argument(s) {', '.join(unknown)}; "
                                f"use {', '.join(MARKER_KEYS)}")
    for key in ("target", "ref"):
        if mark.kwargs.get(key) is not None:
            try:
                _target(mark.kwargs[key])
            except PrecisionDiffError as err:
                raise pytest.UsageError(f"{where}: @pytest.mark.parity({key}=...): {err}") from None
    if mark.kwargs.get("direction") not in (None, "forward", "backward"):
        raise pytest.UsageError(f"{where}: @pytest.mark.parity(direction=...) must be forward or backward")


def _targets(config: pytest.Config, node: Any) -> List[str]:
    marked = _marker_values(node).get("target")
    text = marked or config.stash[_SETTINGS].target
    if text is None:
        return [str(_default_dut())]
    targets = []
    for part in str(text).split(","):
        try:
            targets.append(str(_target(part)))
        except PrecisionDiffError:  # a bad marker target: reported by the marker validation
            targets.append(part.strip())
    return targets


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "parity_target" in metafunc.fixturenames:
        targets = _targets(metafunc.config, metafunc.definition)
        metafunc.parametrize("parity_target", targets, ids=targets, indirect=True, scope="function")


@pytest.fixture
def parity_target(request: pytest.FixtureRequest) -> str:
    """The DUT target this test runs on (parametrized from ``--parity-target`` or the marker)."""
    return getattr(request, "param", None) or _targets(request.config, request.node)[0]


def _safe(nodeid: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_")[:150]


def _skip_if_absent(*targets: "Target") -> None:
    """Skip the running test, with the reason, when a target's device is not on this machine."""
    for which in targets:
        try:
            which.check_available()
        except PrecisionDiffError as err:
            pytest.skip(f"parity target {which} is not available: {err}")


class ParityFixture:
    """What the ``parity`` fixture yields: :meth:`check` and :meth:`check_op`, judged and reported.

    A target (or reference) whose device is absent skips the test, however it was given: the
    command line, a marker, or the call (``parity.check(w, target="mlu/bf16")``).

    Example:
        >>> def test_model(parity):
        ...     parity.check("examples/tiny_transformer.py:build")
    """

    def __init__(self, settings: ParitySettings, nodeid: str, *, force_kernels: bool = False) -> None:
        self.settings = settings
        self.nodeid = nodeid
        self.force_kernels = force_kernels  # --parity-kernels: wins over markers and calls
        self.results: List[Any] = []

    @property
    def target(self) -> "Target":
        return _target(self.settings.target) if self.settings.target else _default_dut()

    @property
    def ref(self) -> "Target":
        return _target(self.settings.ref)

    def _settings(self, overrides: Dict[str, Any]) -> Tuple[ParitySettings, Dict[str, Any]]:
        unknown = sorted(set(overrides) - set(MARKER_KEYS))
        if unknown:
            raise PrecisionDiffError(f"unknown parity option(s) {', '.join(unknown)}; use "
                                     f"{', '.join(MARKER_KEYS)}")
        s = self.settings.merged(**{k: v for k, v in overrides.items() if v is not None})
        if self.force_kernels:
            s = replace(s, kernels=True)
        _skip_if_absent(_target(s.target) if s.target else _default_dut(), _target(s.ref))
        return s, {k: v for k, v in s.budgets.items() if v is not None}

    def _dump_dir(self) -> Optional[str]:
        if not self.settings.dump_dir:
            return None
        return os.path.join(self.settings.dump_dir, _safe(self.nodeid), str(len(self.results)))

    def _finish(self, result: Any, expect: bool) -> Any:
        __tracebackhide__ = True
        self.results.append(result)
        if expect and not result.passed:
            pytest.fail(result.report(), pytrace=False)
        return result

    def check(self, workload: Any, inputs: Any = None, *, loss: Optional[Callable] = None,
              expect: bool = True, **options: Any) -> Any:
        """Run ``workload`` on the DUT and the reference and judge it; fail the test on divergence.

        Args:
            workload: a Workload, a factory, a ``file.py:fn`` spec, ``(model, inputs)`` or a model.
            inputs: the inputs when ``workload`` is a model.
            loss: a loss on the output (enables gradients).
            expect: fail the test on a divergence (False: just return the result).
            **options: any marker keyword (target, ref, rel_l2, max_ulp, min_cosine, kernels,
                direction, bisect, seed, accept).

        Returns:
            The :class:`precisiondiff.parity.ParityResult`.
        """
        __tracebackhide__ = True
        from . import parity
        s, budgets = self._settings(options)
        result = parity.check(workload, inputs, target=s.target, ref=s.ref, loss=loss, seed=s.seed,
                              bisect=s.bisect, kernels=s.kernels, direction=s.direction,
                              dump_dir=self._dump_dir(), accept=list(s.accept), **budgets)
        return self._finish(result, expect)

    def check_op(self, fn: Callable[..., Any], *inputs: Any, expect: bool = True,
                 kwargs: Optional[Dict[str, Any]] = None, name: Optional[str] = None, **options: Any) -> Any:
        """Run one function or op on the DUT and on the reference (the DUT's inputs upcast).

        Args:
            fn: an ATen overload, a torch function or any callable.
            *inputs: its positional arguments.
            expect: fail the test on a divergence (False: just return the result).
            kwargs: its keyword arguments.
            name: the op name choosing its budget class (default: from ``fn``).
            **options: target, ref and budgets (rel_l2, max_ulp, min_cosine); ``kernels`` does not
                apply (the op itself is what is judged).

        Returns:
            The :class:`precisiondiff.parity.ParityResult`.
        """
        __tracebackhide__ = True
        from . import parity
        s, budgets = self._settings(options)
        result = parity.check_op(fn, *inputs, target=s.target, ref=s.ref, name=name, kwargs=kwargs,
                                 **budgets)
        return self._finish(result, expect)


@pytest.fixture
def parity(request: pytest.FixtureRequest, parity_target: str) -> Iterator[ParityFixture]:
    """Numerical parity checks on ``--parity-target`` against ``--parity-ref``.

    Skips the test when the target's device is not available here.
    """
    configured = request.config.stash[_SETTINGS]
    settings = replace(configured.merged(**_marker_values(request.node)), target=parity_target)
    _skip_if_absent(_target(parity_target), _target(settings.ref))
    fixture = ParityFixture(settings, request.node.nodeid, force_kernels=configured.kernels)
    yield fixture
    for result in fixture.results:
        request.node.user_properties.append(("parity", f"{result.name} on {result.target}: "
                                             f"{'pass' if result.passed else 'fail'}"))
