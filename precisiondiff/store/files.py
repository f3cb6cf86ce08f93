"""File-level helpers of the dump writer: atomic JSON, fsync, and preparing a dump directory."""
from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any, List, Mapping, Union

from ..errors import DumpError
from .schema import H5_FILE, INDEX, META, encode_line, is_shard_name

__all__ = ["write_json_atomic", "h5_dataset_name", "prepare_dir", "fsync_dir", "fsync_file",
           "unlink_quietly", "now"]


def write_json_atomic(path: Union[str, Path], obj: Mapping[str, Any], *, sync: bool = True,
                      sync_dir: bool = True) -> None:
    """Write ``obj`` as JSON to ``path`` atomically: temporary file, fsync, rename, fsync the
    directory.

    ``sync=False`` skips the fsyncs: still atomic for readers and after a killed process, not
    across a power loss. ``sync_dir=False`` skips the last one: after a power loss the file
    is then the new one or the old one, both whole.

    Raises:
        OSError: the file cannot be written.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    data = (encode_line(obj) + "\n").encode()
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            if sync:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        unlink_quietly(tmp)
        raise
    if sync and sync_dir:
        fsync_dir(path.parent)


def h5_dataset_name(data_key: str) -> str:
    """Return the flat HDF5 dataset name of ``data_key`` ("%" → "%25", "/" → "%2F").

    Example:
        >>> h5_dataset_name("blocks.0/aten.mm.default#0:forward:output.0")
        'blocks.0%2Faten.mm.default#0:forward:output.0'
    """
    name = data_key.replace("%", "%25").replace("/", "%2F")
    return "%2E" if name == "." else name


def unlink_quietly(path: Union[str, Path]) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (best effort: not every platform allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: Union[str, Path]) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def dump_files(path: Path) -> List[Path]:
    """The files in ``path`` that belong to a dump (including leftovers of a crash)."""
    found = []
    for p in path.iterdir():
        base = p.name[:-4] if p.name.endswith(".tmp") else p.name
        if base in (META, INDEX, H5_FILE) or is_shard_name(base):
            found.append(p)
    return found


def prepare_dir(path: Path, overwrite: bool) -> None:
    if path.exists() and not path.is_dir():
        raise DumpError(f"cannot create dump directory {path}: a file with that name exists; "
                        "choose another output path")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DumpError(f"cannot create dump directory {path}: {err.strerror or err}; "
                        "choose a writable output path") from err
    existing = dump_files(path)
    if existing and not overwrite:
        raise DumpError(f"{path} already holds a dump; choose another output path or "
                        "overwrite it (--overwrite / overwrite=True)")
    for p in existing:
        try:
            p.unlink()
        except OSError as err:
            raise DumpError(f"cannot overwrite the dump in {path}: {err.strerror or err}; "
                            "check its permissions or choose another output path") from err
    if not os.access(path, os.W_OK | os.X_OK):
        raise DumpError(f"cannot write to dump directory {path}: permission denied; "
                        "choose a writable output path")
