"""The checks every field of the Plan and the Workload goes through."""

from __future__ import annotations

from typing import Any

from stratagem.errors import UsageError


def check_choice(field: str, value: Any, valid: tuple) -> None:
    """Raise :class:`UsageError` unless ``value`` is one of ``valid``, listing them."""
    if value not in valid:
        raise UsageError(f"{field}={value!r} is not one of {', '.join(map(repr, valid))}")


def check_positive(field: str, value: Any) -> None:
    """Raise :class:`UsageError` unless ``value`` is an int (not a bool) of at least 1."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UsageError(f"{field} must be a positive integer, got {value!r}")
