"""Helpers for the processes calibration and verification spawn on this host."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

__all__ = ["across_ranks", "free_port"]


def free_port() -> int:
    """A TCP port free on this host now, for a spawned process group's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def across_ranks(value: float, *, smallest: bool = False) -> float:
    """The largest ``value`` over the ranks of the default group (the slowest step, the fullest
    rank), or the smallest (the slowest rate); the same on every rank. A collective."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    tensor = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN if smallest else dist.ReduceOp.MAX)
    return float(tensor.item())
