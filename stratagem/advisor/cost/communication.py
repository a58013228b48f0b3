"""Communication terms of a step: tensor-parallel collectives (none hidden) and data-parallel
gradient reductions and parameter gathers, with the part of them compute hides.

Each collective costs what :mod:`~stratagem.advisor.cost.collectives` says on the link its
mesh axis crosses, plus the wait for ranks that reach it apart (:func:`collective_wait_seconds`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from stratagem.advisor.cost.collectives import (
    estimate_all_gather_seconds,
    estimate_all_reduce_seconds,
    estimate_reduce_scatter_seconds,
    nearest_measured,
)
from stratagem.advisor.cost.rank_step import RankStep
from stratagem.advisor.cost.rates import linear_rows, model_width
from stratagem.advisor.profile.model_profile import LinearLayer, ModelProfile, SegmentProfile
from stratagem.plan import MeshAxis, Plan
from stratagem.plan.precision import DTYPE_BYTES

# Share of the overlappable compute that really hides DP communication (NCCL kernels take SMs and
# memory bandwidth from the compute beside them). Estimate; `stratagem calibrate` measures it.
DP_OVERLAP_EFFICIENCY = 0.8

# DDP's gradient bucket: torch DistributedDataParallel's default bucket_cap_mb=25.
DDP_BUCKET_BYTES = 25 * 2**20

_COLLECTIVE_SECONDS = {"all_reduce": estimate_all_reduce_seconds, "all_gather": estimate_all_gather_seconds,
                       "reduce_scatter": estimate_reduce_scatter_seconds}

_Messages = tuple[tuple[str, float], ...]


def collective_wait_seconds(step: RankStep, group_size: int) -> float:
    """What a blocking collective over ``group_size`` ranks waits beyond its own time, seconds: the
    ranks reach it apart after the compute before it, and it ends when the last of them arrives, so
    the more ranks it waits for the longer. As calibrated for the group's size, or the nearest
    measured (:func:`~stratagem.advisor.cost.collectives.nearest_measured`; ``NodeSpec.sync_seconds``:
    ranks that share cores arrive a scheduler slice apart);
    uncalibrated none, as for ranks with a device each, which arrive within microseconds of each
    other."""
    measured = step.cluster.node.sync_seconds
    if group_size == 1 or not measured:
        return 0.0
    return nearest_measured(measured, group_size)


# -- tensor parallelism -----------------------------------------------------------------------


def estimate_tp_comm_seconds(step: RankStep) -> float:
    """TP collectives of every block and micro-batch, seconds, none overlapped: those of
    :func:`tp_collectives` in forward and backward, the forward's again under full recomputation,
    each with its wait for the ranks; and those of the embedding and head split by vocabulary
    (:func:`vocab_collectives`), outside the recomputed blocks; with sequence parallelism, those at
    its edges and the norms' gradients' (:func:`_sequence_parallel_edges`)."""
    plan = step.plan
    if plan.tp == 1:
        return 0.0
    forwards = 2 if plan.recomputes_blocks else 1
    vocab_forward, vocab_backward = vocab_collectives(step)
    per_microbatch = _tp_seconds(step, vocab_forward) + _tp_seconds(step, vocab_backward)
    for block, count in step.stage.kinds:
        forward, backward = tp_collectives(step, block)
        per_microbatch += count * (forwards * _tp_seconds(step, forward) + _tp_seconds(step, backward))
    return step.num_microbatches * per_microbatch + _sequence_parallel_edges(step)


def _sequence_parallel_edges(step: RankStep) -> float:
    """Seconds of the TP collectives sequence parallelism adds outside the blocks' own, as the plugin
    applies it (:mod:`stratagem.plugins.tensor_parallel`): per micro-batch and stage the rank holds
    (``pp_virtual`` of them in an interleaved pipeline), the stage's last block's output
    all-gathered forward and its first block's input gradient all-gathered backward; per
    step, where the plugin sums the norms' weight gradients (``Plan.sums_norm_grads_at_step``), one
    all-reduce of them. Messages ``b·s·h`` (:func:`tp_message_bytes`) and ``h`` per norm (a
    LayerNorm's bias left out: the sum is latency-bound)."""
    plan, kinds = step.plan, step.stage.kinds
    if not plan.sequence_parallel or not kinds:
        return 0.0
    first = kinds[0][0]
    width = tp_message_bytes(step, first)
    seconds = step.num_microbatches * plan.pp_virtual * _tp_seconds(step, (("all_gather", width),) * 2)
    if plan.sums_norm_grads_at_step:
        norms = sum(style == "sequence_parallel" for style in plan.block_tp_styles.values())
        weights = norms * sum(n for _, n in kinds) * model_width(first) * step.precision.param_bytes
        seconds += _tp_seconds(step, (("all_reduce", weights),)) if weights else 0.0
    return seconds


def _tp_seconds(step: RankStep, messages: _Messages) -> float:
    """Seconds of ``messages`` over the TP group, each with its wait for the ranks."""
    tp = step.plan.tp
    return sum(_COLLECTIVE_SECONDS[op](num_bytes, group_size=tp, **step.link(MeshAxis.TP, op))
               + collective_wait_seconds(step, tp) for op, num_bytes in messages)


def vocab_collectives(step: RankStep) -> tuple[_Messages, _Messages]:
    """The TP collectives ``(op, bytes)`` of one micro-batch through the input embedding and the
    output head the stage holds and the layout splits by vocabulary, in forward and in backward,
    as the TP plugin applies them (torch's ``RowwiseParallel`` on the Embedding, ``ColwiseParallel``
    gathering the logits; alike with sequence parallelism, whose edges stay at the blocks:
    docs/design.md): the embedding's lookups all-reduced (its output: the first block's input);
    the head's logits all-gathered forward (its rows × the vocabulary, in the compute dtype) and its
    input's gradient all-reduced backward (the head's input, the last block's output). A loss on the
    logits' vocabulary shards (``vocab_loss``) gathers none: torch's ``loss_parallel`` all-reduces
    each row's maximum, sum of exponentials and target logit instead, :data:`LOSS_PARALLEL_REDUCTIONS`
    fp32 values a row, and its backward computes on the shards alone."""
    styles, shares, profile = step.plan.vocab_tp_styles, step.stage.vocab_shares, step.profile
    forward: list[tuple[str, float]] = []
    backward: list[tuple[str, float]] = []
    if "vocab_embedding" in styles and "vocab_embedding" in shares:
        forward.append(("all_reduce", profile.embed.output_bytes * step.batch_scale))
    if "vocab_head" in styles and "vocab_head" in shares:
        for linear in profile.head.linears:
            rows = linear_rows(linear, step.batch_scale, step.tokens_per_microbatch)
            forward.extend([("all_reduce", rows * DTYPE_BYTES["float32"])] * LOSS_PARALLEL_REDUCTIONS
                           if "vocab_loss" in styles
                           else [("all_gather", rows * linear.out_features * step.precision.compute_bytes)])
        backward.append(("all_reduce", profile.head.input_bytes * step.batch_scale))
    return tuple(forward), tuple(backward)


LOSS_PARALLEL_REDUCTIONS = 3
"""All-reduces of one fp32 value a row that torch's ``loss_parallel`` cross-entropy runs forward:
the row's maximum and sum of exponentials (its ``_log_softmax``) and its target's log-probability
(its ``nll_loss_forward``), torch/distributed/tensor/parallel/loss.py in torch 2.13."""


def tp_collectives(step: RankStep, block: SegmentProfile) -> tuple[_Messages, _Messages]:
    """The TP collectives ``(op, bytes)`` of one micro-batch through ``block``, in forward and in
    backward, as the TP plugin applies the layout one Linear at a time (torch's ``ColwiseParallel``
    and ``RowwiseParallel``): forward all-reduces each rowwise Linear's output, backward each
    colwise Linear's input gradient. With sequence parallelism each norm on sequence shards
    all-gathers forward and reduce-scatters backward, each rowwise Linear the reverse (Korthikanti
    et al. 2022, §4.2.2). Messages are ``rows × width`` in the compute dtype (:func:`linear_rows`).
    A block the layout does not name: Megatron's pairing (Shoeybi et al. 2019, §3), two ``b·s·h``
    all-reduces each way, or an all-gather and a reduce-scatter with SP."""
    styles = step.plan.block_tp_styles
    rows = [linear for linear in block.linears if styles.get(linear.name) == "rowwise"]
    cols = [linear for linear in block.linears if styles.get(linear.name) == "colwise"]
    element = step.precision.compute_bytes

    def per_row(linear: LinearLayer) -> float:
        return linear_rows(linear, step.batch_scale, step.tokens_per_microbatch) * element

    width = tp_message_bytes(step, block)
    if step.plan.sequence_parallel:
        norms = sum(style == "sequence_parallel" for style in styles.values())
        if not rows:
            norms, row_bytes = 2, [width, width]
        else:
            row_bytes = [per_row(linear) * linear.out_features for linear in rows]
        return ((("all_gather", width),) * norms + tuple(("reduce_scatter", b) for b in row_bytes),
                (("reduce_scatter", width),) * norms + tuple(("all_gather", b) for b in row_bytes))
    if not rows:
        return (("all_reduce", width),) * 2, (("all_reduce", width),) * 2
    return (tuple(("all_reduce", per_row(linear) * linear.out_features) for linear in rows),
            tuple(("all_reduce", per_row(linear) * linear.in_features) for linear in cols))


def tp_message_bytes(step: RankStep, block: SegmentProfile) -> float:
    """Bytes of one TP collective of ``block``: ``b·s·h`` in the compute dtype, ``h`` the input
    width of the block's first Linear (the model width), ``b·s`` the rows it multiplies (a ViT's
    patches too); a block without Linears: its output as profiled, scaled to the micro-batch."""
    if not block.linears:
        return block.output_bytes * step.batch_scale
    rows = linear_rows(block.linears[0], step.batch_scale, step.tokens_per_microbatch)
    return rows * model_width(block) * step.precision.compute_bytes


def num_tp_linears(plan: Plan, block: SegmentProfile) -> int:
    """``block``'s Linears the plan's layout splits (all of them when it names none)."""
    styles = plan.block_tp_styles
    split = sum(styles.get(linear.name) in ("colwise", "rowwise") for linear in block.linears)
    return split or len(block.linears)


def splits_routed_experts(profile: ModelProfile, plan: Plan) -> bool:
    """Whether ``plan``'s tensor parallelism splits a Linear that multiplies fewer rows than its
    block's others: a routed expert, whose rows follow the routing from step to step."""
    if plan.tp == 1:
        return False
    split = {name for name, style in plan.block_tp_styles.items() if style in ("colwise", "rowwise")}
    for block in profile.blocks:  # as num_tp_linears: a layout that names none splits them all
        most = max((linear.rows for linear in block.linears), default=0)
        if any(0 < linear.rows < most and (not split or linear.name in split) for linear in block.linears):
            return True
    return False


# -- data parallelism -------------------------------------------------------------------------


def estimate_grad_sync_seconds(step: RankStep) -> float:
    """Gradient reductions per step, seconds, one collective per communication unit (DDP bucket,
    FSDP unit), each paying its latency and its wait. Gradients reduce in the parameter dtype (DDP
    reduces ``param.grad``; FSDP2 as applied keeps ``reduce_dtype`` fp32, like torchtitan). DDP
    (ZeRO 0/1): all-reduce; FSDP: reduce-scatter over ``dp_shard``, then HSDP all-reduces the
    shard over ``dp_replicate`` (Rajbhandari et al. 2020, §7.2)."""
    plan = step.plan
    units = _num_comm_units(step)
    unit_bytes = step.params_per_rank * step.precision.param_bytes / units
    if not plan.uses_fsdp:
        axis = MeshAxis.DP_SHARD if plan.shards_optimizer else MeshAxis.DP_REPLICATE
        return step.num_reductions * units * (
            estimate_all_reduce_seconds(unit_bytes, group_size=plan.dp, **step.link(axis, "all_reduce"))
            + collective_wait_seconds(step, plan.dp))
    shard = estimate_reduce_scatter_seconds(unit_bytes, group_size=plan.dp_shard,
                                            **step.link(MeshAxis.DP_SHARD, "reduce_scatter"))
    shard += estimate_all_reduce_seconds(unit_bytes / plan.dp_shard, group_size=plan.dp_replicate,
                                         **step.link(MeshAxis.DP_REPLICATE, "all_reduce"))
    shard += collective_wait_seconds(step, plan.dp_shard) + collective_wait_seconds(step, plan.dp_replicate)
    return step.num_reductions * units * shard


def estimate_param_gather_seconds(step: RankStep) -> float:
    """Parameter all-gathers over ``dp_shard`` per step, seconds, each paying its latency and wait.
    ZeRO-1: ZeroRedundancyOptimizer re-syncs the updated parameters after its step (each rank
    broadcasts its bucket, all at once: one gather of the parameter dtype's bytes). ZeRO-2: each
    FSDP unit gathered once per step in the compute dtype; ZeRO-3: before forward and again before
    backward of every micro-batch (Rajbhandari et al. 2020, §7.2.2: 1.5× DDP's volume), fewer
    under a pipeline (:attr:`RankStep.num_gathers`)."""
    plan = step.plan
    if not plan.shards_optimizer:
        return 0.0
    dtype_bytes = step.precision.param_bytes if plan.shards_optimizer_only else step.precision.compute_bytes
    pieces = 1 if plan.shards_optimizer_only else _num_comm_units(step)
    count = 1 if plan.shards_optimizer_only else step.num_gathers
    gather = estimate_all_gather_seconds(step.params_per_rank * dtype_bytes / pieces, group_size=plan.dp_shard,
                                         **step.link(MeshAxis.DP_SHARD, "all_gather"))
    return count * pieces * (gather + collective_wait_seconds(step, plan.dp_shard))


class DpExposure(NamedTuple):
    """DP communication no compute hides (``exposed``), and of it what reduces inside the last
    backward (``in_backward``: DDP's buckets), which a pipeline's drain waits for on every stage."""

    exposed: float
    in_backward: float


def estimate_dp_comm_exposed_seconds(step: RankStep, *, grads: float, gathers: float,
                                     compute: float, recompute: float) -> DpExposure:
    """The part of DP communication no compute hides, seconds (``grads``, ``gathers``: their full
    seconds; ``compute``, ``recompute``: the step's).

    DDP and FSDP overlap reductions with backward, FSDP its gathers with forward too: exposed =
    ``max(0, comm − window × efficiency)`` (:data:`DP_OVERLAP_EFFICIENCY`, or the calibrated
    overlap) plus the last bucket or unit, which starts when compute ends. ZeRO-1's post-step
    parameter sync hides behind nothing. Under a pipeline schedule DDP reduces inside each stage's
    last backward; FSDP reduces once after the last micro-batch, beside no compute."""
    plan = step.plan
    fixed, hideable = (gathers, grads) if plan.shards_optimizer_only else (0.0, grads + gathers)
    if plan.pp > 1 and plan.uses_fsdp:
        fixed, hideable = grads, gathers
    if hideable == 0.0:
        return DpExposure(fixed, 0.0)
    overlap = step.cluster.node.comm_overlap
    efficiency = DP_OVERLAP_EFFICIENCY if overlap is None else overlap
    window = _dp_overlap_window_seconds(step, compute=compute, recompute=recompute) * efficiency
    tail = hideable / _num_comm_units(step)
    overlapped = min(hideable, max(0.0, hideable - window) + tail)
    return DpExposure(fixed + overlapped, 0.0 if plan.uses_fsdp else overlapped)


def _dp_overlap_window_seconds(step: RankStep, *, compute: float, recompute: float) -> float:
    """Compute that DP communication can run beside: the backward of the micro-batches that
    reduce (DDP), plus the first forward (ZeRO-2's one gather), or everything (ZeRO-3)."""
    plan = step.plan
    if plan.shards_parameters:
        return compute + recompute
    backward = step.pass_seconds("bwd") + recompute / step.num_microbatches
    forward = step.pass_seconds("fwd") if plan.uses_fsdp else 0.0
    return forward + step.num_reductions * backward


def _num_comm_units(step: RankStep) -> int:
    """Pieces DP communication runs in: FSDP units (one per block plus the root), or DDP buckets."""
    if step.plan.uses_fsdp:
        return len(step.stage.blocks) + 1
    grad_bytes = step.params_per_rank * step.precision.param_bytes
    return max(1, math.ceil(grad_bytes / DDP_BUCKET_BYTES))
