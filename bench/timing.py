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


def kernel_seconds(fn: Callable[[], object], repeats: int = 10) -> float:
    """The GPU's kernel time per call of ``fn``: the profiler's device time of ``repeats`` calls
    after one warm-up, summed and divided, without the host's launches and the synchronisation that
    :func:`median_seconds` counts (a fair share of a small kernel's time). On CPU,
    :func:`median_seconds`."""
    if not torch.cuda.is_available():
        return median_seconds(fn, repeats)
    fn()
    sync()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(repeats):
            fn()
        sync()
    return sum(event.self_device_time_total for event in profile.key_averages()) / 1e6 / repeats
