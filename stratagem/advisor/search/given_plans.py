"""Why not plan X? Plans a user gives by hand, read from JSON, completed as the search would build
them for the model, checked against the workload and the cluster, then costed side by side
(:func:`compare_plans`); :mod:`~stratagem.advisor.search.explain` says why one wins.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, replace
from typing import Any

from stratagem.advisor.cost.estimate import Estimate
from stratagem.advisor.cost.evaluate import evaluate
from stratagem.advisor.cost.rates import flops_per_moved_byte
from stratagem.advisor.hardware import Cluster
from stratagem.advisor.profile.model_profile import ModelProfile
from stratagem.advisor.search.advice import OBJECTIVES, rank_estimates
from stratagem.advisor.search.enumeration import search_plans
from stratagem.advisor.search.explain import explain_comparison
from stratagem.advisor.search.partition import balanced_stage_blocks
from stratagem.advisor.search.targets import model_excludes
from stratagem.errors import UsageError
from stratagem.plan import Plan, Workload
from stratagem.plan.checks import shown

LABELS = ("A", "B")
"""What reports and sentences call the first and the second plan."""


@dataclass(frozen=True, slots=True)
class GivenPlan:
    """A plan as the user gave it: ``fields`` are the Plan fields its JSON names (the rest take
    the search's choices, see :func:`complete_plan`); ``plan`` is them validated, uncompleted."""

    label: str  # "A" or "B"
    source: str  # where it came from: a file name, "inline", "the advisor's best"
    fields: dict[str, Any]
    plan: Plan

    @property
    def title(self) -> str:
        """``'plan A (a.json)'``: how errors name it."""
        return f"plan {self.label} ({self.source})"


def read_plan(text: str, *, label: str, source: str) -> GivenPlan:
    """A plan from JSON ``text``: its fields, an entry of ``advise --format json`` or that whole
    document (its best plan), as :meth:`Plan.from_json` reads them; a :class:`UsageError` naming
    the plan otherwise."""
    try:
        plan = Plan.from_json(text)
    except UsageError as err:
        raise UsageError(f"plan {label} ({source}): {err}") from None
    data = json.loads(text)  # valid now: the same unwrapping as from_json, to see which fields it names
    data = data["plans"][0] if isinstance(data.get("plans"), list) else data
    data = data["plan"] if isinstance(data.get("plan"), dict) else data
    return GivenPlan(label, source, data, plan)


def named_plan(name: str, profile: ModelProfile, cluster: Cluster, workload: Workload, *, label: str) -> Plan:
    """The plan named ``name`` (as reports print it; ``.`` may stand for ``·``) among those the
    search builds for the workload: complete as the search builds it. A :class:`UsageError` naming
    the closest names when there is none."""
    wanted = _plain_name(name)
    plans = []
    for group in search_plans(profile, cluster, workload):
        for plan in group:
            if _plain_name(plan.name) == wanted:
                return plan
            plans.append(plan)
    names = [plan.name for plan in plans]
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5) if len(name) <= _LONGEST_NAME else []
    raise UsageError(f"plan {label}: no plan named {shown(name)} among the {len(names):,} the search builds for "
                     f"{profile.name} on {cluster.spec} at a global batch of {workload.global_batch_size}"
                     f"{_batching(wanted, plans)}\n"
                     "HINT: " + (f"the closest: {'; '.join(close)}" if close else
                                 "`stratagem advise --format json` lists plans by name")
                     + "; or give the plan's fields as JSON")


_BATCHING = re.compile(r"\s*\b(?:mb|ga|m)=\d+")
"""The batching of a plan's name: micro-batch, gradient accumulation, pipeline micro-batches."""


def _batching(wanted: str, plans: list[Plan]) -> str:
    """Where the search builds the plan ``wanted`` names with another batching: what each
    data-parallel rank takes a step, which micro-batch × accumulation × micro-batches must make."""
    stem = _BATCHING.sub("", wanted)
    same = next((p for p in plans if _BATCHING.sub("", _plain_name(p.name)) == stem), None)
    if same is None:
        return ""
    per_rank = same.micro_batch_size * same.grad_accum * same.microbatches
    return (f"; it builds {stem} with each data-parallel rank taking {per_rank} samples a step, which mb × ga "
            f"(× m) must make")


_LONGEST_NAME = 200
"""Characters of a name worth matching against the plans' (the longest plan names run to ~110)."""


def _plain_name(name: str) -> str:
    """``name`` with ``·`` as ``.`` and single spaces: how one types a plan's name."""
    return " ".join(name.replace("·", ".").split())


def complete_plan(given: GivenPlan, profile: ModelProfile, cluster: Cluster, workload: Workload) -> Plan:
    """``given`` checked against ``workload`` and ``cluster`` (world size, global batch, precision,
    what the model and the runtime allow) and completed: the fields it leaves out take what the
    search would give them (the workload's precision, the profile's block container and
    tensor-parallel layout, the balanced stage partition). :class:`UsageError` when it cannot
    train this workload here, saying what would match."""
    plan = given.plan
    _check_world(given, cluster)
    _check_batch(given, workload)
    if "precision" in given.fields and plan.precision != workload.precision:
        raise UsageError(f"{given.title} trains in {plan.precision}, the workload in {workload.precision}\n"
                         f"HINT: pass --precision {plan.precision} (the model is profiled in it), or leave "
                         "precision out of the plan")
    if "block_container" in given.fields and plan.block_container != profile.block_container:
        raise UsageError(f"{given.title} names block_container={plan.block_container!r}, but "
                         f"{profile.name}'s blocks are {profile.block_container!r}, as its profile found them\n"
                         "HINT: leave block_container out of the plan (the profile's is taken)")
    try:
        plan.check(world_size=cluster.world_size, devices_per_node=cluster.devices_per_node,
                   num_heads=profile.num_heads, num_kv_heads=profile.num_kv_heads, num_blocks=len(profile.blocks))
    except UsageError as err:
        raise UsageError(f"{given.title} cannot run here: {err}") from None
    reason = model_excludes(profile, cluster, plan)
    if reason:
        raise UsageError(f"{given.title}, {plan.name}, cannot run here: {reason}\n"
                         f"HINT: `stratagem advise --model {profile.name}` lists plans that can")
    fill: dict[str, Any] = {"precision": workload.precision, "block_container": profile.block_container}
    if plan.tp > 1:
        fill["tp_layout"] = profile.tp_layout
    if plan.pp > 1:
        fill["stage_blocks"] = balanced_stage_blocks(profile, plan.num_stages, compiled=plan.compile,
                                                     byte_flops=flops_per_moved_byte(cluster, workload.precision))
    return replace(plan, **{k: v for k, v in fill.items() if k not in given.fields})


def _check_world(given: GivenPlan, cluster: Cluster) -> None:
    """The plan's ranks must be the cluster's; the hint names a data-parallel degree that matches."""
    plan, world = given.plan, cluster.world_size
    if plan.world_size == world:
        return
    fix = ""
    others = plan.world_size // plan.dp  # pp × tp
    if world % others == 0:
        axis, kept = ("dp_shard", plan.dp_replicate) if plan.dp_shard > 1 else ("dp_replicate", plan.dp_shard)
        if (world // others) % kept == 0:
            fix = f"e.g. {axis}={world // others // kept}, "
    raise UsageError(f"{given.title} spans {plan.world_size} ranks (pp {plan.pp} × dp_replicate {plan.dp_replicate} "
                     f"× dp_shard {plan.dp_shard} × tp {plan.tp}), but {cluster.spec} has {world}\n"
                     f"HINT: give a plan of {world} ranks ({fix}with the micro-batching that keeps the global "
                     f"batch), or a cluster of {plan.world_size} devices")


def _check_batch(given: GivenPlan, workload: Workload) -> None:
    """The plan's global batch must be the workload's; the hint names an accumulation that matches."""
    plan, batch = given.plan, workload.global_batch_size
    if plan.global_batch_size == batch:
        return
    step = plan.micro_batch_size * plan.microbatches * plan.dp  # samples per accumulation step
    fix = f"set grad_accum={batch // step} in the plan, or " if batch % step == 0 else ""
    raise UsageError(f"{given.title} trains a global batch of {plan.global_batch_size} (micro_batch_size "
                     f"{plan.micro_batch_size} × microbatches {plan.microbatches} × grad_accum {plan.grad_accum} "
                     f"× dp {plan.dp}), but the workload's is {batch}\n"
                     f"HINT: {fix}train a global batch of {plan.global_batch_size} (--global-batch-size "
                     f"{plan.global_batch_size})")


@dataclass(frozen=True, slots=True, kw_only=True)
class Comparison:
    """Two plans for one workload, costed side by side: ``estimates`` in the order given (A, B),
    ``winner`` the index of the better one (None when neither fits) and ``reasons`` why."""

    profile: ModelProfile
    cluster: Cluster
    workload: Workload
    estimates: tuple[Estimate, Estimate]
    sources: tuple[str, str]
    winner: int | None
    reasons: tuple[str, ...]
    objective: str = "throughput"
    target: str = "any"  # plans are checked against what any runtime can run (report headings read it)
    labels: tuple[str, str] = LABELS


def compare_plans(profile: ModelProfile, cluster: Cluster, workload: Workload, plans: tuple[Plan, Plan], *,
                  sources: tuple[str, str], objective: str = "throughput") -> Comparison:
    """Cost ``plans`` (checked and completed, see :func:`complete_plan`) and say which wins: one
    that fits beats one that does not; between two that fit, ``objective`` decides as in
    :func:`~stratagem.advisor.search.advice.rank_estimates` (near-ties to the simpler plan)."""
    if objective not in OBJECTIVES:
        raise UsageError(f"unknown objective {objective!r}; valid: {', '.join(OBJECTIVES)}")
    a, b = (evaluate(profile, cluster, workload, plan) for plan in plans)
    fitting = [e for e in (a, b) if e.fits]
    best = rank_estimates(fitting, objective)[0] if fitting else None
    winner = None if best is None else (0 if best is a else 1)
    reasons = explain_comparison(a, b, winner=winner, labels=LABELS, objective=objective)
    return Comparison(profile=profile, cluster=cluster, workload=workload, estimates=(a, b), sources=sources,
                      winner=winner, reasons=reasons, objective=objective)
