"""Pipeline stages of a profile, with the sums the cost models read, computed once per stage.

The search costs tens of thousands of plans for one profile and a handful of pipeline degrees;
summing 80 blocks for every plan would dominate it. A :class:`Stage` holds one rank's segments,
their per-field sums, and its blocks folded into kinds (identical blocks with a count), so a
cost term is a few multiplications.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from stratagem.advisor.memo import by_identity
from stratagem.advisor.model_profile import ModelProfile, SegmentProfile

_SUMMED = tuple(f.name for f in fields(SegmentProfile) if f.type in ("int", int))


@dataclass(frozen=True, slots=True)
class Stage:
    """The segments one pipeline rank holds: ⌈blocks/pp⌉ blocks plus the embedding (first
    stage) or the head (last stage); every segment when pp = 1."""

    segments: tuple[SegmentProfile, ...]
    blocks: tuple[SegmentProfile, ...]
    kinds: tuple[tuple[SegmentProfile, int], ...]  # each distinct block once, with its count
    sums: dict[str, int]  # every integer field of SegmentProfile, summed over ``segments``
    block_sums: dict[str, int]  # the same over ``blocks`` only
    largest_unit_params: int  # the largest FSDP unit: a block, or the embedding/head with the root
    max_block_output_bytes: int  # the largest block output (profiled batch): a pipeline message

    @property
    def num_params(self) -> int:
        return self.sums["num_params"]


def first_stage(profile: ModelProfile, pp: int) -> Stage:
    """The first pipeline rank's stage (it keeps the most micro-batches in flight)."""
    return _stage_of(profile, pp, "first")


def busiest_stage(profile: ModelProfile, pp: int) -> Stage:
    """The stage with the most FLOPs: the first (with the embedding) or the last (with the head)."""
    return _stage_of(profile, pp, "busiest")


def whole_model(profile: ModelProfile) -> Stage:
    """Every segment, as one stage: the model's totals without summing them again."""
    return _stage_of(profile, 1, "first")


@by_identity
def _stage_of(profile: ModelProfile, pp: int, which: str) -> Stage:
    return _build(profile, pp, which)


def _build(profile: ModelProfile, pp: int, which: str) -> Stage:
    if pp == 1:
        return _stage(profile.segments, profile.blocks)
    per_stage = math.ceil(len(profile.blocks) / pp)
    first_blocks, last_blocks = profile.blocks[:per_stage], profile.blocks[-per_stage:]
    first = _stage((profile.embed, *first_blocks), first_blocks)
    if which == "first":
        return first
    last = _stage((*last_blocks, profile.head), last_blocks)
    return max((first, last), key=lambda s: s.sums["fwd_flops"] + s.sums["bwd_flops"])


def _stage(segments: tuple[SegmentProfile, ...], blocks: tuple[SegmentProfile, ...]) -> Stage:
    counts: dict[str, int] = {}
    first_of: dict[str, SegmentProfile] = {}
    for block in blocks:
        kind = block.measured_as or block.name
        counts[kind] = counts.get(kind, 0) + 1
        first_of.setdefault(kind, block)
    return Stage(
        segments=segments, blocks=blocks,
        kinds=tuple((first_of[k], n) for k, n in counts.items()),
        sums={f: sum(getattr(s, f) for s in segments) for f in _SUMMED},
        block_sums={f: sum(getattr(b, f) for b in blocks) for f in _SUMMED},
        largest_unit_params=max(s.num_params for s in segments),
        max_block_output_bytes=max((b.output_bytes for b in blocks), default=0),
    )
