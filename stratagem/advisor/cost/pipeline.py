"""Pipeline terms of a step: the bubble (fill and drain), the point-to-point messages between
stages, as torch.distributed.pipelining's schedules run them, and the sum of a tied weight's two
copies' gradients (docs/cost-model.md, "Pipeline")."""

from __future__ import annotations

from stratagem.advisor.cost.collectives import estimate_all_reduce_seconds, estimate_p2p_seconds
from stratagem.advisor.cost.communication import collective_wait_seconds
from stratagem.advisor.cost.pace import Pace
from stratagem.advisor.cost.rank_step import RankStep
from stratagem.advisor.cost.stages import others_share
from stratagem.plan import MeshAxis


def estimate_bubble_seconds(pace: Pace, *, reductions: float) -> float:
    """Pipeline fill and drain of the rank that paces the step (``pace``), seconds;
    ``reductions``: its DP reductions that run inside its last backward
    (:attr:`~stratagem.advisor.cost.communication.DpExposure.in_backward`).

    The rank waits one micro-batch of every other rank before its first and after its last:
    ``share/(m·v)`` of its busy time ``ideal`` (``pace.others_share`` and ``pace.busy``: its
    micro-batches' compute, recompute, TP communication and, on CPU ranks, host time). Narayanan
    et al. 2021, §2.2.1 eq. 1, ``share = p − 1`` for equal stages; §2.2.2 for ``v`` virtual
    stages. Zero-bubble keeps only the forward's part (:func:`_zero_bubble_share`). Ranks sharing
    cores lose only part of it (:func:`_shared_core_seconds`). The drain waits for the other
    ranks' in-backward reductions too."""
    step, share, ideal = pace.step, pace.others_share, pace.busy.seconds
    plan = step.plan
    if plan.pp == 1:
        return 0.0
    fill = share / (plan.microbatches * plan.pp_virtual) * ideal * _zero_bubble_share(step)
    lost = bubble_lost_share(plan.pp, step.cluster.ranks_per_core)
    drain = others_share(step.profile, plan, step.stage, "num_params") * reductions
    return lost * fill + _shared_core_seconds(step, share=share, lost=lost, ideal=ideal) + drain


def _zero_bubble_share(step: RankStep) -> float:
    """The share of the bubble ``interleaved-zb`` leaves: Qi et al. 2024 (ZB-H1, §3) fill
    ``(p−1)(T_F + T_B + T_W)`` down to ``(p−1)(T_F + T_B − T_W)`` with the backward split into
    equal input and weight halves, i.e. the forward's share of a pass; 1 for other schedules."""
    if not step.plan.is_zero_bubble:
        return 1.0
    forward, backward = step.stage.sums["fwd_flops"], step.stage.sums["bwd_flops"]
    return forward / (forward + backward) if forward + backward else 1.0


def _shared_core_seconds(step: RankStep, *, share: float, lost: float, ideal: float) -> float:
    """Where ranks share cores, the part of the bubble the node keeps busy (``1 − lost``) runs
    every rank's micro-batches as they come: the busiest rank's take the ranks' mean time rather
    than its own, ``((1 + share)/pp − 1)`` of ``ideal`` (negative where stages differ)."""
    return (1 - lost) * ((1 + share) / step.plan.pp - 1) * ideal


def bubble_lost_share(pp: int, ranks_per_core: float) -> float:
    """The share of a pipeline's bubble a node loses when ``ranks_per_core`` ranks share each core.

    The bubble fills and drains in ``pp − 1`` steps, ``j/pp`` of the ranks busy at step ``j``:
    with a core each, the idle ``1 − j/pp`` is lost; sharing cores, the busy ranks take the idle
    ones' cores, so the node loses only ``max(0, 1 − ranks_per_core · j/pp)``. 1 for ranks with a
    device each; 0 where the busy stage's ranks fill the cores."""
    steps = range(1, pp)
    idle = sum(1 - j / pp for j in steps)
    if not idle or ranks_per_core <= 1:
        return 1.0
    return sum(max(0.0, 1 - ranks_per_core * j / pp) for j in steps) / idle


def estimate_pp_comm_seconds(step: RankStep) -> float:
    """Pipeline p2p, seconds per step on one rank: every micro-batch sends its activation forward
    and its gradient backward across each of the rank's ``pp_virtual`` stage boundaries
    (Narayanan et al. 2021, §2.2), each received by a rank that waits on it."""
    plan = step.plan
    if plan.pp == 1:
        return 0.0
    return 2 * step.num_microbatches * plan.pp_virtual * _pp_message_seconds(step)


def estimate_tied_gradient_seconds(step: RankStep) -> float:
    """Summing the gradients of the tied weights' two copies (``pp_tied_params``: the first stage's
    embedding, the last's head) after each schedule step, seconds: an all-reduce between those two
    ranks of the copy's gradient in the parameter dtype (split by a vocabulary layout over TP, one
    shard of it under FSDP), after the last backward, so nothing hides it
    (:class:`~stratagem.plugins.pipeline.Pipeline`; Megatron-LM's embedding all-reduce)."""
    plan, tied = step.plan, step.profile.pp_tied_params
    if plan.pp == 1 or not tied:
        return 0.0
    split = plan.tp if "vocab_head" in plan.vocab_tp_styles else 1
    elements = tied / split / (plan.dp_shard if plan.shards_gradients else 1)
    seconds = estimate_all_reduce_seconds(elements * step.precision.param_bytes, group_size=2,
                                          **step.link(MeshAxis.PP, "all_reduce"))
    return plan.grad_accum * (seconds + collective_wait_seconds(step, 2))


def estimate_pp_comm_exposed_seconds(step: RankStep, *, total: float, compute: float) -> float:
    """The part of pipeline p2p no compute hides, seconds (``total``: all of the rank's p2p):
    the first micro-batch's activation crosses all ``pp·v − 1`` boundaries before the last stage
    starts and its gradient crosses back (on the critical path); steady-state sends run beside
    compute (``compute``, recompute included), exposed only beyond it."""
    if total == 0.0:
        return 0.0
    fill_drain = 2 * (step.plan.num_stages - 1) * _pp_message_seconds(step)
    return min(total, fill_drain + max(0.0, total - compute))


def _pp_message_seconds(step: RankStep) -> float:
    """One boundary activation (as profiled, scaled to the micro-batch; whole with SP too: the plugin
    all-gathers each stage's last block's output, where Megatron-LM sends the shard), and the
    receiver's wait for a sender that reaches it apart, as a blocking collective's."""
    num_bytes = step.stage.max_block_output_bytes * step.batch_scale
    return estimate_p2p_seconds(num_bytes, **step.link(MeshAxis.PP, "p2p")) + collective_wait_seconds(step, 2)
