"""Process groups as this package starts and ends them (calibrate, verify and the Lightning and
Fabric strategies share these), the ports they meet on, and reductions over their ranks."""

from __future__ import annotations

import gc
import importlib
import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import torch
import torch.distributed as dist

__all__ = ["across_ranks", "free_port", "import_group_defaults", "init_process_group", "launched_job",
           "leave_process_group", "leave_spawned_process", "leaving_process_group"]


def launched_job() -> bool:
    """Whether this process is a rank of a launched job (torchrun, a Slurm step: ``RANK`` and
    ``WORLD_SIZE`` set) rather than a program that spawns its own ranks."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    """A TCP port free on this host now, for a spawned process group's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def import_group_defaults() -> None:
    """Import ``torch.distributed.nn.functional`` before a process group exists: its functions
    bind the default group as default arguments when it is first imported (the first optimizer
    step imports it, through ``torch._dynamo``), and a live group bound there outlives
    ``destroy_process_group``, its gloo threads running into the interpreter's teardown, where
    gloo can abort the process (docs/platform.md)."""
    importlib.import_module("torch.distributed.nn.functional")


def init_process_group(backend: str, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group`` after :func:`import_group_defaults`."""
    import_group_defaults()
    dist.init_process_group(backend, **kwargs)


def leave_process_group(*, together: bool = True) -> None:
    """Destroy the default process group as docs/platform.md has gloo survive it (``terminate
    called without an active exception`` at exit while something still holds a group): collect
    the garbage that may hold one (wrapped modules in reference cycles), wait for every rank
    (``together``; leave it out when a rank failed and the others may be gone), then destroy.
    What torch itself keeps holding, :func:`leave_spawned_process` steps around."""
    gc.collect()
    if together:
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()
    dist.destroy_process_group()


@contextmanager
def leaving_process_group() -> Iterator[None]:
    """Run the body on the default process group, then :func:`leave_process_group`: with every
    rank when the body returned, alone when it raised (the exception goes on)."""
    try:
        yield
    except BaseException:
        leave_process_group(together=False)
        raise
    leave_process_group()


def leave_spawned_process() -> NoReturn:
    """End a process this package spawned, its results written and its group left, without the
    interpreter's teardown. torch keeps process groups referenced past ``destroy_process_group``
    (a ``DeviceMesh`` that DTensor's caches hold; :func:`import_group_defaults` steps around
    another holder), and gloo can abort the process when it tears them down at exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def across_ranks(value: float, *, smallest: bool = False) -> float:
    """The largest ``value`` over the ranks of the default group (the slowest step, the fullest
    rank), or the smallest (the slowest rate); the same on every rank. A collective."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    tensor = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN if smallest else dist.ReduceOp.MAX)
    return float(tensor.item())
