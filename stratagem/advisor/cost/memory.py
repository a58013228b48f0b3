"""Memory per rank for a Plan: model states sharded by ZeRO/TP/PP, activations, buffers, and
the moment of the step at which they peak together.

Pipeline ranks differ: the first keeps the most micro-batches in flight, and the partition
(``Plan.stage_blocks``) gives each rank its own blocks, the first the embedding and the last the
head. :func:`estimate_memory` costs every rank that may be the most loaded
(:func:`~stratagem.advisor.cost.stages.candidate_ranks`), each through its
:class:`~stratagem.advisor.cost.rank_view.RankView`, and reports the fullest. Every term is a
named ``estimate_*`` function returning bytes for one rank; :func:`estimate_rank_memory` is their
visible sum. The search costs thousands of plans that share most of them: :func:`estimate_memory`
costs the model states once per layout and activations once per what they depend on
(:func:`~stratagem.advisor.memo.by_identity_and_plan`), exactly as :func:`estimate_rank_memory` would.

Sources: model states — Rajbhandari et al. 2020 (ZeRO), §3 and Table 1; activations —
:mod:`~stratagem.advisor.cost.activations`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

from stratagem.advisor.cost.activations import RankActivations, rank_activations
from stratagem.advisor.cost.buffers import Transient, ddp_bucket_bytes, estimate_buffers
from stratagem.advisor.cost.estimate import MemoryBreakdown, device_bytes
from stratagem.advisor.cost.optimizer import runs_foreach
from stratagem.advisor.cost.rank_view import RankView, rank_view
from stratagem.advisor.cost.stages import candidate_ranks
from stratagem.advisor.hardware import Cluster
from stratagem.advisor.memo import by_identity, by_identity_and_plan
from stratagem.advisor.profile.model_profile import ModelProfile
from stratagem.plan import Plan, Workload
from stratagem.plan.precision import get_precision

# Device memory kept free: the CUDA context (~0.5 GiB on H100, CUDA 12), NCCL's buffers (up to
# ~1 GiB per communicator set) and allocator fragmentation. Estimate; `calibrate` measures the
# framework's own bytes apart (framework_bytes).
RESERVED_BYTES = 2 * 2**30
RESERVED_FRACTION = 0.05

# Host RAM per byte of device memory on a catalog node whose RAM is unknown: DGX A100/H100 carry
# 2 TiB for 8 × 40-80 GB GPUs, cloud 8-GPU instances 1.1-2 TiB (vendor specifications).
HOST_MEMORY_PER_DEVICE_MEMORY = 2.0

# Share of host RAM offloaded states may take; the OS, data loaders and pinned buffers need the rest. Estimate.
HOST_USABLE_FRACTION = 0.8

# What model states never depend on: a layout's plans differ only in these (checkpointing decides
# which autocast weight copies a step keeps: _autocast_copies).
_NOT_IN_MODEL_STATES = ("micro_batch_size", "microbatches", "grad_accum", "pp_schedule", "sequence_parallel")
# What activations never depend on: the data-parallel sharding, offload, precision (profiled in it).
# Not the TP layout: a loss on the logits' vocabulary shards (vocab_loss) divides the loss's tensors.
_NOT_IN_ACTIVATIONS = ("dp_replicate", "dp_shard", "zero", "offload", "precision", "grad_accum",
                       "block_container")


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
    step_temporaries: float = 0.0  # bytes per parameter the optimizer's step allocates at once (foreach)


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
    # torch.optim's foreach AdamW (its default on GPUs) holds sqrt(exp_avg_sq) for every parameter
    # at once, one state's bytes: 20 bytes per fp32 parameter at its step against 16 (MemTracker,
    # bench/fake_peak.py); foreach SGD with momentum updates in place; DeepSpeed's fused Adam too.
    temporaries = prec.param_bytes if optimizer == "adamw" and not deepspeed else 0.0
    return StateLayout(weights=weights, grads=grads, optimizer=states, zero2_shards_weights=not deepspeed,
                       frees_gradients=not deepspeed, step_temporaries=temporaries)


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


def estimate_params_per_rank(view: RankView) -> float:
    """Parameters the rank holds before ZeRO sharding: its blocks divided over TP, the embedding
    and head too where the layout splits the vocabulary, the rest whole
    (:meth:`~stratagem.advisor.cost.stages.Stage.per_tp_rank`)."""
    return view.per_tp_rank("num_params")


def estimate_offloaded(params: float, plan: Plan, layout: StateLayout) -> float:
    """Model states held in host memory, bytes per rank: the rank's shard of gradients and
    optimizer states (``optimizer``), and of the weights too (``params``) — FSDP2's
    CPUOffloadPolicy, ZeRO-Offload (Ren et al. 2021). ``params``: the rank's before sharding."""
    if not plan.offloads:
        return 0.0
    per_param = layout.grads + layout.optimizer + (layout.weights if plan.offloads_parameters else 0)
    return per_param * params / plan.dp_shard


def estimate_parameters(params: float, plan: Plan, layout: StateLayout) -> float:
    """Weights kept between steps, bytes per rank (``params``: the rank's before sharding):
    sharded over dp_shard by ZeRO-3 (ZeRO §3, P_os+g+p), and by ZeRO-2 where the runtime
    gathers them for the step (``layout.zero2_shards_weights``; the gathered copy is a buffer)."""
    sharded = plan.shards_parameters or (plan.shards_gradients and layout.zero2_shards_weights)
    shard = plan.dp_shard if sharded else 1
    if plan.offloads_parameters:
        return 0.0
    return layout.weights * params / shard


def estimate_gradients(params: float, plan: Plan, layout: StateLayout) -> float:
    """Gradients, bytes per rank: sharded over dp_shard from ZeRO-2 (ZeRO §3, P_os+g)."""
    if plan.offloads:
        return 0.0  # offloaded shards are reduced straight to host memory
    shard = plan.dp_shard if plan.shards_gradients else 1
    return layout.grads * params / shard


def estimate_optimizer(params: float, plan: Plan, layout: StateLayout) -> float:
    """Optimizer states, bytes per rank: sharded over dp_shard from ZeRO-1 (ZeRO §3, P_os)."""
    if plan.offloads:
        return 0.0
    shard = plan.dp_shard if plan.shards_optimizer else 1
    return layout.optimizer * params / shard


class RankStates(NamedTuple):
    """A rank's model states (:func:`_model_states`' breakdown) and the gradients that exist only
    while backward runs, beyond the sharded ones (:func:`estimate_unsharded_gradients`): those held,
    the unit's being reduced and its copy for the reduce-scatter; the input embedding's beyond
    the rank's rows, for a moment at the backward's end (:func:`estimate_embedding_gradient`); the
    root unit's as it is reduced last, and its shard they make (:func:`estimate_root_reduce`);
    the buffers moment by moment (``states.buffers``: the most of them)."""

    states: MemoryBreakdown
    transient: Transient
    held_grads: float
    unit_grads: float
    unit_copy: float  # the reduce-scatter's copy of the unit's gradients (a copying backend's own too)
    embedding_grads: float = 0.0
    root_reduce: float = 0.0
    root_shard: float = 0.0
    step_temporaries: float = 0.0  # the optimizer step's (estimate_step_bytes)
    step_buffers: float = 0.0  # the buffers that outlive the backward (estimate_step_bytes)
    first_block_grads: float = 0.0  # of the gradients, the rank's first block's, which its backward makes last
    grads_per_param: float = 0.0  # the gradient bytes on the rank of one of a block's parameters


def estimate_unsharded_gradients(view: RankView, layout: StateLayout, *,
                                 collectives_copy: bool = False) -> tuple[float, float, float]:
    """Gradient bytes FSDP2 holds unsharded while backward runs, beyond the sharded gradients:
    ``(held, unit, copy)``, those held while a unit's are reduced, that unit's, and the copy of
    them the reduce-scatter takes (for a moment all three). Autograd makes them in the dtype of
    the parameters FSDP gathered (the compute dtype under ``*-mixed``), and the reduce-scatter
    copies a unit's into one buffer in the reduce dtype, the sharded gradients' (fp32 under
    ``*-mixed``; torch's ``foreach_reduce``), before it frees them; a backend whose
    reduce-scatter holds its input again while it runs (``collectives_copy``:
    :func:`collectives_copy`) holds that copy twice. Each block unit is reduced as
    its backward ends, the root unit's gradients (the head's) only when the root's backward ends,
    after the embedding's; a model without block units is one unit, reduced at the end. Under a
    pipeline, torch's schedule reduces nothing until the last micro-batch's backward has run
    (``set_requires_gradient_sync(False)``, then ``perform_reduce_grad``): every unit's gradients
    are held through the step, accumulated in the reduce dtype, and copied for reducing only once
    the activations are freed. Without FSDP, none: DDP reduces into its buckets
    (:func:`estimate_buffers`)."""
    plan = view.plan
    if not plan.uses_fsdp or not layout.frees_gradients:
        return 0.0, 0.0, 0.0
    stage = estimate_params_per_rank(view)
    if plan.pp > 1:
        return layout.grads * stage, 0.0, 0.0
    unsharded = get_precision(plan.precision).compute_bytes
    copies = reduce_scatter_copies(collectives_copy)
    if view.one_fsdp_unit:
        return 0.0, unsharded * stage, copies * layout.grads * stage
    head = sum(s.num_params for s in view.head)
    if view.head and "vocab_head" in plan.vocab_tp_styles:
        head -= view.stage.vocab_shares.get("vocab_head", {}).get("num_params", 0) * (1 - 1 / plan.tp)
    block = view.stage.largest_block_params / plan.tp
    return unsharded * head, unsharded * block, copies * layout.grads * block


def estimate_root_reduce(view: RankView, layout: StateLayout, *,
                         collectives_copy: bool = False) -> tuple[float, float]:
    """``(reduce, shard)``: what FSDP2 holds beyond the sharded gradients as it reduces the root
    unit (the embedding's and head's gradients), the backward's last moment where the blocks are
    units of their own: the root's gradients unsharded, in the dtype of the parameters it gathered,
    and their copy in the reduce dtype (twice where the backend's reduce-scatter copies its input:
    :func:`collectives_copy`); and the root's shard of the sharded gradients, which this reduction
    makes (until then absent, unless an earlier micro-batch made it; none on the device where the
    plan offloads the sharded gradients, :func:`estimate_gradients`). The root's parameters are
    resharded before its gradients are reduced (``FSDPParamGroup.post_backward``). Measured on
    fake H100 ranks (``bench/fake_parallel_peak.py``, Llama 3 8B ``fsdp8 zero3 ckpt=full``): the
    peak held exactly this, 20.34 GiB, which the model put at 19.52 without the moment."""
    plan = view.plan
    if not plan.uses_fsdp or not layout.frees_gradients or plan.pp > 1 or view.one_fsdp_unit:
        return 0.0, 0.0
    root = view.outside_per_tp_rank("num_params")
    copies = reduce_scatter_copies(collectives_copy)
    reduce = root * (get_precision(plan.precision).compute_bytes + copies * layout.grads)
    return reduce, 0.0 if plan.offloads else root * layout.grads / plan.dp_shard


def reduce_scatter_copies(collectives_copy: bool) -> int:
    """Copies of a unit's gradients FSDP2's reduce-scatter holds beyond them: its input buffer, and
    the backend's own copy of that input where its collectives copy (:func:`collectives_copy`)."""
    return 2 if collectives_copy else 1


def estimate_step_bytes(view: RankView, params: float, layout: StateLayout, *, on_gpu: bool) -> tuple[float, float]:
    """Bytes beyond the model states while the optimizer steps (``params``: the rank's before
    sharding): the step's temporaries, over the rank's optimizer shard where torch.optim runs its
    ``foreach`` path (:func:`~stratagem.advisor.cost.optimizer.runs_foreach`; ``on_gpu``: the
    profile counts a GPU's kernels), else those of the largest tensor it steps
    (:func:`largest_stepped_tensor`), none on the device where the plan offloads the step; and the
    buffers that outlive the backward: DDP's gradient buckets (FSDP's gathered units and
    autocast's weight copies are gone by then)."""
    plan = view.plan
    if runs_foreach(plan, on_accelerator=on_gpu):
        temporaries = layout.step_temporaries * params / (plan.dp_shard if plan.shards_optimizer else 1)
    else:  # AdamW's denominator, `(exp_avg_sq.sqrt() / bias_correction2_sqrt)`, holds the root and the
        # quotient at once: two of foreach's one state per element (torch/optim/adam.py, _single_tensor_adam)
        temporaries = 0.0 if plan.offloads else 2 * layout.step_temporaries * largest_stepped_tensor(view)
    return temporaries, ddp_bucket_bytes(plan, params)


def largest_stepped_tensor(view: RankView) -> float:
    """Elements of the largest parameter tensor the rank's optimizer steps: TP splits the blocks'
    tensors (their norms' are smaller than their Linears'), and the embedding's table and head's
    weight where the plan splits the vocabulary (``Plan.vocab_tp_styles``); FSDP shards each
    tensor over ``dp_shard``, where ZeRO-1 steps whole ones."""
    plan = view.plan
    split = {"embed": "vocab_embedding" in plan.vocab_tp_styles, "head": "vocab_head" in plan.vocab_tp_styles}
    largest = max((s.largest_tensor_params / (plan.tp if split.get(s.kind, True) else 1)
                   for s in view.stage.segments), default=0.0)
    return largest / plan.dp_shard if plan.uses_fsdp else largest


def estimate_embedding_gradient(view: RankView, layout: StateLayout) -> float:
    """Bytes of the input embedding's gradient beyond the rank's rows, alive for a moment at the end
    of backward where TP splits the vocabulary: DTensor computes the whole table's gradient on every
    rank, which the rank then cuts to its rows (docs/design.md, "Tensor parallelism"). Autograd
    makes it in the dtype of the table the forward read: under FSDP the gathered one's (the compute
    dtype under ``*-mixed``), as :func:`estimate_unsharded_gradients` makes a unit's."""
    plan = view.plan
    share = view.stage.vocab_shares.get("vocab_embedding")
    if share is None or plan.tp == 1 or "vocab_embedding" not in plan.vocab_tp_styles:
        return 0.0
    made = get_precision(plan.precision).compute_bytes if plan.uses_fsdp else layout.grads
    return made * share["num_params"] * (1 - 1 / plan.tp)


def estimate_memory(profile: ModelProfile, workload: Workload, plan: Plan, *, runtime: str = "torch",
                    cluster: Cluster | None = None) -> MemoryBreakdown:
    """Peak bytes per rank on the most loaded rank, term by term: every pipeline rank that may be
    the most loaded is costed, the fullest reported, from the profile of what the plan computes
    (``ModelProfile.computed_by``). ``cluster``: what its ranks' processes take beyond the tensors
    (:func:`framework_bytes`) and whether its collectives copy (:func:`collectives_copy`); None
    for neither."""
    profile = profile.computed_by(plan)
    layout = state_layout(plan.precision, workload.optimizer, runtime=runtime)
    framework, copying = _cluster_terms(cluster)
    ranks = zip(_candidates_states(profile, plan, layout, copying), _candidates_activations(profile, plan))
    meet = gradients_meet_activations(plan, layout)
    states, activations = max(ranks, key=lambda rank: _fullness(*rank, framework, meet))
    return _with_activations(states, activations, framework, meet)


def gradients_meet_activations(plan: Plan, layout: StateLayout) -> bool:
    """Whether gradients are there at every moment of a rank's step, before its backward makes
    them: where the runtime keeps gradient buffers (``layout.frees_gradients`` false), and where a
    step runs several forwards into the same gradients (accumulation: the earlier micro-batches'
    reduced, FSDP's sharded). Otherwise the gradients are None through the forward
    (``zero_grad(set_to_none=True)``) and come during backward as the activations they come from
    are freed, unless a pipeline rank runs a forward after its first backward
    (:func:`_alive_at_peak`)."""
    return not layout.frees_gradients or plan.grad_accum > 1


def framework_bytes(cluster: Cluster) -> float:
    """Memory each rank's training process takes beyond its plan's tensors (kernel libraries'
    workspaces, the autograd engine, allocator bookkeeping), bytes: as ``stratagem calibrate``
    measured it (``NodeSpec.framework_bytes``); 0 uncalibrated, where :data:`RESERVED_BYTES` stands."""
    return cluster.node.framework_bytes or 0.0


def _cluster_terms(cluster: Cluster | None) -> tuple[float, bool]:
    """:func:`framework_bytes` and :func:`collectives_copy` of ``cluster``; none of either without one."""
    return (framework_bytes(cluster), collectives_copy(cluster)) if cluster else (0.0, False)


def collectives_copy(cluster: Cluster) -> bool:
    """Whether the cluster's collectives hold a second copy of what they move while they run:
    gloo's (CPU ranks) do, an all-gather its output, a reduce-scatter its input (two ranks, 64 MiB
    fp32: 127.7 and 65.7 MiB beyond the tensors, ``bench/gloo_collective_memory.py``); NCCL's
    work in the tensors given them, beside a fixed buffer of their own."""
    return cluster.backend == "gloo"


def estimate_rank_memory(profile: ModelProfile, plan: Plan, layout: StateLayout, *, rank: int,
                         cluster: Cluster | None = None) -> MemoryBreakdown:
    """Peak bytes of pipeline rank ``rank``, term by term (``cluster``: as :func:`estimate_memory`)."""
    view = rank_view(profile.computed_by(plan), plan, rank)
    framework, copying = _cluster_terms(cluster)
    states = _model_states(view, layout, on_gpu=profile.kernels == "gpu", collectives_copy=copying)
    return _with_activations(states, rank_activations(view), framework, gradients_meet_activations(plan, layout))


def _model_states(view: RankView, layout: StateLayout, *, on_gpu: bool, collectives_copy: bool) -> RankStates:
    """Every term of the rank but activations and framework: what micro-batching leaves alone.
    ``on_gpu``: the profile counts a GPU's kernels (:func:`estimate_step_bytes`); ``collectives_copy``:
    :func:`collectives_copy`."""
    plan = view.plan
    params = estimate_params_per_rank(view)
    transient = estimate_buffers(view, params, collectives_copy=collectives_copy)
    states = MemoryBreakdown(
        parameters=estimate_parameters(params, plan, layout),
        gradients=estimate_gradients(params, plan, layout),
        optimizer=estimate_optimizer(params, plan, layout),
        activations=0.0,
        buffers=max(transient),
        host=estimate_offloaded(params, plan, layout),
    )
    first_block = view.stage.blocks[0].num_params / plan.tp if view.stage.blocks else 0.0
    return RankStates(states, transient, *estimate_unsharded_gradients(view, layout, collectives_copy=collectives_copy),
                      estimate_embedding_gradient(view, layout),
                      *estimate_root_reduce(view, layout, collectives_copy=collectives_copy),
                      *estimate_step_bytes(view, params, layout, on_gpu=on_gpu),
                      first_block_grads=estimate_gradients(first_block, plan, layout),
                      grads_per_param=estimate_gradients(1 / plan.tp, plan, layout))


def _alive_at_peak(states: RankStates, activations: RankActivations, meet: bool) -> tuple[float, float, float]:
    """Gradients, activations and buffers (:class:`Transient`) at the peak: the fullest of the
    moments of the rank's first backward and the forward's end before it (every activation): the
    loss's backward (every activation and the gradients of the head's output, no parameter
    gradient yet); the head's backward as it starts (one gradient of the head's output); the
    first block's backward (the rank's last block: the activations but the head's, what the block
    rebuilds and, in its middle, the gradients of its activations, ``BlockBackward.held``; at its
    end the gradients held and the block unit's with the reduce-scatter's copy of them, while the
    block's activations are freed); the last block's (the rank's first: every gradient, in its
    middle but its own, with what the embedding keeps and what the block keeps, rebuilds and
    holds; at its end every gradient, the block's activations freed likewise, its input where a
    full checkpoint keeps it); between the two, where blocks differ, those that begin or end a run
    of identical blocks (``RankActivations.middle``: every gradient but those of the blocks up to
    it, what they keep, what it rebuilds and holds); the embedding's backward after the blocks'
    (every gradient, and the whole table's gradient of a vocabulary split); the root unit's reduction, the last (every
    gradient but the root's shard, which it makes, unless kept from an earlier micro-batch, and the
    root's unsharded with their copy, its parameters resharded). The rank's other in-flight micro-batches'
    activations are held through all of them (``RankActivations.others``). Where gradients meet
    activations (:func:`gradients_meet_activations`), the gradients kept from the step's earlier
    micro-batches or in the runtime's buffers are there at every moment; where a pipeline rank
    runs forwards after its first backward (``others`` None), every in-flight micro-batch's
    activations meet every gradient, the unsharded ones and the loss's, with the most buffers."""
    unit = states.unit_grads  # the block's activations go as its gradients come, up to their bytes
    unsharded = states.held_grads + states.unit_grads + states.unit_copy
    at, every = states.transient, states.states.gradients
    embedding = (every + unsharded + states.embedding_grads, (activations.others or 0.0) + activations.before,
                 at.embedding)
    root = (every - (0.0 if meet else states.root_shard) + states.root_reduce, activations.others or 0.0, 0.0)
    if activations.others is None:
        return max((every + unsharded, activations.total + activations.loss_grads, max(at)), embedding, root, key=sum)
    kept = every if meet else 0.0
    forward = activations.total - activations.rebuilt  # no block is rebuilt before the backward reaches it
    first, last = activations.first, activations.last
    moments = ((kept, forward + activations.loss_inputs, at.forward),
               (kept, forward + activations.loss_grads, at.loss),
               (kept, forward + activations.output_grad, at.head),
               (kept + states.held_grads, forward - activations.released + first.rebuilt + first.held, at.first_block),
               (kept + unsharded, forward - activations.released + first.rebuilt - min(activations.block, unit),
                at.first_block),
               (every - states.first_block_grads + states.held_grads,
                activations.others + activations.before + last.kept + last.rebuilt + last.held, at.last_block),
               (every + unsharded,
                activations.others + activations.before + last.input + last.rebuilt - min(last.rebuilt, unit),
                at.last_block),
               *((max(kept, every - states.grads_per_param * params) + states.held_grads,
                  activations.others + alive, at.first_block + copies) for alive, params, copies in activations.middle),
               embedding, root)
    return max(moments, key=sum)


def _peak(states: RankStates, activations: RankActivations, meet: bool) -> tuple[float, float, float, float]:
    """``(gradients, optimizer, activations, buffers)`` at the rank's peak: the fuller of the
    backward's (:func:`_alive_at_peak`, with the model states) and the optimizer step's (every
    gradient, the step's temporaries beside the states, no activation, the buffers that outlive
    the backward)."""
    kept = states.states
    gradients, alive, buffers = _alive_at_peak(states, activations, meet)
    step = (kept.gradients, kept.optimizer + states.step_temporaries, 0.0, states.step_buffers)
    return max((gradients, kept.optimizer, alive, buffers), step, key=sum)


def _with_activations(states: RankStates, activations: RankActivations, framework: float,
                      meet: bool) -> MemoryBreakdown:
    """:func:`_model_states`' breakdown with the rank's activations and the framework's bytes, as
    alive at the peak (:func:`_peak`)."""
    gradients, optimizer, alive, buffers = _peak(states, activations, meet)
    kept = states.states
    return MemoryBreakdown(parameters=kept.parameters, gradients=gradients, optimizer=optimizer,
                           activations=alive, buffers=buffers, framework=framework, host=kept.host)


def _fullness(states: RankStates, activations: RankActivations, framework: float, meet: bool) -> tuple[float, float]:
    """The device and host bytes of :func:`_with_activations`' breakdown, without building it:
    the fuller rank has the larger total, then the larger host share."""
    kept = states.states
    return device_bytes(kept.parameters, *_peak(states, activations, meet), framework), kept.host


@by_identity_and_plan(ignoring=_NOT_IN_MODEL_STATES)
def _candidates_states(profile: ModelProfile, plan: Plan, layout: StateLayout,
                       collectives_copy: bool) -> tuple[RankStates, ...]:
    """:func:`_model_states` of each of :func:`candidate_ranks`, once for the plans of a layout."""
    return tuple(_model_states(rank_view(profile, plan, r), layout, on_gpu=profile.kernels == "gpu",
                               collectives_copy=collectives_copy) for r in candidate_ranks(profile, plan))


@by_identity_and_plan(ignoring=_NOT_IN_ACTIVATIONS)
def _candidates_activations(profile: ModelProfile, plan: Plan) -> tuple[RankActivations, ...]:
    """:func:`~stratagem.advisor.cost.activations.rank_activations` of each of :func:`candidate_ranks`,
    once for the plans that differ only in what activations do not depend on."""
    return tuple(rank_activations(rank_view(profile, plan, r)) for r in candidate_ranks(profile, plan))
