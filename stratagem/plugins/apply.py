"""``apply_plan``: the one place that combines techniques, in one documented order.

The order (STYLE §2, torchtitan's ``parallelize_llama``):

1. build on ``meta`` — the caller's job (only FSDP, ``zero >= 2``, accepts a meta module);
2. split into pipeline stages — not applied yet: ``pp > 1`` raises;
3. tensor / sequence parallel over the ``tp`` axis, as ``plan.tp_layout`` says
   (``apply_tensor_parallel``);
4. activation checkpointing, per block (``apply_activation_checkpointing``);
5. ``torch.compile``, per block — not part of the Plan, so never applied here;
6. data parallel: ``fully_shard`` per block and then the root (``zero >= 2``), or DDP
   (``zero`` 0/1) (``apply_data_parallel``); with ``tp > 1`` FSDP shards the tensor-parallel
   DTensors over the data-parallel sub-mesh of the 2-D (dp × tp) mesh, and DDP is refused
   (it cannot hold DTensor parameters);
7. ``to_empty`` and weight init (the caller's, for a meta module), then the optimizer
   (:func:`build_optimizer`).

A ``bf16-true`` plan casts the module to bfloat16 before step 2, so every wrapper sees the
final dtypes. ``*-mixed`` plans with ``zero`` 0/1 run forward under ``autocast_context``.
"""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from stratagem.advisor.plan import MeshAxis, Plan
from stratagem.errors import UsageError
from stratagem.plugins.checkpointing import apply_activation_checkpointing
from stratagem.plugins.data_parallel import apply_data_parallel, build_optimizer
from stratagem.plugins.mesh import check_world_size, submesh
from stratagem.plugins.precision import apply_param_dtype
from stratagem.plugins.tensor_parallel import apply_tensor_parallel, check_tp_layout_given, match_tp_layout

__all__ = ["apply_plan", "build_optimizer", "check_applicable"]

log = logging.getLogger(__name__)


def apply_plan(module: nn.Module, plan: Plan, mesh: DeviceMesh) -> nn.Module:
    """Parallelize ``module`` as ``plan`` says on ``mesh`` (from ``build_mesh``), in the module
    docstring's order; returns the module to train (a DDP wrapper for ``zero`` 0/1, otherwise
    ``module`` itself, changed in place).

    Raises :class:`UsageError` for what cannot be applied (yet), for a ``tp_layout`` that does not
    fit the model and for a mesh whose size does not match the plan, before changing anything.
    """
    check_applicable(plan)
    check_world_size(plan, world_size=mesh.size())
    if plan.tp > 1:
        match_tp_layout(module, plan)
    log.info("applying plan %s", plan.name)
    apply_param_dtype(module, plan)
    log.info("pipeline parallel: degree 1, nothing to split")
    apply_tensor_parallel(module, plan, submesh(mesh, (MeshAxis.TP,)) if plan.tp > 1 else None)
    apply_activation_checkpointing(module, plan)
    return apply_data_parallel(module, plan, mesh)


def check_applicable(plan: Plan) -> None:
    """Raise :class:`UsageError` for the plan features the plugins cannot apply yet, and for
    checkpointing without blocks."""
    check_tp_layout_given(plan)
    if plan.tp > 1 and plan.zero < 2 and plan.dp > 1:
        # DDP cannot hold DTensor parameters: its initial broadcast fails on "mixed torch.Tensor and
        # DTensor"; torch's private pre_dp_module_transform workaround is untested for nested modules.
        raise UsageError(f"plan {plan.name}: DDP (zero {plan.zero}) does not compose with tensor "
                         f"parallelism here (DDP cannot hold TP's DTensor parameters)\nHINT: use zero=2 or "
                         "zero=3 (FSDP over dp_shard, or HSDP with dp_replicate), which shards DTensors")
    if plan.pp > 1:
        raise UsageError(f"pipeline parallelism is not applied yet (plan {plan.name} has pp={plan.pp})\n"
                         "HINT: pick a plan with pp=1")
    if plan.activation_checkpointing != "none" and plan.block_container is None:
        raise UsageError(f"activation_checkpointing={plan.activation_checkpointing!r} checkpoints each "
                         "block, but the plan names no block_container\n"
                         "HINT: set Plan.block_container to the FQN of the ModuleList holding the blocks "
                         "(e.g. 'layers'), or activation_checkpointing='none'")
