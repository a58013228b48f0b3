"""Optimizer parameter groups that torch.optim's multi-tensor steps can take under tensor parallelism.

On GPUs torch.optim steps each parameter group with its ``foreach`` (or ``fused``) kernels: one
operator over all the group's tensors of a device and dtype. A TP rank without FSDP holds DTensors
(the Linears the layout splits, an embedding or head split by vocabulary) beside plain tensors
(the norms and whatever else the layout leaves whole), and DTensor refuses an operator whose
tensors mix the two ("got mixed torch.Tensor and DTensor"): the first optimizer step would fail.
FSDP makes every parameter a DTensor, so its plans never mix. CPU ranks step one tensor at a time
by default, which takes either kind (docs/design.md, "Optimizers under TP").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from stratagem.errors import UsageError

__all__ = ["separate_dtensors", "step_mixed_groups_per_tensor"]


def separate_dtensors(params: Iterable[torch.Tensor]) -> list[torch.Tensor] | list[dict[str, Any]]:
    """``params`` as an optimizer's constructor takes them: as they are where they are all of one
    kind, else two groups (the DTensors, then the plain tensors) with the optimizer's defaults, so
    that each multi-tensor operator meets one kind."""
    params = list(params)
    dtensors = [param for param in params if isinstance(param, DTensor)]
    if not dtensors or len(dtensors) == len(params):
        return params
    return [{"params": dtensors}, {"params": [param for param in params if not isinstance(param, DTensor)]}]


def step_mixed_groups_per_tensor(optimizer: torch.optim.Optimizer) -> int:
    """Make each group of an optimizer built elsewhere (a Lightning or Fabric user's) that mixes
    DTensors and plain tensors step one tensor at a time, in place, where its implementation was
    left to torch; the groups changed. Its groups cannot be split as :func:`separate_dtensors`
    builds them: a learning-rate scheduler already counts them. Raises :class:`UsageError` where
    such a group asks for ``foreach`` or ``fused``, which cannot step it."""
    mixed = [group for group in optimizer.param_groups
             if len({isinstance(param, DTensor) for param in group["params"]}) == 2]
    for group in mixed:
        asked = [name for name in ("foreach", "fused") if group.get(name)]
        if asked:
            raise UsageError(f"{type(optimizer).__name__}({asked[0]}=True) steps a parameter group in one "
                             "operator per device and dtype, and a group here mixes the DTensors tensor "
                             "parallelism splits with the plain tensors it leaves whole, which DTensor refuses\n"
                             f"HINT: leave {asked[0]} unset (each such group then steps one tensor at a time), "
                             "or put the DTensor parameters in a group of their own")
        group["foreach"] = False
    return len(mixed)
