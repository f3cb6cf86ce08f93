"""Wrapper prefixes: one side's module paths seen through the wrappers a framework adds, so they
align with an unwrapped reference (:func:`unwrap`). Pure Python, no torch.

A job's model is often wrapped where the reference is not: DDP, DeepSpeed and Megatron's
``Float16Module`` keep the model as ``.module`` (every path gets ``module.``; both together give
``module.module.``), ``torch.compile`` as ``._orig_mod``, FSDP1 and activation checkpointing wrap
each block (``_fsdp_wrapped_module.`` and ``_checkpoint_wrapped_module.`` inside the paths).

* **Wrapper components** anywhere in a path (``_fsdp_wrapped_module``,
  ``_checkpoint_wrapped_module``, ``_orig_mod``: names no model gives its own children) are dropped
  on the side that has them when the other side has none.
* **A common leading prefix**: when every non-root path of one side starts with the same
  components and the other side's do not, the prefix length whose removal makes the most paths of
  both sides equal is removed (only when it makes at least as many equal as keeping it, and only a prefix of
  wrapper attributes — ``module``, ``_orig_mod``... — unless the two root modules differ in class:
  a wrapper of another name). The wrapper's own
  events (the root module ``DistributedDataParallel``, ``Float16Module``..., and the ops it runs
  at its own paths) get the scope ``(wrapper)``: they stay unmatched instead of shifting the
  model's root events. Ops at the root path stay there: in a script they are the program's own
  (initialization, the loss, the optimizer's), the wrapper's among them stay unmatched by the
  op sequence alignment.

A ``--script`` capture also names the modules it first meets outside every module it knows
(a ``torch.nn.Softmax()`` built inside a forward, as Megatron's softmax does) as new roots,
``Class_N`` (capture/hooks.py). Those subtrees are neither the wrapper nor the model: they are
left out of the common prefix and keep their paths. So are the scopes of parameter updates
(``optimizer.param_groups.0/module.fc1.weight``, capture/optimizer.py): the prefix is removed from
the parameter's path after the ``/``.

Only the paths alignment matches on change; rows keep each dump's own paths.
"""
from __future__ import annotations

import re
from typing import Any, Callable, List, Sequence, Set, Tuple

__all__ = ["WRAPPER_COMPONENTS", "WRAPPER_SCOPE", "unwrap", "wrapper_prefix"]

WRAPPER_COMPONENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")
WRAPPER_SCOPE = "(wrapper)"
# the attribute under which a wrapper keeps the model it wraps (DDP, DeepSpeed, Megatron, compile)
WRAPPER_ATTRIBUTES = ("module",) + WRAPPER_COMPONENTS


def _script_roots(events: Sequence) -> Set[str]:
    """The first path components that are a script capture's extra roots (``Softmax_3``: a
    module event at that path whose class is ``Softmax``)."""
    return {e.scope for e in events
            if e.kind == "module" and "." not in e.scope and re.fullmatch(re.escape(e.name) + r"_\d+", e.scope)}


def _has_components(events: Sequence) -> bool:
    return any(c in WRAPPER_COMPONENTS for scope in {e.scope for e in events} for c in re.split(r"[./]", scope))


def _rescoped(events: Sequence, new_scope: Callable[[Any], str]) -> list:
    """``events`` with the scopes ``new_scope(event)`` (an event whose scope stays is kept)."""
    out = []
    for e in events:
        scope = new_scope(e)
        out.append(e if scope == e.scope else type(e)(e.index, e.seq, e.kind, scope, e.name, e.direction,
                                                      e.call, e.step, e.out_shapes))
    return out


def _drop_components(scope: str) -> str:
    head, slash, path = scope.rpartition("/")  # an update's scope: the parameter's path after the /
    return head + slash + ".".join(c for c in path.split(".") if c not in WRAPPER_COMPONENTS)


def _common_prefix(scopes: Sequence[str]) -> List[str]:
    paths = [s.split(".") for s in scopes if s]
    if not paths:
        return []
    prefix = paths[0]
    for p in paths[1:]:
        n = 0
        while n < len(prefix) and n < len(p) and prefix[n] == p[n]:
            n += 1
        prefix = prefix[:n]
    return prefix


def _strip(scope: str, prefix: str, extra_roots: Set[str] = frozenset()) -> str:
    if "/" in scope:  # a parameter update's scope, optimizer.param_groups.0/PARAM: the parameter's path
        head, _, param = scope.partition("/")
        inner = _strip(param, prefix, extra_roots)
        return scope if inner == WRAPPER_SCOPE else f"{head}/{inner}"
    if scope.split(".", 1)[0] in extra_roots:
        return scope
    if scope == prefix:
        return ""
    if scope.startswith(prefix + "."):
        return scope[len(prefix) + 1:]
    return WRAPPER_SCOPE  # the wrapper itself, or a level of it above the model


def _best_prefix(mine: Sequence[str], theirs: Sequence[str], any_name: bool,
                 extra_roots: Set[str] = frozenset()) -> str:
    """The leading prefix of ``mine`` (update scopes and paths under ``extra_roots`` left out) whose removal
    matches most paths of ``theirs`` ("" if none does better than keeping it); of wrapper
    attributes only unless ``any_name``."""
    prefix = _common_prefix([s for s in mine if "/" not in s and s.split(".", 1)[0] not in extra_roots])
    if not any_name:
        n = 0
        while n < len(prefix) and prefix[n] in WRAPPER_ATTRIBUTES:
            n += 1
        prefix = prefix[:n]
    theirs_set = set(theirs)
    under = [s == ".".join(prefix) or s.startswith(".".join(prefix) + ".") for s in theirs if s]
    if not prefix or (under and all(under)):
        return ""
    mine_set = set(mine)
    kept = len(mine_set & theirs_set)  # the wrapper's root "" matches the other's root: a tie
    best, best_score = "", 0
    for k in range(1, len(prefix) + 1):
        p = ".".join(prefix[:k])
        score = len({_strip(s, p, extra_roots) for s in mine_set} & theirs_set)
        if score > best_score and score >= kept:
            best, best_score = p, score
    return best


def _root_name(events: Sequence) -> str:
    return next((e.name for e in events if e.kind == "module" and e.scope == ""), "")


def unwrap(a: Sequence, b: Sequence) -> Tuple[list, list, List[str]]:
    """``a`` and ``b`` (:class:`~precisiondiff.compare.align.EventRef`) with the wrapper prefix of
    one side removed from its scopes (module docstring), and a note saying what was removed.

    Returns:
        ``(a, b, notes)``; the same events when neither side is wrapped.

    Example:
        >>> from precisiondiff.compare.align import EventRef
        >>> ev = lambda i, scope, name: EventRef(i, i, "module", scope, name, "forward")
        >>> a = [ev(0, "module.0", "Linear"), ev(1, "module", "Sequential"), ev(2, "", "DistributedDataParallel")]
        >>> b = [ev(0, "0", "Linear"), ev(1, "", "Sequential")]
        >>> [e.scope for e in unwrap(a, b)[0]]
        ['0', '', '(wrapper)']
    """
    sides = [list(a), list(b)]
    notes: List[str] = []
    for me, label in ((0, "A"), (1, "B")):
        mine, theirs = sides[me], sides[1 - me]
        if _has_components(mine) and not _has_components(theirs):
            dropped = {scope: _drop_components(scope) for scope in {e.scope for e in mine}}
            sides[me] = _rescoped(mine, lambda e: dropped[e.scope])
            notes.append(f"{label}'s module paths carry wrapper components ({', '.join(WRAPPER_COMPONENTS)}): "
                         "aligned without them")
    for me, label in ((0, "A"), (1, "B")):
        mine, theirs = sides[me], sides[1 - me]
        root, their_root = _root_name(mine), _root_name(theirs)
        extra_roots = _script_roots(mine) - {e.scope for e in theirs}
        prefix = _best_prefix(list({e.scope for e in mine}), list({e.scope for e in theirs}),
                              any_name=bool(root and their_root and root != their_root), extra_roots=extra_roots)
        if not prefix:
            continue
        stripped = {scope: _strip(scope, prefix, extra_roots) for scope in {e.scope for e in mine}}
        sides[me] = _rescoped(mine, lambda e: "" if e.scope == "" and e.kind == "op" else stripped[e.scope])
        other = "B" if label == "A" else "A"
        notes.append(f"{label}'s module paths carry the wrapper prefix '{prefix}.'"
                     f"{f' (its root {root} wraps the model)' if root else ''}: aligned with {other}'s "
                     f"unwrapped paths; the wrapper's own events are left unmatched")
        break  # one side is the wrapped one
    return sides[0], sides[1], notes


def wrapper_prefix(recorded: Sequence[str], model: Sequence[str]) -> str:
    """The wrapper prefix (``module``, ``module.module``, ``_orig_mod``...: wrapper attributes
    only) under which every recorded module path is a path of ``model`` or the wrapper itself
    (the path ``""`` or a level of the prefix), or ``""`` when none is needed or none fits.

    Example:
        >>> wrapper_prefix(["", "module", "module.fc"], ["", "fc"])
        'module'
        >>> wrapper_prefix(["", "fc"], ["", "fc"])
        ''
    """
    known = set(model)
    recorded = sorted(set(recorded))
    if all(s in known for s in recorded):
        return ""
    prefix = max(recorded, key=lambda s: s.count(".")).split(".")  # every path must be under it
    n = 0
    while n < len(prefix) and prefix[n] in WRAPPER_ATTRIBUTES:
        n += 1
    for k in range(n, 0, -1):
        p = ".".join(prefix[:k])
        levels = {".".join(prefix[:j]) for j in range(k)}  # "" and the wrapper levels above the model
        if all(s in levels or _strip(s, p) in known for s in recorded):
            return p
    return ""
