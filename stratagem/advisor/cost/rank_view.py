"""One pipeline rank of a plan as the memory model reads it: :class:`RankView`, built once per
(plan, rank) and handed to every memory term, as :class:`~stratagem.advisor.cost.rank_step.RankStep`
is to the time terms."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from stratagem.advisor.cost.stages import Stage, rank_stages, virtual_stages
from stratagem.advisor.profile.model_profile import ModelProfile, SegmentProfile
from stratagem.plan import Plan


@dataclass(frozen=True, slots=True)
class RankView:
    """Pipeline rank ``rank`` of ``plan``: ``stage`` (all its segments), ``virtual`` (its stages
    one by one, in schedule order), ``in_flight`` (the micro-batches each of those holds at the
    peak of its schedule: :func:`in_flight_per_stage`), ``head`` (the head segment where the rank
    runs it, else empty), ``scale`` (micro-batch size over profiled batch size: what profiled
    bytes scale by), ``one_fsdp_unit`` (FSDP wraps the rank's model as one unit, the root: it
    has no blocks, or its pipeline stage is a traced graph with no block modules to wrap) and
    ``loss_in_forward`` (the model's forward computes the loss: ``ModelProfile.loss_in_forward``)."""

    plan: Plan
    rank: int
    stage: Stage
    virtual: tuple[Stage, ...]
    in_flight: tuple[int, ...]
    head: tuple[SegmentProfile, ...]
    scale: float
    one_fsdp_unit: bool = False
    loss_in_forward: bool = False

    def per_tp_rank(self, field: str) -> float:
        """``field`` summed over the rank's segments as one TP rank holds it (:meth:`Stage.per_tp_rank`)."""
        return self.stage.per_tp_rank(field, self.plan.tp, self.plan.vocab_tp_styles)

    def outside_per_tp_rank(self, field: str) -> float:
        """``field`` summed over the rank's segments outside the blocks as one TP rank holds it
        (:meth:`Stage.outside_per_tp_rank`): FSDP's root unit, for ``num_params``."""
        return self.stage.outside_per_tp_rank(field, self.plan.tp, self.plan.vocab_tp_styles)


def rank_view(profile: ModelProfile, plan: Plan, rank: int = 0) -> RankView:
    """Pipeline rank ``rank`` of ``plan`` for ``profile``."""
    stage = rank_stages(profile, plan)[rank]
    return RankView(plan=plan, rank=rank, stage=stage, virtual=virtual_stages(profile, plan, rank=rank),
                    in_flight=in_flight_per_stage(plan, rank=rank),
                    head=tuple(s for s in stage.segments if s.name == profile.head.name),
                    scale=plan.micro_batch_size / profile.batch_size,
                    one_fsdp_unit=plan.block_container is None or (plan.pp > 1 and profile.pp_traced),
                    loss_in_forward=profile.loss_in_forward)


def in_flight_microbatches(plan: Plan, *, rank: int = 0) -> float:
    """Micro-batches whose activations pipeline rank ``rank`` holds at once, in units of the
    rank's whole set of blocks (Korthikanti et al. 2022, §4.2.3): :func:`in_flight_per_stage`
    summed over ``pp_virtual`` — for rank 0 of interleaved 1F1B ``pp·(1 + (pp−1)/(pp·v))``."""
    return sum(in_flight_per_stage(plan, rank=rank)) / plan.pp_virtual


def in_flight_per_stage(plan: Plan, *, rank: int) -> tuple[int, ...]:
    """Micro-batches each of pipeline rank ``rank``'s (virtual) stages holds at the peak of its
    schedule, as torch's schedules run them (``torch.distributed.pipelining.schedules``).

    GPipe keeps every micro-batch. 1F1B runs ``pp − rank`` warm-up forwards before its first
    backward: ``min(pp − rank, m)``. Interleaved 1F1B runs ``(v − 1)·pp + 2·(pp − rank − 1)``
    warm-up forwards and one more before the first backward (of ``m·v`` at most), forward ``k``
    on virtual stage ``(k // pp) mod v``: the first virtual stages hold more. Interleaved
    zero-bubble warms up the same way (its deferred weight passes keep their inputs a little
    longer: not counted)."""
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
