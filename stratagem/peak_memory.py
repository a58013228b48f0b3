"""How far a process's memory peaks while it runs a plan: CUDA's allocator statistics on a GPU,
the resident set on a CPU (with glibc's malloc made to return freed tensors, so the set holds
the tensors alive, not the allocator's history). Calibration and verification measure with it."""

from __future__ import annotations

import ctypes
import resource
from pathlib import Path

import torch

__all__ = ["PeakMemory", "keep_freed_tensors", "return_freed_tensors"]


class PeakMemory:
    """How far this process's memory peaks above where it stands at construction, on ``device``:
    CUDA's max allocated bytes, or on CPU the peak of the anonymous resident set, since
    construction or :meth:`reset_peak`.

    On CPU that is the kernel's high-water mark of the resident set (reset through
    ``/proc/self/clear_refs`` where Linux allows it, else the lifetime peak) less the
    shared libraries' code paged in meanwhile (file-backed pages, shared by every process on the
    node; a plan that runs new code paths pages in more). From construction glibc's malloc hands
    each freed tensor back to the system (:func:`return_freed_tensors`): as CUDA's allocated
    bytes, the peak counts the tensors alive at once, not what the allocator kept of earlier
    ones. That costs time: measure the peak over the first steps, then :meth:`stop` before the
    steps that are timed.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak: int | None = None
        if device.type == "cuda":
            self.baseline = torch.cuda.memory_allocated(device)
        else:
            return_freed_tensors()
            self.baseline, self.code = _resident("VmRSS"), _resident("RssFile")
        self.reset_peak()

    def reset_peak(self) -> None:
        """Count the peak from now on (above the same baseline): what was freed no longer counts."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_resident_peak()

    def grown(self) -> int:
        """Bytes the peak lies above the baseline (never negative), up to :meth:`stop` if it ran."""
        if self.peak is not None:
            return self.peak
        if self.device.type == "cuda":
            return max(0, torch.cuda.max_memory_allocated(self.device) - self.baseline)
        code_paged_in = max(0, _resident("RssFile") - self.code)
        return max(0, _resident("VmHWM") - self.baseline - code_paged_in)

    def stop(self) -> int:
        """End the measurement: the peak so far (:meth:`grown` from now on), and on CPU malloc's
        own fast policy back (:func:`keep_freed_tensors`)."""
        self.peak = self.grown()
        if self.device.type == "cpu":
            keep_freed_tensors()
        return self.peak


_M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)
RETURN_FROM_BYTES = 64 * 1024
"""What :func:`return_freed_tensors` hands back: allocations of this many bytes or more."""
KEEP_BELOW_BYTES = 32 * 2**20
"""What :func:`keep_freed_tensors` keeps: allocations below this many bytes (glibc's most)."""


def return_freed_tensors() -> None:
    """Make glibc's malloc give back the free pages it holds (``malloc_trim``) and map each later
    allocation of :data:`RETURN_FROM_BYTES` or more apart, so that freeing it returns its pages. By
    default malloc raises that threshold to the largest mapped block freed so far, after which
    tensors come from its heap, whose freed pages stay resident: the resident set then holds the
    allocator's history. A no-op on other C libraries."""
    _mallopt_threshold(RETURN_FROM_BYTES, trim=True)


def keep_freed_tensors() -> None:
    """Undo :func:`return_freed_tensors` for speed: malloc serves allocations below
    :data:`KEEP_BELOW_BYTES` from its heap, reusing freed ones without faulting in new pages, as
    its default policy does once warm."""
    _mallopt_threshold(KEEP_BELOW_BYTES, trim=False)


def _mallopt_threshold(num_bytes: int, *, trim: bool) -> None:
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, num_bytes)
        if trim:
            libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: its allocator's own policy stands


def _reset_resident_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # not Linux, or not allowed: the lifetime peak stands


def _resident(field: str) -> int:
    """``VmRSS`` (now), ``VmHWM`` (peak) or ``RssFile`` (file-backed, now) from /proc/self/status,
    bytes; without /proc, ``getrusage``'s peak for the first two and 0 for ``RssFile``."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    if field == "RssFile":
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
