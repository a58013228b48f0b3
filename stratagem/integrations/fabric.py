"""``Fabric(strategy="auto-parallel")``: Fabric training under a stratagem Plan.

:class:`AutoParallelFabricStrategy` is Fabric's ``ModelParallelStrategy`` with the Plan as its
``parallelize_fn``: it brings the process group up in ``setup_environment`` and, in
``setup_module``, chooses a Plan (or takes the one given), builds its DeviceMesh and hands the
module to :func:`stratagem.plugins.apply_plan`. Launching, collectives and meta-device init are
``ModelParallelStrategy``'s; the Lightning strategy shares the rest through
:mod:`stratagem.integrations.planning`.

Registration: the name ``"auto-parallel"`` enters Fabric's own ``STRATEGY_REGISTRY`` when this
module is imported (``import stratagem`` imports it when ``lightning.fabric`` was imported first).
Fabric re-runs the script for the other ranks, so the import must sit in that script. Passing
``strategy=AutoParallelFabricStrategy(...)`` always works.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import STRATEGY_REGISTRY, ModelParallelStrategy
from lightning.fabric.strategies.ddp import _DDPBackwardSyncControl
from lightning.fabric.strategies.model_parallel import _ParallelBackwardSyncControl
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.types import _PATH, _Stateful
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from stratagem.distributed import import_group_defaults, name_lost_peers_in, start_heartbeat
from stratagem.advisor.profile.model_profile import ModelProfile
from stratagem.plan import Plan
from stratagem.plan.checks import check_choice as check_choice_of
from stratagem.plan.workload import GRAD_CLIPS
from stratagem.errors import UsageError
from stratagem.integrations.launchers import FabricLauncher
from stratagem.integrations.planning import (
    PlanPrecision,
    adapt_optimizer,
    check_choice,
    check_plan_precision,
    choose_plan,
    constructor_options,
    load_plan,
    partial_batch_note,
    release_at_exit,
    sampler_kwargs,
    stratagem_precision,
    workload_optimizer,
)
from stratagem.integrations.steps import fabric_step
from stratagem.plugins import apply_plan, build_mesh, build_optimizer, clip_grad_norm_, clip_grad_value_
from stratagem.plugins.materialize import has_meta_tensors, initialises_after_sharding, materialize
from stratagem.plugins.state_dict import (
    load_checkpoint,
    model_state_dict,
    optimizer_state_dict,
    save_sharded_checkpoint,
)

if TYPE_CHECKING:
    from torch import Tensor

    from stratagem.advisor.search.advice import Advice

__all__ = ["AutoParallelFabricStrategy", "register_strategies"]

log = logging.getLogger(__name__)


class _PlanPrecision(PlanPrecision, Precision):
    """Fabric's fp32 plugin with the Plan's compute precision (see :class:`PlanPrecision`)."""


class _PlanBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync`` for what the plan made: DDP's ``no_sync``, or FSDP2's switch."""

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if isinstance(module, DistributedDataParallel):
            return _DDPBackwardSyncControl().no_backward_sync(module, enabled)
        return _ParallelBackwardSyncControl().no_backward_sync(module, enabled)


# Where collectives run outside forward (the plan's precision plugin covers forward): a lost
# rank is named there (stratagem.errors.PeerLost).
@name_lost_peers_in("setup_module", "backward", "optimizer_step", "all_reduce", "barrier", "broadcast",
                    "all_gather", "save_checkpoint", "load_checkpoint")
class AutoParallelFabricStrategy(ModelParallelStrategy):
    """Run a Fabric model as a stratagem Plan says: DDP, ZeRO-1, FSDP2 (ZeRO-2/3, HSDP), tensor
    parallelism, activation checkpointing, offload and precision, on CPU/gloo or CUDA/NCCL.

    Arguments:
        plan: the Plan to apply, as a :class:`Plan`, a dict of its fields or a JSON file (see
            :func:`~stratagem.integrations.planning.load_plan`). ``None`` lets rank 0 choose in
            ``setup``: it profiles the module on fake tensors from ``example_inputs`` or, when that
            is not given, the module's ``example_input_array`` (one rank's batch of ``forward``'s
            inputs: a tensor, a tuple of positional or a dict of keyword arguments), asks the
            advisor for the best plan on the gathered cluster for a global batch of that batch ×
            world size (``micro_batch_size`` at that batch, ``grad_accum`` 1) and the optimizer
            given with the model, ``fabric.setup(model, optimizer)`` (SGD or Adam(W); AdamW for
            another, or when the model is set up alone: the notes say), and broadcasts it.
            :attr:`advice` keeps rank 0's advice.
        example_inputs: inputs to profile on when no plan is given (see ``plan``).
        loss_fn: ``loss_fn(output) -> scalar``, the loss the training loop computes from the
            model's output on ``example_inputs`` (closing over targets shaped for them): the
            profile then holds the loss, its fp32 copies of the logits and their gradients.
            Without it backward is seeded with the sum of the outputs (the advice's notes say
            so), as when ``loss_fn`` cannot run on fake tensors (the notes say why).
        target: the runtime the advisor's plans must run on.
        objective, constraints: what ranks the plans and the Plan fields pinned in the search, as
            for :class:`~stratagem.integrations.lightning.AutoParallelStrategy`.
        verbose: print the advisor's table and the chosen plan on rank 0.
        grad_clip: how the training loop clips the gradients before each optimizer step
            (``fabric.clip_gradients``: ``"norm"`` with ``max_norm``, ``"value"`` with ``clip_val``),
            which the advice then prices (``Workload.grad_clip``); None: not clipped. The strategy
            cannot see the loop when it chooses the plan.
        save_distributed_checkpoint: save checkpoints sharded (a directory written by every rank
            through ``torch.distributed.checkpoint``) rather than as one file gathered on rank 0.
            Either kind loads whatever plan wrote it; the layout is the Lightning strategy's.
        process_group_backend: defaults to ``nccl`` on CUDA, ``gloo`` otherwise.
        timeout: for the process group's collectives.

    Fabric's ``precision`` must be the plan's (``32-true``→``fp32``, ``bf16-mixed``,
    ``bf16-true``); the strategy then applies it itself. One model per Fabric: ``setup`` (or
    ``setup_module``) applies the plan to it. Optimizers given to ``fabric.setup`` with the model
    are pointed at the parallel parameters (they must not have stepped yet); a ZeRO-1 plan
    rebuilds the optimizer around :func:`stratagem.plugins.build_optimizer` (same class and
    defaults, one parameter group, no LR scheduler), also when it is set up with
    ``setup_optimizers`` after the model. A model built under ``fabric.init_module(empty_init=True)``
    is initialised by its ``init_weights()`` or its layers' ``reset_parameters()``: after the plan
    shards it where FSDP runs on GPUs, whole before otherwise
    (:func:`~stratagem.plugins.materialize.initialises_after_sharding`). Pipeline plans (``pp > 1``)
    are not run yet.

    The process group lives until the process exits; it is then released the way gloo survives.
    When a rank dies, the others raise :class:`~stratagem.errors.PeerLost` naming it, within seconds.
    """

    strategy_name = "auto-parallel"

    def __init__(self, plan: Plan | Mapping[str, Any] | str | Path | None = None, *,
                 example_inputs: Any = None, loss_fn: Callable[[Any], Tensor] | None = None,
                 target: str = "lightning", objective: str = "throughput",
                 constraints: Mapping[str, Any] | None = None, verbose: bool = True, grad_clip: str | None = None,
                 save_distributed_checkpoint: bool = True, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout) -> None:
        super().__init__(self._apply_plan, save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self._plan = None if plan is None else load_plan(plan)
        self._example_inputs = example_inputs
        self._loss_fn = loss_fn
        self._advice: Advice | None = None
        self._target = target
        self._objective = objective
        self._constraints = check_choice(target=target, objective=objective, constraints=constraints)
        self._verbose = verbose
        if grad_clip is not None:
            check_choice_of("AutoParallelFabricStrategy.grad_clip", grad_clip, GRAD_CLIPS)
        self._grad_clip = grad_clip
        self._backward_sync_control = _PlanBackwardSyncControl()
        self._module: nn.Module | None = None
        self._given: list[Optimizer] = []  # set up with the module: the optimizers the advice costs

    @property
    def plan(self) -> Plan:
        """The Plan being applied (chosen in ``setup_module`` when none was given)."""
        if self._plan is None:
            raise UsageError("auto-parallel chooses its plan when the model is set up; it is not known yet\n"
                             "HINT: call fabric.setup(model, ...) first, or pass AutoParallelFabricStrategy(plan=...)")
        return self._plan

    @property
    def advice(self) -> Advice | None:
        """The advice rank 0 chose the plan from (its profile, notes and ranked plans); None on
        other ranks and when the plan was given."""
        return self._advice

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return sampler_kwargs(self.plan, self.global_rank)

    @override
    def process_dataloader(self, dataloader: DataLoader) -> DataLoader:
        """The dataloader as it is; on rank 0, a warning where a compiled plan would meet a smaller
        last batch each epoch (:func:`~stratagem.integrations.planning.partial_batch_note`)."""
        if self._plan is not None and self.global_rank == 0 and (note := partial_batch_note(dataloader, self._plan)):
            log.warning("auto-parallel: %s", note)
        return dataloader

    @override
    def _configure_launcher(self) -> None:
        # Lightning's launcher, its observer giving the ranks time to name a lost peer (launchers.py).
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = FabricLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        # ParallelStrategy's, not ModelParallelStrategy's: the mesh is the plan's, built in setup_module.
        ParallelStrategy.setup_environment(self)
        stratagem_precision(self.precision.precision)
        if self._plan is not None:
            check_plan_precision(self._plan, self.precision.precision)
        import_group_defaults()
        self._setup_distributed()
        start_heartbeat()  # so that a lost rank can be named
        release_at_exit(weakref.WeakMethod(self._drop_wrappers))

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        if self._module is not None:
            raise UsageError("auto-parallel applies its plan to one model, which is already set up\n"
                             "HINT: set up one model per Fabric, or combine the models in one nn.Module")
        if self._plan is None:
            inputs = self._profiled_inputs(module)  # on every rank: choose_plan profiles on rank 0 only
            example = inputs if self._loss_fn is None else fabric_step(inputs, self._loss_fn)
            given = self._given
            self._plan, self._advice = choose_plan(
                module, lambda: example, precision=stratagem_precision(self.precision.precision),
                target=self._target, objective=self._objective, constraints=self._constraints,
                verbose=self._verbose, node_rank=self.node_rank, pipelined=_without_pipelines,
                optimizer=lambda: workload_optimizer(lambda: given, "fabric.setup(model, optimizer)"),
                grad_clip=self._grad_clip)
        if self.plan.pp > 1:
            raise UsageError(f"plan {self.plan.name} is a pipeline, which the Fabric strategy does not run yet\n"
                             "HINT: pin a plan with pp=1")
        self.precision = _PlanPrecision(self.plan, self.precision.precision, self.root_device.type)
        self._device_mesh = build_mesh(self.plan, device_type=self.root_device.type)
        self._module = super().setup_module(module)
        log.info("auto-parallel: rank %d applied plan %s", self.global_rank, self.plan.name)
        return self._module

    def _profiled_inputs(self, module: nn.Module) -> Any:
        inputs = self._example_inputs if self._example_inputs is not None else getattr(
            module, "example_input_array", None)
        if inputs is None:
            raise UsageError(f"auto-parallel needs example inputs to profile {type(module).__name__} and choose a "
                             "plan\nHINT: pass AutoParallelFabricStrategy(example_inputs=...), set the module's "
                             "example_input_array, or pin a plan with AutoParallelFabricStrategy(plan=...)")
        return inputs

    def _apply_plan(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        """ModelParallelStrategy's ``parallelize_fn``: the plan, applied, with meta weights initialised."""
        if not initialises_after_sharding(self.plan, self.root_device):
            materialize(module, self.root_device)  # whole, before sharding or DDP's broadcast
        applied = apply_plan(module, self.plan, mesh)
        materialize(module, self.root_device, params_on_host=self.plan.offloads_parameters)
        return applied

    @override
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer],
                                    scheduler: Any = None) -> tuple[nn.Module, list[Optimizer], Any]:
        names = {param: name for name, param in module.named_parameters()}
        for optimizer in optimizers:
            _check_fresh(optimizer, names)
        self._given = optimizers
        try:
            module = self.setup_module(module)
        finally:
            self._given = []
        if self.plan.shards_optimizer_only:
            if scheduler is not None:
                raise UsageError("a zero=1 plan rebuilds the optimizer around ZeroRedundancyOptimizer, so a "
                                 "scheduler built on the original cannot follow it\nHINT: set up the model and "
                                 "optimizer first, then build the scheduler on the optimizer setup returned")
            return module, [self.setup_optimizer(optimizer) for optimizer in optimizers], scheduler
        current = dict(_unwrap_ddp(module).named_parameters())
        for optimizer in optimizers:
            _point_at(optimizer, {param: current[name] for param, name in names.items()})
            adapt_optimizer(optimizer, self.plan, rank=self.global_rank)
        return module, optimizers, scheduler

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self._plan is not None:
            adapt_optimizer(optimizer, self._plan, rank=self.global_rank)
        if self._plan is None or not self._plan.shards_optimizer_only:
            return optimizer
        # ZeroRedundancyOptimizer must be built over the DDP module apply_plan returned.
        if len(optimizer.param_groups) != 1:
            raise UsageError("a zero=1 plan rebuilds the optimizer around ZeroRedundancyOptimizer and supports "
                             f"one parameter group, not {len(optimizer.param_groups)}\n"
                             "HINT: use one parameter group, or a zero=0/2/3 plan")
        assert self._module is not None
        return build_optimizer(self._module, self.plan, type(optimizer), **constructor_options(optimizer))

    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: float | int,
                            norm_type: float | int = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        """Clip by the whole model's gradient norm on any plan (torch's fails on TP ranks)."""
        self.precision.unscale_gradients(optimizer)
        return clip_grad_norm_(self.precision.main_params(optimizer), max_norm, norm_type,
                               error_if_nonfinite=error_if_nonfinite)

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        """Clip by value on any plan (torch's multi-tensor clamp fails on a TP rank's mixed gradients)."""
        self.precision.unscale_gradients(optimizer)
        clip_grad_value_(self.precision.main_params(optimizer), clip_val)

    @override
    def module_to_device(self, module: nn.Module) -> None:
        if not has_meta_tensors(module):
            module.to(self.root_device)

    @override
    def save_checkpoint(self, path: _PATH, state: dict[str, nn.Module | Optimizer | Any],
                        storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        if storage_options is not None or filter is not None:
            raise UsageError("auto-parallel checkpoints take no storage_options or filter\n"
                             "HINT: save the whole state, and filter it after loading")
        path = Path(self.broadcast(path))  # rank 0's path, for every rank
        module, optimizers, rest = self._split_state(state)
        full = not self._save_distributed_checkpoint
        if full and path.is_dir():
            raise UsageError(f"cannot save a full checkpoint to {path}: it is a directory\n"
                             "HINT: give a file path, or save sharded checkpoints")
        checkpoint = {
            "state_dict": model_state_dict(module, full=full),
            "optimizer_states": [optimizer_state_dict(module, o, full=full) for o in optimizers.values()],
            **{key: value.state_dict() if isinstance(value, _Stateful) else value for key, value in rest.items()},
        }
        if not full:
            save_sharded_checkpoint(path, checkpoint, list(optimizers.values()))
        elif self.is_global_zero:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(checkpoint, path)

    @override
    def load_checkpoint(self, path: _PATH, state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] |
                        None = None, strict: bool = True, weights_only: bool | None = None) -> dict[str, Any]:
        if not isinstance(state, dict) or not state:
            raise UsageError("auto-parallel loads a checkpoint into a state dict holding the set-up model\n"
                             "HINT: fabric.load(path, {'model': model, 'optimizer': optimizer, ...})")
        path = Path(self.broadcast(path))
        module, optimizers, rest = self._split_state(state)
        remaining = load_checkpoint(path, module, list(optimizers.values()), strict=strict, weights_only=weights_only)
        missing = rest.keys() - remaining.keys()
        if strict and missing:
            raise UsageError(f"the checkpoint {path} holds no {', '.join(sorted(missing))}\n"
                             "HINT: load with strict=False, or ask only for what was saved")
        for key in rest.keys() & remaining.keys():
            if isinstance(rest[key], _Stateful):
                rest[key].load_state_dict(remaining.pop(key))
            else:
                state[key] = remaining.pop(key)
        return remaining

    def _split_state(self, state: Mapping[str, Any]) -> tuple[nn.Module, dict[str, Optimizer], dict[str, Any]]:
        """The set-up model (unwrapped from DDP), the optimizers in order and everything else."""
        modules = [value for value in state.values() if isinstance(value, nn.Module)]
        if len(modules) != 1 or self._module is None or _unwrap_ddp(modules[0]) is not _unwrap_ddp(self._module):
            raise UsageError(f"an auto-parallel checkpoint holds the one model the plan was applied to; the state "
                             f"has {len(modules)} module(s)\nHINT: pass the model fabric.setup returned, once")
        optimizers = {key: value for key, value in state.items() if isinstance(value, Optimizer)}
        rest = {key: value for key, value in state.items()
                if not isinstance(value, (nn.Module, Optimizer))}
        clash = rest.keys() & {"state_dict", "optimizer_states"}
        if clash:
            raise UsageError(f"the checkpoint layout keeps {', '.join(sorted(clash))} for the model and optimizers\n"
                             "HINT: rename that entry of the state")
        return _unwrap_ddp(modules[0]), optimizers, rest

    def _drop_wrappers(self) -> None:
        """Let go of the applied module before the process group goes (gloo's teardown abort: docs/platform.md)."""
        self._module = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="stratagem: advise a Plan and apply it",
                                   override=True)


def _unwrap_ddp(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, DistributedDataParallel) else module


def _check_fresh(optimizer: Optimizer, names: dict[nn.Parameter, str]) -> None:
    """``optimizer`` may follow the model into its plan: it has not stepped and holds only the
    model's parameters (``names``)."""
    if optimizer.state:
        raise UsageError("the optimizer has taken steps before fabric.setup, and its state belongs to the "
                         "unparallelized parameters\nHINT: set up the model and optimizer before training")
    if any(param not in names for group in optimizer.param_groups for param in group["params"]):
        raise UsageError("the optimizer holds parameters of another model than the one being set up\n"
                         "HINT: build the optimizer from model.parameters()")


def _point_at(optimizer: Optimizer, moved: dict[nn.Parameter, nn.Parameter]) -> None:
    """Point ``optimizer``'s parameter groups at the parameters ``apply_plan`` put in place of the
    original ones (FSDP and TP register new DTensor parameters)."""
    for group in optimizer.param_groups:
        group["params"] = [moved[param] for param in group["params"]]


def register_strategies() -> None:
    """Add ``"auto-parallel"`` to Fabric's ``STRATEGY_REGISTRY`` (again is fine: it overrides)."""
    AutoParallelFabricStrategy.register_strategies(STRATEGY_REGISTRY)


register_strategies()


def _without_pipelines(profile: ModelProfile) -> ModelProfile:
    """``profile`` offering no pipeline plans: the Fabric strategy does not run them yet."""
    return dataclasses.replace(profile, pp_unavailable="the Fabric strategy does not run pipelines yet")
