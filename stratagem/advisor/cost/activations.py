"""Activation memory of one pipeline rank: what its blocks keep for backward per micro-batch,
times the micro-batches its schedule holds, after checkpointing and TP/SP; the outputs a pipeline
stage keeps; and the gradients the loss's backward makes of the logits.

Sources: Korthikanti et al. 2022, §4 (eq. 1–5) and §4.2.3 (in-flight micro-batches per schedule).
"""

from __future__ import annotations

from typing import NamedTuple

from stratagem.advisor.cost.buffers import recomputed_copies
from stratagem.advisor.cost.rank_view import RankView
from stratagem.advisor.cost.stages import Stage
from stratagem.advisor.profile.model_profile import SegmentProfile, policy_field
from stratagem.plan import Plan

# Gradients of the logits the loss's backward holds at once (cross-entropy: its input's and the
# head's output's), each the logits' size in the loss's dtype: measured by bench/gpu_phases.py.
LOSS_GRADIENT_COPIES = 2
# The same on the logits' vocabulary shards (vocab_loss): torch's loss_parallel computes the
# gradient as (grad_input + exp(x)) * grad_output, its zeros-filled grad_input, the exponentials and
# their sum alive at once (_nll_loss_and_log_softmax_backward, torch/distributed/tensor/parallel/
# loss.py in torch 2.13), each a shard of the logits in the loss's dtype.
LOSS_PARALLEL_GRADIENT_COPIES = 3
# What its forward holds beyond a fused log_softmax's input and output: the shifted logits, beside
# their exponentials (freed once summed) and then beside the log-probabilities (its _log_softmax,
# the same file).
LOSS_PARALLEL_TEMPORARIES = 1


class BlockBackward(NamedTuple):
    """One block's backward on a rank, for one micro-batch: what the block keeps from the forward
    (:func:`estimate_block_activations`), what its backward rebuilds (:func:`_rebuilt`), what it
    holds at most beyond both: the gradients of its activations as it makes them (:func:`_held`),
    and ``input``: the input a full checkpoint keeps, which its rerun reads, to the backward's end."""

    kept: float = 0.0
    rebuilt: float = 0.0
    held: float = 0.0
    input: float = 0.0


class RankActivations(NamedTuple):
    """A rank's activations at the end of its forward (with a pipeline stage's kept outputs);
    ``loss_grads``: the gradients the loss's backward makes of the head's output (on the last
    stage); ``released``: the activations its backward frees first (the head's); ``block``: those of
    the rank's last block, the first its backward reaches, alive while that block's backward runs
    (as rebuilt under full checkpointing); ``rebuilt``: the most a block's backward rebuilds
    (:func:`_rebuilt`; 0 without checkpointing), in ``total``; ``first`` and ``last``: the backward
    of the rank's last block, which it reaches first, and of its first, which it holds to its end
    (:class:`BlockBackward`; blocks differ: a convolutional network's first block holds its widest
    images, its last its smallest); ``before``: what the rank's embedding (what runs before the
    blocks) keeps, which its backward frees after every block's (a convolutional network's stem
    keeps its widest images); ``middle``: for each block between those two that begins or ends a
    run of identical ones, what its backward holds at its fullest, the parameters of the blocks up
    to it, whose gradients are yet to come, and the weight copies it recomputes beyond the rank's
    last block's (:func:`_middle_backwards`); ``others``: what the rank's other in-flight
    micro-batches hold while its first backward runs, where every forward precedes that backward
    (0 without a pipeline), None where a forward follows it (:func:`held_through_first_backward`);
    ``loss_inputs``: what the loss's forward holds beside what it saves (on the last stage:
    :func:`_loss_inputs`); ``output_grad``: the one gradient of the head's output, in its dtype,
    that the loss's backward leaves for the head's."""

    total: float
    loss_grads: float
    released: float
    block: float
    rebuilt: float
    others: float | None
    first: BlockBackward = BlockBackward()
    last: BlockBackward = BlockBackward()
    middle: tuple[tuple[float, float, float], ...] = ()
    before: float = 0.0
    loss_inputs: float = 0.0
    output_grad: float = 0.0


def estimate_block_activations(block: SegmentProfile, plan: Plan, *, scale: float,
                               checkpointing: str | None = None) -> float:
    """Bytes one block keeps for backward for one micro-batch (``scale`` = micro-batch size /
    profiled batch size), after checkpointing (the plan's, unless ``checkpointing`` is given),
    TP and SP (Korthikanti eq. 1–5). Without checkpointing it keeps :func:`saved_bytes`; a
    selective policy keeps what the profile measured a block checkpointed under it keeping (its
    input and the kept operators' outputs, eager). TP without SP leaves on each rank what the
    profile measured a split block keeping whole (eq. 2's replicated part, measured:
    :mod:`~stratagem.advisor.profile.tp_layout`; under a selective policy, of what the policy
    keeps), at most what the block keeps, and splits the rest;
    with SP, eq. 4 splits it all but, without checkpointing, the column Linears' inputs, which
    torch's SP all-gathers and autograd keeps so (Megatron-LM gathers them again in backward)."""
    checkpointing = checkpointing or plan.activation_checkpointing
    if checkpointing == "full":
        kept = block.input_bytes * scale  # eq. 5: only the block's input (2sbh)
        return kept / plan.tp if plan.sequence_parallel else kept
    if checkpointing == "none":
        saved = saved_bytes(block, plan) * scale
    else:
        saved = getattr(block, policy_field(checkpointing, "kept_bytes")) * scale
    if plan.tp == 1:
        return saved
    if not plan.sequence_parallel:  # eq. 2, of what the block keeps under its policy
        whole = getattr(block, "tp_replicated_bytes" if checkpointing == "none"
                        else policy_field(checkpointing, "tp_replicated_bytes"))
    elif checkpointing == "none":
        whole = block.tp_gathered_bytes  # eq. 4, but for the gathered inputs torch keeps
    else:
        whole = 0  # eq. 4: a policy keeps operators' outputs, and the gathered inputs are recomputed
    whole = min(saved, whole * scale)
    return whole + (saved - whole) / plan.tp


def saved_bytes(block: SegmentProfile, plan: Plan) -> int:
    """What ``block`` saves for backward at the profiled batch: as the profile measured it compiled
    where the plan compiles its blocks (:mod:`~stratagem.advisor.profile.compiled`), else eager."""
    return block.compiled_saved_bytes if plan.compile and block.compiled_saved_bytes else block.saved_bytes


def estimate_activations(view: RankView) -> float:
    """Activation bytes on the rank at the peak of its schedule: each of its stages' activations
    per micro-batch times the micro-batches that stage holds; under full checkpointing, plus the
    full activations of the one block its backward rebuilds at a time."""
    total = sum(held * _per_microbatch(stage, view.plan, scale=view.scale)
                for stage, held in zip(view.virtual, view.in_flight))
    return total + _rebuilt_block(view)


def rank_activations(view: RankView) -> RankActivations:
    """:func:`estimate_activations` of the rank and its stages' kept outputs, with the loss's
    gradients, what its backward frees first (the head's saved bytes, for one micro-batch), holds
    per block (a checkpointed block's as rebuilt: its full activations) and rebuilds."""
    plan, blocks = view.plan, view.stage.blocks
    block = 0.0 if not blocks else estimate_block_activations(
        blocks[-1], plan, scale=view.scale, checkpointing="none" if plan.checkpoints else None)
    first, last = ((_block_backward(b, plan, scale=view.scale) for b in (blocks[-1], blocks[0])) if blocks
                   else (BlockBackward(), BlockBackward()))
    before = view.scale * view.stage.embedding_sum("saved_bytes")
    logits, on_shards = view.scale * logits_share(plan), logits_share(plan) < 1
    gradients = logits * sum(_logits_gradient(s) for s in view.head)
    copies = LOSS_PARALLEL_GRADIENT_COPIES if on_shards else LOSS_GRADIENT_COPIES
    return RankActivations(estimate_activations(view) + _stage_outputs(view), loss_grads=copies * gradients,
                           released=view.scale * sum(_head_saved(s, plan) for s in view.head),
                           block=block, rebuilt=_rebuilt_block(view), others=held_through_first_backward(view),
                           first=first, last=last, middle=_middle_backwards(view, before), before=before,
                           loss_inputs=logits * sum(_loss_inputs(s) for s in view.head)
                           + (LOSS_PARALLEL_TEMPORARIES * gradients if on_shards else 0.0),
                           output_grad=logits * sum(s.output_bytes for s in view.head))


def logits_share(plan: Plan) -> float:
    """The share of the logits, and of the loss's tensors as wide as the vocabulary, that one TP
    rank holds: ``1 / tp`` where the loss runs on their vocabulary shards (``vocab_loss``: torch's
    ``loss_parallel``, whose decomposition holds :data:`LOSS_PARALLEL_TEMPORARIES` and
    :data:`LOSS_PARALLEL_GRADIENT_COPIES` of them), else all of them (``vocab_head`` gathers the
    logits)."""
    return 1 / plan.tp if "vocab_loss" in plan.vocab_tp_styles else 1.0


def _head_saved(head: SegmentProfile, plan: Plan) -> float:
    """What the head saves for backward on one TP rank: its tensors as wide as the vocabulary
    split as the logits are (:func:`logits_share`), the rest (its input, a final norm's) whole."""
    return head.saved_bytes - head.vocab_saved_bytes * (1 - logits_share(plan))


def _output_bytes(segment: SegmentProfile, plan: Plan) -> float:
    """A stage's last segment's output on one TP rank: the head's logits split as
    :func:`logits_share` says, a block's whole."""
    return segment.output_bytes * (logits_share(plan) if segment.kind == "head" else 1.0)


def held_through_first_backward(view: RankView) -> float | None:
    """Activation bytes the rank's other in-flight micro-batches hold while its first backward
    runs, where its schedule runs every forward before that backward (GPipe; 1F1B with no more
    micro-batches than the rank warms up: ``min(pp − rank, m) = m``): each one's blocks' and the
    stage output torch's stage keeps. 0 without a pipeline. None where a forward follows the first
    backward (1F1B's steady state, interleaved stages): the gradients then meet every in-flight
    micro-batch's activations."""
    plan = view.plan
    if plan.pp == 1:
        return 0.0
    if len(view.virtual) > 1 or view.in_flight[0] < plan.microbatches:
        return None
    stage = view.virtual[0]
    return (view.in_flight[0] - 1) * view.scale * (_per_microbatch(stage, plan, scale=1.0)
                                                    + _output_bytes(stage.segments[-1], plan))


def _rebuilt_block(view: RankView) -> float:
    """What a checkpointed block's backward rebuilds for one micro-batch, one block at a time, for
    the largest (:func:`_rebuilt`); 0 without checkpointing."""
    return max((_rebuilt(b, view.plan, scale=view.scale) for b, _ in view.stage.kinds), default=0.0)


def _middle_backwards(view: RankView, before: float) -> tuple[tuple[float, float, float], ...]:
    """For each of the rank's blocks but its first and last that begins or ends a run of identical
    blocks: the activations alive at its backward's fullest (``before``, what the embedding keeps;
    what every block up to it keeps; what it rebuilds and holds beyond that), the parameters of
    the blocks up to it and, where its backward recomputes it under autocast, its weight copies
    beyond the rank's last block's (:func:`~stratagem.advisor.cost.buffers.recomputed_copies`),
    which the buffers of that block's backward hold. As the backward goes from block to block it
    frees one block's activations and makes its gradients; along a run of identical blocks their
    sum changes by as much each time, so the fullest moment of a run is at one of its ends. Where
    a network's blocks differ (a convolutional network's stages: the last have the fewest
    activations and the most weights), the fullest can be inside: a ResNet-101's at the end of
    its third stage."""
    blocks, plan = view.stage.blocks, view.plan
    if len(view.stage.kinds) < 2:
        return ()
    kinds = [b.measurement for b in blocks]
    costs: dict[str, tuple[float, float, float]] = {}  # kind -> (kept, held beyond it at its fullest, copies)
    last_copies = recomputed_copies(view, blocks[-1])
    moments, kept, params = [], before, 0.0
    for i, block in enumerate(blocks):
        if kinds[i] not in costs:
            backward = _block_backward(block, plan, scale=view.scale)
            costs[kinds[i]] = (backward.kept, backward.rebuilt + backward.held,
                               recomputed_copies(view, block) - last_copies)
        block_kept, beyond, copies = costs[kinds[i]]
        kept += block_kept
        params += block.num_params
        if 0 < i < len(blocks) - 1 and (kinds[i - 1] != kinds[i] or kinds[i + 1] != kinds[i]):
            moments.append((kept + beyond, params, copies))
    return tuple(moments)


def _block_backward(block: SegmentProfile, plan: Plan, *, scale: float) -> BlockBackward:
    kept = estimate_block_activations(block, plan, scale=scale)
    return BlockBackward(kept, _rebuilt(block, plan, scale=scale), _held(block, plan, scale=scale),
                         input=kept if plan.recomputes_blocks else 0.0)


def _held(block: SegmentProfile, plan: Plan, *, scale: float) -> float:
    """The most ``block``'s backward holds for one micro-batch beyond what it keeps and rebuilds:
    the gradients of its activations as it makes them (``bwd_held_bytes``,
    :mod:`~stratagem.advisor.profile.backward_held`) or, under full checkpointing where more, its
    forward's rerun at its fullest: what that forward holds beyond what it saves
    (``fwd_held_bytes``, :mod:`~stratagem.advisor.profile.forward_held`) beside the gradient of the
    block's output, which waits for the rerun (a compiled block's rerun keeps its intermediates in
    its kernels). Of either a TP rank holds the share it keeps of the activations themselves."""
    whole = block.saved_bytes * scale
    share = estimate_block_activations(block, plan, scale=scale, checkpointing="none") / whole if whole else 1 / plan.tp
    held = block.bwd_held_bytes * scale * share
    if not plan.recomputes_blocks or (plan.compile and block.compiled_saved_bytes):
        return held
    output_grad = block.output_bytes * scale / (plan.tp if plan.sequence_parallel else 1)
    return max(held, block.fwd_held_bytes * scale * share + output_grad)


def _rebuilt(block: SegmentProfile, plan: Plan, *, scale: float) -> float:
    """What ``block``'s backward rebuilds for one micro-batch: under the plan's full checkpointing
    its full activations but the input it saves itself, which the rerun saves again from what the
    checkpoint kept, not a copy (``input_saved_bytes``); under a selective policy those beyond what
    the block kept (its recomputed operators' saved tensors); and what the model's own checkpoint
    of the block rebuilds (``rebuilt_bytes``, :mod:`~stratagem.advisor.profile.own_checkpoints`),
    split over the TP ranks with SP (eq. 4) and, as no run measured what TP without SP leaves
    whole of it, whole without."""
    split = plan.tp if plan.sequence_parallel else 1
    own = block.rebuilt_bytes * scale / split
    if plan.recomputes_blocks:
        full = estimate_block_activations(block, plan, scale=scale, checkpointing="none")
        return full - block.input_saved_bytes * scale / split + own
    if not plan.checkpoints_selectively:
        return own
    return own + max(0.0, estimate_block_activations(block, plan, scale=scale, checkpointing="none")
                     - estimate_block_activations(block, plan, scale=scale))


def _stage_outputs(view: RankView) -> float:
    """Bytes of the outputs the rank's pipeline stages keep beside their saved activations: torch's
    ``PipelineStage`` holds each in-flight micro-batch's output (the last stage's: the logits)
    until that micro-batch's backward starts from it. None without a pipeline."""
    if view.plan.pp == 1:
        return 0.0
    return view.scale * sum(held * _output_bytes(stage.segments[-1], view.plan)
                            for stage, held in zip(view.virtual, view.in_flight))


def _logits_gradient(head: SegmentProfile) -> int:
    """Bytes of one gradient of the logits as the loss's backward makes it: the largest tensor the
    head's backward writes (the loss's dtype: fp32 under autocast), at least the head's output."""
    return max(head.output_bytes, head.bwd_largest_output_bytes)


def _loss_inputs(head: SegmentProfile) -> int:
    """Bytes of the logits the loss's forward holds beside what it saves (the log-probabilities):
    the head's output, and where the loss computes in a wider dtype (fp32 under autocast) its copy
    of them in that dtype, as wide as one of its gradients (:func:`_logits_gradient`)."""
    widened = _logits_gradient(head)
    return widened + head.output_bytes if widened > head.output_bytes else widened


def _per_microbatch(stage: Stage, plan: Plan, *, scale: float) -> float:
    """Bytes one micro-batch leaves saved on ``stage``: its blocks', and the embedding's or
    head's (whole on every TP rank, but for the head's tensors as wide as the vocabulary where the
    loss runs on its shards: ``Stage.outside_per_tp_rank``)."""
    blocks = sum(n * estimate_block_activations(b, plan, scale=scale) for b, n in stage.kinds)
    return blocks + stage.outside_per_tp_rank("saved_bytes", plan.tp, plan.vocab_tp_styles) * scale
