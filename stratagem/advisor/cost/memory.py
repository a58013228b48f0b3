"""Memory per rank for a Plan: model states sharded by ZeRO/TP/PP, activations, transient buffers.

Pipeline ranks differ: the first keeps the most micro-batches in flight, and the partition
(``Plan.stage_blocks``) gives each rank its own blocks, the first the embedding and the last the
head. :func:`estimate_memory` costs every rank that may be the most loaded
(:func:`~stratagem.advisor.cost.stages.candidate_ranks`) and reports the fullest. Every term is a
named ``estimate_*`` function returning bytes for one pipeline rank (``rank``, 0 by default);
:func:`estimate_rank_memory` is their visible sum. The search costs thousands of plans that share
most of them: :func:`estimate_memory` costs the model states once per layout (plans that differ
only in micro-batching) and activations once per what they depend on, both exactly as
:func:`estimate_rank_memory` would.

Sources: model states — Rajbhandari et al. 2020 (ZeRO), §3 and Table 1; activations —
Korthikanti et al. 2022, §4 (eq. 1–5) and §4.2.3 (in-flight micro-batches per schedule).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

from stratagem.advisor.cost.estimate import MemoryBreakdown, device_bytes
from stratagem.advisor.hardware import Cluster
from stratagem.plan import Plan, Workload
from stratagem.plan.precision import get_precision
from stratagem.advisor.profile.model_profile import ModelProfile, SegmentProfile
from stratagem.advisor.memo import by_identity, by_identity_and_fields
from stratagem.advisor.cost.stages import PARTITION_FIELDS, Stage, candidate_ranks, rank_stages, virtual_stages

# Kept free on every device: CUDA context, NCCL buffers and allocator fragmentation. The
# context takes ~0.5 GiB on H100 (CUDA 12); NCCL reserves up to ~1 GiB per communicator set.
RESERVED_BYTES = 2 * 2**30
RESERVED_FRACTION = 0.05
# Host memory of a catalog node whose RAM is unknown, per device: DGX A100/H100 carry 2 TiB for
# 8 × 40-80 GB GPUs, cloud 8-GPU instances 1.1-2 TiB; twice the device memory is conservative.
HOST_MEMORY_PER_DEVICE_MEMORY = 2.0
# Share of host memory offloaded states may take (the OS, data loaders and pinned buffers
# need the rest). Estimate.
HOST_USABLE_FRACTION = 0.8
# Gradients the loss's backward holds at once of the head's output (the logits): that of the
# loss's input and that of the head's output before the loss's own ops (cross-entropy: the
# log-softmax's output and input), each the logits' size in the loss's dtype (fp32 under autocast,
# twice the bf16 logits': on an H200, bench/gpu_phases.py's GPT-2 at 16 × 1024 tokens peaks
# 2 × 3.07 GiB above what its backward starts with); the reason chunked cross-entropy exists.
LOSS_GRADIENT_COPIES = 2
# Korthikanti et al. 2022, eq. 2: without SP, 10 of a block's 34·sbh bytes stay replicated
# over the TP group (layer-norm inputs, attention and MLP inputs, dropout masks): five tensors
# as wide as the block's input. Used until TP-sharded blocks are profiled directly.
TP_REPLICATED_INPUT_WIDTHS = 5


@dataclass(frozen=True, slots=True)
class StateLayout:
    """Bytes per parameter of model states: ``weights`` (what forward reads), ``grads`` and
    ``optimizer`` (master weights included when the runtime keeps them there).
    ``zero2_shards_weights``: ZeRO-2 keeps the weights sharded between steps and gathers them for
    the step (FSDP2 with ``reshard_after_forward=False``), rather than replicating them (DeepSpeed).
    ``frees_gradients``: the gradients are dropped between steps (torch's ``zero_grad(set_to_none=
    True)``), rather than kept in buffers of their own (DeepSpeed)."""

    weights: float
    grads: float
    optimizer: float
    zero2_shards_weights: bool = True
    frees_gradients: bool = True


@functools.lru_cache(maxsize=None)
def state_layout(precision: str, optimizer: str, *, runtime: str = "torch") -> StateLayout:
    """Model-state bytes per parameter.

    ``runtime="torch"`` (what stratagem applies): parameters and gradients in the precision's
    parameter dtype (fp32 for *-mixed), AdamW keeps two states, SGD one momentum buffer, in that
    dtype. ``runtime="deepspeed"``: under mixed precision the ZeRO paper's layout — 16-bit
    weights and gradients, fp32 master weights plus states in the optimizer (K = 12 for Adam, 8
    for SGD); ZeRO-2 weights replicated and gradient buffers kept, whatever the precision.
    """
    prec = get_precision(precision)
    num_states = 2 if optimizer == "adamw" else 1
    deepspeed = runtime == "deepspeed"
    if deepspeed and prec.autocast:
        weights, grads, states = 2, 2, 4 + 4 * num_states
    else:
        weights = grads = prec.param_bytes
        states = num_states * prec.param_bytes
    return StateLayout(weights=weights, grads=grads, optimizer=states, zero2_shards_weights=not deepspeed,
                       frees_gradients=not deepspeed)


def usable_bytes(memory_bytes: float) -> float:
    """Bytes of a device with ``memory_bytes`` a plan may use: capacity less RESERVED_FRACTION
    and RESERVED_BYTES."""
    return memory_bytes * (1 - RESERVED_FRACTION) - RESERVED_BYTES


def usable_host_bytes_per_rank(cluster: Cluster) -> float:
    """Host memory one rank's offloaded states may take, bytes: the node's RAM (probed, or
    :data:`HOST_MEMORY_PER_DEVICE_MEMORY` × its device memory when unknown) × the usable
    fraction, shared by the node's ranks."""
    host = cluster.node.host
    node_ram = host.memory_bytes if host else HOST_MEMORY_PER_DEVICE_MEMORY * cluster.device.memory_bytes * cluster.devices_per_node
    return node_ram * HOST_USABLE_FRACTION / cluster.devices_per_node


def overflow(memory: MemoryBreakdown, cluster: Cluster) -> float:
    """How full a plan leaves the tighter of device and host memory: use over usable capacity
    (at most 1 when it fits)."""
    device, host = _capacities(cluster)
    return max(memory.total / device, memory.host / host)


@by_identity
def _capacities(cluster: Cluster) -> tuple[float, float]:
    return usable_bytes(cluster.device.memory_bytes), usable_host_bytes_per_rank(cluster)


def estimate_params_per_rank(profile: ModelProfile, plan: Plan, *, rank: int = 0) -> float:
    """Parameters pipeline rank ``rank`` holds before ZeRO sharding: its blocks divided over TP,
    the embedding and head whole (:meth:`~stratagem.advisor.cost.stages.Stage.per_tp_rank`)."""
    return rank_stages(profile, plan)[rank].per_tp_rank("num_params", plan.tp)


def estimate_offloaded(params: float, plan: Plan, layout: StateLayout) -> float:
    """Model states held in host memory, bytes per rank: the rank's shard of gradients and
    optimizer states (``optimizer``), and of the weights too (``params``) — FSDP2's
    CPUOffloadPolicy, ZeRO-Offload (Ren et al. 2021). ``params``: the rank's before sharding."""
    if plan.offload == "none":
        return 0.0
    per_param = layout.grads + layout.optimizer + (layout.weights if plan.offload == "params" else 0)
    return per_param * params / plan.dp_shard


def estimate_parameters(params: float, plan: Plan, layout: StateLayout) -> float:
    """Weights kept between steps, bytes per rank (``params``: the rank's before sharding):
    sharded over dp_shard by ZeRO-3 (ZeRO §3, P_os+g+p), and by ZeRO-2 where the runtime
    gathers them for the step (``layout.zero2_shards_weights``; the gathered copy is a buffer)."""
    sharded = plan.zero == 3 or (plan.zero == 2 and layout.zero2_shards_weights)
    shard = plan.dp_shard if sharded else 1
    if plan.offload == "params":
        return 0.0
    return layout.weights * params / shard


def estimate_gradients(params: float, plan: Plan, layout: StateLayout) -> float:
    """Gradients, bytes per rank: sharded over dp_shard from ZeRO-2 (ZeRO §3, P_os+g)."""
    if plan.offload != "none":
        return 0.0  # offloaded shards are reduced straight to host memory
    shard = plan.dp_shard if plan.zero >= 2 else 1
    return layout.grads * params / shard


def estimate_optimizer(params: float, plan: Plan, layout: StateLayout) -> float:
    """Optimizer states, bytes per rank: sharded over dp_shard from ZeRO-1 (ZeRO §3, P_os)."""
    if plan.offload != "none":
        return 0.0
    shard = plan.dp_shard if plan.zero >= 1 else 1
    return layout.optimizer * params / shard


def in_flight_microbatches(plan: Plan, *, rank: int = 0) -> float:
    """Micro-batches whose activations pipeline rank ``rank`` holds at once, in units of the
    rank's whole set of blocks (Korthikanti §4.2.3): the sum of :func:`in_flight_per_stage`
    over ``pp_virtual`` — for rank 0 of interleaved 1F1B ``pp·(1 + (pp−1)/(pp·v))``, i.e.
    L·(1 + (p−1)/(p·v)) layers' worth."""
    return sum(in_flight_per_stage(plan, rank=rank)) / plan.pp_virtual


def in_flight_per_stage(plan: Plan, *, rank: int) -> tuple[int, ...]:
    """Micro-batches each of pipeline rank ``rank``'s (virtual) stages holds at the peak of its
    schedule, as torch's schedules run them (``torch.distributed.pipelining.schedules``).

    GPipe keeps every micro-batch. 1F1B runs ``pp − rank`` warm-up forwards before its first
    backward: it holds ``min(pp − rank, m)``. Interleaved 1F1B runs ``(v − 1)·pp + 2·(pp −
    rank − 1)`` warm-up forwards and one more before the first backward (of ``m·v`` at most),
    forward ``k`` on virtual stage ``(k // pp) mod v``: the first virtual stages hold more.
    Interleaved zero-bubble warms up the same way and is costed so (its deferred weight passes
    keep their gradients' inputs a little longer; not counted).
    """
    return _in_flight(plan.pp, plan.pp_schedule, plan.pp_virtual, plan.microbatches, rank)


@functools.lru_cache(maxsize=4096)
def _in_flight(pp: int, schedule: str, v: int, m: int, rank: int) -> tuple[int, ...]:
    if pp == 1 or schedule == "gpipe":
        return (m,)
    if schedule == "1f1b":
        return (min(pp - rank, m),)
    chunks = min((v - 1) * pp + 2 * (pp - rank - 1) + 1, m * v)
    cycles, rest = divmod(chunks, pp * v)  # forwards go round the virtual stages, pp at a time
    return tuple(cycles * pp + min(max(rest - j * pp, 0), pp) for j in range(v))


def estimate_block_activations(block: SegmentProfile, plan: Plan, *, scale: float,
                               checkpointing: str | None = None) -> float:
    """Bytes one block keeps for backward for one micro-batch (``scale`` = micro-batch size /
    profiled batch size), after checkpointing (the plan's, unless ``checkpointing`` is given),
    TP and SP (Korthikanti eq. 1–5)."""
    checkpointing = checkpointing or plan.activation_checkpointing
    if checkpointing == "full":
        kept = block.input_bytes * scale  # eq. 5: only the block's input (2sbh)
        return kept / plan.tp if plan.sequence_parallel else kept
    saved = block.saved_bytes
    if checkpointing == "selective":
        saved -= block.attention_saved_bytes  # eq. 4 drops 5as²b
    saved *= scale
    if plan.tp == 1 or plan.sequence_parallel:
        return saved / plan.tp  # eq. 4: SP splits the replicated part too
    replicated = min(saved, TP_REPLICATED_INPUT_WIDTHS * block.input_bytes * scale)
    return replicated + (saved - replicated) / plan.tp  # eq. 2


def estimate_activations(profile: ModelProfile, plan: Plan, *, rank: int = 0) -> float:
    """Activation bytes on pipeline rank ``rank`` at the peak of its schedule: each of its
    stages' activations per micro-batch times the micro-batches that stage holds
    (:func:`in_flight_per_stage`).

    With full checkpointing one block's activations are rebuilt at a time during backward:
    that block's full saved bytes are added once.
    """
    scale = plan.micro_batch_size / profile.batch_size
    total = sum(held * _per_microbatch(stage, plan, scale=scale) for stage, held in
                zip(virtual_stages(profile, plan, rank=rank), in_flight_per_stage(plan, rank=rank)))
    return total + _rebuilt_block(profile, plan, rank=rank)


def _rebuilt_block(profile: ModelProfile, plan: Plan, *, rank: int) -> float:
    """The largest of rank ``rank``'s blocks' full activations for one micro-batch under full
    checkpointing (what its backward rebuilds, one block at a time); 0 without it."""
    if plan.activation_checkpointing != "full":
        return 0.0
    return _largest_block(profile, plan, rank=rank, checkpointing="none")


def _largest_block(profile: ModelProfile, plan: Plan, *, rank: int, checkpointing: str | None = None) -> float:
    """The largest of :func:`estimate_block_activations` over rank ``rank``'s blocks (0 without)."""
    scale = plan.micro_batch_size / profile.batch_size
    return max((estimate_block_activations(b, plan, scale=scale, checkpointing=checkpointing)
                for b, _ in rank_stages(profile, plan)[rank].kinds), default=0.0)


def _stage_outputs(profile: ModelProfile, plan: Plan, *, rank: int) -> float:
    """Bytes of the outputs pipeline rank ``rank``'s stages keep beside their saved activations:
    torch's ``PipelineStage`` holds each in-flight micro-batch's output (the last stage's: the
    logits) until that micro-batch's backward starts from it. None without a pipeline."""
    if plan.pp == 1:
        return 0.0
    scale = plan.micro_batch_size / profile.batch_size
    return scale * sum(held * stage.segments[-1].output_bytes for stage, held in
                       zip(virtual_stages(profile, plan, rank=rank), in_flight_per_stage(plan, rank=rank)))


def _rank_activations(profile: ModelProfile, plan: Plan, *, rank: int) -> RankActivations:
    """:func:`estimate_activations` of rank ``rank`` and its stages' outputs (:func:`_stage_outputs`),
    with the loss's gradients, what its backward frees first (the head's saved bytes, for one
    micro-batch), holds per block and rebuilds (:func:`_rebuilt_block`)."""
    scale = plan.micro_batch_size / profile.batch_size
    head = [s for s in rank_stages(profile, plan)[rank].segments if s is profile.head]
    rebuilt = _rebuilt_block(profile, plan, rank=rank)
    return RankActivations(estimate_activations(profile, plan, rank=rank) + _stage_outputs(profile, plan, rank=rank),
                           loss_grads=LOSS_GRADIENT_COPIES * scale * sum(_logits_gradient(s) for s in head),
                           released=scale * sum(s.saved_bytes for s in head),
                           block=rebuilt or _largest_block(profile, plan, rank=rank), rebuilt=rebuilt)


def _logits_gradient(head: SegmentProfile) -> int:
    """Bytes of one gradient of the logits as the loss's backward makes it: the largest tensor
    the head's backward writes (the loss's dtype: fp32 under autocast), at least the head's
    output (the profiled batch)."""
    return max(head.output_bytes, head.bwd_largest_output_bytes)


def _per_microbatch(stage: Stage, plan: Plan, *, scale: float) -> float:
    """Bytes one micro-batch leaves saved on ``stage``: its blocks', and the embedding's or
    head's (whole on every TP rank)."""
    blocks = sum(n * estimate_block_activations(b, plan, scale=scale) for b, n in stage.kinds)
    return blocks + stage.outside_blocks("saved_bytes") * scale


def estimate_buffers(profile: ModelProfile, plan: Plan, params: float, *, rank: int = 0) -> float:
    """Bytes beyond the model states: gathered FSDP units, DDP's gradient buckets, and
    autocast's compute-dtype weight copies, which live from forward to backward. ``params``: the
    rank's parameters before sharding. DDP (data parallelism over more than one rank, zero 0/1)
    keeps a copy of every gradient in its buckets for the module's life (torch's
    ``gradient_as_bucket_view=False``, the default, which the plugins keep). FSDP2 (ZeRO-3) holds the root unit (what lies outside the blocks: embedding, head)
    gathered from its forward to its backward (it does not reshard the root after forward) and
    a block unit and the next, prefetched; ZeRO-2 keeps every unit gathered until backward; a
    plan without blocks has the root as its only unit."""
    prec = get_precision(plan.precision)
    stage = rank_stages(profile, plan)[rank]
    if plan.zero >= 2:
        if plan.zero == 2 or plan.block_container is None:
            return params * prec.compute_bytes
        return (stage.root_params + 2 * stage.largest_block_params / plan.tp) * prec.compute_bytes
    copies = stage.per_tp_rank("saved_param_copy_bytes", plan.tp) if prec.autocast else 0.0
    buckets = params * prec.param_bytes if plan.dp > 1 else 0.0  # DDP: a copy of every gradient, kept
    return buckets + copies


class RankStates(NamedTuple):
    """A rank's model states (:func:`_model_states`' breakdown) and the gradients that exist only
    while backward runs, beyond the sharded ones (:func:`estimate_unsharded_gradients`): the head's
    and one block unit's."""

    states: MemoryBreakdown
    head_grads: float
    unit_grads: float


class RankActivations(NamedTuple):
    """A rank's activations at the end of its forward (with a pipeline stage's kept outputs:
    :func:`_stage_outputs`); ``loss_grads``: the gradients the loss's
    backward makes of the head's output (on the last stage); ``released``: the activations its
    backward frees first (the head's); ``block``: the largest block's alive while that block's
    backward runs, for one micro-batch (as rebuilt under full checkpointing); ``rebuilt``: that
    block's under full checkpointing, which the backward holds to its end (0 without it)."""

    total: float
    loss_grads: float
    released: float
    block: float
    rebuilt: float


def estimate_unsharded_gradients(profile: ModelProfile, plan: Plan, layout: StateLayout, *,
                                 rank: int = 0) -> tuple[float, float]:
    """Gradient bytes FSDP2 (ZeRO-2/3, torch's runtime) holds unsharded while backward runs,
    beyond the sharded gradients: the root unit's head gradients, reduced only when the root's
    backward ends (after the embedding's), and one block unit's, which the reduce-scatter then
    copies into its input (two of them for a moment). Without FSDP, none: DDP reduces into its
    buckets (:func:`estimate_buffers`); nor counted for a model without blocks (one unit)."""
    if plan.zero < 2 or not layout.frees_gradients or plan.block_container is None:
        return 0.0, 0.0
    stage = rank_stages(profile, plan)[rank]
    head = sum(s.num_params for s in stage.segments if s is profile.head)
    return layout.grads * head, layout.grads * stage.largest_block_params / plan.tp


def estimate_memory(profile: ModelProfile, workload: Workload, plan: Plan, *, runtime: str = "torch",
                    framework: float = 0.0) -> MemoryBreakdown:
    """Peak bytes per rank on the most loaded rank, term by term: every pipeline rank that may
    be the most loaded is costed (:func:`~stratagem.advisor.cost.stages.candidate_ranks`), the
    fullest reported. ``framework``: :func:`framework_bytes` of the cluster."""
    layout = state_layout(plan.precision, workload.optimizer, runtime=runtime)
    ranks = zip(_candidates_states(profile, plan, layout), _candidates_activations(profile, plan))
    apart = not gradients_meet_activations(plan, layout)
    states, activations = max(ranks, key=lambda rank: _fullness(*rank, framework, apart))
    return _with_activations(states, activations, framework, apart)


def gradients_meet_activations(plan: Plan, layout: StateLayout) -> bool:
    """Whether a step's peak holds its gradients and its activations together. They meet where the
    runtime keeps gradient buffers (``layout.frees_gradients`` false), and where a step runs
    several forwards into the same gradients: gradient accumulation, and a pipeline's
    micro-batches. Otherwise the gradients are None through the forward (``zero_grad(set_to_none=
    True)``, torch's default) and come during backward as the activations they come from are freed:
    the peak is the end of the forward (activations, no gradients) or of the backward (gradients,
    activations freed), whichever holds more."""
    return not layout.frees_gradients or plan.grad_accum > 1 or plan.pp > 1


def framework_bytes(cluster: Cluster) -> float:
    """Memory each rank's training process takes beyond the tensors of its plan (kernel
    libraries' workspaces and caches, the autograd engine, allocator bookkeeping), bytes: as
    ``stratagem calibrate`` measured it on the cluster (``NodeSpec.framework_bytes``); 0
    uncalibrated, where the device reserve (:data:`RESERVED_BYTES`) stands for it."""
    return cluster.node.framework_bytes or 0.0


def estimate_rank_memory(profile: ModelProfile, plan: Plan, layout: StateLayout, *, rank: int,
                         framework: float = 0.0) -> MemoryBreakdown:
    """Peak bytes of pipeline rank ``rank``, term by term (``framework``: :func:`framework_bytes`)."""
    return _with_activations(_model_states(profile, plan, layout, rank), _rank_activations(profile, plan, rank=rank),
                             framework, not gradients_meet_activations(plan, layout))


def _model_states(profile: ModelProfile, plan: Plan, layout: StateLayout, rank: int) -> RankStates:
    """Every term of rank ``rank`` but activations and framework: what micro-batching leaves alone."""
    params = estimate_params_per_rank(profile, plan, rank=rank)
    states = MemoryBreakdown(
        parameters=estimate_parameters(params, plan, layout),
        gradients=estimate_gradients(params, plan, layout),
        optimizer=estimate_optimizer(params, plan, layout),
        activations=0.0,
        buffers=estimate_buffers(profile, plan, params, rank=rank),
        host=estimate_offloaded(params, plan, layout),
    )
    return RankStates(states, *estimate_unsharded_gradients(profile, plan, layout, rank=rank))


def _alive_at_peak(states: RankStates, activations: RankActivations, apart: bool) -> tuple[float, float]:
    """Gradients and activations at the peak. Where they meet (not ``apart``:
    :func:`gradients_meet_activations`), all of both, with the unsharded ones
    (:class:`RankStates`), and the loss's gradients (:class:`RankActivations`). Otherwise the
    fullest of three moments: the loss's backward (every activation and the gradients of the
    head's output, no parameter gradient yet); the end of the first block's backward (the
    activations but the head's; the head's gradients and the block unit's twice, as the
    reduce-scatter copies them, while the block's activations are freed: a block unit's
    gradients grow as its activations go); the backward's end (every gradient, and the block
    full checkpointing rebuilt last, likewise)."""
    unit = states.unit_grads
    unsharded = states.head_grads + 2 * unit
    if not apart:
        return states.states.gradients + unsharded, activations.total + activations.loss_grads
    moments = ((0.0, activations.total + activations.loss_grads),
               (unsharded, activations.total - activations.released - min(activations.block, unit)),
               (states.states.gradients + unsharded, activations.rebuilt - min(activations.rebuilt, unit)))
    return max(moments, key=sum)


def _with_activations(states: RankStates, activations: RankActivations, framework: float,
                      apart: bool) -> MemoryBreakdown:
    """:func:`_model_states`' breakdown with the rank's activations and the framework's bytes, as
    alive at the peak (:func:`_alive_at_peak`)."""
    gradients, alive = _alive_at_peak(states, activations, apart)
    kept = states.states
    return MemoryBreakdown(parameters=kept.parameters, gradients=gradients, optimizer=kept.optimizer,
                           activations=alive, buffers=kept.buffers, framework=framework, host=kept.host)


def _fullness(states: RankStates, activations: RankActivations, framework: float, apart: bool) -> tuple[float, float]:
    """The device and host bytes of :func:`_with_activations`' breakdown, without building it:
    the fuller rank has the larger total, then the larger host share."""
    gradients, alive = _alive_at_peak(states, activations, apart)
    kept = states.states
    return device_bytes(kept.parameters, gradients, kept.optimizer, alive, kept.buffers, framework), kept.host


@by_identity_and_fields(*PARTITION_FIELDS, "tp", "zero", "dp_shard", "dp_replicate", "offload", "precision",
                        "block_container")
def _candidates_states(profile: ModelProfile, plan: Plan, layout: StateLayout) -> tuple[RankStates, ...]:
    """:func:`_model_states` of each of :func:`candidate_ranks`, costed once for the plans of a
    layout: they differ only in micro-batching."""
    return tuple(_model_states(profile, plan, layout, r) for r in candidate_ranks(profile, plan))


@by_identity_and_fields(*PARTITION_FIELDS, "pp_schedule", "microbatches", "micro_batch_size", "tp",
                        "sequence_parallel", "activation_checkpointing")
def _candidates_activations(profile: ModelProfile, plan: Plan) -> tuple[RankActivations, ...]:
    """:func:`_rank_activations` of each of :func:`candidate_ranks`, costed once for the plans
    that differ only in what activations do not depend on (ZeRO stage, data-parallel degrees,
    offload)."""
    return tuple(_rank_activations(profile, plan, rank=r) for r in candidate_ranks(profile, plan))
