"""Data parallelism as the Plan's ``zero`` stage says, and the optimizer that goes with it.

======  ===========================================================================================
zero    applied as
======  ===========================================================================================
0       ``DistributedDataParallel`` over the ``dp_replicate`` axis
1       ``DistributedDataParallel`` over ``dp_shard`` + ``ZeroRedundancyOptimizer`` on the same
        group (:func:`build_optimizer`)
2       FSDP2 ``fully_shard(reshard_after_forward=False)``: parameters gathered once per step,
        gradients reduce-scattered
3       FSDP2 ``fully_shard(reshard_after_forward=True)``: parameters resharded after forward
======  ===========================================================================================

For ``zero >= 2`` the FSDP units are each block (children of ``plan.block_container``) and then
the root; ``dp_replicate > 1`` makes it HSDP on the 2-D ``dp_replicate × dp_shard`` mesh. A plan
computing in 16 bits first makes each BatchNorm layer a unit of its own that stays float32
(:func:`~stratagem.plugins.precision.norm_policy`).
``offload="params"`` becomes FSDP2's ``CPUOffloadPolicy``, which keeps parameter shards,
gradients and the optimizer step on the host; ``"optimizer"`` (states only) has no FSDP2
equivalent and is refused. Pinned host memory needs an accelerator, so it is pinned only when
CUDA is available.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from stratagem.plan import Plan
from stratagem.plan.precision import get_precision
from stratagem.errors import UsageError
from stratagem.plugins.blocks import find_blocks
from stratagem.plugins.host_optimizer import host_optimizer_options
from stratagem.plugins.mesh import data_parallel_axes, submesh
from stratagem.plugins.parameter_groups import separate_dtensors
from stratagem.plugins.precision import fp32_norm_names, mixed_precision_policy, norm_policy
from stratagem.plugins.tensor_parallel import reduce_norm_grads_once

__all__ = ["apply_data_parallel", "apply_fully_shard", "build_optimizer", "offload_policy"]

log = logging.getLogger(__name__)


def apply_data_parallel(module: nn.Module, plan: Plan, mesh: DeviceMesh, *,
                        norm_names: Collection[str] | None = None) -> nn.Module:
    """Wrap ``module`` in DDP (``zero`` 0/1) or shard it with FSDP2 (``zero >= 2``) on ``mesh``;
    returns the module to train (a new DDP wrapper, or ``module`` itself, changed in place).
    ``norm_names``: see :func:`apply_fully_shard`."""
    axes = data_parallel_axes(plan)
    if plan.uses_fsdp:
        apply_fully_shard(module, plan, submesh(mesh, axes), norm_names=norm_names)
        return module
    if not axes:
        log.info("data parallel: degree 1, nothing to replicate")
        return module
    group = submesh(mesh, axes).get_group()
    device = next(module.parameters()).device
    device_ids = [device] if device.type != "cpu" else None
    log.info("data parallel: DDP over %s (%d ranks)%s", axes[0], group.size(),
             ", optimizer states sharded (ZeRO-1)" if plan.shards_optimizer_only else "")
    return DistributedDataParallel(module, device_ids=device_ids, process_group=group)


def apply_fully_shard(module: nn.Module, plan: Plan, dp_mesh: DeviceMesh, *,
                      norm_names: Collection[str] | None = None) -> None:
    """``fully_shard`` each BatchNorm layer (16-bit plans only), each block, then the root, on
    ``dp_mesh`` (1-D FSDP or 2-D HSDP), in place. ``norm_names``: the BatchNorm layers' FQNs in
    the unsplit model, for a traced pipeline stage (tracing replaced the layers by graph
    modules under the same names); by default they are found by type."""
    options: dict[str, Any] = {
        "mesh": dp_mesh,
        "reshard_after_forward": plan.shards_parameters,
        "mp_policy": mixed_precision_policy(plan),
        "offload_policy": offload_policy(plan),
    }
    if plan.block_container is None:
        log.warning("FSDP: no block units (the plan names no block_container, or this is a pipeline stage "
                    "traced as one graph), so the root is the only unit and all of it is gathered at once")
        blocks = []
    else:
        blocks = find_blocks(module, plan)
    norms = _norm_units(module, plan, norm_names)
    for norm in norms:  # innermost first: each unit takes the parameters no inner unit holds
        # never resharded: a few floats per channel, and a resharded unit would gather again inside a
        # selectively checkpointed block's recompute, whose count of FSDP's profiler ops SAC checks
        fully_shard(norm, **{**options, "mp_policy": norm_policy(), "reshard_after_forward": False})
    for block in blocks:
        fully_shard(block, **options)
    fully_shard(module, **options)
    log.info("FSDP (zero %d) over mesh %s: %d BatchNorm units, %d block units + root, offload=%s, precision=%s",
             plan.zero, dp_mesh.mesh_dim_names, len(norms), len(blocks), plan.offload, plan.precision)


def _norm_units(module: nn.Module, plan: Plan, names: Collection[str] | None) -> list[nn.Module]:
    """The BatchNorm layers that become float32 units: none for an fp32 plan (nothing is cast);
    those at ``names`` that this module holds (a pipeline stage holds only its own)."""
    if get_precision(plan.precision).compute_dtype == "float32":
        return []
    units = []
    for name in fp32_norm_names(module) if names is None else names:
        try:
            units.append(module.get_submodule(name))
        except AttributeError:
            continue
    return units


def offload_policy(plan: Plan) -> OffloadPolicy:
    """FSDP2's offload policy for ``plan.offload``; pinned memory only when CUDA is available."""
    if not plan.offloads:
        return OffloadPolicy()
    if plan.offload == "optimizer":
        raise UsageError("offload='optimizer' keeps parameters on the device and only optimizer "
                         "states on the host; FSDP2 has no such policy (its CPU offload moves "
                         "parameter shards and gradients too)\nHINT: use offload='params', or run "
                         "the plan with DeepSpeed (ZeRO-Offload)")
    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())


def build_optimizer(module: nn.Module, plan: Plan, optimizer_cls: type[torch.optim.Optimizer],
                    **optimizer_kwargs: Any) -> torch.optim.Optimizer:
    """The optimizer for ``module`` as :func:`apply_data_parallel` returned it (or a pipeline's
    ``modules``, this rank's stages): ``optimizer_cls(params, **optimizer_kwargs)``, wrapped in
    ``ZeroRedundancyOptimizer`` on the DDP group for ``zero = 1``, its parameters packed into one
    bucket per rank (``parameters_as_bucket_view``): after its step each rank broadcasts its
    bucket, one collective per rank instead of one per parameter tensor. FSDP's parameters are
    already sharded (``zero >= 2``). An offloaded plan's optimizer steps on the host, fused
    where the caller named no implementation (:mod:`~stratagem.plugins.host_optimizer`). With
    sequence parallelism (and no FSDP) the norms' gradients are summed over the TP ranks once
    before each step (:func:`~stratagem.plugins.tensor_parallel.reduce_norm_grads_once`). Under TP
    without FSDP the DTensors and the plain tensors are two parameter groups, which GPUs' multi-tensor
    steps take (:func:`~stratagem.plugins.parameter_groups.separate_dtensors`)."""
    if not plan.shards_optimizer_only:
        options = host_optimizer_options(plan, optimizer_cls, optimizer_kwargs)
        optimizer = optimizer_cls(separate_dtensors(module.parameters()), **options)
        reduce_norm_grads_once(optimizer, plan)
        return optimizer
    wrapped = list(module) if isinstance(module, nn.ModuleList) else [module]
    if not all(isinstance(m, DistributedDataParallel) for m in wrapped):
        raise UsageError(f"zero=1 shards the optimizer over DDP's group, but the module is a "
                         f"{type(module).__name__}\nHINT: pass the module apply_plan returned "
                         "(a pipeline's .modules)")
    return ZeroRedundancyOptimizer(module.parameters(), optimizer_class=optimizer_cls,
                                   process_group=wrapped[0].process_group, parameters_as_bucket_view=True,
                                   **optimizer_kwargs)
