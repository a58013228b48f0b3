"""Training precisions: what each name means for parameter and compute dtypes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stratagem.errors import UsageError


@dataclass(frozen=True, slots=True)
class Precision:
    """A training precision: ``param_dtype`` is what the optimizer updates, ``compute_dtype``
    what matmuls run in; ``autocast`` says whether compute runs under ``torch.autocast``."""

    name: str
    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    autocast: bool

    @property
    def param_bytes(self) -> int:
        """Bytes per parameter element as stored."""
        return self.param_dtype.itemsize

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of activations and gathered compute-dtype weights."""
        return self.compute_dtype.itemsize


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("fp32", torch.float32, torch.float32, autocast=False),
        Precision("bf16-mixed", torch.float32, torch.bfloat16, autocast=True),
        Precision("fp16-mixed", torch.float32, torch.float16, autocast=True),
        Precision("bf16-true", torch.bfloat16, torch.bfloat16, autocast=False),
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
