"""``apply_plan``: the one place that combines techniques, in one documented order.

The order (docs/design.md, torchtitan's ``parallelize_llama``):

1. build on ``meta`` — the caller's job (only FSDP, ``zero >= 2``, accepts a meta module);
2. split into pipeline stages: this rank's stage modules, as ``plan.stage_blocks`` says
   (:func:`~stratagem.plugins.pipeline.split_stages`); steps 3–6 then apply to each stage,
   and the stages go into a schedule (:class:`~stratagem.plugins.pipeline.Pipeline`);
3. tensor / sequence parallel over the ``tp`` axis, as ``plan.tp_layout`` says
   (``apply_tensor_parallel``);
4. activation checkpointing, per block (``apply_activation_checkpointing``);
5. ``torch.compile``, per block, when ``plan.compile`` (``apply_compile``): after checkpointing,
   so the compiled graph holds the checkpoint's recomputation, and before FSDP, whose hooks
   stay outside the compiled region (torchtitan's order);
6. data parallel: ``fully_shard`` per block and then the root (``zero >= 2``), or DDP
   (``zero`` 0/1) (``apply_data_parallel``); with ``tp > 1`` FSDP shards the tensor-parallel
   DTensors over the data-parallel sub-mesh of the 2-D (dp × tp) mesh, and DDP is refused
   (it cannot hold DTensor parameters);
7. ``to_empty`` and weight init (the caller's, for a meta module), then the optimizer
   (:func:`build_optimizer`).

A ``bf16-true`` plan casts the module to bfloat16 (BatchNorm layers stay float32) before step 2,
so every wrapper sees the final dtypes. ``*-mixed`` plans with ``zero`` 0/1 run forward under
``autocast_context``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from stratagem.plan import MeshAxis, Plan
from stratagem.errors import UsageError
from stratagem.plugins.checkpointing import apply_activation_checkpointing
from stratagem.plugins.compile import apply_compile
from stratagem.plugins.data_parallel import apply_data_parallel, build_optimizer
from stratagem.plugins.mesh import check_world_size, submesh
from stratagem.plugins.pipeline import (
    Pipeline,
    build_schedule,
    first_last_group,
    split_stages,
    tied_parameters,
    unwrap,
)
from stratagem.plugins.traced_stages import check_traced_stage_plan, rebuild_generated_code
from stratagem.plugins.precision import apply_param_dtype, fp32_norm_names
from stratagem.plugins.tensor_parallel import (
    apply_tensor_parallel,
    check_tp_layout_given,
    match_tp_layout,
    unmatched_tp_patterns,
)
from stratagem.plan.stages import removal_convention

__all__ = ["apply_plan", "build_optimizer", "check_applicable", "check_plan_fits"]

log = logging.getLogger(__name__)


def apply_plan(module: nn.Module, plan: Plan, mesh: DeviceMesh, *,
               loss_fn: Callable[[Any, Tensor], Tensor] | None = None,
               example_inputs: tuple[Tensor, ...] | None = None) -> nn.Module | Pipeline:
    """Parallelize ``module`` as ``plan`` says on ``mesh`` (from ``build_mesh``), in the module
    docstring's order; returns the module to train (a DDP wrapper for ``zero`` 0/1, otherwise
    ``module`` itself, changed in place) or, for ``pp > 1``, this rank's :class:`Pipeline`.

    A pipeline needs ``loss_fn(output, target) -> scalar`` (the schedule runs it on the last
    stage) and ``example_inputs``, one micro-batch of the model's positional inputs (for a
    model whose stages are traced). Raises :class:`UsageError` for what cannot be applied, for
    a ``tp_layout`` that does not fit the model and for a mesh whose size does not match the
    plan, before changing anything; and for a plan made for another model, where applying it
    reads what the model lacks (:func:`check_plan_fits`).
    """
    check_applicable(plan)
    if plan.pp > 1:
        _check_pipeline_inputs(module, plan, loss_fn=loss_fn, example_inputs=example_inputs)
    check_plan_fits(module, _as_applied(plan))
    check_world_size(plan, world_size=mesh.size())
    if plan.tp > 1:
        match_tp_layout(module, plan)
    log.info("applying plan %s", plan.name)
    apply_param_dtype(module, plan)
    if plan.pp == 1:
        log.info("pipeline parallel: degree 1, nothing to split")
        return _apply_per_stage(module, plan, mesh)
    pp_mesh = mesh[str(MeshAxis.PP)]
    pp_rank = pp_mesh.get_local_rank()
    tied = tied_parameters(module, plan)
    tied_group, tied_source = first_last_group(mesh) if tied else (None, -1)
    traced = removal_convention(module, block_container=plan.block_container) is None
    stage_plan = replace(plan, block_container=None) if traced else plan  # no per-block FSDP units
    norm_names = fp32_norm_names(module) if traced else None  # tracing replaces the layers, keeps the names
    stages = nn.ModuleList(_apply_per_stage(stage, stage_plan, mesh, norm_names=norm_names)
                           for stage in split_stages(module, plan, pp_rank=pp_rank, example_inputs=example_inputs))
    if traced:
        for stage in stages:
            rebuild_generated_code(unwrap(stage))
    return Pipeline(plan=plan, modules=stages, schedule=build_schedule(list(stages), plan, mesh, loss_fn=loss_fn),
                    pp_group=pp_mesh.get_group(), device_type=mesh.device_type, is_first=pp_rank == 0,
                    is_last=pp_rank == plan.pp - 1, tied=tied, tied_group=tied_group, tied_source=tied_source)


def _apply_per_stage(module: nn.Module, plan: Plan, mesh: DeviceMesh, *,
                     norm_names: list[str] | None = None) -> nn.Module:
    """Steps 3–6 on one stage (the whole model without pipelining); ``norm_names``: a traced
    stage's BatchNorm layers (``apply_fully_shard``)."""
    apply_tensor_parallel(module, plan, submesh(mesh, (MeshAxis.TP,)) if plan.tp > 1 else None)
    apply_activation_checkpointing(module, plan)
    apply_compile(module, plan)
    return apply_data_parallel(module, plan, mesh, norm_names=norm_names)


def _check_pipeline_inputs(module: nn.Module, plan: Plan, *, loss_fn: Callable | None,
                           example_inputs: tuple[Tensor, ...] | None) -> None:
    if loss_fn is None:
        raise UsageError(f"plan {plan.name} is a pipeline: its schedule computes the loss on the last "
                         "stage, so apply_plan needs loss_fn\nHINT: pass loss_fn=lambda output, target: ...")
    if removal_convention(module, block_container=plan.block_container) is None:
        check_traced_stage_plan(plan)
        if example_inputs is None:
            raise UsageError(f"{type(module).__name__}'s pipeline stages are traced, which needs one "
                             "micro-batch of its inputs\nHINT: pass example_inputs=(tensor, ...) of "
                             f"micro_batch_size={plan.micro_batch_size} samples")


def check_applicable(plan: Plan) -> None:
    """Raise :class:`UsageError` for the plan features the plugins cannot apply yet, and for
    checkpointing without blocks."""
    check_tp_layout_given(plan)
    if plan.tp > 1 and plan.uses_ddp:
        # DDP cannot hold DTensor parameters: its initial broadcast fails on "mixed torch.Tensor and
        # DTensor"; torch's private pre_dp_module_transform workaround is untested for nested modules.
        raise UsageError(f"plan {plan.name}: DDP (zero {plan.zero}) does not compose with tensor "
                         f"parallelism here (DDP cannot hold TP's DTensor parameters)\nHINT: use zero=2 or "
                         "zero=3 (FSDP over dp_shard, or HSDP with dp_replicate), which shards DTensors")
    if plan.compile and plan.block_container is None:
        raise UsageError("compile=true compiles each block, and the plan names no blocks\n"
                         "HINT: set block_container to the FQN of the model's block list (e.g. 'layers'), or "
                         "compile=false")
    if plan.checkpoints and plan.block_container is None:
        raise UsageError(f"activation_checkpointing={plan.activation_checkpointing!r} checkpoints each "
                         "block, but the plan names no block_container\n"
                         "HINT: set Plan.block_container to the FQN of the ModuleList holding the blocks "
                         "(e.g. 'layers'), or activation_checkpointing='none'")


def check_plan_fits(module: nn.Module, plan: Plan, *, world_size: int | None = None) -> None:
    """Raise :class:`UsageError` when ``plan`` was made for another model than ``module`` (or, given
    ``world_size``, another launch), naming every mismatch: a ``block_container`` the module lacks or
    that holds no blocks, ``tp_layout`` patterns that match none of its modules, ``stage_blocks``
    (or pipeline stages) for another block count, degrees multiplying to another world size."""
    problems = _module_mismatches(module, plan)
    if world_size is not None and plan.world_size != world_size:
        problems.append(f"its degrees multiply to {plan.world_size} ranks (pp {plan.pp} × dp_replicate "
                        f"{plan.dp_replicate} × dp_shard {plan.dp_shard} × tp {plan.tp}), but {world_size} run")
    if problems:
        launch = f", or launch {plan.world_size} processes" if world_size not in (None, plan.world_size) else ""
        raise UsageError(f"plan {plan.name} was not made for this {type(module).__name__}: {'; '.join(problems)}"
                         f"\nHINT: advise for this model (`advise --model ...`, or profile_model(module) and "
                         f"advise) and use that plan{launch}")


def _as_applied(plan: Plan) -> Plan:
    """``plan`` less what applying it does not read, so that a plan that runs is not refused: the
    blocks where nothing works per block (no checkpointing, FSDP, TP or pipeline), the TP layout at tp 1."""
    uses_blocks = plan.checkpoints or plan.uses_fsdp or plan.tp > 1 or plan.pp > 1
    return replace(plan, block_container=plan.block_container if uses_blocks else None,
                   tp_layout=plan.tp_layout if plan.tp > 1 else ())


def _module_mismatches(module: nn.Module, plan: Plan) -> list[str]:
    """What ``plan`` names that ``module`` lacks, one phrase each."""
    problems, blocks = [], None
    if plan.block_container is not None:
        try:
            blocks = list(module.get_submodule(plan.block_container).children())
        except AttributeError:
            lists = [name for name, sub in module.named_modules() if isinstance(sub, nn.ModuleList)]
            prefixes = [name.removesuffix(plan.block_container) for name in lists
                        if name.endswith(f".{plan.block_container}")]
            within = (f"; a plan for the model it holds as {prefixes[0][:-1]!r}? Prefix block_container and "
                      f"tp_layout's patterns with {prefixes[0]!r}") if len(prefixes) == 1 else ""
            problems.append(f"block_container {plan.block_container!r} is not one of its submodules (its module "
                            f"lists: {', '.join(map(repr, lists)) or 'none'}{within})")
        else:
            if not blocks:
                problems.append(f"block_container {plan.block_container!r} holds no blocks")
    unmatched = unmatched_tp_patterns(module, plan)
    if unmatched:
        problems.append(f"tp_layout names modules it lacks: {', '.join(map(repr, unmatched))}")
    if blocks and plan.stage_blocks is not None and sum(plan.stage_blocks) != len(blocks):
        problems.append(f"stage_blocks {list(plan.stage_blocks)} split {sum(plan.stage_blocks)} blocks, but "
                        f"{plan.block_container!r} holds {len(blocks)}")
    elif blocks and plan.num_stages > len(blocks):
        problems.append(f"its {plan.num_stages} pipeline stages need at least as many blocks, but "
                        f"{plan.block_container!r} holds {len(blocks)}")
    return problems
