"""Rank-parallel compare: the ranks of a many-rank job compared in a pool of worker processes,
or by the processes of a ``torchrun`` job (one per machine: each compares its share of the
ranks where the dumps are, and process 0 merges the rows into the one report).

Each worker loads both dumps lazily and compares one rank at a time (its own rank's events and
tensors only), so memory is bounded by ``jobs`` ranks whatever the world size; the rows come
back to the caller, which merges them into one :class:`~precisiondiff.compare.Comparison` as a
sequential compare would (same rows, same order).
"""
from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable, Iterator, List, Optional, Tuple

from ..runtime.gloo_exit import guard_exit

__all__ = ["compare_ranks_in_pool", "compare_ranks_across_processes", "under_torchrun"]


def compare_ranks_in_pool(worker: Callable, a: Any, b: Any, noise: Any, ranks: List[int], ref_rank: Optional[int],
                          jobs: int, **options: Any) -> Iterator[Tuple[int, list, List[str]]]:
    """Yield ``(rank, rows, notes)`` for each rank, in rank order, computed by ``jobs`` processes
    running ``worker(a, b, noise, rank, ref_rank, options)`` (a module-level function)."""
    context = multiprocessing.get_context("spawn")  # no fork of a process with threads
    with ProcessPoolExecutor(max_workers=min(jobs, len(ranks)), mp_context=context) as pool:
        futures = [pool.submit(worker, str(a), str(b), str(noise) if noise is not None else None, rank,
                               ref_rank, options) for rank in ranks]
        for future in futures:
            yield future.result()


def under_torchrun() -> bool:
    """Whether this process is one of several started by torchrun (its environment says so)."""
    import os
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ and "MASTER_ADDR" in os.environ


def compare_ranks_across_processes(worker: Callable, a: Any, b: Any, noise: Any, ranks: List[int],
                                   ref_rank: Optional[int], **options: Any
                                   ) -> Optional[List[Tuple[int, list, List[str]]]]:
    """Compare ranks ``i, i+W, i+2W...`` here (process ``i`` of ``W``, gloo from torchrun's
    environment) and gather every process's rows on process 0.

    Returns:
        All ``(rank, rows, notes)`` in rank order on process 0; None on the others.
    """
    import torch.distributed as dist
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo")
        guard_exit()  # gloo's workers idle before the interpreter finalizes (runtime/gloo_exit.py)
    try:
        me, world = dist.get_rank(), dist.get_world_size()
        mine = [worker(str(a), str(b), str(noise) if noise is not None else None, rank, ref_rank, options)
                for i, rank in enumerate(ranks) if i % world == me]
        gathered: Optional[list] = [None] * world if me == 0 else None
        dist.gather_object(mine, gathered, dst=0)
    finally:
        if owned:
            dist.destroy_process_group()
    if gathered is None:
        return None
    order = {rank: i for i, rank in enumerate(ranks)}
    return sorted((item for part in gathered for item in part), key=lambda item: order[item[0]])
