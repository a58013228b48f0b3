"""What a rank holds beyond its model states and gradients at each moment of its step's peak
(:class:`Transient`): FSDP's gathered units, DDP's gradient buckets, autocast's weight copies.
:mod:`~stratagem.advisor.cost.memory` adds them to the moments it costs (docs/cost-model.md,
"Buffers")."""

from __future__ import annotations

from typing import NamedTuple

from stratagem.advisor.cost.rank_view import RankView
from stratagem.advisor.profile.model_profile import SegmentProfile
from stratagem.plan import Plan
from stratagem.plan.precision import get_precision

__all__ = ["Transient", "ddp_bucket_bytes", "estimate_buffers"]


class Transient(NamedTuple):
    """Bytes beyond the model states and gradients (:func:`estimate_buffers`) at each moment the
    rank's peak may be (:func:`~stratagem.advisor.cost.memory._alive_at_peak`): the forward's end,
    before the loss; the loss's backward; the head's backward as it starts, the loss's done; the
    first block's backward (the model's last block; the most, no moment of the forward holds
    more); the last block's (the model's first, as the backward ends); the embedding's, after the
    blocks'."""

    forward: float
    loss: float
    head: float
    first_block: float
    last_block: float
    embedding: float

    @classmethod
    def constant(cls, num_bytes: float) -> Transient:
        """The same bytes at every moment."""
        return cls(*(num_bytes,) * len(cls._fields))


def estimate_buffers(view: RankView, params: float, *, collectives_copy: bool = False) -> Transient:
    """Bytes beyond the model states, moment by moment, ``params`` being the rank's parameters
    before sharding; ``collectives_copy``: the backend's all-gathers hold their output twice while
    they run (:func:`~stratagem.advisor.cost.memory.collectives_copy`).

    The plugins ``fully_shard`` each block and the root with one ``reshard_after_forward``, the
    root included (torch's default would keep the root gathered). ZeRO-3 frees each unit after its
    forward, so the forward ends with the root gathered and no block; the loss, run after the
    root's forward, meets nothing gathered. The root is gathered again when the gradient of its
    output arrives, and with it, prefetched, the last block: as the head's backward starts, or
    before the loss's backward where the model's forward computes the loss
    (``RankView.loss_in_forward``); a copying backend holds the root twice as it gathers it, then
    the block as it prefetches it. Each block's backward holds its unit and the next, prefetched,
    but the model's first block's, the last to run backward (none left to prefetch); every unit is
    freed after its backward, the root after the embedding's. ZeRO-2 keeps every unit gathered
    from its forward to its backward. A plan without blocks has the root as its only unit. Under a
    pipeline, torch's schedule keeps every unit gathered after its backward until the last
    micro-batch's gradients are reduced (``set_reshard_after_backward(False)``): the whole stage,
    gathered. DDP keeps a copy of every gradient in its buckets for the module's life
    (``gradient_as_bucket_view=False``, torch's default, which the plugins keep), beside
    autocast's compute-dtype weight copies (:func:`_autocast_copies`)."""
    plan = view.plan
    prec = get_precision(plan.precision)
    if not plan.uses_fsdp:
        return _autocast_copies(view, ddp_bucket_bytes(plan, params))
    gathered = params * prec.compute_bytes
    if view.one_fsdp_unit or plan.pp > 1:
        return Transient.constant(gathered)
    root = view.outside_per_tp_rank("num_params") * prec.compute_bytes
    block = view.stage.largest_block_params / plan.tp * prec.compute_bytes
    if not plan.shards_parameters:
        return Transient(gathered, gathered, gathered, gathered, root + block, root)
    regathered = max(2 * root, root + 2 * block) if collectives_copy else root + block
    return Transient(forward=root, loss=root + block if view.loss_in_forward else 0.0, head=regathered,
                     first_block=root + 2 * block, last_block=root + block, embedding=root)


def _autocast_copies(view: RankView, buckets: float) -> Transient:
    """``buckets`` and autocast's compute-dtype weight copies, moment by moment. Autocast's cache
    holds every copy the forward makes (``forward_param_copy_bytes``, saved or not) until the
    forward's autocast region ends, after the loss's forward; then the backward holds those it
    saved (``saved_param_copy_bytes``) until the operator that saved each has run its backward:
    without checkpointing, as the head's backward starts, every one (but none of a block the model
    checkpoints itself, whose rerun makes its own, counted in what it rebuilds:
    :mod:`~stratagem.advisor.cost.activations`), the blocks' and the embedding's in the rank's last
    block's backward, its first block's and the embedding's in that block's, the embedding's alone
    after it; under the plan's checkpointing the copies outside the blocks, the head's until its
    backward has run, and a block's own while its backward recomputes it: the rank's last block's
    first, its first block's as the backward ends (a convolutional network's first block has its
    fewest weights). A pipeline's schedule runs its backward inside that region."""
    plan = view.plan
    if not get_precision(plan.precision).autocast:
        return Transient.constant(buckets)
    saved = view.per_tp_rank("saved_param_copy_bytes")
    cached = buckets + max(view.per_tp_rank("forward_param_copy_bytes"), saved)  # the saved are among them
    if plan.pp > 1:
        return Transient.constant(cached)
    embedding = buckets + view.stage.embedding_sum("saved_param_copy_bytes")
    blocks = view.stage.blocks
    if not plan.checkpoints:
        kept = buckets + saved
        in_blocks = view.stage.block_sums["saved_param_copy_bytes"] / plan.tp
        first = blocks[0].saved_param_copy_bytes / plan.tp if blocks else 0.0
        return Transient(forward=cached, loss=kept, head=kept, first_block=embedding + in_blocks,
                         last_block=embedding + first, embedding=embedding)
    outside = buckets + view.outside_per_tp_rank("saved_param_copy_bytes")
    first, last = (recomputed_copies(view, blocks[i]) if blocks else 0.0 for i in (-1, 0))
    return Transient(forward=cached, loss=outside, head=outside, first_block=embedding + first,
                     last_block=embedding + last, embedding=embedding)


def recomputed_copies(view: RankView, block: SegmentProfile) -> float:
    """Autocast's weight copies of ``block`` that its backward holds where the plan checkpoints it
    and the rest of the backward holds none (:func:`_autocast_copies`): those its recompute saves,
    as one TP rank holds them (none but under autocast: a profile without it made no copies); 0
    otherwise. Not of the plan's precision, which the activations' costs do not depend on
    (``memory._NOT_IN_ACTIVATIONS``)."""
    plan = view.plan
    return block.saved_param_copy_bytes / plan.tp if plan.checkpoints and plan.pp == 1 else 0.0


def ddp_bucket_bytes(plan: Plan, params: float) -> float:
    """DDP's gradient buckets: a copy of every gradient, in the parameter dtype, for the module's
    life (``gradient_as_bucket_view=False``); none without data parallelism or under FSDP."""
    return params * get_precision(plan.precision).param_bytes if plan.uses_ddp else 0.0
