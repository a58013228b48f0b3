"""Memoize functions of a large frozen object by its identity.

The search calls cost terms tens of thousands of times with the same profile and cluster;
hashing those nested dataclasses on every call would cost more than the terms. ``by_identity``
keys on the first argument's ``id`` plus the other (small, hashable) arguments, and keeps the
object alive beside the result so that a recycled ``id`` can never return a stale entry.
``by_identity_and_fields`` does the same for a function that also takes a plan but reads only
some of its fields: keyed on those, every plan that agrees on them shares one result (the
search's plans of one layout differ only in their micro-batching).
"""

from __future__ import annotations

import functools
import operator
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
            hit = cache[key] = (obj, fn(obj, *args))
        return hit[1]

    wrapper.cache_clear = cache.clear  # type: ignore[attr-defined]
    return wrapper


def by_identity_and_fields(*names: str) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Cache ``fn(obj, record, *args)`` per ``(id(obj), the attributes names of record, *args)``,
    for an ``fn`` that reads no other attribute of ``record``; ``args`` must be hashable."""
    fields_of = operator.attrgetter(*names)

    def decorate(fn: Callable[..., R]) -> Callable[..., R]:
        cache: dict[tuple, tuple[Any, R]] = {}

        @functools.wraps(fn)
        def wrapper(obj: Any, record: Any, *args: Any) -> R:
            key = (id(obj), fields_of(record), *args)
            hit = cache.get(key)
            if hit is None or hit[0] is not obj:
                hit = cache[key] = (obj, fn(obj, record, *args))
            return hit[1]

        wrapper.cache_clear = cache.clear  # type: ignore[attr-defined]
        return wrapper

    return decorate
