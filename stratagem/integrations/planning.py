"""What the Lightning and Fabric strategies share: reading a pinned Plan, choosing one on rank 0,
the plan's precision plugin behaviour, ZeRO-1's rebuilt optimizer, the data-parallel sampler, and
releasing the process group cleanly. Imports neither Lightning nor Fabric.
"""

from __future__ import annotations

import atexit
import inspect
import json
import os
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from stratagem.distributed import leave_process_group, naming_lost_peers
from stratagem.plan import MeshAxis, Plan, Workload
from stratagem.errors import UsageError

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from stratagem.advisor.profile.model_profile import ModelProfile
    from stratagem.advisor.search.advice import Advice

__all__ = ["LIGHTNING_PRECISIONS", "PlanPrecision", "check_choice", "check_plan_precision", "choose_plan",
           "constructor_options", "load_plan", "plan_hyperparams", "release_at_exit", "sampler_kwargs",
           "stratagem_precision"]

LIGHTNING_PRECISIONS = {"32-true": "fp32", "bf16-mixed": "bf16-mixed", "bf16-true": "bf16-true"}
"""Lightning's (and Fabric's) precision names the strategies run, and stratagem's name for each.
``16-mixed`` is left out: it needs loss scaling, which the strategies do not wire up yet."""


def load_plan(plan: Plan | Mapping[str, Any] | str | Path) -> Plan:
    """A Plan from a Plan, a dict of its fields, or a JSON file: a plan, an entry of
    ``advise --format json`` (``{"plan": ...}``) or that whole document (its best plan)."""
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


def constructor_options(optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its class's constructor takes (AdamW's hold
    ``decoupled_weight_decay``, which ``AdamW()`` refuses): what ZeRO-1 rebuilds it with."""
    accepted = inspect.signature(type(optimizer)).parameters
    return {key: value for key, value in optimizer.defaults.items() if key in accepted}


def check_choice(*, target: str, objective: str, constraints: Mapping[str, Any] | None) -> dict[str, Any]:
    """Validate what a strategy was asked to choose by (before any process starts); returns the
    constraints as a dict. ``micro_batch_size`` and ``grad_accum`` are the dataloader's to set."""
    from stratagem.advisor.search.advice import OBJECTIVES
    from stratagem.advisor.search.targets import check_target

    check_target(target)
    if objective not in OBJECTIVES:
        raise UsageError(f"unknown objective {objective!r}; valid: {', '.join(OBJECTIVES)}")
    constraints = dict(constraints or {})
    fixed = sorted({"micro_batch_size", "grad_accum"} & set(constraints))
    if fixed:
        raise UsageError(f"constraints on {', '.join(fixed)}: the dataloader's batches reach the model unchanged, so "
                         "its batch size is the micro-batch and nothing accumulates\nHINT: change the batch size "
                         "of the dataloader (and example_input_array) instead")
    unknown = sorted(set(constraints) - set(Plan.__dataclass_fields__))
    if unknown:
        raise UsageError(f"unknown constraint(s) {', '.join(unknown)}; they pin Plan fields such as tp or zero")
    return constraints


def choose_plan(module: nn.Module, example_inputs: Callable[[], Any], *, precision: str, target: str,
                verbose: bool, objective: str = "throughput", constraints: Mapping[str, Any] | None = None,
                node_rank: int | None = None,
                pipelined: Callable[[ModelProfile], ModelProfile] | None = None) -> tuple[Plan, Advice | None]:
    """Every rank probes its hardware; rank 0 profiles ``module`` on ``example_inputs()`` (called
    on rank 0 only: a :class:`~stratagem.integrations.steps.TrainingStep` to trace, or one rank's
    batch of forward's inputs, a tensor, a tuple of positional or a dict of keyword arguments; see
    :func:`~stratagem.integrations.steps.profile_for_plan`), advises for the gathered cluster and
    a global batch of that batch × world size, and broadcasts the best plan. A collective: call it
    on every rank. Returns the plan, and on rank 0 the advice it was chosen from (None elsewhere).

    The dataloader's batches reach the model unchanged, so nothing accumulates (``grad_accum``
    1) and one batch is one rank's step: without a pipeline it is the micro-batch; a pipeline
    splits it into ``microbatches`` and its ranks share it (the global batch is the batch × the
    data-parallel degree). Each pipeline shape is searched on its own and the best plan over all
    is taken (:func:`_advise`). ``objective`` and ``constraints`` (Plan fields
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
        advice = _advise(module, example_inputs(), cluster, precision=precision, target=target, objective=objective,
                         constraints=dict(constraints or {}), verbose=verbose, pipelined=pipelined)
        assert advice.best is not None  # _advise raises when no plan fits
        chosen[0] = advice.best.plan.to_json()
    dist.broadcast_object_list(chosen, src=0)
    assert chosen[0] is not None
    return Plan.from_json(chosen[0]), advice


def _advise(module: nn.Module, example_inputs: Any, cluster: Any, *, precision: str, target: str, objective: str,
            constraints: dict[str, Any], verbose: bool,
            pipelined: Callable[[ModelProfile], ModelProfile] | None) -> Advice:
    """The advice (its best plan the one to apply) for ``module`` profiled on ``example_inputs``."""
    from stratagem.advisor.profile.model_profile import kernels_for
    from stratagem.advisor.report.render import render_table
    from stratagem.advisor.search.advice import advise, rank_estimates
    from stratagem.integrations.steps import profile_for_plan

    profile = profile_for_plan(module, example_inputs, precision=precision,
                               kernels=kernels_for(accelerator=cluster.is_accelerator))
    if pipelined is not None:
        profile = pipelined(profile)
    shapes = _pipeline_shapes(profile, dist.get_world_size(), constraints)
    if not shapes:
        raise UsageError(f"the constraints pp={constraints.get('pp', 1)}, microbatches={constraints.get('microbatches', 1)} "
                         f"cannot run one dataloader batch of {profile.batch_size}: a pipeline splits the batch into its "
                         "micro-batches, at least one per stage\nHINT: pick microbatches dividing the batch size and "
                         "at least pp, or change the batch size")
    advices, errors = [], []
    for pp, microbatches in shapes:
        workload = Workload(global_batch_size=profile.batch_size * dist.get_world_size() // pp,
                            seq_len=profile.seq_len, precision=precision)
        shape = {"pp": pp, "microbatches": microbatches, "micro_batch_size": profile.batch_size // microbatches,
                 "grad_accum": 1}
        try:
            advices.append(advise(profile, cluster, workload, target=target, objective=objective,
                                  constraints={**constraints, **shape}))
        except UsageError as err:  # this shape has no candidates (said when no shape has)
            errors.append(err)
    if not advices:
        raise errors[0]
    best = rank_estimates([a.best for a in advices if a.best is not None], objective)
    advice = next((a for a in advices if best and a.best is best[0]), advices[0])
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
    far as ``constraints`` pin them."""
    from stratagem.advisor.search.targets import divisors

    shapes = [(1, 1)]
    if profile.pp_unavailable is None:
        shapes += [(pp, m) for pp in divisors(world)[1:] if pp <= len(profile.blocks)
                   for m in divisors(profile.batch_size) if m >= pp]
    return [(pp, m) for pp, m in shapes
            if constraints.get("pp", pp) == pp and constraints.get("microbatches", m) == m]


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
