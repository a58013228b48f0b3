"""Run a function on real CPU processes joined in a gloo process group, and collect its results.

Each rank runs ``fn(rank, world_size, *args)``; what rank 0 returns comes back to the caller
(through a file, so the result may be any ``torch.save``-able object). The ranks meet at a store
this process hosts (``host_store``: no port to race for). Teardown follows the
gloo-at-exit trap in docs/platform.md: ``fn`` drops its wrapped modules, then the rank leaves its
group and ends as the package's own spawned processes do (``leave_process_group``,
``leave_spawned_process``).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from stratagem.distributed import free_port, host_store, join_group, leave_process_group, leave_spawned_process

__all__ = ["RANK_THREADS", "TIMEOUT", "free_port", "run_on_ranks"]

TIMEOUT = timedelta(seconds=120)
"""How long a collective waits before failing, so a broken rank ends the test instead of hanging it."""
RANK_THREADS = 1
"""Intra-op threads of each rank: ranks share two cores; more threads only contend."""


def run_on_ranks(fn: Callable[..., Any], *args: Any, world_size: int) -> Any:
    """Start ``world_size`` processes running ``fn(rank, world_size, *args)`` and return rank 0's
    result. ``fn`` must be importable (defined at module level). A rank's exception is raised
    here with its traceback."""
    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder) / "rank0.pt"
        store = host_store()
        mp.start_processes(_entry, args=(fn, args, world_size, store.port, result),
                           nprocs=world_size, start_method="spawn", join=True)
        return torch.load(result, weights_only=False)


def _entry(rank: int, fn: Callable[..., Any], args: tuple, world_size: int, port: int, result: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(RANK_THREADS)
    join_group("gloo", ("127.0.0.1", port), rank=rank, world_size=world_size, timeout=TIMEOUT)
    # On an exception the rank exits without the barrier: start_processes then stops the others.
    output = fn(rank, world_size, *args)
    if rank == 0:
        torch.save(output, result)
    leave_process_group()
    leave_spawned_process()
