"""Memoize functions of a large frozen object by its identity.

The search calls cost terms tens of thousands of times with the same profile and cluster;
hashing those nested dataclasses on every call would cost more than the terms. ``by_identity``
keys on the first argument's ``id`` plus the other (small, hashable) arguments, and keeps the
object alive beside the result so that a recycled ``id`` can never return a stale entry.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

R = TypeVar("R")


def by_identity(fn: Callable[..., R]) -> Callable[..., R]:
    """Cache ``fn(obj, *args)`` per ``(id(obj), *args)``; ``args`` must be hashable."""
    cache: dict[tuple, tuple[Any, R]] = {}

    @functools.wraps(fn)
    def wrapper(obj: Any, *args: Any) -> R:
        key = (id(obj), *args)
        hit = cache.get(key)
        if hit is None or hit[0] is not obj:
            hit = (obj, fn(obj, *args))
            cache[key] = hit
        return hit[1]

    wrapper.cache_clear = cache.clear  # type: ignore[attr-defined]
    return wrapper
