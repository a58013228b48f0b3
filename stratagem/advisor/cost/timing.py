"""Step time of one Plan: a visible sum of named terms, each with its source.

:func:`estimate_time` scores the pipeline rank that paces the step (:mod:`~stratagem.advisor.cost.pace`:
the busiest, under the partition the plan carries). It describes that rank's work once
(:class:`~stratagem.advisor.cost.rank_step.RankStep`) and adds the terms of
:class:`~stratagem.advisor.cost.estimate.TimeBreakdown`, each from the module of its family:
:mod:`~stratagem.advisor.cost.compute`, :mod:`~stratagem.advisor.cost.communication`,
:mod:`~stratagem.advisor.cost.pipeline`, :mod:`~stratagem.advisor.cost.host` and
:mod:`~stratagem.advisor.cost.optimizer`. docs/cost-model.md derives them term by term.
"""

from __future__ import annotations

from stratagem.advisor.cost.communication import (
    estimate_dp_comm_exposed_seconds,
    estimate_grad_sync_seconds,
    estimate_param_gather_seconds,
)
from stratagem.advisor.cost.compute import estimate_compile_seconds
from stratagem.advisor.cost.estimate import TimeBreakdown
from stratagem.advisor.cost.host import estimate_dispatch_seconds
from stratagem.advisor.cost.optimizer import (
    estimate_clip_seconds,
    estimate_offload_seconds,
    estimate_optimizer_seconds,
)
from stratagem.advisor.cost.pipeline import (
    estimate_bubble_seconds,
    estimate_pp_comm_exposed_seconds,
    estimate_pp_comm_seconds,
    estimate_tied_gradient_seconds,
)
from stratagem.advisor.cost.pace import pace
from stratagem.advisor.cost.rates import estimate_peak_flops
from stratagem.advisor.cost.stages import whole_model
from stratagem.advisor.hardware.spec import Cluster
from stratagem.advisor.profile.model_profile import ModelProfile
from stratagem.plan import Plan, Workload


def estimate_time(profile: ModelProfile, *, cluster: Cluster, workload: Workload,
                  plan: Plan) -> TimeBreakdown:
    """Seconds per optimizer step of ``plan``, term by term, on the rank that paces it."""
    paced = pace(profile, cluster=cluster, workload=workload, plan=plan)
    step, (compute, recompute, tp_comm, _) = paced.step, paced.busy
    grads, gathers = estimate_grad_sync_seconds(step), estimate_param_gather_seconds(step)
    pp_comm, tied = estimate_pp_comm_seconds(step), estimate_tied_gradient_seconds(step)
    optimizer = estimate_optimizer_seconds(step) + estimate_clip_seconds(step)
    on_device = 0.0 if plan.offloads else optimizer  # an offloaded plan's runs on the host, hiding no launches
    dp_comm = estimate_dp_comm_exposed_seconds(step, grads=grads, gathers=gathers, compute=compute,
                                               recompute=recompute)
    return TimeBreakdown(
        compute=compute,
        recompute=recompute,
        dp_comm=dp_comm.exposed,
        tp_comm=tp_comm,  # on the critical path: nothing overlaps it
        pp_comm=estimate_pp_comm_exposed_seconds(step, total=pp_comm, compute=compute + recompute) + tied,
        bubble=estimate_bubble_seconds(paced, reductions=dp_comm.in_backward),
        optimizer=optimizer,
        offload=estimate_offload_seconds(step),
        dispatch=estimate_dispatch_seconds(step, device_busy=compute + recompute + tp_comm + on_device),
        dp_comm_total=grads + gathers,
        tp_comm_total=tp_comm,
        pp_comm_total=pp_comm + tied,
        compile_once=estimate_compile_seconds(step),
        paced_rank=paced.rank,
    )


def model_flops_per_step(profile: ModelProfile, *, workload: Workload) -> float:
    """Forward and backward FLOPs of one step of the whole global batch, recomputation excluded."""
    totals = whole_model(profile).sums
    return (totals["fwd_flops"] + totals["bwd_flops"]) * workload.global_batch_size / profile.batch_size


def tokens_per_second(profile: ModelProfile, *, workload: Workload, time: TimeBreakdown) -> float:
    """Tokens per second of the whole job (samples per second for non-sequence models)."""
    tokens_per_sample = workload.seq_len or profile.seq_len or 1
    return workload.global_batch_size * tokens_per_sample / time.step_seconds


def mfu(profile: ModelProfile, *, cluster: Cluster, workload: Workload, plan: Plan,
        time: TimeBreakdown) -> float:
    """Model FLOPs utilisation: model FLOPs (no recompute) per second over the plan's ranks'
    dense peak (PaLM, Chowdhery et al. 2022, App. B)."""
    peak = plan.world_size * estimate_peak_flops(cluster, precision=plan.precision)
    return model_flops_per_step(profile, workload=workload) / time.step_seconds / peak
