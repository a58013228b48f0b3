"""What the Lightning and Fabric strategies share: reading a pinned Plan, choosing one on rank 0
(for the batch the run steps with and the optimizer it steps), the plan's precision plugin
behaviour, ZeRO-1's rebuilt optimizer, the data-parallel sampler, and releasing the process group
cleanly. Imports neither Lightning nor Fabric.
"""

from __future__ import annotations

import atexit
import inspect
import json
import logging
import os
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from stratagem.distributed import leave_process_group, naming_lost_peers
from stratagem.plan import MeshAxis, Plan, Workload
from stratagem.plan.workload import OPTIMIZER_CLASSES
from stratagem.errors import UsageError
from stratagem.plugins import fuse_host_optimizer
from stratagem.plugins.parameter_groups import step_mixed_groups_per_tensor
from stratagem.plugins.tensor_parallel import reduce_norm_grads_once

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from stratagem.advisor.profile.model_profile import ModelProfile
    from stratagem.advisor.search.advice import Advice

__all__ = ["LIGHTNING_PRECISIONS", "PlanPrecision", "adapt_optimizer", "check_choice", "check_plan_accumulation",
           "check_plan_precision", "choose_plan", "constructor_options", "load_plan", "partial_batch_note",
           "plan_hyperparams", "release_at_exit", "sampler_kwargs", "stratagem_precision", "workload_optimizer"]

log = logging.getLogger(__name__)

LIGHTNING_PRECISIONS = {"32-true": "fp32", "bf16-mixed": "bf16-mixed", "bf16-true": "bf16-true"}
"""Lightning's (and Fabric's) precision names the strategies run, and stratagem's name for each.
``16-mixed`` is left out: it needs loss scaling, which the strategies do not wire up yet."""


def load_plan(plan: Plan | Mapping[str, Any] | str | Path) -> Plan:
    """A Plan from a Plan, a dict of its fields, or a JSON file: a plan, an entry of
    ``advise --format json`` (``{"plan": ...}``) or that whole document (its best plan), for a
    strategy, whose loss the user's code computes: one that leaves the logits on vocabulary shards
    (``vocab_loss``) is refused."""
    loaded = _read_plan(plan)
    heads = [pattern for pattern, style in loaded.tp_layout if style == "vocab_loss"]
    if heads:
        raise UsageError(f"plan {loaded.name} leaves {heads[0]}'s logits on their vocabulary shards (vocab_loss) for "
                         "a loss run under torch's loss_parallel, and the strategies run your own loss on whole "
                         f"logits\nHINT: make it ({heads[0]!r}, 'vocab_head') in tp_layout: the logits are then "
                         "gathered before your loss")
    return loaded


def _read_plan(plan: Plan | Mapping[str, Any] | str | Path) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, Mapping):
        return Plan.from_dict(dict(plan))
    if not isinstance(plan, (str, os.PathLike)):
        raise UsageError(f"a plan is a Plan, a dict of its fields or a JSON file's path, not {type(plan).__name__}")
    path = Path(plan)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"cannot read the plan file {path}: {err}\nHINT: give the JSON file `advise --format json` "
                         "or `verify --output` wrote") from None
    return Plan.from_json(text)


def stratagem_precision(lightning_precision: str) -> str:
    """stratagem's name for one of Lightning's precision names; :class:`UsageError` otherwise."""
    try:
        return LIGHTNING_PRECISIONS[lightning_precision]
    except KeyError:
        raise UsageError(f"precision={lightning_precision!r} is not supported by the auto-parallel strategy; "
                         f"valid: {', '.join(LIGHTNING_PRECISIONS)}") from None


def check_plan_precision(plan: Plan, lightning_precision: str) -> None:
    """A pinned plan must train in the precision the Trainer/Fabric was given."""
    if plan.precision != stratagem_precision(lightning_precision):
        raise UsageError(f"the plan trains in {plan.precision} but the run is set to {lightning_precision}\n"
                         "HINT: make precision=... the plan's")


def check_plan_accumulation(plan: Plan, accumulate: int) -> None:
    """A pinned plan's ``grad_accum`` must be what the run accumulates, Lightning's
    ``accumulate_grad_batches`` (the strategy accumulates nothing by itself), or 1: a plan for one
    batch, whose gradients the Trainer then accumulates over ``accumulate`` batches."""
    if plan.grad_accum not in (1, accumulate):
        raise UsageError(f"plan {plan.name} accumulates gradients over {plan.grad_accum} batches, but the run's "
                         f"accumulate_grad_batches is {accumulate}: the strategy does not accumulate by itself, "
                         f"Lightning does\nHINT: Trainer(accumulate_grad_batches={plan.grad_accum})")


class PlanPrecision:
    """Mixed in before Lightning's or Fabric's fp32 ``Precision`` plugin: the Plan's compute
    precision. Forward runs under :func:`autocast_context` (zero 0/1 ``*-mixed``) and ``bf16-true``
    inputs are cast to bfloat16; FSDP's policy and ``apply_plan``'s cast do the rest, so the
    frameworks' own mixed/half plugins would cast twice."""

    def __init__(self, plan: Plan, framework_precision: str, device_type: str) -> None:
        super().__init__()
        self.plan = plan
        self.precision = framework_precision  # what the Trainer/Fabric reports
        self._device_type = device_type

    @contextmanager
    def forward_context(self) -> Iterator[None]:
        """Autocast as the plan says; a rank lost in forward (FSDP's gathers) is named."""
        from stratagem.plugins import autocast_context  # `advise --emit lightning` imports this module

        with naming_lost_peers(), autocast_context(self.plan, self._device_type):
            yield

    def convert_input(self, data: Any) -> Any:
        if self.plan.precision != "bf16-true":
            return data
        from lightning_utilities.core.apply_func import apply_to_collection

        return apply_to_collection(data, Tensor, lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t)


def sampler_kwargs(plan: Plan, global_rank: int) -> dict[str, int]:
    """``DistributedSampler`` arguments for ``global_rank``: one replica per data-parallel rank
    (its place on the dp_replicate × dp_shard axes), so the ranks of one tensor-parallel group and
    the stages of one pipeline read the same samples."""
    return {"num_replicas": plan.dp, "rank": (global_rank // plan.mesh_strides[MeshAxis.DP_SHARD]) % plan.dp}


def partial_batch_note(loader: Any, plan: Plan) -> str | None:
    """What a compiled ``plan`` does where an epoch's last training batch on a rank is smaller than
    the others (``loader``, the training DataLoader, split over the plan's data-parallel ranks as
    Lightning's and Fabric's distributed samplers split it, padded to equal shares): dynamo compiles each block
    again for it with a symbolic batch size (``automatic_dynamic_shapes``) and, trying the graph it
    ran last first, runs every later step on those graphs, which the advice prices as static (a
    convolution in them stays NCHW: docs/cost-model.md, "Compilation"). None where every batch is
    whole, the plan compiles nothing, or the loader does not say."""
    batch, drop_last = getattr(loader, "batch_size", None), getattr(loader, "drop_last", True)
    if not plan.compile or not batch or drop_last:
        return None
    try:
        samples = len(loader.dataset)
    except TypeError:  # an iterable dataset: its length is unknown
        return None
    last = -(-samples // plan.dp) % batch
    if not last:
        return None
    return (f"each epoch's last training batch holds {last} samples where the others hold {batch}: the compiled "
            "blocks compile again for it with a symbolic batch size, and every later step runs those graphs, "
            "slower than the static ones the plan was priced with (a convolution in them stays NCHW)\n"
            "HINT: DataLoader(..., drop_last=True), or the strategy's constraints={'compile': False}")


def constructor_options(optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its class's constructor takes (AdamW's hold
    ``decoupled_weight_decay``, which ``AdamW()`` refuses): what ZeRO-1 rebuilds it with."""
    accepted = inspect.signature(type(optimizer)).parameters
    return {key: value for key, value in optimizer.defaults.items() if key in accepted}


def check_choice(*, target: str, objective: str, constraints: Mapping[str, Any] | None) -> dict[str, Any]:
    """Validate what a strategy was asked to choose by (before any process starts); returns the
    constraints as a dict. ``micro_batch_size`` and ``grad_accum`` are the run's to set: the
    dataloader's batch size and Lightning's ``accumulate_grad_batches``."""
    from stratagem.advisor.search.advice import OBJECTIVES
    from stratagem.advisor.search.targets import check_target

    check_target(target)
    if objective not in OBJECTIVES:
        raise UsageError(f"unknown objective {objective!r}; valid: {', '.join(OBJECTIVES)}")
    constraints = dict(constraints or {})
    fixed = sorted({"micro_batch_size", "grad_accum"} & set(constraints))
    if fixed:
        raise UsageError(f"constraints on {', '.join(fixed)}: the dataloader's batches reach the model unchanged, so "
                         "its batch size is the micro-batch, and gradients accumulate over the Trainer's "
                         "accumulate_grad_batches (none under Fabric)\nHINT: change the batch size of the dataloader "
                         "(and example_input_array), or accumulate_grad_batches, instead")
    unknown = sorted(set(constraints) - set(Plan.__dataclass_fields__))
    if unknown:
        raise UsageError(f"unknown constraint(s) {', '.join(unknown)}; they pin Plan fields such as tp or zero")
    return constraints


def choose_plan(module: nn.Module, example_inputs: Callable[[], Any], *, precision: str, target: str,
                verbose: bool, objective: str = "throughput", constraints: Mapping[str, Any] | None = None,
                node_rank: int | None = None, pipelined: Callable[[ModelProfile], ModelProfile] | None = None,
                accumulate: int = 1, optimizer: Callable[[], tuple[str, tuple[str, ...]]] | None = None,
                grad_clip: str | None = None) -> tuple[Plan, Advice | None]:
    """Every rank probes its hardware; rank 0 profiles ``module`` on ``example_inputs()`` (called
    on rank 0 only: a :class:`~stratagem.integrations.steps.TrainingStep` to trace, or one rank's
    batch of forward's inputs, a tensor, a tuple of positional or a dict of keyword arguments; see
    :func:`~stratagem.integrations.steps.profile_for_plan`), advises for the gathered cluster and
    the global batch one optimizer step takes (that batch × the data-parallel degree ×
    ``accumulate``), and broadcasts the best plan. A collective: call it on every rank. Returns the
    plan, and on rank 0 the advice it was chosen from (None elsewhere).

    The dataloader's batches reach the model unchanged, and gradients accumulate over
    ``accumulate`` of them (Lightning's ``accumulate_grad_batches``: the plan's ``grad_accum``).
    Without a pipeline a batch is the micro-batch; a pipeline splits it into ``microbatches``, and
    its ranks share it as a tensor-parallel group's do (the global batch is the batch × the
    data-parallel degree). Each tensor-parallel degree and pipeline shape is searched on its own
    and the best plan over all is taken (:func:`_advise`); the
    advisor's pipeline plans accumulate nothing, so with ``accumulate`` > 1 only plans without a
    pipeline are searched (the notes say so). ``optimizer()``, called on rank 0, gives the
    Workload's optimizer and notes for the advice (:func:`workload_optimizer`; None: AdamW, as
    ``Workload`` assumes); ``grad_clip``, how each step clips the gradients (``Workload.grad_clip``).
    ``objective`` and ``constraints`` (Plan fields
    pinned, as :func:`~stratagem.advisor.search.advice.advise` takes them) steer the search. Ranks with
    the same ``node_rank`` (the strategy's; default:
    :func:`~stratagem.advisor.hardware.gather.this_node`) count as one node. ``pipelined`` gives
    the profile the pipeline facts (``pp_unavailable``, ``pp_traced``) of what pipeline plans
    split, where that is not ``module`` itself."""
    from stratagem.advisor.calibrate import calibrated
    from stratagem.advisor.hardware import gather_cluster, probe_local
    from stratagem.advisor.hardware.gather import node_name

    node_key = None if node_rank is None else node_name(node_rank)
    cluster = calibrated(gather_cluster(probe_local(), node_key=node_key))
    chosen: list[str | None] = [None]
    advice = None
    if dist.get_rank() == 0:
        advice = _advise(module, example_inputs(), cluster, world=dist.get_world_size(), precision=precision,
                         target=target, objective=objective, constraints=dict(constraints or {}), verbose=verbose,
                         pipelined=pipelined, accumulate=accumulate, optimizer=optimizer, grad_clip=grad_clip)
        assert advice.best is not None  # _advise raises when no plan fits
        chosen[0] = advice.best.plan.to_json()
    dist.broadcast_object_list(chosen, src=0)
    assert chosen[0] is not None
    return Plan.from_json(chosen[0]), advice


def _advise(module: nn.Module, example_inputs: Any, cluster: Any, *, world: int, precision: str, target: str,
            objective: str, constraints: dict[str, Any], verbose: bool,
            pipelined: Callable[[ModelProfile], ModelProfile] | None, accumulate: int = 1,
            optimizer: Callable[[], tuple[str, tuple[str, ...]]] | None = None, grad_clip: str | None = None) -> Advice:
    """The advice (its best plan the one to apply) for ``module`` profiled on ``example_inputs``,
    on ``world`` ranks accumulating ``accumulate`` batches a step (see :func:`choose_plan`)."""
    from stratagem.advisor.profile.model_profile import kernels_for
    from stratagem.advisor.report.render import render_table
    from stratagem.advisor.search.advice import advise, rank_estimates, without_constraints
    from stratagem.advisor.search.targets import tp_degrees
    from stratagem.integrations.steps import profile_for_plan

    profile = profile_for_plan(module, example_inputs, precision=precision,
                               kernels=kernels_for(accelerator=cluster.is_accelerator))
    if pipelined is not None:
        profile = pipelined(profile)
    named: dict[str, str] = {"grad_clip": grad_clip} if grad_clip is not None else {}
    if optimizer is not None:
        named["optimizer"], notes = optimizer()
        profile = replace(profile, notes=(*profile.notes, *notes))
    if accumulate > 1 and profile.pp_unavailable is None:
        profile = replace(profile, pp_unavailable=f"accumulate_grad_batches={accumulate} accumulates gradients "
                          "over batches, which the advisor's pipeline plans do not; a pinned pipeline plan (plan=...) "
                          "does")
    shapes = _pipeline_shapes(profile, world, constraints)
    advices, errors = [], []
    tps = [tp for tp in tp_degrees(profile, cluster.devices_per_node)[0] if constraints.get("tp", tp) == tp]
    for tp, (pp, microbatches) in ((tp, shape) for tp in tps for shape in shapes if world % (tp * shape[0]) == 0):
        # the ranks of a tensor-parallel group and of a pipeline share a batch: the global batch
        # is one per data-parallel rank
        workload = Workload(global_batch_size=profile.batch_size * world // (tp * pp) * accumulate,
                            seq_len=profile.seq_len, precision=precision, **named)
        shape = {"tp": tp, "pp": pp, "microbatches": microbatches,
                 "micro_batch_size": profile.batch_size // microbatches,
                 "grad_accum": accumulate}  # pp > 1 only where accumulate is 1
        try:
            advices.append(advise(profile, cluster, workload, target=target, objective=objective,
                                  constraints={**constraints, **shape}))
        except UsageError as err:  # this shape has no candidates (said when no shape has)
            errors.append(err)
    if not advices:
        raise errors[0]
    best = rank_estimates([a.best for a in advices if a.best is not None], objective)
    advice = next((a for a in advices if best and a.best is best[0]), advices[0])
    # each shape's search pinned its tp and pp: the user pinned none of those the advice would list
    advice = without_constraints(advice, [name for name in ("tp", "pp", "microbatches") if name not in constraints])
    if verbose:
        from rich.console import Console

        Console().print(render_table(advice))
    if advice.best is None:
        raise UsageError(f"no plan fits {type(module).__name__} on this cluster\n"
                         "HINT: see the advice printed above, or pin one with AutoParallelStrategy(plan=...)")
    if verbose:
        print(f"auto-parallel: chose plan {advice.best.plan.name}", flush=True)
    return advice


def _pipeline_shapes(profile: ModelProfile, world: int, constraints: Mapping[str, Any]) -> list[tuple[int, int]]:
    """(pp, microbatches) pairs a dataloader batch of ``profile.batch_size`` can run as: no
    pipeline, and each pipeline degree dividing the world with each number of micro-batches
    dividing the batch, at least one per stage (fewer leave stages idle for the whole step), as
    far as ``constraints`` pin them; a UsageError where none is left."""
    from stratagem.advisor.search.targets import divisors

    shapes = [(1, 1)]
    if profile.pp_unavailable is None:
        shapes += [(pp, m) for pp in divisors(world)[1:] if pp <= len(profile.blocks)
                   for m in divisors(profile.batch_size) if m >= pp]
    shapes = [(pp, m) for pp, m in shapes if constraints.get("pp", pp) == pp and constraints.get("microbatches", m) == m]
    pinned = f"pp={constraints.get('pp', 1)}, microbatches={constraints.get('microbatches', 1)}"
    if not shapes and profile.pp_unavailable is not None:
        raise UsageError(f"the constraints pin a pipeline ({pinned}), but no pipeline plans are searched: "
                         f"{profile.pp_unavailable}\nHINT: drop the pp and microbatches constraints")
    if not shapes:
        raise UsageError(f"the constraints {pinned} cannot run one dataloader batch of {profile.batch_size}: a "
                         "pipeline splits the batch into its micro-batches, at least one per stage\nHINT: pick "
                         "microbatches dividing the batch size and at least pp, or change the batch size")
    return shapes


def adapt_optimizer(optimizer: Optimizer, plan: Plan, *, rank: int) -> None:
    """Fit the optimizer a strategy was handed to ``plan``, in place: stepped fused on the host
    where the plan offloads (:func:`~stratagem.plugins.fuse_host_optimizer`; said once, on rank
    0), with sequence parallelism the norms' gradients summed once before each step
    (:func:`~stratagem.plugins.tensor_parallel.reduce_norm_grads_once`), and a group that mixes
    DTensors with plain tensors stepped one tensor at a time
    (:func:`~stratagem.plugins.parameter_groups.step_mixed_groups_per_tensor`; said on rank 0)."""
    if fuse_host_optimizer(optimizer, plan) and rank == 0:
        log.info("auto-parallel: %s steps the offloaded parameters fused on the host", type(optimizer).__name__)
    reduce_norm_grads_once(optimizer, plan)
    mixed = step_mixed_groups_per_tensor(optimizer)
    if mixed and rank == 0:
        log.info("auto-parallel: %s steps %d parameter group(s) one tensor at a time: each holds DTensors that "
                 "tensor parallelism splits beside plain tensors it leaves whole, which a multi-tensor step "
                 "cannot take together (give the DTensors a group of their own to keep it)",
                 type(optimizer).__name__, mixed)


def workload_optimizer(make: Callable[[], Any], source: str) -> tuple[str, tuple[str, ...]]:
    """The Workload's optimizer for what ``make()`` returns: a torch optimizer, or optimizers in a
    list, tuple or dict as ``configure_optimizers`` returns them (schedulers beside them are
    skipped), and notes for the advice where that is an assumption. When ``make`` raises, or
    returns no optimizer, one the cost model does not price or several it prices differently,
    it is AdamW, ``Workload``'s default; ``source`` names ``make`` in the notes."""
    default = Workload.__dataclass_fields__["optimizer"].default
    assumed = f"the advice assumes {default} (its states and step)"
    try:
        found = _optimizers_in(make())
    except Exception as err:  # noqa: BLE001  (any failure: the default, and the note says why)
        message = (str(err).strip().splitlines() or [""])[0]
        note = f"{source} raised {type(err).__name__}: {message}, so the optimizer is unknown and {assumed}"
        log.warning("auto-parallel: %s", note)
        return default, (note,)
    names = {_costed_name(optimizer) for optimizer in found}
    classes = ", ".join(dict.fromkeys(type(optimizer).__name__ for optimizer in found))
    if len(names) == 1 and None not in names:
        return (name := names.pop()), _state_notes(name, found, classes, source)
    if not found:
        note = f"No torch optimizer came from {source}, so {assumed}"
    elif None in names:
        known = " and ".join("/".join(types) for types in OPTIMIZER_CLASSES.values())
        note = f"{source} gives {classes}, which the cost model does not price (it knows {known}), so {assumed}"
    else:
        note = (f"{source} gives {len(found)} optimizers ({classes}), and the cost model prices one for all "
                f"parameters, so {assumed}")
    return default, (note,)


def _state_notes(name: str, found: list[Any], classes: str, source: str) -> tuple[str, ...]:
    """What the cost model's ``name`` misses of the states of the optimizers ``found``."""
    groups = [group for optimizer in found for group in optimizer.param_groups]
    if name == "sgd" and any(not group.get("momentum") for group in groups):
        return ((f"{source} gives SGD without momentum, which keeps no state; the cost model prices SGD with "
                 "momentum, its buffer and the step's passes over it, so the optimizer's memory and time are an "
                 "upper bound"),)
    if name == "adamw" and any(group.get("amsgrad") for group in groups):
        return (f"{source} gives {classes} with amsgrad, whose third state per parameter the cost model omits",)
    return ()


def _optimizers_in(returned: Any) -> list[Any]:
    """The torch optimizers in what ``configure_optimizers`` returned, in order."""
    if isinstance(returned, torch.optim.Optimizer):
        return [returned]
    if isinstance(returned, Mapping):
        return _optimizers_in(returned.get("optimizer"))
    if isinstance(returned, (list, tuple)):
        return [optimizer for item in returned for optimizer in _optimizers_in(item)]
    return []


def _costed_name(optimizer: Any) -> str | None:
    """The cost model's name for ``optimizer`` (:data:`~stratagem.plan.workload.OPTIMIZER_CLASSES`);
    None when it prices none."""
    for name, types in OPTIMIZER_CLASSES.items():
        if isinstance(optimizer, tuple(getattr(torch.optim, cls) for cls in types)):
            return name
    return None


def plan_hyperparams(plan: Plan) -> dict[str, Any]:
    """The plan's fields as flat ``plan/...`` hyperparameters for a logger."""
    fields = {f"plan/{key}": value for key, value in plan.to_dict().items() if key != "tp_layout"}
    return {"plan/name": plan.name, **fields, "plan/tp_layout": json.dumps(plan.to_dict()["tp_layout"])}


_RELEASE: list[weakref.WeakMethod] = []


def release_at_exit(drop_wrappers: weakref.WeakMethod) -> None:
    """At interpreter exit, call ``drop_wrappers`` (if its object still lives) and release the
    default process group as gloo survives it (docs/platform.md): wrapped modules dropped, then
    :func:`~stratagem.distributed.leave_process_group`. Registers one exit handler
    per process."""
    if not _RELEASE:
        atexit.register(_release)
    _RELEASE.append(drop_wrappers)


def _release() -> None:
    for method in _RELEASE:
        if (bound := method()) is not None:
            bound()
    _RELEASE.clear()
    if dist.is_available() and dist.is_initialized():
        # After an uncaught exception the other ranks may be gone.
        leave_process_group(together=not hasattr(sys, "last_value"))
