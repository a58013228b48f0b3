"""``Trainer(strategy="auto-parallel")``: Lightning training under a stratagem Plan.

:class:`AutoParallelStrategy` follows Lightning's ``ModelParallelStrategy``: it brings the
process group up in ``setup_environment`` and, in ``setup``, chooses a Plan (or takes the one
given), builds its DeviceMesh and hands the LightningModule to :func:`stratagem.plugins.apply_plan`.
Everything else is Lightning's ``ParallelStrategy``.

Registration: Lightning has no entry points for strategies, so the name ``"auto-parallel"`` exists
once this module is imported. ``import stratagem.integrations.lightning`` registers it;
``import stratagem`` registers it too when ``lightning`` was imported first (``import stratagem``
itself never imports lightning). Lightning re-runs the training script for the other ranks, so the
import must sit in that script. Passing ``strategy=AutoParallelStrategy(...)`` always works.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable, Generator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from stratagem.distributed import import_group_defaults
from stratagem.advisor.profile.model_profile import ModelProfile
from stratagem.plan import Plan
from stratagem.advisor.search.targets import target_excludes
from stratagem.errors import UsageError
from stratagem.integrations.planning import (
    PlanPrecision,
    check_choice,
    check_plan_precision,
    choose_plan,
    constructor_options,
    forward_inputs,
    load_plan,
    plan_hyperparams,
    release_at_exit,
    sampler_kwargs,
    stratagem_precision,
)
from stratagem.plugins import apply_plan, build_mesh, build_optimizer
from stratagem.plugins.materialize import has_meta_tensors, materialize
from stratagem.plugins.pipeline import Pipeline, rank_module
from stratagem.plugins.state_dict import (
    load_checkpoint,
    model_state_dict,
    optimizer_state_dict,
    save_sharded_checkpoint,
)
from stratagem.plan.stages import removal_convention

__all__ = ["AutoParallelStrategy", "register_strategies"]

log = logging.getLogger(__name__)


class _PlanPrecision(PlanPrecision, Precision):
    """Lightning's fp32 plugin with the Plan's compute precision (see :class:`PlanPrecision`)."""


class AutoParallelStrategy(ParallelStrategy):
    """Train a LightningModule as a stratagem Plan says: DDP, ZeRO-1, FSDP2 (ZeRO-2/3, HSDP),
    tensor parallelism, activation checkpointing, offload and precision, on CPU/gloo or CUDA/NCCL.

    Arguments:
        plan: the Plan to apply, as a :class:`Plan`, a dict of its fields or a JSON file (see
            :func:`~stratagem.integrations.planning.load_plan`). ``None`` lets rank 0 choose: it
            profiles the LightningModule on fake tensors from ``example_input_array`` (one rank's
            batch of ``forward``'s inputs) or, when that is not set, from the inputs ``forward``
            receives on the first batch of the stage's dataloader; it asks the advisor for the best
            plan on the gathered cluster for a global batch of that batch × world size, and
            broadcasts it. The search keeps ``micro_batch_size`` at that batch and ``grad_accum`` at 1,
            since the dataloader's batches reach the model unchanged.
        target: the runtime the advisor's plans must run on.
        objective: what ranks the plans: ``"throughput"`` (the fastest step) or ``"memory"`` (the
            least memory per device).
        constraints: Plan fields to pin in the search, e.g. ``{"zero": 3}`` or ``{"tp": (1, 2)}``.
        verbose: print the advisor's table and the chosen plan on rank 0.
        save_distributed_checkpoint: save checkpoints sharded (a directory written by every rank
            through ``torch.distributed.checkpoint``) rather than as one file gathered on rank 0.
            Either kind loads (``trainer.fit(ckpt_path=...)``) whatever plan wrote it.
        process_group_backend: defaults to ``nccl`` on CUDA, ``gloo`` otherwise.
        timeout: for the process group's collectives.

    The Trainer's ``precision`` must be the plan's (``32-true``→``fp32``, ``bf16-mixed``,
    ``bf16-true``); the strategy then applies it itself (see ``_PlanPrecision``).
    ZeRO-1 rebuilds the optimizer ``configure_optimizers`` returned around
    :func:`stratagem.plugins.build_optimizer` (same class and defaults, one parameter group, no
    LR scheduler). FSDP plans need ``training_step`` to call ``self(...)``, as every step runs
    through the LightningModule's ``forward``. A model built under
    ``trainer.init_module(empty_init=True)`` lives on ``meta`` until the plan is applied and is then
    initialised by its ``init_weights()`` or its layers' ``reset_parameters()``.

    Pipeline plans (``pp > 1``: gpipe, 1f1b, interleaved 1f1b; alone or with DDP, FSDP or TP,
    interleaved stages not under FSDP) split the child module that holds the blocks
    (``block_container``'s first part, e.g. ``self.model``) and put this rank's stages in its
    place, so ``self.parameters()``, ``configure_optimizers`` and checkpoints (sharded) see them.
    The LightningModule must then define ``loss_fn(output, target)``, and batches must be
    ``(inputs..., target)``: the strategy runs the schedule (forward and backward) instead of
    ``training_step``/``validation_step``/``test_step`` and logs the last stage's loss as
    ``train_loss``/``val_loss``/``test_loss`` on every rank. ``trainer.predict`` runs the schedule
    forward only, without the loss, instead of ``predict_step``: a predict batch is the pipelined
    child's positional inputs (a tensor, or a tuple or list starting with them; a target after
    them is ignored), and each rank's prediction for it is the child's output (e.g. the logits),
    sent from the last stage to every rank of the pipeline. Every batch must split into the plan's
    ``microbatches`` equal micro-batches (a :class:`UsageError` says otherwise).

    The process group lives until the process exits (so ``fit`` can be followed by ``validate``
    on the same Trainer); it is then released the way gloo survives.
    """

    strategy_name = "auto-parallel"

    def __init__(self, plan: Plan | Mapping[str, Any] | str | Path | None = None, *, target: str = "lightning",
                 objective: str = "throughput", constraints: Mapping[str, Any] | None = None,
                 verbose: bool = True, save_distributed_checkpoint: bool = True,
                 process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout) -> None:
        super().__init__()
        self._plan = None if plan is None else load_plan(plan)
        self._target = target
        self._objective = objective
        self._constraints = check_choice(target=target, objective=objective, constraints=constraints)
        self._verbose = verbose
        self._save_distributed_checkpoint = save_distributed_checkpoint
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._applied: tuple[LightningModule, torch.nn.Module] | None = None
        self._pipeline: Pipeline | None = None
        self._num_inputs = 0  # positional inputs of the pipelined child's forward
        self._set_aside: list[tuple[torch.nn.Parameter, Tensor | None]] = []
        self.num_nodes = 1

    @property
    def plan(self) -> Plan:
        """The Plan being applied (chosen in ``setup`` when none was given)."""
        if self._plan is None:
            raise RuntimeError("the plan is chosen in AutoParallelStrategy.setup(); it is not known yet")
        return self._plan

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Read by Lightning's accelerator connector: a custom strategy gets distributed samplers
        only when it says so."""
        return True

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return sampler_kwargs(self.plan, self.global_rank)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Checkpoints load into the module apply_plan sharded, and into its optimizers.
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores them

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = (self._process_group_backend
                                       or _get_default_process_group_backend_for_device(self.root_device))
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        import_group_defaults()
        _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout,
                              device_id=device_id)
        release_at_exit(weakref.WeakMethod(self._drop_wrappers))

    def set_world_ranks(self) -> None:
        """Tell the cluster environment (and ``rank_zero_only``) this process's rank and the world size."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # With empty_init the model is built on meta: nothing is allocated before the plan shards it.
        with torch.device("meta") if empty_init else nullcontext(), self.precision_plugin.tensor_init_context():
            yield

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        if self._applied is not None and self._applied[0] is module:
            self.model = self._applied[1]  # fit, then validate: the module is already parallel
        else:
            self._apply(trainer, module)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.logger is not None:
            trainer.logger.log_hyperparams(plan_hyperparams(self.plan))

    def _apply(self, trainer: Trainer, module: LightningModule) -> None:
        precision = stratagem_precision(self.precision_plugin.precision)
        if self._plan is None:
            self._plan = choose_plan(module, lambda: self._example_inputs(trainer, module), precision=precision,
                                     target=self._target, objective=self._objective, constraints=self._constraints,
                                     verbose=self._verbose, node_rank=self.node_rank,
                                     pipelined=lambda profile: _as_pipelined(module, profile))
        else:
            check_plan_precision(self._plan, self.precision_plugin.precision)
            if (reason := target_excludes("lightning", self._plan)) is not None:
                raise UsageError(f"the auto-parallel strategy cannot run plan {self._plan.name}: {reason}\n"
                                 "HINT: advise with --target lightning for plans it runs")
        self.precision_plugin = _PlanPrecision(self.plan, self.precision_plugin.precision, self.root_device.type)
        if self.plan.zero < 2:
            materialize(module, self.root_device)  # DDP broadcasts rank 0's values
        self.model_to_device()
        mesh = build_mesh(self.plan, device_type=self.root_device.type)
        if self.plan.pp > 1:
            self._pipeline = self._apply_pipeline(trainer, module, mesh)
            self.model = module
        else:
            self.model = apply_plan(module, self.plan, mesh)
        materialize(module, self.root_device)
        self._applied = (module, self.model)
        log.info("auto-parallel: rank %d applied plan %s", self.global_rank, self.plan.name)

    def _apply_pipeline(self, trainer: Trainer, module: LightningModule, mesh: Any) -> Pipeline:
        """Split the child module holding the blocks into this rank's stage and put the stage in
        its place, so the LightningModule's parameters, state dict and optimizers are the stage's."""
        plan = self.plan
        loss_fn = getattr(module, "loss_fn", None)
        if not callable(loss_fn):
            raise UsageError(f"plan {plan.name} is a pipeline: the schedule computes the loss on the last stage, "
                             f"so {type(module).__name__} must define loss_fn(output, target)\nHINT: add the "
                             "method, and give batches as (inputs..., target); see AutoParallelStrategy")
        name, child_plan = _pipelined_child(module, plan)
        child = module.get_submodule(name)
        traced = removal_convention(child, block_container=child_plan.block_container) is None
        if traced and (reason := target_excludes("lightning", plan, traced=True)) is not None:
            raise UsageError(f"the auto-parallel strategy cannot run plan {plan.name} on {type(child).__name__}, whose "
                             f"pipeline stages are traced: {reason}\nHINT: pick a gpipe or 1f1b plan")
        example = forward_inputs(child, lambda: module(*_as_args(self._example_inputs(trainer, module))))
        if not isinstance(example, tuple):
            raise UsageError(f"pipeline stages take positional inputs; {name}.forward was given keyword ones")
        example = tuple(t[:plan.micro_batch_size] for t in example)
        self._num_inputs = len(example)
        pipeline = apply_plan(child, child_plan, mesh, loss_fn=loss_fn, example_inputs=example)
        module.set_submodule(name, rank_module(pipeline))
        return pipeline

    @staticmethod
    def _example_inputs(trainer: Trainer, module: LightningModule) -> Any:
        """``example_input_array``, else what ``forward`` receives on the stage's first batch."""
        if module.example_input_array is not None:
            return module.example_input_array
        loop, step = _STAGE_LOOPS[trainer.state.fn]
        source = getattr(trainer, loop)._data_source
        if not source.is_defined():
            raise UsageError(f"auto-parallel needs {type(module).__name__}.example_input_array or a dataloader "
                             "to profile the model\nHINT: set example_input_array, or pass "
                             "AutoParallelStrategy(plan=...)")
        batch = next(iter(source.dataloader()))
        return forward_inputs(module, lambda: getattr(module, step)(batch, 0))

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        if self.plan.zero == 1:
            # ZeroRedundancyOptimizer must be built over the DDP module apply_plan returned.
            if len(self.optimizers) != 1 or len(self.optimizers[0].param_groups) != 1 or self.lr_scheduler_configs:
                raise UsageError("a zero=1 plan rebuilds the optimizer around ZeroRedundancyOptimizer and "
                                 "supports one optimizer with one parameter group and no LR scheduler\n"
                                 "HINT: simplify configure_optimizers, or use a zero=0/2/3 plan")
            user = self.optimizers[0]
            assert isinstance(self.model, torch.nn.Module)
            self.optimizers = [build_optimizer(self.model, self.plan, type(user), **constructor_options(user))]

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if not has_meta_tensors(self.model):
            self.model.to(self.root_device)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            return self._pipeline_training_step(self._pipeline, args)
        return self._step("training_step", self.precision_plugin.train_step_context, args, kwargs)

    def _pipeline_training_step(self, pipeline: Pipeline, args: tuple) -> Tensor:
        """The schedule runs backward with forward, inside ``training_step``; Lightning zeroes
        gradients after ``training_step`` and before ``backward``. So the gradients are set
        aside here and put back in :meth:`backward` (and cleared first when this batch opens a
        gradient-accumulation window, where Lightning would have zeroed them)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
        params = [p for p in pipeline.parameters() if p.requires_grad]
        if len(args) < 2 or args[1] % accumulate == 0:
            for param in params:
                param.grad = None
        loss = self._pipeline_step(pipeline.step, "train_loss", args)
        self._set_aside = [(param, param.grad) for param in params]
        for param in params:
            param.grad = None
        return loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            return self._pipeline_step(self._pipeline.evaluate, "val_loss", args)
        return self._step("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    def _pipeline_step(self, run: Callable[..., Tensor], name: str, args: tuple) -> Tensor:
        """One batch ``(inputs..., target)`` through the schedule (forward and, training, backward);
        the loss, from the last stage on every rank, is logged as ``name`` averaged over replicas."""
        batch = args[0]
        if not isinstance(batch, (tuple, list)) or len(batch) < 2:
            raise UsageError("a pipeline plan takes batches (inputs..., target): a tuple or list whose last item "
                             f"is the target, got {type(batch).__name__}")
        *inputs, target = batch
        loss = run(*inputs, target=target)
        assert self.lightning_module is not None
        self.lightning_module.log(name, loss, sync_dist=True, prog_bar=True)
        return loss

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        if self._pipeline is not None:  # the schedule ran backward with forward: its gradients come back
            for param, grad in self._set_aside:
                param.grad = grad
            self._set_aside = []
            return closure_loss
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            return self._pipeline_step(self._pipeline.evaluate, "test_loss", args)
        return self._step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            batch = args[0]
            inputs = tuple(batch[:self._num_inputs]) if isinstance(batch, (tuple, list)) else (batch,)
            return self._pipeline.predict(*inputs)
        return self._step("predict_step", self.precision_plugin.predict_step_context, args, kwargs)

    def _step(self, method: str, context: Callable[[], AbstractContextManager], args: tuple, kwargs: dict) -> Any:
        """Run ``method`` through the LightningModule's ``__call__`` when FSDP shards the module
        itself, so FSDP's root hooks fire; Lightning redirects only through wrappers (as DDP is)."""
        module = self.lightning_module
        assert module is not None
        if self.model is not module or self._plan is None or self._plan.zero < 2:
            return getattr(super(), method)(*args, **kwargs)
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        with context():
            return self._forward_redirection(module, module, method, *args, **kwargs)

    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None,
               reduce_op: ReduceOp | str | None = "mean") -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return model_state_dict(self.lightning_module, full=not self._save_distributed_checkpoint)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.lightning_module is not None
        return optimizer_state_dict(self.lightning_module, _unwrap(optimizer), full=not self._save_distributed_checkpoint)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        path = Path(self.broadcast(filepath))  # rank 0's path, for every rank
        if not self._save_distributed_checkpoint and self._pipeline is not None:
            raise UsageError(f"plan {self.plan.name}: each pipeline rank holds its own stage, so its checkpoints "
                             "are sharded\nHINT: AutoParallelStrategy(save_distributed_checkpoint=True)")
        if not self._save_distributed_checkpoint:
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        if storage_options is not None:
            raise UsageError("sharded checkpoints take no storage_options\n"
                             "HINT: AutoParallelStrategy(save_distributed_checkpoint=False) saves through CheckpointIO")
        save_sharded_checkpoint(path, checkpoint, [_unwrap(o) for o in self.optimizers])

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        module = self.lightning_module
        assert module is not None
        return load_checkpoint(path, module, [_unwrap(o) for o in self.optimizers], strict=module.strict_loading,
                               weights_only=weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint loaded it, into the applied module

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # load_checkpoint loaded them

    @override
    def teardown(self) -> None:
        # Not Strategy.teardown: it would move the (sharded) module to CPU. The process group and
        # the applied module stay for a later stage on this Trainer; see release_at_exit.
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    def _drop_wrappers(self) -> None:
        """Let go of the DDP wrapper before the process group goes (PLATFORM_NOTES)."""
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.model.module
        self._applied = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="stratagem: advise a Plan and apply it",
                                   override=True)


_STAGE_LOOPS = {
    TrainerFn.FITTING: ("fit_loop", "training_step"),
    TrainerFn.VALIDATING: ("validate_loop", "validation_step"),
    TrainerFn.TESTING: ("test_loop", "test_step"),
    TrainerFn.PREDICTING: ("predict_loop", "predict_step"),
}
"""Per Trainer stage: the loop whose dataloader gives the profiled batch, and the step it runs."""


def _pipelined_child(module: LightningModule, plan: Plan) -> tuple[str, Plan]:
    """The child of ``module`` that holds the blocks (the first part of ``plan.block_container``),
    and the plan with its FQNs relative to that child."""
    name, container = _child_path(plan.block_container)
    if not container:
        raise UsageError(f"a pipeline plan splits a child module of {type(module).__name__} holding the blocks, but "
                         f"block_container={plan.block_container!r} names none\nHINT: keep the model in an attribute "
                         "(self.model = ...) and set block_container='model.layers' (as the advisor does)")
    prefix = f"{name}."
    layout = tuple((pattern.removeprefix(prefix), style) for pattern, style in plan.tp_layout)
    return name, dataclasses.replace(plan, block_container=container, tp_layout=layout)


def _as_pipelined(module: LightningModule, profile: ModelProfile) -> ModelProfile:
    """``profile`` (of ``module``) with the pipeline facts of what pipeline plans split: the
    child holding the blocks (see :func:`_pipelined_child`)."""
    name, container = _child_path(profile.block_container)
    if not container:
        return dataclasses.replace(profile, pp_unavailable=profile.pp_unavailable or "the auto-parallel strategy "
                                   "splits a child module holding the blocks, and they are not in one")
    traced = removal_convention(module.get_submodule(name), block_container=container) is None
    return dataclasses.replace(profile, pp_traced=traced)


def _child_path(block_container: str | None) -> tuple[str, str]:
    """The child of the LightningModule holding the blocks and the container's FQN inside it
    (``"model.layers"`` → ``("model", "layers")``); the second is empty when there is no child."""
    name, _, container = (block_container or "").partition(".")
    return name, container


def _as_args(inputs: Any) -> tuple[Any, ...]:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def _unwrap(optimizer: Optimizer) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def register_strategies() -> None:
    """Add ``"auto-parallel"`` to Lightning's ``StrategyRegistry`` (again is fine: it overrides)."""
    AutoParallelStrategy.register_strategies(StrategyRegistry)


register_strategies()
