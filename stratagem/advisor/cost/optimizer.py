"""Optimizer terms of a step: the update itself (on the device, or on the host when offloaded)
and the host-link copies that CPU offload adds."""

from __future__ import annotations

from stratagem.advisor.cost.collectives import estimate_p2p_seconds
from stratagem.advisor.cost.rank_step import RankStep
from stratagem.advisor.cost.rates import MEMORY_BANDWIDTH_EFFICIENCY

# Tensor reads + writes per parameter in one torch.optim step (foreach or single-tensor: the same
# operators), counted from torch 2.13's adam.py: AdamW 20 (weight decay 2, both moments 5, the
# denominator 6, addcdiv 4; a fused kernel would move 7), SGD without momentum 3. Calibrated.
OPTIMIZER_TENSOR_PASSES = {"adamw": 20, "sgd": 3}

# Host memory bandwidth torch's CPU optimizer reaches per node when offloaded, bytes/s, shared by
# the node's ranks (a two-socket DDR5 host streams a few hundred GB/s; foreach kernels a fraction). Estimate.
HOST_OPTIMIZER_BANDWIDTH_PER_NODE = 50e9


def estimate_optimizer_seconds(step: RankStep) -> float:
    """One optimizer step on the rank's shard, seconds, beyond launching its operators: the
    calibrated seconds per parameter (``NodeSpec.optimizer_seconds``, fp32, scaled by the
    parameter dtype's bytes), else memory-bound streaming of :data:`OPTIMIZER_TENSOR_PASSES`
    tensors (roofline, Williams et al. 2009). Offloaded, on the host's CPU, which launches the
    step's operators itself while the device waits: at the calibrated seconds per parameter and
    per parameter tensor (``NodeSpec.host_optimizer_seconds``, timed over DTensors as FSDP's
    offloaded parameters are, every rank of the node stepping at once), else at
    :data:`HOST_OPTIMIZER_BANDWIDTH_PER_NODE` shared by the node's ranks, an estimate that holds
    the launches too."""
    num_bytes = (step.optimizer_params * OPTIMIZER_TENSOR_PASSES[step.optimizer]
                 * step.precision.param_bytes)
    if step.plan.offloads:
        if (host := _calibrated(step.cluster.node.host_optimizer_seconds, step.optimizer)) is not None:
            return step.optimizer_params * host[0] * step.precision.param_bytes / 4 + optimizer_tensors(step) * host[1]
        return num_bytes / (HOST_OPTIMIZER_BANDWIDTH_PER_NODE / step.cluster.devices_per_node)
    if (measured := calibrated_optimizer(step)) is not None:
        return step.optimizer_params * measured[0] * step.precision.param_bytes / 4
    return num_bytes / (step.cluster.device.memory_bandwidth * MEMORY_BANDWIDTH_EFFICIENCY)


def optimizer_tensors(step: RankStep) -> float:
    """Parameter tensors the rank's optimizer steps: every tensor of its stage (FSDP shards each
    one), a share of them where ZeRO-1 gives each rank whole tensors."""
    return step.stage.sums["num_tensors"] / (step.plan.dp_shard if step.plan.shards_optimizer_only else 1)


def calibrated_optimizer(step: RankStep) -> tuple[float, float] | None:
    """(seconds per fp32 parameter, seconds per parameter tensor) of the step's optimizer as
    calibrated on the node, or None."""
    return _calibrated(step.cluster.node.optimizer_seconds, step.optimizer)


def _calibrated(measured: tuple[tuple[str, float, float], ...], optimizer: str) -> tuple[float, float] | None:
    """``optimizer``'s (seconds per fp32 parameter, seconds per tensor) among ``measured``, or None."""
    return next(((per_param, per_tensor) for name, per_param, per_tensor in measured if name == optimizer), None)


def estimate_offload_seconds(step: RankStep) -> float:
    """Host-link (PCIe) copies per step, seconds, all exposed (conservative): each gradient
    reduction copies the rank's gradient shard to the host; updated parameters return once
    (``optimizer``, ZeRO-Offload: Ren et al. 2021, §4.1) or before every parameter all-gather
    (``params``, FSDP2's CPUOffloadPolicy). CPU ranks have no host link: nothing moves."""
    plan, host_link = step.plan, step.cluster.node.host_link
    if not plan.offloads or host_link is None:
        return 0.0
    shard_bytes = step.optimizer_params * step.precision.param_bytes
    uploads = step.num_gathers if plan.offloads_parameters else 1
    copy = estimate_p2p_seconds(shard_bytes, bandwidth=host_link.effective_bandwidth,
                                latency=host_link.latency)
    return (step.num_reductions + uploads) * copy
