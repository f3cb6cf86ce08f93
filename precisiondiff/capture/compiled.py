"""The compiled front of op-level capture (optional): a C++ dispatcher hook that records the common
op call without entering Python, the Python :class:`~.dispatch.OpCaptureMode` kept for every
other call and as the oracle (``engine="compiled"``; docs/capture.md, "The compiled engine").

The hook (``csrc/op_hook.cpp``, built with ``torch.utils.cpp_extension`` on first use, cached
on disk) sits on a dispatch key held in thread-local state, above autograd. For a call the
Python side marks recordable (no write, not a collective; :meth:`CompiledOps._describe`, once
per op), while the session would record it (:meth:`CompiledOps._gate`, once per call), with
every tensor argument a plain CPU tensor, it records the call itself: a floating tensor measured
at once by the same statistics kernel (its C entry point, :mod:`._stats_cjit`), any other through
:class:`~.stats.StatsBatch`; the hook formats the records, :meth:`CompiledOps.drain` numbers and
queues them. The Python mode never sees that call. The events reach the recorder in execution order: whatever the Python side records
next (a module, an op of its own, a read-back) drains the hook's events first.

What it records is what the Python path records, bit for bit
(``tests/capture/test_compiled_engine.py``): the same events, call numbers, statistics.
Statistics mode only; without a C++ compiler, or in another mode, capture uses the Python path
(``meta.json``: ``capture_engine``).
"""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch

from .dispatch import _in_hop_compile

if TYPE_CHECKING:
    from .dispatch import OpCaptureMode

__all__ = ["ENGINES", "load", "held", "unavailable_reason", "CompiledOps"]

log = logging.getLogger(__name__)

ENGINES = ("python", "compiled")
_SOURCE = Path(__file__).with_name("csrc") / "op_hook.cpp"
_SLOW, _PASS, _RECORD = 0, 1, 2  # the hook's codes (op_hook.cpp)
BATCH = 256  # events the hook holds before it hands them over
_EXT: Any = None
_ERROR: Optional[str] = None
_HELD: "Optional[CompiledOps]" = None  # the session holding the hook (its state is process-wide)
_HOPS = getattr(torch._ops, "_higher_order_ops", {})  # name -> HigherOrderOperator, as torch builds them


def _build_dir() -> Path:
    digest = hashlib.sha1(_SOURCE.read_bytes()).hexdigest()[:12]
    root = os.environ.get("PRECISIONDIFF_BUILD_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "precisiondiff")
    path = Path(root) / f"op_hook-torch{torch.__version__.split('+')[0]}-{digest}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def load() -> Any:
    """The compiled hook's module, built on first use (~30-60 s; then loaded from the cache), or
    None when it cannot be built here (:func:`unavailable_reason` says why). Never raises."""
    global _EXT, _ERROR
    if _EXT is not None or _ERROR is not None:
        return _EXT
    try:
        from torch.utils.cpp_extension import load as build
        _EXT = build(name="precisiondiff_op_hook", sources=[str(_SOURCE)], build_directory=str(_build_dir()),
                     extra_cflags=["-O2"], verbose=False)
    except Exception as err:  # noqa: BLE001 - no compiler, no headers, a failed build: the Python path
        text = f"{err}"
        # the compiler's first error, not the command line ninja echoes first
        first = next((line for line in text.splitlines() if "error" in line.lower() and ":" in line), "")
        _ERROR = " ".join(f"{type(err).__name__}: {first.strip() or text}".split())[:300]
        log.warning("capture's compiled engine is unavailable (%s): using the Python path", _ERROR)
    return _EXT


def held() -> "Optional[CompiledOps]":
    """The compiled hook of the capture session using it, if one is (the hook is process-wide)."""
    return _HELD


def unavailable_reason() -> Optional[str]:
    """Why :func:`load` returned None (None when it has not failed)."""
    return _ERROR


class CompiledOps:
    """The compiled hook bound to one :class:`~.dispatch.OpCaptureMode` (one session).

    Args:
        mode: the session's op mode: its op descriptions, scope filter and recorder.
        ext: the module :func:`load` returned.
    """

    def __init__(self, mode: "OpCaptureMode", ext: Any) -> None:
        global _HELD
        if _HELD is not None:
            raise RuntimeError("another capture session holds the compiled hook")
        _HELD = self
        self.mode = mode
        self.ext = ext
        self._keys: List[Tuple[str, str]] = []  # (scope, direction) by the hook's key id
        self._key_ids: Dict[Tuple[str, bool], int] = {}
        self._draining = False
        self._on = False
        self._hops_known = -1
        from . import stats_kernel
        entries = stats_kernel.c_entries() if mode.session.recorder._stats.fast else None
        order = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
        # without numba's C entry points every tensor is measured through StatsBatch (slower)
        kernels = [entries["functions"][d] for d in order] if entries else []
        infinities = [entries["infinities"][d] for d in order] if entries else []
        ext.configure(self._gate, self._describe, self._measure, self.drain,
                      (torch.Tensor, torch.nn.Parameter), kernels, infinities,
                      entries["table"] if entries else 0, entries["cumulative"] if entries else 0, BATCH)

    # -- the hook's callbacks (errors become capture errors: never the workload's) ---------------
    def _describe(self, qualified: str, overload: str) -> int:
        """What the hook does with every call of op ``qualified.overload``: record it, let it
        pass (nothing recorded, nothing to note), or leave it to the Python mode."""
        try:
            namespace, _, name = qualified.partition(".")
            func = getattr(getattr(getattr(torch.ops, namespace), name), overload)
            info = self.mode._info.get(func) or self.mode._describe(func)
        except Exception as err:  # noqa: BLE001 - an op torch.ops cannot name: the Python mode
            log.debug("compiled capture leaves %s.%s to the Python mode: %s", qualified, overload, err)
            return _SLOW
        if info.hop or info.writes or info.collective or info.outs or info.overwrites_self \
                or info.uninitialized or info.mutable:
            return _SLOW
        return _RECORD if info.name else _PASS

    def _gate(self) -> int:
        """Per call: the id of (scope, backward) the hook records it under, or -1 when the
        Python mode must see it (the session paused or not recording, a collective in flight, an
        uninitialized buffer live, an optimizer update, a scope filtered out)."""
        try:
            mode = self.mode
            session = mode.session
            if mode.deferred.items or mode._pending or session.paused or not session.recording \
                    or _in_hop_compile():
                return -1
            updates = session._updates
            if updates is not None and updates.stack:
                return -1
            scope, backward, wanted = mode.scope_now()
            if not wanted:
                return -1
            key = (scope, backward)
            found = self._key_ids.get(key)
            if found is None:
                found = self._key_ids[key] = len(self._keys)
                self._keys.append((scope, "backward" if backward else "forward"))
                self.ext.add_key(found, *self._keys[found])
            return found
        except Exception as err:  # noqa: BLE001
            self.mode.session.capture_failed(err)
            return -1

    def _measure(self, t: torch.Tensor) -> int:
        """A statistics handle for a tensor the hook does not measure itself (not floating, a
        negative view, empty)."""
        return self.mode.session.recorder._stats.add(t)

    # -- the session's side ------------------------------------------------------------------------
    def enable(self, on: bool) -> None:
        """Turn the hook on or off on this thread (with the op mode's enter and exit)."""
        self._on = on
        if on and len(_HOPS) != self._hops_known:
            self._hops_fall_through()
        self.ext.enable(on)

    def _hops_fall_through(self) -> None:
        """Make every higher-order operator skip the hook's key. A HOP dispatches in Python from
        the keys in thread-local state: the hook's key (which Python cannot name) would be the
        highest and it has no Python kernel for it ("could not find kernel for HigherOrderOperator
        ... at dispatch key DispatchKey.???"). The key is found as the difference the hook makes
        to the include set; HOPs built later are handled at the next enable."""
        before = torch._C._dispatch_tls_local_include_set()
        self.ext.enable(True)
        try:
            ours = torch._C._dispatch_tls_local_include_set() - before
        finally:
            self.ext.enable(False)
        for hop in list(_HOPS.values()):
            hop.non_fallthrough_keys = hop.non_fallthrough_keys - ours
        self._hops_known = len(_HOPS)

    def drain(self) -> None:
        """Hand the hook's events to the recorder, in order: numbered, measured, finished."""
        if self._draining:
            return
        self._draining = True
        try:
            idents = self.ext.idents()
            if not idents:
                return
            rec = self.mode.session.recorder
            counters, calls = rec._calls, []
            for ident in idents:  # call numbers from the counters the Python mode's events use too
                call = counters.get(ident, 0)
                counters[ident] = call + 1
                calls.append(call)
            step, multi = rec.step, rec.multi_step
            prefix = f"step{step}/" if multi is True or (multi is None and step > 0) else ""
            events, fixups = self.ext.build(calls, rec.seq, step, rec.rank, prefix)
            rec.add_records(events, fixups)
        except Exception as err:  # noqa: BLE001
            self.mode.session.capture_failed(err)
        finally:
            self._draining = False
        self._check()

    def _check(self) -> None:
        error = self.ext.counts()[2]
        if error:
            self.mode.session.capture_failed(RuntimeError(f"compiled capture: {error}"))

    def counts(self) -> Dict[str, int]:
        """Calls recorded by the hook and calls it left to the Python mode."""
        fast, slow, _ = self.ext.counts()
        return {"compiled_events": int(fast), "python_calls": int(slow)}

    def close(self) -> None:
        """Drain, then release the hook's references to this session."""
        global _HELD
        self.enable(False)
        try:
            self.drain()
        finally:
            self.ext.reset()
            _HELD = None
