"""Apply a Plan's precision: which dtype parameters live in and how compute gets its dtype.

=============  ==================================================================================
precision      what the plugins do
=============  ==================================================================================
fp32           nothing
bf16-true      :func:`apply_param_dtype` casts the module to bfloat16 before anything wraps it
*-mixed, zero  FSDP2's ``MixedPrecisionPolicy(param_dtype=<compute dtype>, reduce_dtype=float32)``
>= 2           (:func:`mixed_precision_policy`): FSDP casts the gathered parameters
*-mixed, zero  the caller runs forward under :func:`autocast_context`; DDP keeps fp32 parameters
0/1            and all-reduces fp32 gradients
=============  ==================================================================================

``fp16-mixed`` needs loss scaling (``torch.amp.GradScaler``); the training loop owns it.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from stratagem.plan import Plan
from stratagem.plan.precision import get_precision, torch_dtype

__all__ = ["apply_param_dtype", "autocast_context", "mixed_precision_policy"]

log = logging.getLogger(__name__)


def apply_param_dtype(module: nn.Module, plan: Plan) -> None:
    """Cast ``module``'s parameters and buffers to the plan's parameter dtype when it is not
    fp32 (``bf16-true``), in place."""
    precision = get_precision(plan.precision)
    if precision.param_dtype == "float32":
        log.debug("precision %s: parameters stay float32", plan.precision)
        return
    module.to(torch_dtype(precision.param_dtype))
    log.info("precision %s: cast parameters to %s", plan.precision, precision.param_dtype)


def autocast_context(plan: Plan, device_type: str) -> AbstractContextManager:
    """The context to run forward (and the loss) in: ``torch.autocast`` to the compute dtype for
    ``*-mixed`` plans that DDP applies (``zero`` 0/1), a ``nullcontext`` otherwise (FSDP's
    mixed-precision policy casts for ``zero >= 2``; fp32 and bf16-true need no cast)."""
    if not plan.runs_autocast:
        return nullcontext()
    return torch.autocast(device_type, dtype=torch_dtype(get_precision(plan.precision).compute_dtype))


def mixed_precision_policy(plan: Plan) -> MixedPrecisionPolicy:
    """FSDP2's policy: gather parameters in the compute dtype and reduce gradients in float32 for
    ``*-mixed`` plans; no casting otherwise."""
    precision = get_precision(plan.precision)
    if not precision.autocast:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch_dtype(precision.compute_dtype), reduce_dtype=torch.float32)
