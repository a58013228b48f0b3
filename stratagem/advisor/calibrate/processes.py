"""Helpers for the processes calibration and verification spawn on this host."""

from __future__ import annotations

import resource
import socket
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["PeakMemory", "across_ranks", "free_port"]


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


class PeakMemory:
    """How far this process's memory peaks above where it is now, on ``device``: CUDA's max
    allocated bytes (its counter reset now), or on CPU the peak resident set — the kernel's
    high-water mark, reset now through ``/proc/self/clear_refs`` where Linux allows it, else the
    lifetime peak."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.baseline = torch.cuda.memory_allocated(device)
        else:
            _reset_resident_peak()
            self.baseline = _resident("VmRSS")

    def grown(self) -> int:
        """Bytes the peak since construction lies above the baseline (never negative)."""
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = _resident("VmHWM")
        return max(0, peak - self.baseline)


def _reset_resident_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # not Linux, or not allowed: the lifetime peak stands


def _resident(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak) from /proc/self/status, bytes; ``getrusage`` where
    there is no /proc."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
