"""Training precisions: what each name means for parameter and compute dtypes.

Dtypes are named as torch names them (``float32``, ``bfloat16``, ``float16``) so that the cost
models never import torch; :func:`torch_dtype` resolves a name where torch is at hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from stratagem.errors import UsageError

if TYPE_CHECKING:
    import torch

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class Precision:
    """A training precision: ``param_dtype`` is what the optimizer updates, ``compute_dtype``
    what matmuls run in; ``autocast`` says whether compute runs under ``torch.autocast``."""

    name: str
    param_dtype: str
    compute_dtype: str
    autocast: bool

    @property
    def param_bytes(self) -> int:
        """Bytes per parameter element as stored."""
        return DTYPE_BYTES[self.param_dtype]

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of activations and gathered compute-dtype weights."""
        return DTYPE_BYTES[self.compute_dtype]


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("fp32", "float32", "float32", autocast=False),
        Precision("bf16-mixed", "float32", "bfloat16", autocast=True),
        Precision("fp16-mixed", "float32", "float16", autocast=True),
        Precision("bf16-true", "bfloat16", "bfloat16", autocast=False),
        Precision("fp16-true", "float16", "float16", autocast=False),
    )
}


def get_precision(name: str) -> Precision:
    """The :class:`Precision` called ``name``; a :class:`UsageError` lists the valid ones."""
    try:
        return PRECISIONS[name]
    except KeyError:
        raise UsageError(
            f"unknown precision {name!r}; valid: {', '.join(PRECISIONS)}"
        ) from None


def in_compute_dtype(name: str) -> str:
    """The precision that computes as FSDP2's mixed precision runs ``name``: parameters cast to
    its compute dtype and no autocast (``bf16-mixed`` → ``bf16-true``); ``name`` itself when it
    does not autocast."""
    precision = get_precision(name)
    if not precision.autocast:
        return name
    return next(p.name for p in PRECISIONS.values()
                if not p.autocast and p.param_dtype == p.compute_dtype == precision.compute_dtype)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``"bfloat16"`` → ``torch.bfloat16``)."""
    import torch

    return getattr(torch, name)
