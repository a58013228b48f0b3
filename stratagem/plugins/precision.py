"""Apply a Plan's precision: which dtype parameters live in and how compute gets its dtype.

=============  ==================================================================================
precision      what the plugins do
=============  ==================================================================================
fp32           nothing
bf16-true      :func:`apply_param_dtype` casts the module to bfloat16 before anything wraps it,
               BatchNorm layers apart
*-mixed, zero  FSDP2's ``MixedPrecisionPolicy(param_dtype=<compute dtype>, reduce_dtype=float32)``
>= 2           (:func:`mixed_precision_policy`): FSDP casts the gathered parameters, BatchNorm
               layers apart (:func:`norm_policy`)
*-mixed, zero  the caller runs forward under :func:`autocast_context`; DDP keeps fp32 parameters
0/1            and all-reduces fp32 gradients
=============  ==================================================================================

BatchNorm layers (:data:`FP32_NORMS`) keep float32 weights and running statistics under every
precision: ``batch_norm`` takes a 16-bit input with float32 weights and statistics (it
accumulates in float32 and returns the input's dtype) or everything in one dtype, never 16-bit
weights with float32 statistics. Under FSDP each becomes its own unit without mixed precision,
as FSDP1's ``MixedPrecision`` does by default (``_module_classes_to_ignore``); a ``*-true`` cast
leaves them out, as apex's O2 (``keep_batchnorm_fp32``) did, except under ZeRO-1:
``ZeroRedundancyOptimizer`` refuses parameters of two dtypes, so there they are cast with the rest
(weights and statistics in bfloat16, which ``batch_norm`` runs).

``fp16-mixed`` needs loss scaling (``torch.amp.GradScaler``); the training loop owns it.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from functools import partial

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn.modules.batchnorm import _BatchNorm

from stratagem.plan import Plan
from stratagem.plan.precision import get_precision, torch_dtype

__all__ = ["FP32_NORMS", "apply_param_dtype", "autocast_context", "fp32_norm_names", "mixed_precision_policy",
           "norm_policy"]

log = logging.getLogger(__name__)

FP32_NORMS: tuple[type[nn.Module], ...] = (_BatchNorm,)
"""Norm layers whose weights, running statistics and arithmetic stay float32 under every
precision (BatchNorm 1d/2d/3d, SyncBatchNorm; see the module docstring)."""


def fp32_norm_names(module: nn.Module) -> list[str]:
    """The FQNs of ``module``'s :data:`FP32_NORMS` layers, in module order."""
    return [name for name, sub in module.named_modules() if isinstance(sub, FP32_NORMS)]


def apply_param_dtype(module: nn.Module, plan: Plan) -> None:
    """Cast ``module``'s floating parameters and buffers to the plan's parameter dtype when it
    is not fp32 (``bf16-true``), in place; :data:`FP32_NORMS` layers are made float32 instead,
    except under ZeRO-1, whose optimizer takes one dtype (all of it then runs in bfloat16)."""
    precision = get_precision(plan.precision)
    if precision.param_dtype == "float32":
        log.debug("precision %s: parameters stay float32", plan.precision)
        return
    dtype = torch_dtype(precision.param_dtype)
    # ZeroRedundancyOptimizer takes parameters of one dtype only: under ZeRO-1 the norms follow
    keep_norms = not plan.shards_optimizer_only
    norms = 0
    for sub in module.modules():
        keep = keep_norms and isinstance(sub, FP32_NORMS)
        norms += keep
        # each module's own tensors (recurse=False), cast as ``Module.to(dtype)`` casts them
        sub._apply(partial(_cast, dtype=torch.float32 if keep else dtype), recurse=False)
    log.info("precision %s: cast parameters to %s%s", plan.precision, precision.param_dtype,
             f", {norms} BatchNorm layers kept float32" if norms else "")


def _cast(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() or tensor.is_complex() else tensor


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


def norm_policy() -> MixedPrecisionPolicy:
    """FSDP2's policy for a unit of one :data:`FP32_NORMS` layer: parameters gathered and
    gradients reduced in float32, and its input left in the dtype the layer before produced
    (``batch_norm`` normalises a 16-bit input with float32 weights and statistics)."""
    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
