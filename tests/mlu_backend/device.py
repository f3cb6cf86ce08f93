"""The ``torch.mlu`` device module of the stand-in accelerator.

What PyTorch's generic paths (``torch.get_device_module``, ``torch.accelerator``, ``torch.amp``,
``torch.manual_seed``) and precisiondiff ask of a device module. Kernels run synchronously on
host memory, so streams and events are complete as soon as they exist.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional

import torch

def is_available() -> bool:
    """Always true: the stand-in's memory is host memory."""
    return True


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def _lazy_init() -> None:
    """Nothing to initialize (the C++ side registered itself when loaded)."""


def device_count() -> int:
    """The C++ side's device count (the one its device guard reports)."""
    return int(torch.ops.mlu_standin.device_count())


def current_device() -> int:
    return _current()


def _current() -> int:
    return torch.accelerator.current_device_index() if hasattr(torch, "accelerator") else 0


def set_device(device: "int | str | torch.device") -> None:
    index = torch.device(device).index if not isinstance(device, int) else device
    if index is not None:
        torch.accelerator.set_device_index(index)


@contextlib.contextmanager
def device(index: "int | str | torch.device") -> Iterator[None]:
    """Make ``index`` the current device inside the block."""
    previous = _current()
    set_device(index)
    try:
        yield
    finally:
        set_device(previous)


def synchronize(device: Any = None) -> None:
    """Kernels are synchronous: nothing is ever queued."""


def get_device_name(device: Any = None) -> str:
    return "precisiondiff MLU stand-in (host memory)"


def get_device_capability(device: Any = None) -> "tuple[int, int]":
    return (0, 0)


def get_amp_supported_dtype() -> List[torch.dtype]:
    """The dtypes ``torch.autocast("mlu", ...)`` accepts."""
    return [torch.float16, torch.bfloat16]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def memory_allocated(device: Any = None) -> int:
    """Bytes held by live device tensors (all devices)."""
    return int(torch.ops.mlu_standin.memory_allocated())


def empty_cache() -> None:
    """Nothing cached: freed memory goes straight back to the host."""


# ---- random numbers: kernels run on the CPU's generator, which torch.manual_seed seeds -------

def manual_seed(seed: int) -> None:
    torch.random.default_generator.manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    manual_seed(seed)


def seed() -> None:
    torch.random.default_generator.seed()


def seed_all() -> None:
    seed()


def initial_seed() -> int:
    return torch.random.default_generator.initial_seed()


def get_rng_state(device: Any = "mlu") -> torch.Tensor:
    return torch.random.default_generator.get_state()


def set_rng_state(new_state: torch.Tensor, device: Any = "mlu") -> None:
    torch.random.default_generator.set_state(new_state)


def get_rng_state_all() -> List[torch.Tensor]:
    return [get_rng_state() for _ in range(device_count())]


def set_rng_state_all(states: List[torch.Tensor]) -> None:
    set_rng_state(states[0])


# ---- streams and events: always complete ----------------------------------------------------

class Stream:
    """The device's only stream; work on it is done when it is issued."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        index = device if isinstance(device, int) else (torch.device(device).index if device is not None else None)
        self.device = torch.device("mlu", _current() if index is None else index)

    def synchronize(self) -> None:
        """Nothing queued."""

    def query(self) -> bool:
        return True

    def wait_stream(self, stream: "Stream") -> None:
        """Streams are always complete."""

    def wait_event(self, event: "Event") -> None:
        """Events are always complete."""

    def record_event(self, event: "Optional[Event]" = None) -> "Event":
        return event or Event()


class Event:
    """An event that has completed when recorded."""

    def __init__(self, enable_timing: bool = False, **kwargs: Any) -> None:
        self.enable_timing = enable_timing

    def record(self, stream: Optional[Stream] = None) -> None:
        """Complete at once."""

    def wait(self, stream: Optional[Stream] = None) -> None:
        """Complete at once."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Complete at once."""


def current_stream(device: Any = None) -> Stream:
    return Stream(device)


def default_stream(device: Any = None) -> Stream:
    return Stream(device)


@contextlib.contextmanager
def stream(s: Optional[Stream]) -> Iterator[None]:
    yield
