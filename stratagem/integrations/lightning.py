"""``Trainer(strategy="auto-parallel")``: Lightning training under a stratagem Plan.

:class:`AutoParallelStrategy` is Lightning's ``ModelParallelStrategy`` with the Plan doing the
parallelizing that ``configure_model`` does there: in ``setup`` it chooses a Plan (or takes the
one given), builds its DeviceMesh and hands the LightningModule to
:func:`stratagem.plugins.apply_plan`. Launching, collectives and teardown are the parent's; the
Fabric strategy shares the rest through :mod:`stratagem.integrations.planning`.

Registration: Lightning has no entry points for strategies, so the name ``"auto-parallel"`` exists
once this module is imported. ``import stratagem.integrations.lightning`` registers it;
``import stratagem`` registers it too when ``lightning`` was imported first (``import stratagem``
itself never imports lightning). Lightning re-runs the training script for the other ranks, so the
import must sit in that script. Passing ``strategy=AutoParallelStrategy(...)`` always works.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from stratagem.distributed import import_group_defaults, name_lost_peers_in, start_heartbeat
from stratagem.plan import Plan
from stratagem.advisor.search.targets import target_excludes
from stratagem.errors import UsageError
from stratagem.integrations.launchers import TrainerLauncher
from stratagem.integrations.lightning_pipeline import as_pipelined, pipelined_child
from stratagem.integrations.planning import (
    PlanPrecision,
    adapt_optimizer,
    check_choice,
    check_plan_accumulation,
    check_plan_precision,
    choose_plan,
    constructor_options,
    load_plan,
    partial_batch_note,
    plan_hyperparams,
    release_at_exit,
    sampler_kwargs,
    stratagem_precision,
    workload_optimizer,
)
from stratagem.integrations.steps import forward_inputs, lightning_step, positional
from stratagem.plugins import apply_plan, build_mesh, build_optimizer, clip_grad_norm_, clip_grad_value_
from stratagem.plugins.materialize import has_meta_tensors, initialises_after_sharding, materialize
from stratagem.plugins.pipeline import Pipeline, rank_module
from stratagem.plugins.state_dict import (
    load_checkpoint,
    model_state_dict,
    optimizer_state_dict,
    save_sharded_checkpoint,
)
from stratagem.plan.stages import removal_convention

if TYPE_CHECKING:
    from stratagem.advisor.search.advice import Advice

__all__ = ["AutoParallelStrategy", "register_strategies"]

log = logging.getLogger(__name__)


class _PlanPrecision(PlanPrecision, Precision):
    """Lightning's fp32 plugin with the Plan's compute precision (see :class:`PlanPrecision`),
    clipping on any plan (``gradient_clip_val``): by value, or by the whole model's gradient norm,
    over every stage of ``pipeline`` where the plan has one (the strategy sets it)."""

    pipeline: Pipeline | None = None

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        if self.pipeline is not None:
            self.pipeline.clip_grad_norm_(clip_val)
        else:
            clip_grad_norm_(self.main_params(optimizer), clip_val)

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: float) -> None:
        clip_grad_value_(self.main_params(optimizer), clip_val)


# Where a step's collectives run: a lost rank is named there (stratagem.errors.PeerLost).
@name_lost_peers_in("setup", "training_step", "validation_step", "test_step", "predict_step", "backward",
                    "optimizer_step", "reduce", "barrier", "broadcast", "all_gather", "save_checkpoint",
                    "load_checkpoint")
class AutoParallelStrategy(ModelParallelStrategy):
    """Train a LightningModule as a stratagem Plan says: DDP, ZeRO-1, FSDP2 (ZeRO-2/3, HSDP),
    tensor and pipeline parallelism, activation checkpointing, offload and precision, on
    CPU/gloo or CUDA/NCCL. The module needs no ``configure_model``.

    Arguments:
        plan: a :class:`Plan`, a dict of its fields or a JSON file (see
            :func:`~stratagem.integrations.planning.load_plan`). ``None`` lets rank 0 choose in
            ``setup``: fitting, it profiles ``training_step`` on the first training batch (fake
            tensors: the loss and all the step computes around forward); else, or when the step
            cannot run on fake tensors (the advice's notes say why), forward alone on
            ``example_input_array`` (one rank's batch of ``forward``'s inputs) or else on what
            ``forward`` gets from the stage's first batch. It advises for an optimizer step's
            global batch, that batch × data-parallel ranks × ``accumulate_grad_batches`` (the
            plan's ``grad_accum``; no pipeline plans where it is > 1), and the optimizer an extra
            ``configure_optimizers()`` call returns on the unsharded module (SGD or Adam(W); AdamW
            where it fails or returns another, the notes say), and broadcasts the plan;
            :attr:`advice` keeps rank 0's advice. Lightning accumulates, not the strategy: a pinned
            plan's ``grad_accum`` must be ``accumulate_grad_batches`` or 1 (a plan for one batch).
            The value at ``setup`` counts, not a ``GradientAccumulationScheduler``'s later ones.
        target, objective, constraints: steer that choice: the runtime plans must run on,
            ``"throughput"`` or ``"memory"``, Plan fields to pin (``{"zero": 3}``).
        verbose: print the advisor's table and the chosen plan on rank 0.
        save_distributed_checkpoint: checkpoints as a directory every rank writes, rather than
            one file gathered on rank 0; either kind loads under any plan.
        process_group_backend, timeout: the process group's (``nccl`` on CUDA, else ``gloo``).

    The Trainer's ``precision`` must be the plan's (``32-true``, ``bf16-mixed``, ``bf16-true``).
    ZeRO-1 rebuilds the optimizer around :func:`stratagem.plugins.build_optimizer`: one
    optimizer, one parameter group, no LR scheduler. FSDP plans need ``training_step`` to call
    ``self(...)``. A model built under ``trainer.init_module(empty_init=True)`` is initialised by
    its ``init_weights()`` or its layers' ``reset_parameters()``: after sharding where FSDP runs on
    GPUs, whole before it otherwise (:func:`~stratagem.plugins.materialize.initialises_after_sharding`).
    Pipeline plans (``pp > 1``) put this rank's stages in place of the child holding the blocks
    (``block_container``'s first part). The module must define ``loss_fn(output, target)``,
    batches must be ``(inputs..., target)`` splitting into ``microbatches`` equal parts, and the
    schedule runs instead of the step methods, logging ``train_loss``/``val_loss``/``test_loss``;
    ``predict`` returns the last stage's output for the child's inputs, on every rank.
    The process group lives until the process exits, so one Trainer can ``fit`` then ``validate``.
    When a rank dies, the others raise :class:`~stratagem.errors.PeerLost` naming it, within seconds.
    """

    strategy_name = "auto-parallel"

    def __init__(self, plan: Plan | Mapping[str, Any] | str | Path | None = None, *, target: str = "lightning",
                 objective: str = "throughput", constraints: Mapping[str, Any] | None = None,
                 verbose: bool = True, save_distributed_checkpoint: bool = True,
                 process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout) -> None:
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self._plan = None if plan is None else load_plan(plan)
        self._advice: Advice | None = None
        self._target = target
        self._objective = objective
        self._constraints = check_choice(target=target, objective=objective, constraints=constraints)
        self._verbose = verbose
        self._applied: tuple[LightningModule, torch.nn.Module] | None = None
        self._pipeline: Pipeline | None = None
        self._num_inputs = 0  # positional inputs of the pipelined child's forward
        self._set_aside: list[tuple[torch.nn.Parameter, Tensor | None]] = []

    @property
    def plan(self) -> Plan:
        """The Plan being applied (chosen in ``setup`` when none was given)."""
        if self._plan is None:
            raise RuntimeError("the plan is chosen in AutoParallelStrategy.setup(); it is not known yet")
        return self._plan

    @property
    def advice(self) -> Advice | None:
        """The advice rank 0 chose the plan from (its profile, notes and ranked plans); None on
        other ranks and when the plan was given."""
        return self._advice

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # The plan's mesh has no "data_parallel" axis: a replica is a data-parallel rank of the plan.
        return sampler_kwargs(self.plan, self.global_rank)

    @override
    def _configure_launcher(self) -> None:
        # Lightning's launcher, its observer giving the ranks time to name a lost peer (launchers.py).
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = TrainerLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        # The parent's without its dp × tp mesh: the plan's mesh is built in setup, once the plan is known.
        import_group_defaults()
        self._setup_distributed()
        start_heartbeat()  # so that a lost rank can be named
        # The process group and the applied module outlive teardown (a later stage reuses them).
        release_at_exit(weakref.WeakMethod(self._drop_wrappers))

    @override
    def setup(self, trainer: Trainer) -> None:
        # The parent's requires configure_model to parallelize the module; here the plan does it.
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
        fitting = trainer.state.fn == TrainerFn.FITTING  # an optimizer steps, accumulating batches
        accumulate = trainer.accumulate_grad_batches if fitting else 1
        if self._plan is None:
            source = f"{type(module).__name__}.configure_optimizers"  # what the advice's notes name
            self._plan, self._advice = choose_plan(
                module, lambda: self._profiled(trainer, module), precision=precision, target=self._target,
                objective=self._objective, constraints=self._constraints, verbose=self._verbose, accumulate=accumulate,
                node_rank=self.node_rank, pipelined=lambda profile: as_pipelined(module, profile),
                optimizer=(lambda: workload_optimizer(module.configure_optimizers, source)) if fitting else None,
                grad_clip=_grad_clip(trainer) if fitting else None)
        else:
            check_plan_precision(self._plan, self.precision_plugin.precision)
            check_plan_accumulation(self._plan, accumulate)
            if (reason := target_excludes("lightning", self._plan)) is not None:
                raise UsageError(f"the auto-parallel strategy cannot run plan {self._plan.name}: {reason}\n"
                                 "HINT: advise with --target lightning for plans it runs")
        source = trainer.fit_loop._data_source
        if fitting and self.plan.compile and self.global_rank == 0 and source.is_defined() and (
                note := partial_batch_note(source.dataloader(), self.plan)):
            log.warning("auto-parallel: %s", note)
        self.precision_plugin = _PlanPrecision(self.plan, self.precision_plugin.precision, self.root_device.type)
        if not initialises_after_sharding(self.plan, self.root_device):
            materialize(module, self.root_device)  # whole, before sharding or DDP's broadcast
        self.model_to_device()
        mesh = self._device_mesh = build_mesh(self.plan, device_type=self.root_device.type)
        if self.plan.pp > 1:
            self._pipeline = self.precision_plugin.pipeline = self._apply_pipeline(trainer, module, mesh)
            self.model = module
        else:
            self.model = apply_plan(module, self.plan, mesh)
        materialize(module, self.root_device, params_on_host=self.plan.offloads_parameters)
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
        name, child_plan = pipelined_child(module, plan)
        child = module.get_submodule(name)
        traced = removal_convention(child, block_container=child_plan.block_container) is None
        if traced and (reason := target_excludes("lightning", plan, traced=True)) is not None:
            raise UsageError(f"the auto-parallel strategy cannot run plan {plan.name} on {type(child).__name__}, whose "
                             f"pipeline stages are traced: {reason}\nHINT: pick a gpipe or 1f1b plan")
        example = forward_inputs(child, lambda: module(*positional(self._example_inputs(trainer, module))))
        if not isinstance(example, tuple):
            raise UsageError(f"pipeline stages take positional inputs; {name}.forward was given keyword ones")
        example = tuple(t[:plan.micro_batch_size] for t in example)
        self._num_inputs = len(example)
        pipeline = apply_plan(child, child_plan, mesh, loss_fn=loss_fn, example_inputs=example)
        module.set_submodule(name, rank_module(pipeline))
        return pipeline

    @classmethod
    def _profiled(cls, trainer: Trainer, module: LightningModule) -> Any:
        """What rank 0 profiles: fitting, ``training_step`` on the first training batch (forward
        alone, as :meth:`_example_inputs` says, when it cannot be traced); else forward alone."""
        source = trainer.fit_loop._data_source
        if trainer.state.fn != TrainerFn.FITTING or not source.is_defined():
            return cls._example_inputs(trainer, module)
        batch = next(iter(source.dataloader()))
        return lightning_step(module, batch, fallback=lambda: cls._example_inputs(trainer, module, batch))

    @staticmethod
    def _example_inputs(trainer: Trainer, module: LightningModule, batch: Any = None) -> Any:
        """``example_input_array``, else what ``forward`` receives on the stage's first batch
        (``batch`` when given)."""
        if module.example_input_array is not None:
            return module.example_input_array
        loop, step = _STAGE_LOOPS[trainer.state.fn]
        source = getattr(trainer, loop)._data_source
        if not source.is_defined():
            raise UsageError(f"auto-parallel needs {type(module).__name__}.example_input_array or a dataloader "
                             "to profile the model\nHINT: set example_input_array, or pass "
                             "AutoParallelStrategy(plan=...)")
        batch = next(iter(source.dataloader())) if batch is None else batch
        return forward_inputs(module, lambda: getattr(module, step)(batch, 0))

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        # ZeRO-1: ZeroRedundancyOptimizer must be built over the DDP module apply_plan returned.
        super().setup_optimizers(trainer)
        if self.plan.shards_optimizer_only:
            if len(self.optimizers) != 1 or len(self.optimizers[0].param_groups) != 1 or self.lr_scheduler_configs:
                raise UsageError("a zero=1 plan rebuilds the optimizer around ZeroRedundancyOptimizer and "
                                 "supports one optimizer with one parameter group and no LR scheduler\n"
                                 "HINT: simplify configure_optimizers, or use a zero=0/2/3 plan")
            user = self.optimizers[0]
            assert isinstance(self.model, torch.nn.Module)
            self.optimizers = [build_optimizer(self.model, self.plan, type(user), **constructor_options(user))]
        for optimizer in map(_unwrap, self.optimizers):
            adapt_optimizer(optimizer, self.plan, rank=self.global_rank)

    @override
    def model_to_device(self) -> None:
        # Meta tensors stay until apply_plan has sharded the module; materialize then fills them.
        assert self.model is not None
        if not has_meta_tensors(self.model):
            self.model.to(self.root_device)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # A pipeline's schedule runs forward and backward here; see _step for FSDP.
        if self._pipeline is not None:
            return self._pipeline_training_step(self._pipeline, args)
        return self._step("training_step", self.precision_plugin.train_step_context, args, kwargs)

    def _pipeline_training_step(self, pipeline: Pipeline, args: tuple) -> Tensor:
        """The schedule runs backward with forward, inside ``training_step``; Lightning zeroes
        gradients after ``training_step`` and before ``backward``. So the gradients are set
        aside here and put back in :meth:`backward`. Within a gradient-accumulation window the
        batch's gradients are divided by the window's size and added to those set aside before
        (none when the batch opens it), as Lightning's other strategies average a window by
        dividing each batch's loss, which a schedule that has already run backward never sees."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
        params = [p for p in pipeline.parameters() if p.requires_grad]
        opens = len(args) < 2 or args[1] % accumulate == 0
        earlier = [None if opens else param.grad for param in params]
        for param in params:
            param.grad = None
        loss = self._pipeline_step(pipeline.step, "train_loss", args)
        self._set_aside = []
        for param, before in zip(params, earlier):
            grad = param.grad
            if grad is not None and accumulate > 1:
                grad.div_(accumulate)
            if before is not None:
                grad = before if grad is None else grad.add_(before)
            self._set_aside.append((param, grad))
            param.grad = None
        return loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        # As training_step, forward only.
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
        # As training_step, forward only.
        if self._pipeline is not None:
            return self._pipeline_step(self._pipeline.evaluate, "test_loss", args)
        return self._step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        # A pipeline predicts with the child's inputs, without the target or loss_fn.
        if self._pipeline is not None:
            batch = args[0]
            inputs = positional(batch)[:self._num_inputs]
            return self._pipeline.predict(*inputs)
        return self._step("predict_step", self.precision_plugin.predict_step_context, args, kwargs)

    def _step(self, method: str, context: Callable[[], AbstractContextManager], args: tuple, kwargs: dict) -> Any:
        """Run ``method`` through the LightningModule's ``__call__`` when FSDP shards the module
        itself, so FSDP's root hooks fire; Lightning redirects only through wrappers (as DDP is)."""
        module = self.lightning_module
        assert module is not None
        if self.model is not module or self._plan is None or not self._plan.uses_fsdp:
            return getattr(super(), method)(*args, **kwargs)
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        with context():
            return self._forward_redirection(module, module, method, *args, **kwargs)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # The LightningModule (a pipeline rank's stages in place), with flattened optimizer keys
        # that differ per stage: plugins.state_dict's layout, which loads under any plan.
        assert self.lightning_module is not None
        return model_state_dict(self.lightning_module, full=not self._save_distributed_checkpoint)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        # ZeRO-1's ZeroRedundancyOptimizer has no distributed state dict: it is consolidated on rank 0.
        assert self.lightning_module is not None
        return optimizer_state_dict(self.lightning_module, _unwrap(optimizer), full=not self._save_distributed_checkpoint)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        # Lightning's sharded layout with ZeRO-1's whole state in meta.pt; a full file goes
        # through CheckpointIO, storage_options included, which the parent refuses.
        path = Path(self.broadcast(filepath))  # rank 0's path, for every rank
        if not self._save_distributed_checkpoint and self._pipeline is not None:
            raise UsageError(f"plan {self.plan.name}: each pipeline rank holds its own stage, so its checkpoints "
                             "are sharded\nHINT: AutoParallelStrategy(save_distributed_checkpoint=True)")
        if not self._save_distributed_checkpoint:
            Strategy.save_checkpoint(self, checkpoint, path, storage_options)
            return
        if storage_options is not None:
            raise UsageError("sharded checkpoints take no storage_options\n"
                             "HINT: AutoParallelStrategy(save_distributed_checkpoint=False) saves through CheckpointIO")
        save_sharded_checkpoint(path, checkpoint, [_unwrap(o) for o in self.optimizers])

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        # Either layout, written under any plan, ZeRO-1's state included (plugins.state_dict).
        path = Path(self.broadcast(checkpoint_path))
        module = self.lightning_module
        assert module is not None
        return load_checkpoint(path, module, [_unwrap(o) for o in self.optimizers], strict=module.strict_loading,
                               weights_only=weights_only)

    def _drop_wrappers(self) -> None:
        """Let go of the DDP wrapper before the process group goes (gloo's teardown abort: docs/platform.md)."""
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


def _unwrap(optimizer: Optimizer) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _grad_clip(trainer: Trainer) -> str | None:
    """How the Trainer clips each step's gradients (``Workload.grad_clip``): by norm or by value
    where ``gradient_clip_val`` is set above 0 (Lightning's ``clip_gradients`` does nothing else),
    by its ``gradient_clip_algorithm``, norm by default."""
    if not trainer.gradient_clip_val or trainer.gradient_clip_val <= 0:
        return None
    algorithm = trainer.gradient_clip_algorithm
    return "norm" if algorithm is None else str(algorithm.value)


def register_strategies() -> None:
    """Add ``"auto-parallel"`` to Lightning's ``StrategyRegistry`` (again is fine: it overrides)."""
    AutoParallelStrategy.register_strategies(StrategyRegistry)


register_strategies()
