"""The BatchNorms a fake step runs on batch statistics, as the cost models read them
(:class:`BatchNormCall`): channels, elements, dtypes and layout, which pick the kernels a GPU runs
them with (docs/cost-model.md, "BatchNorm's kernels")."""

from __future__ import annotations

from typing import Any

import torch

from stratagem.advisor.profile.convolutions import is_channels_last
from stratagem.advisor.profile.model_profile import BatchNormCall

aten = torch.ops.aten

BATCH_NORM_OPS = (aten.native_batch_norm, aten._native_batch_norm_legit)
"""The ATen operators a BatchNorm's forward dispatches to (with running statistics, or without)."""


def batch_norm_call(func_packet: Any, args: tuple, kwargs: dict[str, Any]) -> BatchNormCall | None:
    """The :class:`BatchNormCall` of one forward call of a :data:`BATCH_NORM_OPS` operator, its
    arguments as dispatched; None in evaluation mode (running statistics: one elementwise pass)."""
    bound = {**dict(zip(_argument_names(func_packet, len(args) + len(kwargs)), args)), **kwargs}
    if not bound.get("training", False):
        return None
    source, weight = bound["input"], bound.get("weight")
    return BatchNormCall(channels=int(source.shape[1]), elements=int(source.numel()), dtype=_name(source.dtype),
                         weight_dtype=None if weight is None else _name(weight.dtype),
                         channels_last=is_channels_last(source))


def _argument_names(func_packet: Any, count: int) -> list[str]:
    """The argument names of ``func_packet``'s overload that takes ``count`` arguments and writes
    no ``out`` (``_native_batch_norm_legit``'s ``no_stats`` leaves the running statistics out)."""
    for overload in func_packet.overloads():
        names = [argument.name for argument in getattr(func_packet, overload)._schema.arguments]
        if len(names) == count and "out" not in names:
            return names
    raise ValueError(f"{func_packet} has no overload of {count} arguments")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
