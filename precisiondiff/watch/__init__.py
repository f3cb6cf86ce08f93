"""Watch: a cheap monitor of long training runs, and the comparison of two runs' watch logs.

``with precisiondiff.watch("runs/w", model=model, optimizer=opt) as w: ...; w.step(loss=loss)``
writes, per step, a few statistics of every layer's output and output gradient, of every
parameter's weight and gradient (and, with an optimizer, its state and the update/weight ratio)
and the loss, into one line-oriented log (docs/watch.md). :func:`compare_logs` finds the first
step, layer and tensor at which two runs part by more than rounding explains.

A stage beside capture: may import runtime/, capture/ (its statistics and, for replay steps, its
session), store/, comparators/ and report/ (its plot helpers); never compare/, bisect/ or the
faces (cli/, testing/).
``precisiondiff.watch(...)`` calls :func:`watch` (the package is callable, see ``_callable.py``).
"""
from .compare import WatchComparison, compare_logs
from .log import LOG_FILE, WatchLog, is_watch_log, read_logs
from .monitor import Watch, WatchWarning, watch

__all__ = ["LOG_FILE", "WatchLog", "is_watch_log", "read_logs", "Watch", "WatchWarning", "watch",
           "WatchComparison", "compare_logs"]

from .._callable import make_callable  # noqa: E402

make_callable(__name__, "watch")
