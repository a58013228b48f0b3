"""``advise``: cost the candidate plans (memory first: a plan that does not fit is not timed, and
larger micro-batches of a plan that does not fit are skipped), keep those that fit, rank them and
explain the ranking; :class:`Advice` is what it returns.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from stratagem.advisor.cost.batch_norm import latency_unknown_note
from stratagem.advisor.cost.estimate import Estimate, MemoryBreakdown, TimeBreakdown
from stratagem.advisor.cost.evaluate import evaluate
from stratagem.advisor.cost.rates import matmul_dtype
from stratagem.advisor.cost.memory import estimate_memory, overflow
from stratagem.advisor.cost.communication import splits_routed_experts
from stratagem.advisor.cost.convolutions import pays_layout_transforms
from stratagem.advisor.cost.timing import estimate_time, tokens_per_second
from stratagem.advisor.hardware import Cluster
from stratagem.advisor.profile.model_profile import ModelProfile, kernels_for
from stratagem.advisor.search.enumeration import COMPILE_ON_CPU, search_plans
from stratagem.advisor.search.explain import NEAR_TIE, explain_ranking, suggest_fixes
from stratagem.advisor.search.targets import check_target, runtime_for, target_profile, tp_degrees
from stratagem.errors import UsageError
from stratagem.plan import Plan, Workload
from stratagem.plan.workload import HOST_FUSED_OPTIMIZERS
from stratagem.plan.stages import TRACED_STAGE_LIMITS
from stratagem.units import format_count, format_seconds

OBJECTIVES = {"throughput": "the fastest step", "memory": "the least memory per device"}
"""What ``advise`` can rank plans by, and how the report says it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Advice:
    """The advisor's answer for one model, cluster and workload.

    ``plans`` are the top fitting plans, best first (empty when nothing fits; then
    ``suggestions`` say what would make the model fit). ``reasons`` explain the winner and why
    the runner-up loses; ``excluded`` counts the plans the target runtime cannot run, by reason;
    ``notes`` carry caveats from the profile and the cluster. ``overall`` is the best plan with
    no target restriction, when a target restricted the search (see :meth:`against`).
    """

    profile: ModelProfile
    cluster: Cluster
    workload: Workload
    target: str
    plans: tuple[Estimate, ...]
    reasons: tuple[str, ...] = ()
    suggestions: tuple[str, ...] = ()
    excluded: dict[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    num_evaluated: int = 0
    search_seconds: float = 0.0
    overall: Estimate | None = None

    @property
    def best(self) -> Estimate | None:
        """The recommended plan, or None when nothing fits."""
        return self.plans[0] if self.plans else None

    def against(self, overall: Estimate | None) -> Advice:
        """This advice with ``overall``, the best plan of the unrestricted search, to say what
        the target's restriction costs."""
        return replace(self, overall=overall)

    def to_dict(self) -> dict[str, Any]:
        """The JSON document of ``advise --format json``."""
        p = self.profile
        return {
            "model": {"name": p.name, "parameters": p.num_params, "flops_per_step": p.flops_per_step,
                      "profiled_batch_size": p.batch_size, "seq_len": p.seq_len,
                      "num_blocks": len(p.blocks), "num_heads": p.num_heads, "num_kv_heads": p.num_kv_heads},
            "cluster": self.cluster.to_dict(),
            "workload": self.workload.to_dict(),
            "target": self.target,
            "plans": [e.to_dict() for e in self.plans],
            "reasons": list(self.reasons),
            "suggestions": list(self.suggestions),
            "excluded": dict(self.excluded),
            "notes": list(self.notes),
            "num_evaluated": self.num_evaluated,
            "search_seconds": self.search_seconds,
            "overall": self.overall.to_dict() if self.overall else None,
        }


class _Timed(NamedTuple):
    """A plan that fits, as the ranking reads it; :func:`evaluate` makes the full
    :class:`~stratagem.advisor.cost.estimate.Estimate` only of the plans the advice keeps."""

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
    profile = target_profile(profile, check_target(target))
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
    runtime = runtime_for(target)
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
            memory = estimate_memory(profile, workload, plan, runtime=runtime, cluster=cluster)
            fullness = overflow(memory, cluster)
            if smallest is None or fullness < smallest[0]:
                smallest = (fullness, plan, memory)
            if fullness > 1:
                break  # a larger micro-batch needs more memory still
            step = estimate_time(profile, cluster=cluster, workload=workload, plan=plan)
            fitting.append(_Timed(plan, memory, step, tokens_per_second(profile, workload=workload, time=step)))
    if evaluated == 0:
        raise _no_candidates(cluster, workload, excluded, target)
    ranked = [evaluate(profile, cluster, workload, t.plan, runtime=runtime, memory=t.memory, time=t.time)
              for t in _distinct_layouts(rank_estimates(fitting, objective))]
    reasons = explain_ranking(ranked) if ranked else ()
    suggestions = () if ranked else suggest_fixes(profile, cluster, workload, smallest and smallest[1:], runtime=runtime,
                                                       candidates=search_plans)
    return Advice(
        profile=profile, cluster=cluster, workload=workload, target=target, plans=tuple(ranked[:top]),
        reasons=reasons, suggestions=suggestions, excluded=dict(excluded),
        notes=(*_model_notes(profile, cluster), *_cpu_precision_note(cluster, workload),
               *_warm_up_note(profile, ranked[:top]), *_host_optimizer_note(ranked[:top], workload),
               *_dynamic_shape_note(profile, ranked[:top]), *_vocab_loss_note(ranked[:top]),
               *_channels_last_note(profile, cluster, workload, ranked[:1]), *_objective_note(objective),
               *profile.notes, *cluster.notes),
        num_evaluated=evaluated,
        search_seconds=time.perf_counter() - started,
    )


def _model_notes(profile: ModelProfile, cluster: Cluster) -> tuple[str, ...]:
    """What the model itself rules out, and what its profile does not describe, said once."""
    _, no_tp = tp_degrees(profile, cluster.devices_per_node)
    notes = (f"No tensor-parallel plans: {no_tp}.",) if no_tp else (
        (f"No sequence-parallel plans: {profile.sp_unavailable}.",) if profile.sp_unavailable else ())
    notes += latency_unknown_note(profile, cluster)
    if not cluster.is_accelerator and profile.block_container is not None:
        notes += (COMPILE_ON_CPU,)
    wanted = kernels_for(accelerator=cluster.is_accelerator)
    if profile.kernels != wanted:
        notes += (f"The profile counts {profile.kernels.upper()} kernels and the cluster runs {wanted.upper()} ones "
                  f"(fused norms, dropout masks): profile with kernels={wanted!r} for its numbers.",)
    if profile.ddp_unavailable and cluster.world_size > 1:
        notes += (f"No DDP plans (zero 0 or 1): {profile.ddp_unavailable}.",)
    if profile.pp_unavailable and cluster.world_size > 1:
        notes += (f"No pipeline plans: {profile.pp_unavailable}.",)
    elif profile.pp_traced and cluster.world_size > 1:
        notes += (f"Pipeline plans only with tp=1, no activation checkpointing and no compilation: {profile.name}'s "
                  f"stages are built by tracing, and {TRACED_STAGE_LIMITS}.",)
    return notes


def _cpu_precision_note(cluster: Cluster, workload: Workload) -> tuple[str, ...]:
    """On CPU ranks whose cores have no fp16 vector units, what fp16 costs there and what runs faster."""
    device = cluster.device
    if cluster.is_accelerator or matmul_dtype(cluster, workload.precision) != "fp16":
        return ()
    if device.peak_fp16 >= device.peak_fp32:
        return ()
    fp16, bf16 = format_count(device.peak_fp16, "FLOP/s"), format_count(device.peak_bf16, "FLOP/s")
    return (f"{workload.precision} on these CPU ranks: their cores have no fp16 vector units (AVX512-FP16, "
            f"AMX-FP16), so torch runs fp16 matmuls and convolutions unvectorized, priced at {fp16} a rank "
            f"against {bf16} in bf16; bf16-mixed is the 16-bit precision for them.",)


def _host_optimizer_note(ranked: list, workload: Workload) -> tuple[str, ...]:
    """Where a ranked plan offloads, how its host step is priced and what a user's own loop must build."""
    if workload.optimizer not in HOST_FUSED_OPTIMIZERS or not any(e.plan.offloads for e in ranked):
        return ()
    return ("Offloaded plans step the optimizer on the host, priced fused as stratagem's plugins and strategies "
            "build it: an optimizer your own code builds should pass fused=True to AdamW or Adam (torch's default on "
            "CPU tensors steps one tensor at a time, several times slower).",)


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


def _vocab_loss_note(ranked: list) -> tuple[str, ...]:
    """How the tensor-parallel plans ranked compute the loss where they run it on the logits'
    vocabulary shards (``vocab_loss``): what a loop of the user's own must do to run them so."""
    if not any(e.plan.tp > 1 and "vocab_loss" in e.plan.vocab_tp_styles for e in ranked):
        return ()
    return ("Tensor-parallel plans compute the loss on the logits' vocabulary shards (vocab_loss: torch's "
            "loss_parallel, as verify runs this model); in a training loop of your own, run the loss and its backward "
            "under stratagem.plugins.vocab_parallel_loss(plan). The Lightning and Fabric strategies, whose loss is "
            "your code's, plan with the logits gathered (vocab_head) and refuse these.",)


def _dynamic_shape_note(profile: ModelProfile, ranked: list) -> tuple[str, ...]:
    """What the compiled plans ranked leave out where blocks of one class take inputs of several
    sizes (a ResNet's bottlenecks, stage by stage): compiled one by one, they share one forward's
    code, which dynamo recompiles with dynamic shapes once a second size arrives (torch's
    ``automatic_dynamic_shapes``); the cost model prices the layout of their convolutions so
    (``cost.convolutions.symbolic_kinds``), and one static graph per kind of block otherwise.
    Sizes, not bytes: an input of another dtype alone (an MLP's first block, before autocast's
    first matmul) recompiles a static graph, as the cost model prices it."""
    if not any(e.plan.compile for e in ranked):
        return ()
    sizes: dict[str, set[int]] = {}
    for block in profile.blocks:
        sizes.setdefault(block.kind, set()).add(block.input_elements)
    varied = [f"its {sum(b.kind == kind for b in profile.blocks)} {kind} blocks take inputs of {len(found)} sizes"
              for kind, found in sizes.items() if len(found) > 1]
    if not varied:
        return ()
    priced = ("the convolutions of graphs so traced stay NCHW, which is priced, but their other kernels"
              if any(block.convs for block in profile.blocks) else "their kernels")
    return (f"Compiled plans compile each block, and {'; '.join(varied)} through one forward, which dynamo "
            f"recompiles with dynamic shapes once a second size arrives: {priced} and the compile times are priced "
            "as static graphs, one per kind of block (ResNet-101 at 128 images on one H100, 2026-11-26: 75 ms a step "
            "measured, 59 predicted, and over a minute compiling).",)


_CHANNELS_LAST_GAIN = 0.1
"""The share of the best plan's step that torch.channels_last must save before the advice says so."""


def _channels_last_note(profile: ModelProfile, cluster: Cluster, workload: Workload, best: list) -> tuple[str, ...]:
    """What ``torch.channels_last`` would save the best plan where the model's convolutions run in
    NCHW on a GPU whose cuDNN transforms them (``cost.convolutions.pays_layout_transforms``): the
    same plan costed on the profile laid out channels-last (``ModelProfile.in_channels_last``),
    said where it saves :data:`_CHANNELS_LAST_GAIN` of the step or more."""
    nchw = any(not conv.channels_last for segment in profile.segments for conv in segment.convs)
    if not best or not nchw or not pays_layout_transforms(cluster, best[0].plan.precision):
        return ()
    plan, step = best[0].plan, best[0].time.step_seconds
    faster = estimate_time(profile.in_channels_last(), cluster=cluster, workload=workload, plan=plan).step_seconds
    if faster > step * (1 - _CHANNELS_LAST_GAIN):
        return ()
    batch_norms = any(segment.batch_norms for segment in profile.segments)
    norms = " (and its BatchNorms run ATen's slower NCHW kernels)" if batch_norms else ""
    return (f"{profile.name}'s convolutions run in torch's default NCHW layout, around which cuDNN transforms their "
            f"tensors to the NHWC its tensor-core kernels read, and back{norms}: laid out channels-last, {plan.name} "
            f"is predicted at {format_seconds(faster)} a step instead of {format_seconds(step)} "
            "(model.to(memory_format=torch.channels_last), and each batch's images likewise).",)


def _no_candidates(cluster: Cluster, workload: Workload, excluded: Counter, target: str) -> UsageError:
    """Not a memory problem: no plan at all can run this workload here (or for this target). A
    global batch that does not divide over every rank leaves only layouts with tensor or pipeline
    parallelism, which the reasons counted then concern: said first."""
    batch, world = workload.global_batch_size, cluster.world_size
    why = "; ".join(f"{reason} ({count})" for reason, count in excluded.most_common(3)) or "none"
    split = "" if batch % world == 0 else (
        f"{batch} samples do not divide over {world} data-parallel ranks, which leaves layouts with tensor or "
        "pipeline parallelism, and ")
    hint = (f"use a global batch divisible by the data-parallel degree, e.g. a multiple of {world}" if split
            else "--target any for the plans any runtime can run" if target != "any"
            else "the reasons above are what rules each layout out")
    return UsageError(f"no plan can train a global batch of {batch} on {world} devices: {split}every layout was "
                      f"left out (most often: {why})\nHINT: {hint}")


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
            return f"{_CONSTRAINT}{name} in {list(allowed)}"
    return None


_CONSTRAINT = "constraint "
"""How ``excluded`` names the plans a constraint left out: ``'constraint tp in [2]'``."""


def without_constraints(advice: Advice, names: Collection[str]) -> Advice:
    """``advice`` less what the constraints on ``names`` left out (a caller's own pins, such as
    the strategies' search of one tensor-parallel degree and pipeline shape at a time)."""
    pinned = tuple(f"{_CONSTRAINT}{name} in" for name in names)
    return replace(advice, excluded={why: n for why, n in advice.excluded.items() if not why.startswith(pinned)})
