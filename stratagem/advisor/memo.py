"""Memoize functions of a large frozen object by its identity.

The search calls cost terms tens of thousands of times with the same profile and cluster;
hashing those nested dataclasses on every call would cost more than the terms. ``by_identity``
keys on the first argument's ``id`` plus the other (small, hashable) arguments, and keeps the
object alive beside the result so that a recycled ``id`` can never return a stale entry.
``by_identity_and_plan`` does the same for a function that also takes a plan but ignores some
of its fields: every plan that differs only in those shares one result (the search's plans of
one layout differ only in their micro-batching).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterable
from dataclasses import fields
from typing import Any, TypeVar

from stratagem.plan import Plan

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


def by_identity_and_plan(*, ignoring: Iterable[str]) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Cache ``fn(obj, plan, *args)`` per ``(id(obj), every Plan field but those in ignoring,
    *args)``, for an ``fn`` that reads none of the ``ignoring`` fields; ``args`` must be hashable.

    The key names what ``fn`` does not read, so a field the Plan gains is keyed until someone
    decides otherwise: forgetting it costs a cache miss, never a stale result."""
    names = {f.name for f in fields(Plan)}
    unknown = set(ignoring) - names
    assert not unknown, f"not Plan fields: {sorted(unknown)}"
    fields_of = operator.attrgetter(*sorted(names - set(ignoring)))

    def decorate(fn: Callable[..., R]) -> Callable[..., R]:
        cache: dict[tuple, tuple[Any, R]] = {}

        @functools.wraps(fn)
        def wrapper(obj: Any, plan: Plan, *args: Any) -> R:
            key = (id(obj), fields_of(plan), *args)
            hit = cache.get(key)
            if hit is None or hit[0] is not obj:
                hit = cache[key] = (obj, fn(obj, plan, *args))
            return hit[1]

        wrapper.cache_clear = cache.clear  # type: ignore[attr-defined]
        return wrapper

    return decorate
