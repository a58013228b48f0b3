"""The order a pipeline schedule runs forward and backward passes, laid out in time.

An illustration for the HTML report, not a cost model: every forward pass of a rank's model
slice takes one unit, every backward two, and sends between stages are free. A slice split
into ``v`` virtual stages (interleaved 1F1B) runs each chunk in ``1/v`` of that. Each rank runs
its passes in the schedule's order, a pass starting once its rank is free and its inputs exist
(the previous stage's forward; the next stage's backward). The gaps left are the bubble.

Orders: GPipe — all forwards, then all backwards (Huang et al. 2019). 1F1B — ``pp - rank - 1``
warm-up forwards, then one forward and one backward alternately, then the remaining backwards
(Narayanan et al. 2021, PipeDream-Flush). Interleaved 1F1B — Narayanan et al. 2021, §2.2, in
Megatron-LM's order: micro-batches in groups of ``pp`` per chunk, ``2·(pp - rank - 1) +
(v - 1)·pp`` warm-up forwards. Interleaved zero-bubble is drawn in interleaved 1F1B's order:
its weight-gradient passes, which fill the bubble, are not drawn apart from the backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from stratagem.plan import Plan

FORWARD_UNITS = 1.0
BACKWARD_UNITS = 2.0


@dataclass(frozen=True, slots=True)
class Pass:
    """One forward (``kind="F"``) or backward (``"B"``) of ``microbatch`` through ``chunk`` (the
    virtual stage on this rank, 0 without interleaving), from ``start`` to ``end`` in units."""

    rank: int
    kind: str
    microbatch: int
    chunk: int
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class Timeline:
    """Every pass of one step on every pipeline rank."""

    num_ranks: int
    passes: tuple[Pass, ...]

    @property
    def makespan(self) -> float:
        """Units from the first forward to the last backward."""
        return max(p.end for p in self.passes)

    @property
    def bubble_fraction(self) -> float:
        """Share of rank-time spent idle, 0..1."""
        busy = sum(p.end - p.start for p in self.passes)
        return 1 - busy / (self.makespan * self.num_ranks)


def pipeline_order(plan: Plan, rank: int) -> list[tuple[str, int, int]]:
    """``(kind, microbatch, chunk)`` in the order ``rank`` runs them under ``plan``'s schedule."""
    if plan.pp_schedule == "gpipe":
        m = plan.microbatches
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    if plan.pp_schedule == "1f1b":
        return _one_f_one_b(plan.microbatches, warmup=plan.pp - rank - 1, chunk=lambda i, fwd: (i, 0))
    total = plan.microbatches * plan.pp_virtual
    warmup = 2 * (plan.pp - rank - 1) + (plan.pp_virtual - 1) * plan.pp
    return _one_f_one_b(total, warmup=warmup, chunk=lambda k, fwd: _interleaved(plan, k, forward=fwd))


def simulate_pipeline(plan: Plan) -> Timeline:
    """Lay every rank's passes out in time (see the module docstring for the model)."""
    orders = [pipeline_order(plan, rank) for rank in range(plan.pp)]
    state = _Simulation(plan)
    while any(orders):
        progressed = False
        for rank, order in enumerate(orders):
            while order and state.try_run(rank, *order[0]):
                order.pop(0)
                progressed = True
        assert progressed, f"schedule deadlocked for {plan.name}"
    return Timeline(plan.pp, tuple(state.passes))


def _one_f_one_b(total: int, *, warmup: int,
                 chunk: Callable[[int, bool], tuple[int, int]]) -> list[tuple[str, int, int]]:
    """Warm-up forwards, then forward/backward pairs, then the remaining backwards."""
    warmup = min(warmup, total)
    forwards = [("F", *chunk(k, True)) for k in range(total)]
    backwards = [("B", *chunk(k, False)) for k in range(total)]
    order = forwards[:warmup]
    for k in range(total - warmup):
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[total - warmup:]


def _interleaved(plan: Plan, k: int, *, forward: bool) -> tuple[int, int]:
    """(microbatch, chunk) of a rank's ``k``-th forward or backward under interleaved 1F1B."""
    group = plan.pp * plan.pp_virtual
    chunk = (k // plan.pp) % plan.pp_virtual
    microbatch = (k // group) * plan.pp + k % plan.pp
    return microbatch, chunk if forward else plan.pp_virtual - 1 - chunk


class _Simulation:
    """Pass end times by ``(kind, microbatch, stage)``, and when each rank is next free."""

    def __init__(self, plan: Plan) -> None:
        self.pp, self.num_stages = plan.pp, plan.num_stages
        self.units = {"F": FORWARD_UNITS / plan.pp_virtual, "B": BACKWARD_UNITS / plan.pp_virtual}
        self.done: dict[tuple[str, int, int], float] = {}
        self.free = [0.0] * plan.pp
        self.passes: list[Pass] = []

    def try_run(self, rank: int, kind: str, microbatch: int, chunk: int) -> bool:
        """Schedule the pass if its inputs exist; False if it must wait."""
        stage = chunk * self.pp + rank
        needs = [("F", microbatch, stage - 1)] if kind == "F" and stage > 0 else []
        if kind == "B":
            needs.append(("F", microbatch, stage))
            if stage < self.num_stages - 1:
                needs.append(("B", microbatch, stage + 1))
        if any(need not in self.done for need in needs):
            return False
        start = max([self.free[rank], *(self.done[need] for need in needs)])
        end = start + self.units[kind]
        self.done[(kind, microbatch, stage)] = self.free[rank] = end
        self.passes.append(Pass(rank, kind, microbatch, chunk, start, end))
        return True
