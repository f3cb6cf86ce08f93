"""The one 2-rank gloo job every test of this package reads (workers.py runs each scenario once)."""
from __future__ import annotations

import socket

import pytest
import torch.multiprocessing as mp

from tests.distributed import workers


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for MASTER_PORT)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture(scope="package")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("job")
    mp.spawn(workers.run, args=(2, free_port(), str(out), list(workers.SCENARIOS)), nprocs=2)
    return out
