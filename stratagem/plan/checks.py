"""The checks every value crossing into stratagem goes through, and the bounds they enforce.

A bool is a bool and a count is an int (never a float, a string or a bool standing in), and every
number a user types is bounded by what a real cluster and a 64-bit index can hold, so work that
grows with it stays bounded. Refusals name the field, the rule and the limit.
"""

from __future__ import annotations

from typing import Any

from stratagem.errors import UsageError

MAX_WORLD_SIZE = 2**20
"""Ranks a plan or a cluster may hold: a million, ten times the largest GPU clusters built by 2025
(about 100,000 GPUs)."""

MAX_SAMPLES = 2**31
"""Samples in a step (the global batch) and tokens in a sample (the sequence length) at most: each a
32-bit count, so a step's tokens, their product, stay a 64-bit index."""

_SHOWN = 60  # characters of a refused value the message quotes


def shown(value: Any) -> str:
    """``repr(value)``, cut to a readable length."""
    text = repr(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN - 3] + "..."


def check_choice(field: str, value: Any, valid: tuple) -> None:
    """Raise :class:`UsageError` unless ``value`` is one of ``valid`` (of the same type: ``True``
    is not ``1``, ``3.0`` is not ``3``), listing them."""
    if type(value) not in {type(v) for v in valid} or value not in valid:
        raise UsageError(f"{field}={shown(value)} is not one of {', '.join(map(repr, valid))}")


def check_bool(field: str, value: Any) -> None:
    """Raise :class:`UsageError` unless ``value`` is ``True`` or ``False`` (not ``"false"``, not 0)."""
    if not isinstance(value, bool):
        raise UsageError(f"{field} must be true or false, got {shown(value)}")


def check_positive(field: str, value: Any, *, maximum: int | None = None, why: str = "") -> None:
    """Raise :class:`UsageError` unless ``value`` is an int (not a bool) of at least 1 and, with
    ``maximum``, at most that (``why`` says where the limit comes from)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UsageError(f"{field} must be a positive integer, got {shown(value)}")
    if maximum is not None and value > maximum:
        raise UsageError(f"{field}={value} is more than {maximum:,}{f': {why}' if why else ''}")


def check_optional_str(field: str, value: Any) -> None:
    """Raise :class:`UsageError` unless ``value`` is a string or None."""
    if value is not None and not isinstance(value, str):
        raise UsageError(f"{field} must be a string or null, got {shown(value)}")
