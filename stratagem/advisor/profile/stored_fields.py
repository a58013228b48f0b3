"""Reading a stored profile's fields back: each plain field checked by its annotation, with an error
that names the field and the rule (:class:`ProfileDataError`). What holds between the fields is
:mod:`~stratagem.advisor.profile.model_profile`'s to check."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, fields
from typing import Any

__all__ = ["ProfileDataError", "as_count", "as_list", "as_pair", "as_text", "checked_fields", "require"]


class ProfileDataError(ValueError):
    """A stored profile breaks the schema: the message names the field and the rule."""


_POSITIVE = frozenset({"batch_size", "seq_len", "num_heads", "num_kv_heads", "in_features", "out_features",
                       "in_channels", "out_channels", "channels", "groups", "seq_q", "seq_kv", "head_dim",
                       "block_sequence"})



def checked_fields(cls: type, data: Any, where: str) -> dict[str, Any]:
    """``data``'s values for ``cls``'s plain fields (ints, strings, flags), each checked by its
    annotation; a field without a default must be present. Nested fields are left to the caller."""
    if not isinstance(data, Mapping):
        raise ProfileDataError(f"{where}: expected a JSON object, got {type(data).__name__}")
    values = {}
    for f in fields(cls):
        check = _CHECKS.get(str(f.type))
        if check is None:  # a nested field: the caller reads it
            continue
        if f.name not in data:
            if _required(f):
                raise ProfileDataError(f"{where}.{f.name}: missing")
            continue
        value = data[f.name]
        if value is None and str(f.type).endswith("| None"):
            values[f.name] = None
            continue
        values[f.name] = check(value, f"{where}.{f.name}", minimum=1 if f.name in _POSITIVE else 0)
    return values


def _required(f: Field) -> bool:
    return f.default is MISSING and f.default_factory is MISSING





def require(data: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in data:
        raise ProfileDataError(f"{where}.{key}: missing")
    return data[key]


def as_count(value: Any, where: str, minimum: int = 0) -> int:
    """An integer of at least ``minimum`` (JSON's true/false and 3.0 are not integers)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProfileDataError(f"{where}: expected an integer, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ProfileDataError(f"{where}: must be at least {minimum}, got {value}")
    return value


def as_text(value: Any, where: str, minimum: int = 0) -> str:
    if not isinstance(value, str):
        raise ProfileDataError(f"{where}: expected a string, got {type(value).__name__} {value!r}")
    return value


def _flag(value: Any, where: str, minimum: int = 0) -> bool:
    if not isinstance(value, bool):
        raise ProfileDataError(f"{where}: expected true or false, got {type(value).__name__} {value!r}")
    return value


def _seconds(value: Any, where: str, minimum: int = 0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ProfileDataError(f"{where}: expected a non-negative number of seconds, got {value!r}")
    return float(value)


def as_list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ProfileDataError(f"{where}: expected a list, got {type(value).__name__}")
    return value


def as_pair(value: Any, where: str) -> tuple[str, str]:
    if not (isinstance(value, list) and len(value) == 2):
        raise ProfileDataError(f"{where}: expected [module pattern, style], got {value!r}")
    return as_text(value[0], f"{where}[0]"), as_text(value[1], f"{where}[1]")


# How each plain field's annotation is checked ("| None" allows null as well).
_CHECKS: dict[str, Callable[..., Any]] = {
    "int": as_count, "int | None": as_count, "str": as_text, "str | None": as_text, "bool": _flag, "float": _seconds,
}
