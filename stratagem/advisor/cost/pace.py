"""The pipeline rank that paces a step. A pipeline's ranks differ: the first also runs the
embedding, the last the head and the loss, and a partition may give them fewer blocks for it.
Every stage runs each micro-batch in turn, so the slowest rank sets the pace of all of them
(Narayanan et al. 2021, §2.2). Each rank whose work differs from the others'
(:func:`~stratagem.advisor.cost.stages.distinct_ranks`) is costed by the time its micro-batches
keep it busy (:class:`Busy`), and the step is costed on the busiest (docs/cost-model.md,
"Pipeline ranks differ")."""

from __future__ import annotations

from typing import NamedTuple

from stratagem.advisor.cost.communication import estimate_tp_comm_seconds
from stratagem.advisor.cost.compute import estimate_compute_seconds, estimate_recompute_seconds
from stratagem.advisor.cost.host import in_line_host_seconds
from stratagem.advisor.cost.rank_step import RankStep, rank_step
from stratagem.advisor.cost.stages import distinct_ranks, others_over_own
from stratagem.advisor.hardware.spec import Cluster
from stratagem.advisor.profile.model_profile import ModelProfile
from stratagem.plan import Plan, Workload


class Busy(NamedTuple):
    """The seconds a rank's micro-batches keep it busy in a step: their compute and recompute,
    their TP collectives (on the critical path) and the host's launching of their operators where
    it runs in line with them (CPU ranks; 0 on accelerators, which the host runs ahead of)."""

    compute: float
    recompute: float
    tp_comm: float
    host: float

    @property
    def seconds(self) -> float:
        return self.compute + self.recompute + self.tp_comm + self.host


class Pace(NamedTuple):
    """The pipeline rank that paces a plan's step (``rank``, its work ``step``), what keeps it busy
    (``busy``), and the other pipeline ranks' busy seconds over its own (``others_share``:
    ``pp − 1`` for equal stages, 0 without a pipeline): how many of its micro-batches the
    pipeline's fill and drain take."""

    rank: int
    step: RankStep
    busy: Busy
    others_share: float


def pace(profile: ModelProfile, *, cluster: Cluster, workload: Workload, plan: Plan) -> Pace:
    """The :class:`Pace` of ``plan``: the :func:`~stratagem.advisor.cost.rank_step.rank_step` of
    its busiest pipeline rank (every rank's without a pipeline)."""
    ranks = []
    for rank, count in distinct_ranks(profile.computed_by(plan), plan):
        step = rank_step(profile, cluster=cluster, workload=workload, plan=plan, rank=rank)
        ranks.append((busy(step), rank, step, count))
    own, rank, step, _ = max(ranks, key=lambda entry: entry[0].seconds)
    total = sum(work.seconds * count for work, _, _, count in ranks)
    return Pace(rank, step, own, others_over_own(own.seconds, total, plan.pp))


def busy(step: RankStep) -> Busy:
    """What keeps ``step``'s rank busy in a step (:class:`Busy`)."""
    return Busy(estimate_compute_seconds(step), estimate_recompute_seconds(step), estimate_tp_comm_seconds(step),
                in_line_host_seconds(step))
