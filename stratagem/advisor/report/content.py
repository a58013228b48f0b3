"""What every ``advise`` report says, as plain strings: the terminal, Markdown and HTML
renderers lay out the same rows and sentences, so they cannot drift apart."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from stratagem.advisor.search.advice import Advice
from stratagem.advisor.cost.estimate import Estimate
from stratagem.advisor.search.explain import explain_target_cost
from stratagem.advisor.cost.memory import usable_bytes
from stratagem.advisor.cost.compute import COMPILE_SECONDS_PER_BLOCK_KIND
from stratagem.units import format_bytes, format_count, format_params, format_seconds

if TYPE_CHECKING:
    from stratagem.advisor.search.given_plans import Comparison

# Term name on the breakdown → (label, colour). Colours are shared by the terminal bars and the
# HTML plots (Tableau 10), so a term looks the same everywhere.
MEMORY_TERMS: dict[str, tuple[str, str]] = {
    "parameters": ("parameters", "#4e79a7"),
    "gradients": ("gradients", "#f28e2b"),
    "optimizer": ("optimizer states", "#59a14f"),
    "activations": ("activations", "#e15759"),
    "buffers": ("buffers", "#b07aa1"),
    "framework": ("framework", "#9d7660"),
}
TIME_TERMS: dict[str, tuple[str, str]] = {
    "compute": ("compute", "#4e79a7"),
    "recompute": ("recompute", "#a0cbe8"),
    "dp_comm": ("dp comm", "#f28e2b"),
    "tp_comm": ("tp comm", "#ffbe7d"),
    "pp_comm": ("pp comm", "#9c755f"),
    "bubble": ("pipeline bubble", "#bab0ac"),
    "optimizer": ("optimizer step", "#59a14f"),
    "offload": ("offload", "#edc948"),
    "dispatch": ("op dispatch", "#79706e"),
}
PLAN_COLUMNS = ("#", "plan", "memory / {device}", "step", "{unit}", "MFU")
OVERLAP_NOTE = "comm: exposed part (of: before overlap)"


@dataclass(frozen=True, slots=True)
class Term:
    """One line of a breakdown: ``value`` in bytes or seconds, ``share`` of the total (0..1)."""

    key: str
    label: str
    color: str
    value: float
    share: float
    text: str  # the value, formatted
    detail: str = ""  # communication: "of <time before overlap>"


def memory_cell(estimate: Estimate) -> str:
    """Peak bytes per GPU against usable capacity, e.g. ``'61.2 / 74.0 GiB'``."""
    used, capacity = format_bytes(estimate.memory.total), format_bytes(estimate.capacity_bytes)
    used_number, used_unit = used.split()
    if capacity.endswith(f" {used_unit}"):
        return f"{used_number} / {capacity}"
    return f"{used} / {capacity}"


def throughput_unit(advice: Advice) -> str:
    """``tokens/s`` or ``samples/s``, as the plans report it."""
    if advice.plans:
        return advice.plans[0].throughput_unit
    return "tokens/s" if advice.workload.seq_len else "samples/s"


def plan_columns(advice: Advice) -> tuple[str, ...]:
    """Headers of the ranked-plans table."""
    return tuple(c.format(unit=throughput_unit(advice), device=advice.cluster.device.noun) for c in PLAN_COLUMNS)


def plan_row(rank: int, estimate: Estimate) -> tuple[str, ...]:
    """One ranked plan as table cells, in :func:`plan_columns` order."""
    return (str(rank), estimate.plan.name, memory_cell(estimate), format_seconds(estimate.time.step_seconds),
            format_count(estimate.throughput), f"{estimate.mfu:.1%}")


def memory_terms(estimate: Estimate) -> list[Term]:
    """The memory breakdown of ``estimate``, bytes per GPU."""
    total = estimate.memory.total or 1.0
    return [Term(key, label, color, value, value / total, format_bytes(value))
            for key, (label, color) in MEMORY_TERMS.items()
            for value in (getattr(estimate.memory, key),)]


def time_terms(estimate: Estimate) -> list[Term]:
    """The step-time breakdown of ``estimate``: exposed seconds per step, per term."""
    time = estimate.time
    total = time.step_seconds or 1.0
    terms = []
    for key, (label, color) in TIME_TERMS.items():
        value = getattr(time, key)
        before = getattr(time, f"{key}_total", 0.0)
        detail = f"of {format_seconds(before)}" if before > value else ""
        terms.append(Term(key, label, color, value, value / total, format_seconds(value), detail))
    return terms


def title(advice: Advice | Comparison) -> str:
    """``'gpt2 (124.4M parameters) on 2x8xH100-SXM5-80GB:ib-ndr-x8 (16 GPUs)'``."""
    cluster = advice.cluster
    kind = cluster.device.noun + ("s" if cluster.world_size > 1 else "")
    return (f"{advice.profile.name} ({format_params(advice.profile.num_params)} parameters) "
            f"on {cluster.spec} ({cluster.world_size} {kind})")


def workload_line(advice: Advice | Comparison) -> str:
    """Global batch, sequence length, precision, optimizer (and the gradients' clipping) and target
    runtime, in one line."""
    work = advice.workload
    batch = f"global batch {work.global_batch_size}" + (f" × {work.seq_len} tokens" if work.seq_len else "")
    clip = f", gradients clipped by {work.grad_clip}" if work.grad_clip else ""
    return f"{batch} · {work.precision} · {work.optimizer}{clip} · target {advice.target}"


def winner_line(estimate: Estimate) -> str:
    """Total memory against capacity, with the headroom, for the breakdown heading."""
    return (f"{format_bytes(estimate.memory.total)} of {format_bytes(estimate.capacity_bytes)} usable "
            f"({format_bytes(estimate.headroom_bytes)} headroom){offload_note(estimate)}")


def offload_note(estimate: Estimate) -> str:
    """What a plan keeps in host memory per rank, against its share of the host; '' without offload."""
    if not estimate.memory.host:
        return ""
    return (f"; {format_bytes(estimate.memory.host)} offloaded to host memory "
            f"(of {format_bytes(estimate.host_capacity_bytes)} per {estimate.device})")


def step_note(estimate: Estimate) -> str:
    """What follows the step time: the pipeline rank that paces it, whose terms they are
    (``'costed on pipeline rank 1 of 2, with the head: the slowest'``), and what compiling the
    plan's blocks costs once, before the first step (``'plus about 14 s …'``), in parentheses;
    '' for neither."""
    plan, time = estimate.plan, estimate.time
    notes = []
    if plan.pp > 1:
        holds = {0: ", with the embedding", plan.pp - 1: ", with the head"}  # the last stage's rank
        notes.append(f"costed on pipeline rank {time.paced_rank} of {plan.pp}{holds.get(time.paced_rank, '')}: "
                     "the slowest")
    if time.compile_once:
        notes.append(f"plus about {time.compile_once:.0f} s compiling its blocks once, before the first step "
                     f"(estimated at {COMPILE_SECONDS_PER_BLOCK_KIND:.0f} s a kind of block)")
    return f" ({'; '.join(notes)})" if notes else ""


def excluded_lines(advice: Advice) -> list[str]:
    """One line per reason plans were left out before costing, most plans first; then what
    the target's restriction costs against the best plan overall."""
    ranked = sorted(advice.excluded.items(), key=lambda item: -item[1])
    cost = explain_target_cost(advice.target, advice.best, advice.overall)
    return [f"{count:,} {_plans(count)} — {reason}" for reason, count in ranked] + ([cost] if cost else [])


def nothing_fits_line(advice: Advice) -> str:
    """Why the report has no plan."""
    device = advice.cluster.device
    return (f"No plan fits {advice.profile.name} on {advice.cluster.spec}: every candidate needs more than "
            f"the {format_bytes(usable_bytes(device.memory_bytes))} usable on one {device.name}, or offloads "
            "more than its share of host memory.")


def footer(advice: Advice) -> str:
    """``'evaluated 12,345 plans in 0.84 s'``."""
    return f"evaluated {advice.num_evaluated:,} {_plans(advice.num_evaluated)} in {advice.search_seconds:.2f} s"


def _plans(count: int) -> str:
    return "plan" if count == 1 else "plans"
