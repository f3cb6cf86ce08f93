"""What capture needs from torch.distributed: the process-group layout, collectives, DTensor.

* :func:`layout` describes the job for ``meta.json``: rank, world size, local rank, backend and
  every process group with its ranks.
* :func:`collective` recognizes a collective reaching the dispatch mode (``c10d.allreduce_``,
  ``_c10d_functional.all_reduce``...), names its group, and :func:`wait_collective` makes its
  result ready before it is recorded: ``Work.wait()`` for c10d ops (on NCCL/CNCL this orders the
  current stream after the communication stream, so statistics and host copies issued next
  read the reduced values) and ``wait_tensor`` for functional collectives.
* :func:`local_view` turns what capture meets into a plain tensor it can measure: a DTensor's
  local shard (placements and global shape recorded beside it), an AsyncCollectiveTensor's
  waited value; meta and fake tensors and unknown subclasses are not measured (``None``).

Nothing here imports torch.distributed unless it is available and initialized.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

__all__ = ["COLLECTIVE_NAMESPACES", "layout", "rank_and_world", "process_groups", "collective", "wait_collective", "destinations",
           "local_view", "Deferred", "collective_outputs"]

_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_dtensor")
COLLECTIVE_NAMESPACES = _NAMESPACES  # op-name prefixes of collectives


def is_initialized() -> bool:
    """Whether a default process group exists."""
    return _initialized()


def _initialized() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def rank_and_world() -> Tuple[int, int]:
    """This process's rank and the world size (from the process group, else RANK/WORLD_SIZE)."""
    if _initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def process_groups() -> List[Any]:
    """Every process group of this process (the Python objects), empty when not distributed."""
    if not _initialized():
        return []
    from torch.distributed import distributed_c10d as c10d
    return list(c10d._world.pg_map)


def layout() -> Dict[str, Any]:
    """The job's process-group layout for ``meta.json`` (empty when not distributed).

    Returns:
        ``{"backend", "local_rank", "groups": [{"name", "ranks", "backend"}...]}``; the
        default group is named ``"WORLD"``.
    """
    out: Dict[str, Any] = {}
    if "LOCAL_RANK" in os.environ:
        out["local_rank"] = int(os.environ["LOCAL_RANK"])
    if not _initialized():
        return out
    dist = torch.distributed
    from torch.distributed import distributed_c10d as c10d
    world = c10d._world.default_pg
    out["backend"] = str(dist.get_backend())
    groups: List[Dict[str, Any]] = []
    for pg in list(c10d._world.pg_map):
        try:
            ranks = sorted(dist.get_process_group_ranks(pg))
            backend = str(dist.get_backend(pg))
        except (RuntimeError, ValueError):  # a group this rank is not part of
            continue
        groups.append({"name": "WORLD" if pg is world else _group_name(pg), "ranks": ranks,
                       "backend": backend})
    out["groups"] = groups
    return out


def _group_name(pg: Any) -> str:
    try:
        return str(pg.group_name)
    except (AttributeError, RuntimeError):
        return str(id(pg))


def _group_of(value: Any) -> Optional[Dict[str, Any]]:
    """``{"group", "ranks"}`` of a ProcessGroup script object or a functional group name."""
    try:
        if isinstance(value, torch.ScriptObject):
            pg = torch._C._distributed_c10d.ProcessGroup.unbox(value)
        elif isinstance(value, str):
            from torch.distributed import distributed_c10d as c10d
            pg = c10d._resolve_process_group(value)
        else:
            return None
        name = "WORLD" if pg is torch.distributed.distributed_c10d._world.default_pg else _group_name(pg)
        return {"group": name, "ranks": sorted(torch.distributed.get_process_group_ranks(pg))}
    except (AttributeError, RuntimeError, ValueError, KeyError, TypeError):
        return None


def collective(name: str, args: tuple, kwargs: dict) -> Optional[Dict[str, Any]]:
    """The event field of a collective (``{"op", "group", "ranks"}``), or None for other ops."""
    if not name.startswith(_NAMESPACES):
        return None
    info: Dict[str, Any] = {"op": name.split(".")[1]}
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, (torch.ScriptObject, str)):
            group = _group_of(v)
            if group is not None:
                info.update(group)
                break
    return info


def _storage_key(t: torch.Tensor) -> Any:
    try:
        return (t.device, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None


class _Issued:
    __slots__ = ("name", "out", "storages", "settle")

    def __init__(self, name: str, out: Any, settle: Callable[[bool, Dict[str, str]], None]) -> None:
        self.name, self.out, self.settle = name, out, settle
        self.storages = {k for k in map(_storage_key, _flat(out)) if k is not None}


class Deferred:
    """Collectives issued and not yet recorded (see the module docstring).

    A collective's outputs are recorded when its result is ready without capture waiting
    where it is issued: just before the first recorded op that touches one of its tensors (the
    workload waited for it by then: ``Work.wait()``, or ``wait_tensor`` for functional
    collectives, which this op may be), and at the step's end for the others. Capture then
    waits on the work itself, which returns at once for a finished gloo collective and, on
    NCCL/CNCL, orders the current stream after the communication stream (it does not block
    the host), so the statistics and copies issued next read the reduced values. Recording
    happens on the thread that dispatches the touching op, never in a communication thread.
    """

    def __init__(self) -> None:
        self.items: List[_Issued] = []
        # The c10d works recorded this step and the step before, held until the next step's end
        # (dropped with the session at its close). A gloo work created under capture's dispatch
        # mode keeps that mode (a Python object) in its thread-local state; if a gloo worker
        # thread drops the last reference, it needs the GIL to free it, while the main thread,
        # tearing down a DDP reducer or process group, holds the GIL and joins that worker: a
        # deadlock seen at the end of a torchrun script. Holding a reference here makes the
        # main thread the one that frees the work.
        self._works: List[Any] = []
        self._works_before: List[Any] = []

    def defer(self, name: str, out: Any, settle: Callable[[bool, Dict[str, str]], None],
              written: Any = None) -> None:
        """Hold a collective; ``settle(ready, note)`` records it (``ready`` False: without outputs,
        ``note`` says why: ``{"failed": error}`` or ``{"output": "not complete..."}``)."""
        item = _Issued(name, out, settle)
        if written is not None and written is not out:  # a receive's destination
            item.storages |= {k for k in map(_storage_key, _flat(written)) if k is not None}
        self.items.append(item)

    def settle_touching(self, tensors: List[Any]) -> None:
        """Record the held collectives whose tensors share storage with ``tensors``."""
        touched = {k for k in map(_storage_key, (t for t in tensors if isinstance(t, torch.Tensor)))
                   if k is not None}
        hits = [item for item in self.items if item.storages & touched]
        for item in hits:
            self.items.remove(item)
            self._hold(item)
            self._settle(item)

    def new_step(self) -> None:
        """A step ended: the works held from the step before it are released."""
        self._works_before, self._works = self._works, []

    def _hold(self, item: _Issued) -> None:
        """Keep the c10d works of ``item`` (see ``__init__``)."""
        self._works.extend(v for v in _flat_objects(item.out) if isinstance(v, torch.ScriptObject))

    def settle_all(self, at_step_end: bool = True) -> None:
        """Record every held collective. A c10d collective on the host (gloo) whose work is not
        complete is recorded without outputs (``collective.output: "not complete"``) rather
        than waited for: waiting there could hang a job that waits later on purpose."""
        items, self.items = self.items, []
        for item in items:
            self._hold(item)
            if item.name in _P2P and item.storages:  # a receive no op read: its work cannot be asked
                item.settle(False, {"output": "a receive no op read before the step's end: not recorded"})
            elif at_step_end and _incomplete_on_host(item):
                item.settle(False, {"output": "not complete at the step's end: not recorded"})
            else:
                self._settle(item)

    @staticmethod
    def _settle(item: _Issued) -> None:
        try:
            if item.name not in _P2P:  # the workload waited on a send/recv: a second wait hangs on gloo
                wait_collective(item.name, item.out)
        except Exception as err:  # noqa: BLE001 - the job's failure (a peer died), not capture's
            item.settle(False, {"failed": str(err).splitlines()[0] if str(err) else type(err).__name__})
            return
        with torch.no_grad():
            item.settle(True, {})


# point-to-point ops: gloo counts completions of a send/recv buffer, so waiting on its work a
# second time (after the workload did) blocks for ever; a touched receive is complete
_P2P = {"c10d.send.default", "c10d.recv_.default", "c10d.recv_any_source_.default"}


def _incomplete_on_host(item: _Issued) -> bool:
    """Whether a c10d collective on host tensors (gloo) has not completed yet."""
    tensors = _flat(item.out)
    if tensors and any(t.device.type != "cpu" for t in tensors):
        return False
    for v in _flat_objects(item.out):
        if isinstance(v, torch.ScriptObject) and v._has_method("wait"):
            # the TorchBind Work has only wait(); its Python face answers is_completed()
            work = torch._C._distributed_c10d.Work.unbox(v)
            return not work.is_completed()
    return False


def wait_collective(name: str, out: Any) -> None:
    """Make a collective's outputs ready (see the module docstring)."""
    if name.startswith("_c10d_functional.") or name.startswith("c10d_functional."):
        for t in _flat(out):
            torch.ops._c10d_functional.wait_tensor(t)
        return
    for v in _flat_objects(out):
        # the c10d Work as the dispatcher returns it (a TorchBind object: _type() aborts the process)
        if isinstance(v, torch.ScriptObject) and v._has_method("wait"):
            v.wait()


def collective_outputs(name: str, args: tuple, out: Any) -> Any:
    """What a collective writes, to record as its outputs: what it returns, except for a
    point-to-point receive, which returns only its work and writes its first argument."""
    if name in ("c10d.recv_.default", "c10d.recv_any_source_.default") and args:
        return args[0]
    return out


# c10d ops whose first argument is a destination the collective writes without reading
_DESTINATION_FIRST = {"c10d._allgather_base_.default", "c10d.allgather_.default",
                      "c10d.allgather_coalesced_.default", "c10d.allgather_into_tensor_coalesced_.default",
                      "c10d._reduce_scatter_base_.default", "c10d.reduce_scatter_.default",
                      "c10d.reduce_scatter_tensor_coalesced_.default", "c10d.alltoall_base_.default",
                      "c10d.alltoall_.default", "c10d.gather_.default", "c10d.scatter_.default",
                      "c10d.recv_.default", "c10d.recv_any_source_.default"}


def destinations(name: str, args: tuple) -> List[torch.Tensor]:
    """Tensors a collective overwrites without reading (not inputs: their contents are noise)."""
    if name not in _DESTINATION_FIRST or not args:
        return []
    return [v for v in _flat_objects(args[0]) if isinstance(v, torch.Tensor)]


def _flat(value: Any) -> List[torch.Tensor]:
    return [v for v in _flat_objects(value) if isinstance(v, torch.Tensor)]


def _flat_objects(value: Any) -> List[Any]:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flat_objects(v)]
    return [value]


def local_view(t: torch.Tensor) -> Tuple[Optional[torch.Tensor], Dict[str, Any]]:
    """The plain tensor capture measures for ``t``, and fields for its record.

    Returns:
        ``(t, {})`` for a plain tensor; ``(local shard, {"placements", "global_shape",
        "mesh", "mesh_shape"})`` for a DTensor; ``(None, {"skipped": why})`` for a tensor without data
        (meta, fake) or a subclass capture cannot see into.
    """
    cls = type(t)
    if cls is torch.Tensor or cls is torch.nn.Parameter:
        if t.device.type == "meta":
            return None, {"skipped": "meta tensor"}
        return t, {}
    name = cls.__name__
    if hasattr(t, "_spec") and hasattr(t, "_local_tensor"):  # DTensor
        spec = t._spec
        local = t._local_tensor
        inner, info = local_view(local)
        fields = {"placements": [str(p) for p in spec.placements], "global_shape": list(t.shape),
                  "mesh": list(spec.mesh.mesh.flatten().tolist()),
                  "mesh_shape": list(spec.mesh.mesh.shape)}
        fields.update(info)
        return inner, fields
    if name == "AsyncCollectiveTensor" and hasattr(t, "trigger_wait"):
        return local_view(t.trigger_wait())
    from torch._subclasses.fake_tensor import FakeTensor
    if isinstance(t, FakeTensor):
        return None, {"skipped": "fake tensor"}
    if t.device.type == "meta":
        return None, {"skipped": "meta tensor"}
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    if is_traceable_wrapper_subclass(t):
        return None, {"skipped": f"tensor subclass {name}"}
    return t, {}  # a subclass without its own dispatch (__torch_function__ only) holds real data
