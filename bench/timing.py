"""Timing for the GPU bench scripts (``python bench/NAME.py`` puts this folder on sys.path)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def sync() -> None:
    """Wait for the GPU's queued work (nothing to wait for on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_seconds(fn: Callable[[], object], repeats: int = 10) -> float:
    """The median wall time of ``repeats`` calls of ``fn`` after one warm-up, each synchronised."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times)
