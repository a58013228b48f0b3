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

import gc
import json
import logging
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
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
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.apply_func import apply_to_collection
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from stratagem.advisor.plan import Plan, Workload
from stratagem.errors import UsageError
from stratagem.plugins import apply_plan, autocast_context, build_mesh, build_optimizer

__all__ = ["LIGHTNING_PRECISIONS", "AutoParallelStrategy", "load_plan", "register_strategies"]

log = logging.getLogger(__name__)

LIGHTNING_PRECISIONS = {"32-true": "fp32", "bf16-mixed": "bf16-mixed", "bf16-true": "bf16-true"}
"""Lightning's precision names the strategy runs, and stratagem's name for each. ``16-mixed``
is left out: it needs loss scaling, which this strategy does not wire up yet."""


def load_plan(plan: Plan | Mapping[str, Any] | str | Path) -> Plan:
    """A Plan from a Plan, a dict of its fields, or a JSON file: a plan, an entry of
    ``advise --format json`` (``{"plan": ...}``) or that whole document (its best plan)."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, Mapping):
        return Plan.from_dict(dict(plan))
    path = Path(plan)
    try:
        text = path.read_text()
    except OSError as err:
        raise UsageError(f"cannot read the plan file {path}: {err}") from None
    return Plan.from_json(text)


def stratagem_precision(lightning_precision: str) -> str:
    """stratagem's name for one of Lightning's precision names; :class:`UsageError` otherwise."""
    try:
        return LIGHTNING_PRECISIONS[lightning_precision]
    except KeyError:
        raise UsageError(f"precision={lightning_precision!r} is not supported by the auto-parallel strategy; "
                         f"valid: {', '.join(LIGHTNING_PRECISIONS)}") from None


class _PlanPrecision(Precision):
    """Lightning's fp32 plugin with the Plan's compute precision: forward runs under
    :func:`autocast_context` (zero 0/1 ``*-mixed``); FSDP's policy and ``apply_plan``'s cast do
    the rest, so Lightning's own mixed/half plugins would cast twice."""

    def __init__(self, plan: Plan, lightning_precision: str, device_type: str) -> None:
        super().__init__()
        self.plan = plan
        self.precision = lightning_precision  # what `trainer.precision` reports
        self._device_type = device_type

    @override
    def forward_context(self) -> AbstractContextManager:
        return autocast_context(self.plan, self._device_type)

    @override
    def convert_input(self, data: Any) -> Any:
        if self.plan.precision != "bf16-true":
            return data
        return apply_to_collection(data, Tensor, lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t)


class AutoParallelStrategy(ParallelStrategy):
    """Train a LightningModule as a stratagem Plan says: DDP, ZeRO-1, FSDP2 (ZeRO-2/3, HSDP),
    tensor parallelism, activation checkpointing, offload and precision, on CPU/gloo or CUDA/NCCL.

    Arguments:
        plan: the Plan to apply, as a :class:`Plan`, a dict of its fields or a JSON file (see
            :func:`load_plan`). ``None`` lets rank 0 choose: it profiles the LightningModule on fake
            tensors from ``example_input_array`` (which must be set, holding **one rank's** batch),
            asks :func:`stratagem.advisor.advise` for the best plan on the gathered cluster for a
            global batch of that batch × world size, and broadcasts it. The search keeps
            ``micro_batch_size`` at that batch and ``grad_accum`` at 1, since the dataloader's
            batches reach the model unchanged.
        target: the runtime the advisor's plans must run on.
        verbose: print the advisor's table and the chosen plan on rank 0.
        process_group_backend: defaults to ``nccl`` on CUDA, ``gloo`` otherwise.
        timeout: for the process group's collectives.

    The Trainer's ``precision`` must be the plan's (``32-true``→``fp32``, ``bf16-mixed``,
    ``bf16-true``); the strategy then applies it itself (see ``_PlanPrecision``).
    ZeRO-1 rebuilds the optimizer ``configure_optimizers`` returned around
    :func:`stratagem.plugins.build_optimizer` (same class and defaults, one parameter group, no
    LR scheduler). FSDP plans need ``training_step`` to call ``self(...)``, as every step runs
    through the LightningModule's ``forward``.

    Checkpoints hold the full model state dict (gathered, saved by rank 0) and no optimizer state:
    resuming restarts the optimizer. The process group is destroyed in ``teardown``, so save
    checkpoints during ``fit`` (e.g. ``ModelCheckpoint``).
    """

    strategy_name = "auto-parallel"

    def __init__(self, plan: Plan | Mapping[str, Any] | str | Path | None = None, *, target: str = "lightning",
                 verbose: bool = True, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout) -> None:
        super().__init__()
        self._plan = None if plan is None else load_plan(plan)
        self._target = target
        self._verbose = verbose
        self._process_group_backend = process_group_backend
        self._timeout = timeout
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
        # Ranks of one tensor-parallel group (innermost mesh axis) read the same samples.
        return {"num_replicas": self.plan.dp, "rank": self.global_rank // self.plan.tp}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Full state dicts load into the module apply_plan sharded.
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

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
        _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout,
                              device_id=device_id)

    def set_world_ranks(self) -> None:
        """Tell the cluster environment (and ``rank_zero_only``) this process's rank and the world size."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        precision = stratagem_precision(self.precision_plugin.precision)
        if self._plan is None:
            self._plan = self._choose_plan(precision)
        elif self._plan.precision != precision:
            raise UsageError(f"the plan trains in {self._plan.precision} but the Trainer in "
                             f"{self.precision_plugin.precision}\nHINT: make Trainer(precision=...) the plan's")
        self.precision_plugin = _PlanPrecision(self.plan, self.precision_plugin.precision, self.root_device.type)
        self.model_to_device()
        mesh = build_mesh(self.plan, device_type=self.root_device.type)
        self.model = apply_plan(self.model, self.plan, mesh)
        log.info("auto-parallel: rank %d applied plan %s", self.global_rank, self.plan.name)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.logger is not None:
            trainer.logger.log_hyperparams(_plan_hyperparams(self.plan))

    def _choose_plan(self, precision: str) -> Plan:
        """Profile on rank 0, advise on the gathered cluster, broadcast the best plan."""
        from stratagem.advisor.hardware import gather_cluster, probe_local

        module = self.lightning_module
        assert module is not None
        example = module.example_input_array
        if example is None:
            raise UsageError(f"auto-parallel profiles the model on {type(module).__name__}.example_input_array, "
                             "which is not set\nHINT: set it to one rank's batch of forward's inputs, "
                             "or pass AutoParallelStrategy(plan=...)")
        cluster = gather_cluster(probe_local())  # a collective: every rank probes
        chosen: list[str | None] = [None]
        if self.is_global_zero:
            chosen[0] = self._advise(module, example, cluster, precision).to_json()
        dist.broadcast_object_list(chosen, src=0)
        assert chosen[0] is not None
        return Plan.from_json(chosen[0])

    def _advise(self, module: LightningModule, example: Any, cluster: Any, precision: str) -> Plan:
        from stratagem.advisor.profile import profile_model
        from stratagem.advisor.report import render_table
        from stratagem.advisor.search import advise

        inputs = example if isinstance(example, (tuple, list, Mapping)) else (example,)
        profile = profile_model(module, inputs, precision=precision)
        workload = Workload(global_batch_size=profile.batch_size * self.world_size, seq_len=profile.seq_len,
                            precision=precision)
        advice = advise(profile, cluster, workload, target=self._target,
                        constraints={"micro_batch_size": profile.batch_size, "grad_accum": 1})
        if self._verbose:
            from rich.console import Console

            Console().print(render_table(advice))
        if advice.best is None:
            raise UsageError(f"no plan fits {type(module).__name__} on this cluster\n"
                             "HINT: see the advice printed above, or pass AutoParallelStrategy(plan=...)")
        plan = advice.best.plan
        if self._verbose:
            print(f"auto-parallel: chose plan {plan.name}", flush=True)
        return plan

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
            self.optimizers = [build_optimizer(self.model, self.plan, type(user), **user.defaults)]

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("training_step", self.precision_plugin.train_step_context, args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
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
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # A collective for sharded plans; rank 0 receives the full tensors and saves them.
        assert self.lightning_module is not None
        return get_model_state_dict(self.lightning_module,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        assert self.lightning_module is not None
        set_model_state_dict(self.lightning_module, checkpoint["state_dict"],
                             options=StateDictOptions(full_state_dict=True, strict=strict))

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        # Sharded optimizer states (ZeRO-1, FSDP) are not gathered yet: checkpoints leave them out.
        return {}

    @override
    def teardown(self) -> None:
        super().teardown()
        if _distributed_is_initialized():
            # PLATFORM_NOTES: gloo can abort at exit while a wrapper holds the group.
            if isinstance(self.model, DistributedDataParallel):
                self.model = self.model.module
            gc.collect()
            self.barrier()
            dist.destroy_process_group()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="stratagem: advise a Plan and apply it",
                                   override=True)


def _plan_hyperparams(plan: Plan) -> dict[str, Any]:
    fields = {f"plan/{key}": value for key, value in plan.to_dict().items() if key != "tp_layout"}
    return {"plan/name": plan.name, **fields, "plan/tp_layout": json.dumps(plan.to_dict()["tp_layout"])}


def register_strategies() -> None:
    """Add ``"auto-parallel"`` to Lightning's ``StrategyRegistry`` (again is fine: it overrides)."""
    AutoParallelStrategy.register_strategies(StrategyRegistry)


register_strategies()
