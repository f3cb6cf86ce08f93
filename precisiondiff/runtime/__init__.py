"""Runtime: where and what runs — targets (device, dtype, autocast) and workloads (model, inputs, loss).

Imports only torch and errors; every stage above may import it.
"""
from .targets import Target
from .workload import Workload

__all__ = ["Target", "Workload"]
