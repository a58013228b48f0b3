"""Search: enumerate plans, prune what cannot divide or fit, rank by predicted throughput.

``search_plans`` yields every plan worth costing for a model, cluster and workload: mesh
factorizations (tp inside a node and dividing the heads, pp up to the number of blocks), ZeRO
stages and HSDP, sequence parallelism, pipeline schedules and virtual stages, each with its
balanced stage partition (or the user's), micro-batch sizes with the accumulation that reaches
the global batch, activation checkpointing and CPU offload.
``advise`` costs them (memory first: a plan that does not fit is not timed, and larger
micro-batches of a plan that does not fit are skipped), keeps those that fit, ranks them and
explains the ranking.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain
from typing import Any, NamedTuple

from stratagem.advisor.advice import Advice
from stratagem.advisor.estimate import MemoryBreakdown, TimeBreakdown
from stratagem.advisor.evaluate import evaluate
from stratagem.advisor.explain import NEAR_TIE, explain_ranking, suggest_fixes
from stratagem.advisor.hardware import Cluster
from stratagem.advisor.memory import estimate_memory, framework_bytes, overflow
from stratagem.advisor.plan import CHECKPOINTING, INTERLEAVED_SCHEDULES, Plan, Workload, zero_bubble_refuses
from stratagem.advisor.model_profile import ModelProfile
from stratagem.advisor.partition import balanced_stage_blocks
from stratagem.advisor.targets import (
    check_target,
    divisors,
    pp_degrees,
    runtime_for,
    target_excludes,
    tp_degrees,
)
from stratagem.advisor.timing import estimate_time, splits_routed_experts, tokens_per_second
from stratagem.errors import UsageError
from stratagem.stages import TRACED_STAGE_LIMITS, traced_stages_allow

VIRTUAL_STAGES = (2, 4)

Batching = dict[str, int]
"""A plan's micro-batching: its ``micro_batch_size``, ``microbatches`` and ``grad_accum``."""

OBJECTIVES = {"throughput": "the fastest step", "memory": "the least memory per device"}
"""What ``advise`` can rank plans by, and how the report says it."""


@dataclass(frozen=True, slots=True)
class _Layout:
    """One way to lay a plan's mesh and sharding, before micro-batching."""

    tp: int
    pp: int
    dp_replicate: int
    dp_shard: int
    zero: int


def _layouts(profile: ModelProfile, cluster: Cluster) -> Iterator[_Layout]:
    world, per_node = cluster.world_size, cluster.devices_per_node
    tps, _ = tp_degrees(profile, per_node)
    for tp in tps:
        for pp in pp_degrees(profile, world // tp):
            dp = world // (tp * pp)
            yield _Layout(tp, pp, dp, 1, 0)
            if dp == 1:
                yield _Layout(tp, pp, 1, 1, 3)  # FSDP on one rank, for its CPU offload
                continue
            yield _Layout(tp, pp, 1, dp, 1)
            shard_in_node = per_node // tp
            for zero in (2, 3):
                yield _Layout(tp, pp, 1, dp, zero)
                if 1 < shard_in_node < dp and dp % shard_in_node == 0:
                    yield _Layout(tp, pp, dp // shard_in_node, shard_in_node, zero)  # HSDP


def _schedules(pp: int, num_blocks: int) -> Iterator[tuple[str, int]]:
    if pp == 1:
        yield "1f1b", 1
        return
    yield "gpipe", 1
    yield "1f1b", 1
    for v in VIRTUAL_STAGES:
        if num_blocks >= pp * v:
            yield from ((schedule, v) for schedule in INTERLEAVED_SCHEDULES)


def _offloads(layout: _Layout, cluster: Cluster) -> tuple[str, ...]:
    if layout.zero < 2:
        return ("none",)
    offloads = ("optimizer", "params") if layout.zero == 3 else ("optimizer",)
    if not cluster.is_gpu:
        return () if layout.dp_shard == 1 else ("none",)  # CPU ranks have nothing to offload to
    return offloads if layout.dp_shard == 1 else ("none", *offloads)


def _micro_batching(layout: _Layout, local_batch: int, schedule: str, v: int) -> Iterator[Batching]:
    """The micro-batchings reaching ``local_batch`` per replica, smallest micro-batch first."""
    for mbs in divisors(local_batch):
        m = local_batch // mbs
        if layout.pp == 1:
            yield {"micro_batch_size": mbs, "microbatches": 1, "grad_accum": m}
        elif m >= layout.pp and (v == 1 or m % layout.pp == 0):  # fewer: some stage always idles
            yield {"micro_batch_size": mbs, "microbatches": m, "grad_accum": 1}


def _partition(profile: ModelProfile, pp: int, v: int,
               pinned: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """The stage partition for ``pp × v`` stages: ``pinned`` where it has that many stages (a
    plan with another number is left out by the constraint), else the balanced one."""
    if pp == 1:
        return None
    if pinned is not None and len(pinned) == pp * v:
        return pinned
    return balanced_stage_blocks(profile, pp * v)


def search_plans(profile: ModelProfile, cluster: Cluster, workload: Workload, *,
                 excluded: Counter | None = None, stage_blocks: tuple[int, ...] | None = None,
                 target: str | None = None) -> Iterator[Iterator[Plan]]:
    """Candidate plans in groups that differ only by micro-batch size (ascending), so that a
    caller can stop a group at its first plan that does not fit; a group builds its plans after
    the first lazily, so the rest of a stopped group costs nothing. Pipeline plans carry the
    balanced partition, or ``stage_blocks`` (a user's) where its length fits. A model whose
    stages are traced (``profile.pp_traced``) gets pipeline plans only without TP or
    checkpointing. With ``target``, a group that target cannot run is left out whole, counted in
    ``excluded``: a target's rules read no micro-batching, so a group's first plan answers for
    all of it. Plan checks run once per group, on its first plan: the others differ from it only
    in a micro-batching that :func:`_micro_batching` builds valid."""
    excluded = Counter() if excluded is None else excluded
    for fields, batchings in _layout_groups(profile, cluster, workload, excluded, stage_blocks):
        plans = (Plan.unchecked(*fields, batching) for batching in batchings)
        first = next(plans, None)
        if first is None:
            continue
        reason = target and target_excludes(target, first, on_gpu=cluster.is_gpu, traced=profile.pp_traced)
        if reason:
            excluded[f"not runnable by {target}: {reason}"] += len(batchings)
            continue
        first.validate()
        yield chain((first,), plans)


def _layout_groups(profile: ModelProfile, cluster: Cluster, workload: Workload, excluded: Counter,
                   stage_blocks: tuple[int, ...] | None) -> Iterator[tuple[tuple[dict[str, Any], ...],
                                                                           tuple[Batching, ...]]]:
    """Each group of :func:`search_plans` as the Plan fields its plans share (in dicts, some shared
    with other groups) and their micro-batchings (smallest micro-batch first)."""
    for layout in _layouts(profile, cluster):
        dp = layout.dp_replicate * layout.dp_shard
        if workload.global_batch_size % dp:
            excluded[f"data-parallel degree not dividing the global batch ({workload.global_batch_size})"] += 1
            continue
        local = workload.global_batch_size // dp
        for sp in (False, True) if layout.tp > 1 else (False,):
            for schedule, v in _schedules(layout.pp, len(profile.blocks)):
                shared = dict(tp=layout.tp, pp=layout.pp, dp_replicate=layout.dp_replicate,
                              dp_shard=layout.dp_shard, zero=layout.zero, sequence_parallel=sp,
                              pp_schedule=schedule, pp_virtual=v, precision=workload.precision,
                              block_container=profile.block_container,
                              tp_layout=profile.tp_layout if layout.tp > 1 else (),
                              stage_blocks=_partition(profile, layout.pp, v, stage_blocks))
                batchings = tuple(_micro_batching(layout, local, schedule, v))
                for ckpt in CHECKPOINTING:
                    if schedule == "interleaved-zb" and zero_bubble_refuses(dp=dp, activation_checkpointing=ckpt):
                        continue  # not a plan (Plan validation says why)
                    if (layout.pp > 1 and profile.pp_traced
                            and not traced_stages_allow(tp=layout.tp, activation_checkpointing=ckpt)):
                        excluded[TRACED_STAGE_LIMITS] += 1
                        continue
                    for offload in _offloads(layout, cluster):
                        yield (shared, {"activation_checkpointing": ckpt, "offload": offload}), batchings


class _Timed(NamedTuple):
    """A plan that fits, as the ranking reads it; :func:`evaluate` makes the full
    :class:`~stratagem.advisor.estimate.Estimate` only of the plans the advice keeps."""

    plan: Plan
    memory: MemoryBreakdown
    time: TimeBreakdown
    throughput: float


def advise(profile: ModelProfile, cluster: Cluster, workload: Workload, *, top: int = 5,
           target: str = "any", constraints: dict | None = None, objective: str = "throughput") -> Advice:
    """Rank every plan that fits ``cluster`` for ``profile`` under ``workload``; best first.

    ``target`` keeps only plans a runtime can run (``any``, ``lightning``, ``accelerate``,
    ``deepspeed``); ``constraints`` pins Plan fields (``{"tp": 2}``, ``{"zero": (2, 3)}``);
    ``objective`` is what ranks them (:data:`OBJECTIVES`).
    """
    started = time.perf_counter()
    check_target(target)
    if objective not in OBJECTIVES:
        raise UsageError(f"unknown objective {objective!r}; valid: {', '.join(OBJECTIVES)}")
    if top < 1:
        raise UsageError(f"top must be at least 1, got {top}")
    pinned = _check_constraints(constraints or {})
    pinned_stages = pinned.get("stage_blocks", (None,))[0]
    if pinned_stages is not None and sum(pinned_stages) != len(profile.blocks):
        raise UsageError(f"the pinned stage_blocks {list(pinned_stages)} cover {sum(pinned_stages)} blocks, but "
                         f"{profile.name} has {len(profile.blocks)}\nHINT: give one block count per pipeline "
                         "stage, adding up to the model's blocks")
    runtime, framework = runtime_for(target), framework_bytes(cluster)
    excluded: Counter = Counter()
    fitting, smallest, evaluated = [], None, 0
    for group in search_plans(profile, cluster, workload, excluded=excluded, stage_blocks=pinned_stages,
                              target=target):
        for plan in group:
            reason = _pinned_out(plan, pinned)
            if reason:
                excluded[reason] += 1
                continue
            evaluated += 1
            memory = estimate_memory(profile, workload, plan, runtime=runtime, framework=framework)
            fullness = overflow(memory, cluster)
            if smallest is None or fullness < smallest[0]:
                smallest = (fullness, plan, memory)
            if fullness > 1:
                break  # a larger micro-batch needs more memory still
            step = estimate_time(profile, cluster=cluster, workload=workload, plan=plan)
            fitting.append(_Timed(plan, memory, step, tokens_per_second(profile, workload=workload, time=step)))
    if evaluated == 0:
        raise _no_candidates(cluster, workload, excluded)
    ranked = [evaluate(profile, cluster, workload, t.plan, runtime=runtime, memory=t.memory, time=t.time)
              for t in _distinct_layouts(rank_estimates(fitting, objective))]
    reasons = explain_ranking(ranked) if ranked else ()
    suggestions = () if ranked else suggest_fixes(profile, cluster, workload, smallest and smallest[1:], runtime=runtime,
                                                       candidates=search_plans)
    return Advice(
        profile=profile, cluster=cluster, workload=workload, target=target, plans=tuple(ranked[:top]),
        reasons=reasons, suggestions=suggestions, excluded=dict(excluded),
        notes=(*_model_notes(profile, cluster), *_warm_up_note(profile, ranked[:top]), *_objective_note(objective),
               *profile.notes, *cluster.notes),
        num_evaluated=evaluated,
        search_seconds=time.perf_counter() - started,
    )


def _model_notes(profile: ModelProfile, cluster: Cluster) -> tuple[str, ...]:
    """What the model itself rules out, said once."""
    _, no_tp = tp_degrees(profile, cluster.devices_per_node)
    notes = (f"No tensor-parallel plans: {no_tp}.",) if no_tp else ()
    if profile.pp_unavailable and cluster.world_size > 1:
        notes += (f"No pipeline plans: {profile.pp_unavailable}.",)
    elif profile.pp_traced and cluster.world_size > 1:
        notes += (f"Pipeline plans only with tp=1 and no activation checkpointing: {profile.name}'s stages are "
                  f"built by tracing, and {TRACED_STAGE_LIMITS}.",)
    return notes


def _warm_up_note(profile: ModelProfile, ranked: list) -> tuple[str, ...]:
    """What the predicted step time, a steady state, leaves out for the ranked plans that split
    routed experts over tensor parallelism."""
    count = sum(splits_routed_experts(profile, e.plan) for e in ranked)
    if not count:
        return ()
    return (f"Tensor-parallel plans ({count} of those ranked) split {profile.name}'s routed experts, whose row "
            "counts follow the routing, and DTensor decides how to shard each operator anew for every row count it "
            "has not met yet (milliseconds each): their first tens to hundreds of steps run slower than the step "
            "time predicted here, which is the steady state (`verify` reports that warm-up beside the step).",)


def _no_candidates(cluster: Cluster, workload: Workload, excluded: Counter) -> UsageError:
    """Not a memory problem: no plan at all can run this workload here (or for this target)."""
    why = "; ".join(f"{reason} ({count})" for reason, count in excluded.most_common(3)) or "none"
    return UsageError(
        f"no plan can train a global batch of {workload.global_batch_size} on {cluster.world_size} "
        f"devices: every layout was left out (most often: {why})\n"
        f"HINT: use a global batch divisible by the data-parallel degree, e.g. a multiple of "
        f"{cluster.world_size}, with enough micro-batches per replica to fill a pipeline")


def _objective_note(objective: str) -> tuple[str, ...]:
    return () if objective == "throughput" else (f"Ranked by {OBJECTIVES[objective]} (objective {objective}).",)


def rank_estimates(estimates: list, objective: str = "throughput") -> list:
    """Fastest first (objective ``throughput``; among plans within NEAR_TIE of the fastest, the
    simplest leads), or least memory per device first (``memory``; the faster of equals first).
    ``estimates``: Estimates, or anything with their ``plan``, ``memory`` and ``throughput``."""
    if objective == "memory":
        return sorted(estimates, key=lambda e: (e.memory.total, -e.throughput))
    ranked = sorted(estimates, key=lambda e: -e.throughput)
    if not ranked:
        return ranked
    cutoff = ranked[0].throughput * (1 - NEAR_TIE)
    tied = [e for e in ranked if e.throughput >= cutoff]
    leader = min(tied, key=lambda e: (e.plan.complexity, -e.throughput))
    return [leader, *(e for e in ranked if e is not leader)]


def _distinct_layouts(ranked: list) -> list:
    """The best plan of each mesh layout (degrees, ZeRO stage, SP, schedule): the top list
    offers real alternatives, not the winner again with checkpointing or a smaller micro-batch."""
    seen, out = set(), []
    for estimate in ranked:
        p = estimate.plan
        key = (p.tp, p.pp, p.dp_replicate, p.dp_shard, p.zero, p.sequence_parallel, p.pp_schedule, p.pp_virtual)
        if key not in seen:
            seen.add(key)
            out.append(estimate)
    return out


def _check_constraints(constraints: dict) -> dict[str, tuple]:
    fields = set(Plan.__dataclass_fields__)
    unknown = sorted(set(constraints) - fields)
    if unknown:
        raise UsageError(f"unknown constraint(s) {', '.join(unknown)}; valid: {', '.join(sorted(fields))}")
    pinned = {k: tuple(v) if isinstance(v, (tuple, list, set)) else (v,) for k, v in constraints.items()}
    if constraints.get("stage_blocks") is not None:  # one partition, not a set of choices
        pinned["stage_blocks"] = (tuple(constraints["stage_blocks"]),)
    return pinned


def _pinned_out(plan: Plan, pinned: dict[str, tuple]) -> str | None:
    for name, allowed in pinned.items():
        if getattr(plan, name) not in allowed:
            return f"constraint {name} in {list(allowed)}"
    return None
