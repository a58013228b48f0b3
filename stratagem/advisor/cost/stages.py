"""Pipeline stages of a profile, with the sums the cost models read, computed once per stage.

The search costs tens of thousands of plans for one profile and a handful of partitions;
summing 80 blocks for every plan would dominate it. A :class:`Stage` holds one rank's segments,
their per-field sums, and its blocks folded into kinds (identical blocks with a count), so a
cost term is a few multiplications. A plan's stages are looked up by its partition
(:func:`partition`: the pipeline degree and the blocks per stage, which every function here
keys on), not rebuilt per plan: pipeline rank ``r`` holds stages ``r, r + pp, …`` (one per
virtual stage), the embedding with stage 0, the head with the last.

One TP rank runs ``1 / tp`` of the blocks, and of the input embedding and the output head where
the plan's layout splits the vocabulary (:func:`vocabulary_shares` says what that divides); the
rest outside the blocks (the final norm, position embeddings) runs whole on every TP rank, as
:mod:`stratagem.plugins.tensor_parallel` applies it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

from stratagem.advisor.memo import by_identity
from stratagem.advisor.profile.model_profile import ModelProfile, SegmentProfile
from stratagem.plan import Plan

_SUMMED = tuple(f.name for f in fields(SegmentProfile) if f.type in ("int", int))


@dataclass(frozen=True, slots=True)
class Stage:
    """The segments one pipeline rank holds: the blocks of its stages, plus the embedding (on
    the rank of the first stage) and the head (on the rank of the last); every segment when
    pp = 1."""

    segments: tuple[SegmentProfile, ...]
    blocks: tuple[SegmentProfile, ...]
    kinds: tuple[tuple[SegmentProfile, int], ...]  # each distinct block once, with its count
    sums: dict[str, int]  # every integer field of SegmentProfile, summed over ``segments``
    block_sums: dict[str, int]  # the same over ``blocks`` only
    largest_block_params: int  # the largest block: FSDP's largest unit but the root
    max_block_output_bytes: int  # the largest block output (profiled batch): a pipeline message
    vocab_shares: dict[str, dict[str, float]]  # per vocabulary style, of the module the rank holds: vocabulary_shares
    # outside_per_tp_rank's sums, by field and vocabulary styles: the search asks for them per plan
    _outside: dict[tuple[str, frozenset[str]], tuple[float, float]] = dataclasses.field(default_factory=dict, compare=False)

    @property
    def num_params(self) -> int:
        return self.sums["num_params"]

    def outside_blocks(self, field: str) -> int:
        """``field`` summed over the segments outside the blocks: the embedding, head and final norm."""
        return self.sums[field] - self.block_sums[field]

    def embedding_sum(self, field: str) -> int:
        """``field`` summed over what runs before the blocks (the embedding; none on a later pipeline
        stage's rank)."""
        return sum(getattr(s, field) for s in self.segments if s.kind == "embed")

    def per_tp_rank(self, field: str, tp: int, vocab: frozenset[str] = frozenset()) -> float:
        """``field`` summed over the stage as one of ``tp`` tensor-parallel ranks holds or runs it:
        TP splits the blocks, and the embedding and head as ``vocab`` (the plan's vocabulary styles,
        ``Plan.vocab_tp_styles``) says; the rest stays whole on every TP rank."""
        return self.block_sums[field] / tp + self.outside_per_tp_rank(field, tp, vocab)

    def outside_per_tp_rank(self, field: str, tp: int, vocab: frozenset[str] = frozenset()) -> float:
        """:meth:`outside_blocks` as one TP rank holds or runs it, the vocabulary split by ``vocab``."""
        whole, split = self._outside.get((field, vocab)) or self._outside.setdefault((field, vocab), (
            self.outside_blocks(field),
            sum(self.vocab_shares[style].get(field, 0.0) for style in vocab if style in self.vocab_shares)))
        return whole - split * (1 - 1 / tp)


def vocabulary_shares(embed: SegmentProfile | None, head: SegmentProfile | None) -> dict[str, dict[str, float]]:
    """What splitting the vocabulary divides over the TP ranks, per style, of the input embedding
    and output head a stage holds (None where it holds neither), by summed field: the embedding's
    table (its parameters; DTensor computes the table's gradient whole, so its dense gradient's
    bytes stay: docs/design.md); the head's weight, its projection's forward GEMM and the
    backward's two (input and weight gradients: twice the forward), their unaligned share, and the
    head's parameter-sized traffic and copies (autocast's copies of its weight, made and saved, and
    casts of its gradient: all but a final norm's of them are the projection's); and where the loss
    runs on the logits' vocabulary shards (``vocab_loss``, which splits the head as ``vocab_head``
    too), what the head saves and moves as wide as the vocabulary: the logits and the loss's
    tensors (:mod:`~stratagem.advisor.cost.activations` divides the logits and their gradients)."""
    shares: dict[str, dict[str, float]] = {}
    if embed is not None and embed.vocab_params:
        shares["vocab_embedding"] = {"num_params": embed.vocab_params}
    if head is not None and head.linears:
        forward = sum(2 * linear.rows * linear.in_features * linear.out_features for linear in head.linears)
        shares["vocab_head"] = {
            "num_params": head.vocab_params, "fwd_flops": forward, "bwd_flops": 2 * forward,
            "fwd_unaligned_flops": min(head.fwd_unaligned_flops, forward),
            "bwd_unaligned_flops": min(head.bwd_unaligned_flops, 2 * forward),
            **{f: getattr(head, f) for f in ("saved_param_copy_bytes", "forward_param_copy_bytes", "fwd_param_op_bytes",
                                             "bwd_param_op_bytes")},
        }
        shares["vocab_loss"] = {"saved_bytes": head.vocab_saved_bytes, "fwd_op_bytes": head.vocab_fwd_op_bytes,
                                "bwd_op_bytes": head.vocab_bwd_op_bytes}
    return shares


def partition(profile: ModelProfile, plan: Plan) -> tuple[int, tuple[int, ...]]:
    """What a plan's stages follow from: its pipeline degree and blocks per stage
    (:meth:`~stratagem.plan.Plan.blocks_per_stage`)."""
    return plan.pp, plan.blocks_per_stage(len(profile.blocks))


def others_share(profile: ModelProfile, plan: Plan, stage: Stage, field: str) -> float:
    """The other pipeline ranks' ``field`` (summed) over ``stage``'s, one of ``plan``'s ranks:
    ``pp − 1`` when the stages are equal, less when ``stage`` holds more, such as the head."""
    return others_over_own(stage.sums[field], sum(rank.sums[field] for rank in rank_stages(profile, plan)), plan.pp)


def others_over_own(own: float, total: float, pp: int) -> float:
    """What the other ranks of a ``pp``-rank pipeline hold or do of ``total`` over one rank's
    ``own``: ``pp − 1`` for equal ranks, and where ``own`` is nothing."""
    return (total - own) / own if own else pp - 1.0


def distinct_ranks(profile: ModelProfile, plan: Plan) -> tuple[tuple[int, int], ...]:
    """The pipeline ranks whose work differs, each as the lowest rank that does it and how many
    ranks do the same: those holding the same blocks (by kind and count) and the same of the
    embedding and head run the same passes, whatever the order of their virtual stages."""
    return _distinct(profile, *partition(profile, plan))


def whole_model(profile: ModelProfile) -> Stage:
    """Every segment, as one stage: the model's totals without summing them again."""
    return _ranks(profile, 1, (len(profile.blocks),))[0]


def rank_stages(profile: ModelProfile, plan: Plan) -> tuple[Stage, ...]:
    """One :class:`Stage` per pipeline rank, for the partition ``plan`` carries."""
    return _ranks(profile, *partition(profile, plan))


def candidate_ranks(profile: ModelProfile, plan: Plan) -> tuple[int, ...]:
    """The pipeline ranks that may be the most loaded in memory: those no lower rank dominates.
    A lower rank keeps at least as many micro-batches in flight under every schedule, so one
    that also holds at least as much of everything (each block kind, every summed field, the
    activations outside the blocks, the largest block) needs at least as much memory."""
    return _candidates(profile, *partition(profile, plan))


def virtual_stages(profile: ModelProfile, plan: Plan, *, rank: int) -> tuple[Stage, ...]:
    """Pipeline rank ``rank``'s stages one by one (``pp_virtual`` of them), in schedule order."""
    pp, stage_blocks = partition(profile, plan)
    return _parts(profile, stage_blocks)[rank::pp]


@by_identity
def _distinct(profile: ModelProfile, pp: int, stage_blocks: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    first: dict[tuple, int] = {}
    counts: dict[int, int] = {}
    for rank, stage in enumerate(_ranks(profile, pp, stage_blocks)):  # rank pp − 1 holds the last stage, the head
        work = (rank == 0, rank == pp - 1, tuple(sorted((b.measurement, n) for b, n in stage.kinds)))
        lowest = first.setdefault(work, rank)
        counts[lowest] = counts.get(lowest, 0) + 1
    return tuple(counts.items())


@by_identity
def _candidates(profile: ModelProfile, pp: int, stage_blocks: tuple[int, ...]) -> tuple[int, ...]:
    kinds = sorted({b.measurement for b in profile.blocks})

    def load(stage: Stage) -> tuple[int, ...]:
        counts = {b.measurement: n for b, n in stage.kinds}
        return (*stage.sums.values(), stage.outside_blocks("saved_bytes"), stage.largest_block_params,
                *(counts.get(k, 0) for k in kinds))

    # virtual stage by virtual stage: a lower rank keeps at least as many in flight on each
    parts = _parts(profile, stage_blocks)
    loads = [tuple(x for part in parts[rank::pp] for x in load(part)) for rank in range(pp)]
    return tuple(r for r, mine in enumerate(loads)
                 if not any(all(a >= b for a, b in zip(loads[lower], mine)) for lower in range(r)))


@by_identity
def _parts(profile: ModelProfile, stage_blocks: tuple[int, ...]) -> tuple[Stage, ...]:
    parts, start = [], 0
    for index, count in enumerate(stage_blocks):
        blocks = profile.blocks[start:start + count]
        segments = ((profile.embed,) if index == 0 else ()) + blocks + \
            ((_head(profile, with_embed=index == 0),) if index == len(stage_blocks) - 1 else ())
        parts.append(_stage(profile, segments, blocks))
        start += count
    return tuple(parts)


@by_identity
def _ranks(profile: ModelProfile, pp: int, stage_blocks: tuple[int, ...]) -> tuple[Stage, ...]:
    bounds = [0]
    for count in stage_blocks:
        bounds.append(bounds[-1] + count)
    last = len(stage_blocks) - 1
    ranks = []
    for rank in range(pp):
        stages = range(rank, len(stage_blocks), pp)
        blocks = tuple(b for s in stages for b in profile.blocks[bounds[s]:bounds[s + 1]])
        segments = ((profile.embed,) if rank == 0 else ()) + blocks + \
            ((_head(profile, with_embed=rank == 0),) if last in stages else ())
        ranks.append(_stage(profile, segments, blocks))
    return tuple(ranks)


def _head(profile: ModelProfile, *, with_embed: bool) -> SegmentProfile:
    """The head as a stage holds it: a stage without the embedding also holds its own copy of the
    weights the model ties between them (``pp_tied_params``, the vocabulary's table: one tensor,
    split as the head is by a vocabulary layout), which the profile counts once, in the embedding."""
    tied = profile.pp_tied_params
    if with_embed or not tied:
        return profile.head
    head = profile.head
    return dataclasses.replace(head, num_params=head.num_params + tied, vocab_params=head.vocab_params + tied,
                               num_tensors=head.num_tensors + 1)


def _stage(profile: ModelProfile, segments: tuple[SegmentProfile, ...], blocks: tuple[SegmentProfile, ...]) -> Stage:
    counts: dict[str, int] = {}
    first_of: dict[str, SegmentProfile] = {}
    for block in blocks:
        kind = block.measurement
        counts[kind] = counts.get(kind, 0) + 1
        first_of.setdefault(kind, block)
    return Stage(
        segments=segments, blocks=blocks,
        kinds=tuple((first_of[k], n) for k, n in counts.items()),
        sums={f: sum(getattr(s, f) for s in segments) for f in _SUMMED},
        block_sums={f: sum(getattr(b, f) for b in blocks) for f in _SUMMED},
        largest_block_params=max((b.num_params for b in blocks), default=0),
        max_block_output_bytes=max((b.output_bytes for b in blocks), default=0),
        vocab_shares=vocabulary_shares(*(next((s for s in segments if s.name == part.name), None)
                                         for part in (profile.embed, profile.head))),
    )
