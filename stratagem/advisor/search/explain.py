"""Why the best plan wins, why the runner-up loses, why one of two given plans beats the other,
and what would make a model fit at all.

Every sentence names numbers a user can check against the breakdowns in the report.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

from stratagem.advisor.cost.estimate import Estimate, MemoryBreakdown
from stratagem.advisor.hardware import Cluster
from stratagem.advisor.hardware.lookup import device_from_entry, find_gpu, find_tpu, gpu_names, tpu_names, tpu_node
from stratagem.advisor.cost.memory import (
    HOST_MEMORY_PER_DEVICE_MEMORY,
    estimate_memory,
    overflow,
    usable_bytes,
    usable_host_bytes_per_rank,
)
from stratagem.plan import Plan, Workload
from stratagem.advisor.profile.model_profile import ModelProfile
from stratagem.units import format_bytes, format_seconds

TERM_LABELS = {
    "compute": "compute",
    "recompute": "recomputing checkpointed activations",
    "dp_comm": "exposed data-parallel collectives",
    "tp_comm": "tensor-parallel collectives",
    "pp_comm": "pipeline sends",
    "bubble": "pipeline bubbles",
    "optimizer": "optimizer steps",
    "offload": "CPU offload transfers",
    "dispatch": "launching operators (host-bound)",
}
# The memory terms as sentences name them (the report's tables label them in report/content.py).
MEMORY_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer": "optimizer states",
    "activations": "activations",
    "buffers": "buffers",
    "framework": "framework",
}
# Step times within this fraction count as tied; the simpler plan ranks first.
NEAR_TIE = 0.01
# Above this share of usable memory, memory is what binds a plan.
MEMORY_BOUND = 0.9
# Above this share of the step in compute, a plan is compute-bound.
COMPUTE_BOUND = 0.7
# A term differing by less than this share of the winner's total does not decide a comparison.
DECIDING = 0.01
# Node counts tried, as multiples of the cluster's, when nothing fits.
GROWTH = (2, 4, 8, 16, 32, 64)


def _terms(estimate: Estimate) -> dict[str, float]:
    return {name: getattr(estimate.time, name) for name in TERM_LABELS}


def explain_winner(best: Estimate) -> str:
    """What binds the winner: memory, compute, or its largest overhead."""
    step = best.time.step_seconds
    used = best.memory.total / best.capacity_bytes
    if used > MEMORY_BOUND:
        return (f"Memory binds {best.plan.name}: it uses {format_bytes(best.memory.total)} of "
                f"{format_bytes(best.capacity_bytes)} usable per {best.device} ({used:.0%}), so nothing larger fits.")
    terms = _terms(best)
    if terms["compute"] / step > COMPUTE_BOUND:
        return (f"{best.plan.name} is compute-bound: {terms['compute'] / step:.0%} of its "
                f"{format_seconds(step)} step is compute (MFU {best.mfu:.0%}).")
    name, seconds = max(((k, v) for k, v in terms.items() if k != "compute"), key=lambda kv: kv[1])
    return (f"{best.plan.name} spends {seconds / step:.0%} of its {format_seconds(step)} step on "
            f"{TERM_LABELS[name]}, its largest cost after compute ({terms['compute'] / step:.0%}).")


def explain_loser(best: Estimate, other: Estimate) -> str:
    """Why ``other`` ranks below ``best``: the term that grows most, or the tie-break."""
    slower = other.time.step_seconds / best.time.step_seconds - 1
    if abs(slower) <= NEAR_TIE:
        why = "as the simpler plan" if best.plan.complexity < other.plan.complexity else "as the faster"
        return (f"The runner-up, {other.plan.name}, is within {NEAR_TIE:.0%} ({slower:+.1%} step time), "
                f"a tie: {best.plan.name} ranks first {why}.")
    deltas = {k: v - getattr(best.time, k) for k, v in _terms(other).items()}
    name = max(deltas, key=deltas.get)
    return (f"The runner-up, {other.plan.name}, is {slower:.0%} slower: {TERM_LABELS[name]} "
            f"add {format_seconds(deltas[name])} per step.")


def explain_ranking(ranked: Sequence[Estimate]) -> tuple[str, ...]:
    """One or two plain sentences: the winner's binding constraint and the runner-up's loss."""
    reasons = [explain_winner(ranked[0])]
    if len(ranked) > 1:
        reasons.append(explain_loser(ranked[0], ranked[1]))
    return tuple(reasons)


def explain_target_cost(target: str, best: Estimate | None, overall: Estimate | None) -> str | None:
    """What restricting the search to ``target`` costs: ``best`` (the target's) against
    ``overall`` (the best plan of the unrestricted search); None when there is nothing to compare."""
    if overall is None:
        return None
    if best is None:
        return (f"Nothing {target} can run fits, but {overall.plan.name} does "
                f"({format_seconds(overall.time.step_seconds)} per step).")
    slower = overall.throughput / best.throughput - 1
    if overall.plan == best.plan or slower <= NEAR_TIE:
        return f"What {target} leaves out costs nothing here: its best plan is as fast as the best overall."
    return (f"What {target} leaves out costs {slower:.0%} throughput: the best plan overall, {overall.plan.name}, "
            f"takes {format_seconds(overall.time.step_seconds)} per step against "
            f"{format_seconds(best.time.step_seconds)} for {best.plan.name}.")


def explain_comparison(a: Estimate, b: Estimate, *, winner: int | None, labels: tuple[str, str] = ("A", "B"),
                       objective: str = "throughput") -> tuple[str, ...]:
    """Why ``winner`` (0 for ``a``, 1 for ``b``, None when neither fits) beats the other plan: the
    verdict, the terms that decide it, and the other side of the trade (memory or time)."""
    if a.plan == b.plan:
        return (f"{labels[0]} and {labels[1]} are the same plan, {a.plan.name}.",)
    if winner is None:
        if min(a.memory.total, b.memory.total) > a.capacity_bytes:  # both short of device memory
            return (f"Neither fits the {format_bytes(a.capacity_bytes)} usable per {a.device}: {labels[0]} needs "
                    f"{format_bytes(a.memory.total - a.capacity_bytes)} more, {labels[1]} "
                    f"{format_bytes(b.memory.total - b.capacity_bytes)} more.",)
        return (f"Neither fits: {labels[0]} needs {_overflow(a)}; {labels[1]} {_overflow(b)}.",)
    (w, win), (l, lose) = ((labels[winner], (a, b)[winner]), (labels[1 - winner], (a, b)[1 - winner]))
    if not lose.fits:
        verdict = f"{l} does not fit: it needs {_overflow(lose)}, so {w} wins."
        after = (f"Were it to fit, {l} would take {format_seconds(lose.time.step_seconds)} per step against "
                 f"{format_seconds(win.time.step_seconds)} for {w}.")
        return tuple(s for s in (verdict, _memory_terms(w, win, l, lose), after) if s)
    if objective == "memory":
        verdict = (f"{w} wins on memory: {format_bytes(win.memory.total)} per {win.device} against "
                   f"{format_bytes(lose.memory.total)} for {l}.")
        return tuple(s for s in (verdict, _memory_terms(w, win, l, lose), _time_side(w, win, l, lose)) if s)
    slower = lose.time.step_seconds / win.time.step_seconds - 1
    if slower <= NEAR_TIE:
        why = "as the simpler plan" if win.plan.complexity < lose.plan.complexity else "as the faster"
        return (f"{w} and {l} tie within {NEAR_TIE:.0%} ({l} {slower:+.1%} step time): {w} ranks first {why}.",
                _memory_side(w, win, l, lose))
    gain = f"{lose.time.step_seconds / win.time.step_seconds:.1f}× the throughput" if slower >= 1 else \
        f"{slower:.0%} more throughput"
    verdict = (f"{w} wins: {format_seconds(win.time.step_seconds)} per step against "
               f"{format_seconds(lose.time.step_seconds)} for {l} ({gain}).")
    return tuple(s for s in (verdict, _time_terms(w, win, l, lose), _memory_side(w, win, l, lose)) if s)


def _overflow(estimate: Estimate) -> str:
    """How far a plan that does not fit overshoots, on the device or in host memory."""
    memory, capacity = estimate.memory, estimate.capacity_bytes
    if memory.total > capacity:
        return (f"{format_bytes(memory.total)} per {estimate.device}, {format_bytes(memory.total - capacity)} over the "
                f"{format_bytes(capacity)} usable")
    return (f"{format_bytes(memory.host)} of host memory for offloaded states, "
            f"{format_bytes(memory.host - estimate.host_capacity_bytes)} over its "
            f"{format_bytes(estimate.host_capacity_bytes)} share")


def _deciding(win: dict[str, float], lose: dict[str, float]) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """Terms where the loser costs more (at most two, largest first, the second at least a tenth
    of the first) and where the winner does (at most one), each by more than :data:`DECIDING` of
    the winner's total."""
    floor = DECIDING * sum(win.values())
    deltas = sorted(((k, lose[k] - win[k]) for k in win), key=lambda kv: -abs(kv[1]))
    worse = [kv for kv in deltas if kv[1] > floor][:2]
    return [kv for kv in worse if kv[1] >= worse[0][1] / 10], [(k, -d) for k, d in deltas if -d > floor][:1]


def _time_terms(w: str, win: Estimate, l: str, lose: Estimate) -> str | None:
    """``"B's pipeline bubbles add 41.0 ms per step and its pipeline sends 2.10 ms; A's ..."``."""
    return _differences(w, l, _deciding(_terms(win), _terms(lose)), TERM_LABELS, format_seconds,
                        verb="add", first=" per step", others="")


def _memory_terms(w: str, win: Estimate, l: str, lose: Estimate) -> str | None:
    """``"B's activations take 30.0 GiB more per GPU and its parameters 2.0 GiB; A's ..."``."""
    deciding = _deciding(*({k: getattr(e.memory, k) for k in MEMORY_LABELS} for e in (win, lose)))
    return _differences(w, l, deciding, MEMORY_LABELS, format_bytes, verb="take", first=f" more per {win.device}",
                        others=" more")


def _differences(w: str, l: str, deciding: tuple[list[tuple[str, float]], list[tuple[str, float]]],
                 labels: dict[str, str], fmt: Callable[[float], str], *, verb: str, first: str,
                 others: str) -> str | None:
    """One sentence of the terms where the loser ``l`` pays more (the largest first, with
    ``first`` after it), then those where the winner ``w`` does (``others`` after each)."""
    worse, better = deciding
    if not worse:
        return None
    text = f"{l}'s {labels[worse[0][0]]} {verb} {fmt(worse[0][1])}{first}"
    text += "".join(f" and its {labels[k]} {fmt(d)}" for k, d in worse[1:])
    text += "".join(f"; {w}'s {labels[k]} {verb} {fmt(d)}{others}" for k, d in better)
    return text + "."


def _memory_side(w: str, win: Estimate, l: str, lose: Estimate) -> str:
    """Both plans' memory, and which needs less: the other side of a speed verdict."""
    less = w if win.memory.total <= lose.memory.total else l
    return (f"Memory per {win.device}: {w} {format_bytes(win.memory.total)}, {l} {format_bytes(lose.memory.total)} of "
            f"{format_bytes(win.capacity_bytes)} usable; {less} needs "
            f"{format_bytes(abs(win.memory.total - lose.memory.total))} less.")


def _time_side(w: str, win: Estimate, l: str, lose: Estimate) -> str:
    """Both plans' step times: the other side of a memory verdict."""
    faster = w if win.time.step_seconds <= lose.time.step_seconds else l
    return (f"Step time: {w} {format_seconds(win.time.step_seconds)}, {l} {format_seconds(lose.time.step_seconds)}; "
            f"{faster} is faster.")


Candidates = Callable[[ModelProfile, Cluster, Workload], Iterator[Iterator[Plan]]]


def suggest_fixes(profile: ModelProfile, cluster: Cluster, workload: Workload,
                  smallest: tuple[Plan, MemoryBreakdown], *, runtime: str,
                  candidates: Candidates) -> tuple[str, ...]:
    """When nothing fits: how short the leanest plan falls, and what would close the gap.

    ``candidates`` enumerates plans for a cluster (the search's own enumeration), grouped with
    the smallest micro-batch first."""
    plan, memory = smallest
    out = [_shortfall(plan, memory, cluster)]
    out.extend(s for s in (_more_devices(profile, cluster, workload, runtime=runtime, candidates=candidates),
                           _bigger_gpu(memory, cluster)) if s)
    if plan.recomputes_blocks and memory.activations > usable_bytes(cluster.device.memory_bytes) / 2:
        out.append(_activations_fix(profile, workload, plan, memory, cluster, runtime=runtime))
    return tuple(out)


HEAD_SHARE = 0.25
"""The share of a plan's activations the head's logits and their loss must hold before the advice names them."""


def _activations_fix(profile: ModelProfile, workload: Workload, plan: Plan, memory: MemoryBreakdown,
                     cluster: Cluster, *, runtime: str) -> str:
    """Activations too large under full checkpointing: what the output head's logits and the loss
    over them add to the peak (the plan costed without them), where that is
    :data:`HEAD_SHARE` of the activations or more, and what would shrink them: a shorter sequence,
    a sequence split over GPUs, which stratagem does not plan, or, where the user's code computes
    the loss on gathered logits (``vocab_head``), a loss stratagem runs on their vocabulary shards."""
    text = f"Activations of one micro-batch take {format_bytes(memory.activations)} even with full checkpointing"
    headless = estimate_memory(profile.without_head_outputs(), workload, plan, runtime=runtime, cluster=cluster)
    head = memory.total - headless.total
    gathered = plan.tp > 1 and "vocab_loss" not in plan.vocab_tp_styles
    if head >= HEAD_SHARE * memory.activations:
        whole = "whole on every tensor-parallel rank; " if gathered else ""
        text += (f", {format_bytes(head)} of them the output head's logits and the loss over them ({whole}the plan "
                 f"needs {format_bytes(headless.total)} per {cluster.device.noun} without them)")
    if not workload.seq_len:
        return text + "."
    text += (": a shorter sequence would shrink them. stratagem does not plan context parallelism, which splits "
             "each sequence over GPUs (torch's experimental `context_parallel`)")
    if gathered:
        text += ("; the logits stay whole because your code computes the loss: a loss stratagem runs itself (a "
                 "preset's or a Hugging Face model's, under `verify`) runs on their vocabulary shards (`vocab_loss`)")
    return text + "."


def _shortfall(plan: Plan, memory: MemoryBreakdown, cluster: Cluster) -> str:
    device = usable_bytes(cluster.device.memory_bytes)
    host = usable_host_bytes_per_rank(cluster)
    parts = []
    if memory.total > device:
        parts.append(f"needs {format_bytes(memory.total)} per {cluster.device.noun} where {cluster.device.name} offers "
                     f"{format_bytes(device)} usable")
    if memory.host > host:
        known = "" if cluster.node.host else f" (assumed {HOST_MEMORY_PER_DEVICE_MEMORY:g}× device memory)"
        parts.append(f"offloads {format_bytes(memory.host)} per {cluster.device.noun} to host memory, which holds "
                     f"{format_bytes(host)} per {cluster.device.noun}{known}")
    return f"The leanest plan found, {plan.name}, {' and '.join(parts)}."


def _more_devices(profile: ModelProfile, cluster: Cluster, workload: Workload, *, runtime: str,
                  candidates: Candidates) -> str | None:
    """The smallest cluster of this node kind that fits: a fuller node first, then more nodes
    (for TPU chips, a larger slice)."""
    for bigger in _larger_clusters(cluster):
        for group in candidates(profile, bigger, workload):
            plan = next(group, None)  # the group's smallest micro-batch
            if plan and overflow(estimate_memory(profile, workload, plan, runtime=runtime, cluster=bigger),
                                 bigger) <= 1:
                if bigger.is_tpu:
                    return (f"It would fit on a slice of {bigger.world_size} {cluster.device.name} chips, "
                            f"e.g. as {plan.name}.")
                where = (f"one node of {bigger.devices_per_node}" if bigger.num_nodes == 1
                         else f"{bigger.num_nodes} nodes of {bigger.devices_per_node}")
                return (f"It would fit on {where} {cluster.device.name} ({bigger.world_size} {cluster.device.noun}s), "
                        f"e.g. as {plan.name}.")
    return None


def _larger_clusters(cluster: Cluster) -> list[Cluster]:
    """Clusters of this node kind with more devices, smallest first: a fuller node, then more nodes;
    for TPU chips, larger slices up to the largest one (slices are not joined)."""
    node = cluster.node
    if cluster.is_tpu:
        entry = find_tpu(cluster.device.name)
        largest = int(entry.max_slice.value)
        sizes = (2**k for k in range(1, largest.bit_length()))
        return [replace(cluster, node=tpu_node(entry, num_devices=n)) for n in sizes if node.num_devices < n <= largest]
    fuller = [replace(cluster, node=replace(node, num_devices=n))
              for n in (2, 4, 8) if cluster.num_nodes == 1 and n > node.num_devices]
    more = [replace(cluster, num_nodes=cluster.num_nodes * f, node=replace(node, num_devices=max(8, node.num_devices)))
            for f in GROWTH]
    return [*fuller, *more]


def _bigger_gpu(memory: MemoryBreakdown, cluster: Cluster) -> str | None:
    """The smallest catalogued device of the cluster's kind (GPU or TPU chip) with more memory on
    which the leanest plan fits, as a sentence."""
    if cluster.is_tpu:
        devices = [tpu_node(find_tpu(name), num_devices=1).device for name in tpu_names()]
    else:
        devices = [device_from_entry(find_gpu(name)) for name in gpu_names()]
    fits = []
    for device in devices:
        other = replace(cluster, node=replace(cluster.node, device=device))
        if device.memory_bytes > cluster.device.memory_bytes and overflow(memory, other) <= 1:
            fits.append((device.memory_bytes, device.name))
    if not fits:
        return None
    unit = "chips" if cluster.is_tpu else "GPUs"
    return f"The same number of {min(fits)[1]} (or larger) {unit} would fit its leanest plan."
