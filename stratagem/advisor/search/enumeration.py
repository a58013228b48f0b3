"""Enumerate the plans worth costing for a model, cluster and workload.

``search_plans`` yields mesh factorizations (tp inside a node and dividing the heads, pp up to
the number of blocks), ZeRO stages and HSDP, sequence parallelism, pipeline schedules and virtual
stages, each with its balanced stage partition (or the user's), micro-batch sizes with the
accumulation that reaches the global batch, activation checkpointing and CPU offload;
:func:`~stratagem.advisor.search.advice.advise` costs and ranks them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain, product
from typing import Any

from stratagem.advisor.cost.rates import flops_per_moved_byte
from stratagem.advisor.hardware import Cluster
from stratagem.advisor.profile.model_profile import ModelProfile
from stratagem.advisor.search.partition import balanced_stage_blocks
from stratagem.advisor.search.targets import (
    autocast_excludes,
    divisors,
    pp_degrees,
    sp_excludes,
    target_excludes,
    tp_degrees,
)
from stratagem.plan import CHECKPOINTING, INTERLEAVED_SCHEDULES, Plan, Workload, admitted_offloads, zero_bubble_refuses
from stratagem.plan.stages import TIED_OFFLOAD, TRACED_STAGE_LIMITS, tied_copies_allow, traced_stages_allow

VIRTUAL_STAGES = (2, 4)

Batching = dict[str, int]
"""A plan's micro-batching: its ``micro_batch_size``, ``microbatches`` and ``grad_accum``."""

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
            if dp == 1:
                yield _Layout(tp, pp, 1, 1, 0)
                yield _Layout(tp, pp, 1, 1, 3)  # FSDP on one rank, for its CPU offload
                continue
            if profile.ddp_unavailable is None:  # zero 0 and 1 data parallelism is DDP's
                yield _Layout(tp, pp, dp, 1, 0)
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
    offloads = admitted_offloads(layout.zero)[1:]
    if not offloads:
        return ("none",)
    if not cluster.is_accelerator:
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


def _partition(profile: ModelProfile, pp: int, v: int, pinned: tuple[int, ...] | None, *,
               byte_flops: float, compiled: bool) -> tuple[int, ...] | None:
    """The stage partition for ``pp × v`` stages: ``pinned`` where it has that many stages (a
    plan with another number is left out by the constraint), else the balanced one
    (:func:`~stratagem.advisor.search.partition.balanced_stage_blocks`, for blocks ``compiled``
    or not)."""
    if pp == 1:
        return None
    if pinned is not None and len(pinned) == pp * v:
        return pinned
    return balanced_stage_blocks(profile, pp * v, byte_flops=byte_flops, compiled=compiled)


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
        if autocast := autocast_excludes(profile, first):
            excluded[f"not runnable {autocast}"] += len(batchings)
            continue
        reason = target and target_excludes(target, first, on_gpu=cluster.is_accelerator, traced=profile.pp_traced,
                                            class_wrap_extra=profile.class_wrap_extra)
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
    byte_flops = flops_per_moved_byte(cluster, workload.precision)
    for layout in _layouts(profile, cluster):
        dp = layout.dp_replicate * layout.dp_shard
        if workload.global_batch_size % dp:
            excluded[f"data-parallel degree not dividing the global batch ({workload.global_batch_size})"] += 1
            continue
        local = workload.global_batch_size // dp
        for sp in _sequence_parallel(profile, layout.tp, excluded):
            for schedule, v in _schedules(layout.pp, len(profile.blocks)):
                shared = dict(tp=layout.tp, pp=layout.pp, dp_replicate=layout.dp_replicate,
                              dp_shard=layout.dp_shard, zero=layout.zero, sequence_parallel=sp,
                              pp_schedule=schedule, pp_virtual=v, precision=workload.precision,
                              block_container=profile.block_container,
                              tp_layout=profile.tp_layout if layout.tp > 1 else ())
                batchings = tuple(_micro_batching(layout, local, schedule, v))
                for ckpt, compiled in product(CHECKPOINTING, _compiles(profile, cluster)):
                    if schedule == "interleaved-zb" and zero_bubble_refuses(dp=dp, activation_checkpointing=ckpt):
                        continue  # not a plan (Plan validation says why)
                    if (layout.pp > 1 and profile.pp_traced and not traced_stages_allow(
                            tp=layout.tp, activation_checkpointing=ckpt, compile=compiled)):
                        excluded[TRACED_STAGE_LIMITS] += 1
                        continue
                    for offload in _offloads(layout, cluster):
                        if profile.pp_tied_params and not tied_copies_allow(pp=layout.pp, offload=offload):
                            excluded[TIED_OFFLOAD] += 1
                            continue
                        yield (shared, {"activation_checkpointing": ckpt, "compile": compiled, "offload": offload,
                                        "stage_blocks": _partition(profile, layout.pp, v, stage_blocks,
                                                                   byte_flops=byte_flops, compiled=compiled)}), batchings


def _sequence_parallel(profile: ModelProfile, tp: int, excluded: Counter) -> tuple[bool, ...]:
    """Whether plans split the blocks' sequence: both ways with TP where the model allows it; a
    sequence ``tp`` does not divide is counted among the exclusions (what the model rules out
    whatever the degree, ``sp_unavailable``, the report notes once)."""
    if tp == 1 or profile.sp_unavailable:
        return (False,)
    if why := sp_excludes(profile, tp):
        excluded[f"no sequence parallelism: {why}"] += 1
        return (False,)
    return (False, True)


def _compiles(profile: ModelProfile, cluster: Cluster) -> tuple[bool, ...]:
    """Whether plans compile their blocks: both ways on accelerators, for a model with blocks; not
    on CPU ranks (:data:`COMPILE_ON_CPU`)."""
    return (False, True) if cluster.is_accelerator and profile.block_container is not None else (False,)


COMPILE_ON_CPU = ("No compiled plans on CPU ranks: inductor builds C++ for every block, about a minute on 2 cores "
                  "(llama-tiny's blocks: 62 s), more than the steps it would speed up.")
"""Why CPU ranks get no compiled plans, as the advice says it."""
