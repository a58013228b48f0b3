"""Optimizer terms of a step: the update itself (on the device, or on the host when offloaded),
the gradients' clipping before it, and the host-link copies that CPU offload adds."""

from __future__ import annotations

from stratagem.advisor.cost.collectives import estimate_all_reduce_seconds, estimate_p2p_seconds
from stratagem.advisor.cost.communication import collective_wait_seconds
from stratagem.advisor.cost.rank_step import RankStep
from stratagem.advisor.cost.rates import MEMORY_BANDWIDTH_EFFICIENCY
from stratagem.plan import MeshAxis, Plan
from stratagem.plan.workload import HOST_FUSED_OPTIMIZERS

# Tensor reads + writes per parameter in one torch.optim step (foreach or single-tensor: the same
# operators), counted from torch 2.13's adam.py and sgd.py: AdamW 20 (weight decay 2, both moments
# 5, the denominator 6, addcdiv 4), SGD with momentum (OPTIMIZER_OPTIONS) 8 (the buffer scaled 2,
# the gradient added 3, the parameter updated 3). Calibrated.
OPTIMIZER_TENSOR_PASSES = {"adamw": 20, "sgd": 8}

# The same for the fused kernel an offloaded plan's host step runs (HOST_FUSED_OPTIMIZERS): each
# tensor read once and the updated ones written once: AdamW the parameter, its gradient and two
# moments read, three written (7). Calibrated.
FUSED_TENSOR_PASSES = {"adamw": 7}

# Operators one optimizer step dispatches per parameter tensor (torch.optim's single-tensor update,
# zero_grad included), counted with a dispatch-mode counter on torch 2.13: momentum adds SGD's
# two on its buffer (mul_, add_) to the update's.
OPTIMIZER_OPS_PER_TENSOR = {"adamw": 10, "sgd": 5}

# Host seconds per operator call on DTensors (FSDP2 and TP parameters: DTensor's dispatch and
# sharding propagation around the local kernel), the optimizer's own bookkeeping per step included.
# An AdamW step over eight DTensor parameters, about ten calls on the foreach path, took 0.86 and
# 1.02 ms on this project's two H100 hosts (torch 2.11, bench/calibrations/), where a TP Linear's
# twelve-odd DTensor calls (DTENSOR_OPS_PER_TP_LINEAR) added 1.03 and 1.04 ms to a plain one's;
# bench/dtensor_optimizer.py measures 14 µs a call one tensor at a time and 21 µs on the foreach
# path on a CPU host with torch 2.13. The GPU hosts' figure; calibrated.
DTENSOR_OP_SECONDS = 100e-6

# Host seconds each parameter tensor adds to one foreach call on DTensors (the list's unwrapping and
# the local call's work per tensor): 2.4 µs, bench/dtensor_optimizer.py on a CPU host, torch 2.13.
# Calibrated.
DTENSOR_FOREACH_TENSOR_SECONDS = 2.4e-6

# The same for the fused AdamW kernel's one call on DTensors (an offloaded plan's host step): 33 µs,
# bench/dtensor_optimizer.py on the same host (6.8 on plain tensors). Calibrated with the step.
DTENSOR_FUSED_TENSOR_SECONDS = 33e-6

# Tensor reads + writes per gradient element of one clipping step (Workload.grad_clip): by norm each
# gradient read for its norm, then read and written scaled (plugins.clip_grad_norm_:
# torch._foreach_norm, _foreach_mul_); by value read and written clamped (clamp_).
CLIP_GRADIENT_PASSES = {"norm": 3, "value": 2}

# Host memory bandwidth torch's fused CPU optimizer reaches per node when offloaded, bytes/s, shared
# by the node's ranks (a two-socket DDR5 host streams a few hundred GB/s; bench/host_optimizer_cache.py
# measures it: 46-88 GB/s at 28 bytes a parameter on two Zen 4 cores). Estimate.
HOST_OPTIMIZER_BANDWIDTH_PER_NODE = 50e9


def estimate_optimizer_seconds(step: RankStep) -> float:
    """One optimizer step on the rank's shard, seconds. On the device, beyond launching its
    operators (the host's dispatch term holds those): the calibrated seconds per parameter
    (``NodeSpec.optimizer_seconds``, fp32, scaled by the parameter dtype's bytes), else
    memory-bound streaming of :data:`OPTIMIZER_TENSOR_PASSES` tensors (roofline, Williams et al.
    2009). Offloaded, on the host's CPU, while the device waits, over FSDP's DTensors, fused where
    the plugins build it so (:data:`~stratagem.plan.workload.HOST_FUSED_OPTIMIZERS`), at the calibrated
    seconds per parameter and per parameter tensor (``NodeSpec.host_optimizer_seconds``, timed over
    DTensors, every rank of the node stepping at once), else the longer of
    :func:`uncalibrated_host_step`'s streaming and launching: a bound, as the two estimates cannot
    be told apart (docs/cost-model.md, "Optimizer step and offload")."""
    if step.plan.offloads:
        if (host := _calibrated(step.cluster.node.host_optimizer_seconds, step.optimizer)) is not None:
            return step.optimizer_params * host[0] * step.precision.param_bytes / 4 + optimizer_tensors(step) * host[1]
        return max(uncalibrated_host_step(step))
    if (measured := calibrated_optimizer(step)) is not None:
        return step.optimizer_params * measured[0] * step.precision.param_bytes / 4
    return _streamed_bytes(step) / (step.cluster.device.memory_bandwidth * MEMORY_BANDWIDTH_EFFICIENCY)


def estimate_clip_seconds(step: RankStep) -> float:
    """Clipping the rank's gradients before the optimizer steps, seconds (none unless
    ``Workload.grad_clip``): :data:`CLIP_GRADIENT_PASSES` over the gradients the rank keeps, in
    the parameters' dtype, where they live: on the device at the rate operators without FLOPs
    stream (``RankStep.seconds_per_op_byte``), on the host for an offloaded plan, at the rate its
    optimizer step streams there (calibrated: its seconds per fp32 parameter over the bytes its
    passes move for one; else :data:`HOST_OPTIMIZER_BANDWIDTH_PER_NODE`, shared by the node's
    ranks). By norm, then the all-reduces of the norm's shares, one over each mesh dimension that
    splits the gradients (FSDP's, TP's) and one over the pipeline, four bytes each: their latency
    and wait. The host's launches are :func:`~stratagem.advisor.cost.host.estimate_dispatch_seconds`'."""
    if step.grad_clip is None:
        return 0.0
    plan = step.plan
    streamed = CLIP_GRADIENT_PASSES[step.grad_clip] * step.gradient_params * step.precision.param_bytes
    seconds = streamed * (_host_seconds_per_byte(step) if plan.offloads else step.seconds_per_op_byte)
    if step.grad_clip == "norm":
        split = {MeshAxis.DP_SHARD: plan.dp_shard if plan.uses_fsdp else 1, MeshAxis.TP: plan.tp, MeshAxis.PP: plan.pp}
        seconds += sum(estimate_all_reduce_seconds(4, group_size=size, **step.link(axis, "all_reduce"))
                       + collective_wait_seconds(step, size) for axis, size in split.items() if size > 1)
    return seconds


def _host_seconds_per_byte(step: RankStep) -> float:
    """Seconds per byte an offloaded plan's host optimizer step streams (see :func:`estimate_clip_seconds`)."""
    if (measured := _calibrated(step.cluster.node.host_optimizer_seconds, step.optimizer)) is not None:
        passes = (FUSED_TENSOR_PASSES if step.optimizer in HOST_FUSED_OPTIMIZERS else OPTIMIZER_TENSOR_PASSES)
        return measured[0] / (4 * passes[step.optimizer])
    return 1 / _host_bandwidth(step)


def _host_bandwidth(step: RankStep) -> float:
    """Bytes a second one rank's offloaded optimizer streams on the host uncalibrated:
    :data:`HOST_OPTIMIZER_BANDWIDTH_PER_NODE`, shared by the node's ranks."""
    return HOST_OPTIMIZER_BANDWIDTH_PER_NODE / step.cluster.devices_per_node


def uncalibrated_host_step(step: RankStep) -> tuple[float, float]:
    """An offloaded step's two estimates on the host, seconds, streaming at
    :data:`HOST_OPTIMIZER_BANDWIDTH_PER_NODE` (shared by the node's ranks) and launching: fused
    (:data:`~stratagem.plan.workload.HOST_FUSED_OPTIMIZERS`), the kernel's
    :data:`FUSED_TENSOR_PASSES` and one DTensor call (:data:`DTENSOR_OP_SECONDS`) taking every
    tensor (:data:`DTENSOR_FUSED_TENSOR_SECONDS` each); else one tensor at a time,
    :data:`OPTIMIZER_TENSOR_PASSES` and :data:`OPTIMIZER_OPS_PER_TENSOR` DTensor calls a tensor.
    :func:`estimate_optimizer_seconds` takes the longer; ``bench/gpu_predictions.py`` prints the
    offloaded runs under their sum too."""
    bandwidth = _host_bandwidth(step)
    tensors = optimizer_tensors(step)
    if step.optimizer in HOST_FUSED_OPTIMIZERS:
        return (_streamed_bytes(step, FUSED_TENSOR_PASSES) / bandwidth,
                DTENSOR_OP_SECONDS + tensors * DTENSOR_FUSED_TENSOR_SECONDS)
    return (_streamed_bytes(step) / bandwidth, tensors * OPTIMIZER_OPS_PER_TENSOR[step.optimizer] * DTENSOR_OP_SECONDS)


def _streamed_bytes(step: RankStep, passes: dict[str, int] = OPTIMIZER_TENSOR_PASSES) -> float:
    """Bytes the rank's optimizer step reads and writes: ``passes`` over its shard in the
    parameters' dtype (torch.optim's operators, or the fused kernel's)."""
    return step.optimizer_params * passes[step.optimizer] * step.precision.param_bytes


def optimizer_tensors(step: RankStep) -> float:
    """Parameter tensors the rank's optimizer steps: every tensor of its stage (FSDP shards each
    one), a share of them where ZeRO-1 gives each rank whole tensors."""
    return step.stage.sums["num_tensors"] / (step.plan.dp_shard if step.plan.shards_optimizer_only else 1)


def runs_foreach(plan: Plan, *, on_accelerator: bool) -> bool:
    """Whether torch.optim steps the rank's parameters on its ``foreach`` path, each operator one
    call for all the tensors: its default where they live on an accelerator (DTensors too: DTensor
    adds itself to its foreach types; ``build_optimizer`` groups a TP rank's DTensors apart from its
    plain tensors for it, while a strategy's user-made group that mixes them steps one tensor at a
    time, which is not priced: docs/design.md, "Optimizers under TP"). CPU ranks, and an offloaded
    plan's parameters, which live on the host, step one tensor at a time. The time model asks the
    cluster, the memory model (which takes none) the profile's kernels."""
    return on_accelerator and not plan.offloads


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


def dtensor_optimizer_seconds(step: RankStep) -> tuple[float, float]:
    """Host seconds of an AdamW step over the rank's DTensor parameters on its device, per step and
    per tensor, on the path torch.optim takes (:func:`runs_foreach`). Calibrated, else
    :data:`DTENSOR_OP_SECONDS` per call, once a step on the ``foreach`` path with
    :data:`DTENSOR_FOREACH_TENSOR_SECONDS` per tensor in each, once a tensor off it. (An offloaded
    plan's parameters step on the host: ``estimate_optimizer_seconds``.)"""
    if step.cluster.node.dtensor_optimizer_seconds is not None:
        return step.cluster.node.dtensor_optimizer_seconds
    calls = OPTIMIZER_OPS_PER_TENSOR["adamw"]
    if runs_foreach(step.plan, on_accelerator=step.cluster.is_accelerator):
        return calls * DTENSOR_OP_SECONDS, calls * DTENSOR_FOREACH_TENSOR_SECONDS
    return 0.0, calls * DTENSOR_OP_SECONDS
