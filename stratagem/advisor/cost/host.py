"""Host terms of a step: the time the CPU spends launching operators (Python, the dispatcher,
autograd, DTensor's sharding propagation), and the part of it the device does not hide."""

from __future__ import annotations

from stratagem.advisor.cost.communication import num_tp_linears
from stratagem.advisor.cost.optimizer import (
    DTENSOR_OP_SECONDS,
    OPTIMIZER_OPS_PER_TENSOR,
    calibrated_optimizer,
    dtensor_optimizer_seconds,
    optimizer_tensors,
    runs_foreach,
)
from stratagem.advisor.cost.rank_step import RankStep
from stratagem.advisor.profile.model_profile import policy_field

# Host seconds to dispatch one eager operator whatever its size: ≈ 3 µs without autograd (He
# 2022, "Making Deep Learning Go Brrrr"), more with autograd and hooks. Estimate; calibrated.
OP_DISPATCH_SECONDS = 10e-6

# Operators plugins.clip_grad_norm_ dispatches whatever the number of gradients, on one device and
# dtype: 13, counted with a dispatch-mode counter on torch 2.13 (each gradient's norm in one
# _foreach_norm, their sum, the scale, one _foreach_mul_). Clipping by value clamps each gradient: one.
CLIP_NORM_OPS = 13

# What DTensor.to_local costs the host, in plain operators: 3.4 µs a call against clamp_'s 1.05 µs
# on a CPU host, torch 2.13 (bench/clip_speed.py). Clipping takes each DTensor gradient's local part
# once by value, twice by norm.
TO_LOCAL_OPS = 3

# DTensor operators a TP Linear runs per micro-batch beyond a plain one's (matmuls and the layout
# changes around them, forward and backward): bench/dtensor_ops.py counts 10-17 on the reference
# presets. Used uncalibrated only; `stratagem calibrate` times a TP Linear directly.
DTENSOR_OPS_PER_TP_LINEAR = 12


def estimate_dispatch_seconds(step: RankStep, *, device_busy: float) -> float:
    """Host time launching the step's operators that the device's own work does not hide, seconds:
    every micro-batch's, the gradients' clipping's and the optimizer's (an offloaded plan's
    optimizer launches its own on the host as it runs: its term holds them). A CPU rank runs each
    operator as it launches it, so all of it adds; an accelerator (GPU, TPU) runs behind the host,
    which binds only when it launches slower than the accelerator computes (``device_busy``: the
    step's compute, recompute, TP collectives and optimizer on the device)."""
    optimizer = 0.0 if step.plan.offloads else _optimizer_dispatch_seconds(step)
    host = step.num_microbatches * microbatch_dispatch_seconds(step) + optimizer + _clip_dispatch_seconds(step)
    return max(0.0, host - device_busy) if step.cluster.is_accelerator else host


def in_line_host_seconds(step: RankStep) -> float:
    """The micro-batches' host time that runs in line with their compute: all of it on CPU ranks,
    none on accelerators (which the host runs ahead of)."""
    return 0.0 if step.cluster.is_accelerator else step.num_microbatches * microbatch_dispatch_seconds(step)


def microbatch_dispatch_seconds(step: RankStep) -> float:
    """Host seconds launching one micro-batch's operators: every operator the profile counted in
    forward and backward (and those the checkpointed blocks run again: their whole forward under
    full recomputation, what the profile measured a selective policy recomputing; TP does not
    divide them), or a compiled block's kernels, at the node's seconds per operator, and each TP
    Linear's DTensor overhead (:func:`_tp_linear_seconds`), the embedding and head split by
    vocabulary counted as TP Linears (:func:`num_vocab_splits`); with sequence parallelism, the
    norms' own operators on DTensors (:func:`_sp_norm_seconds`)."""
    plan = step.plan
    ops = step.launched("fwd") + step.launched("bwd")
    if plan.recomputes_blocks:
        ops += step.launched("fwd", blocks_only=True)
    elif plan.checkpoints_selectively:
        recomputed = step.stage.block_sums[policy_field(plan.activation_checkpointing, "recompute_ops")]
        ops += recomputed * step.fused_ops_share
    tp_linears = sum(n * num_tp_linears(plan, b) for b, n in step.stage.kinds) + num_vocab_splits(step) \
        if plan.tp > 1 else 0
    return _op_seconds(step) * ops + tp_linears * _tp_linear_seconds(step) + _sp_norm_seconds(step)


def _sp_norm_seconds(step: RankStep) -> float:
    """Host seconds sequence parallelism's norms add per micro-batch: each operator they dispatch
    (``SegmentProfile.sp_norm_ops``, forward and backward) runs on DTensors, at a TP Linear's
    DTensor overhead per operator (:func:`_tp_linear_seconds` over
    :data:`DTENSOR_OPS_PER_TP_LINEAR`). A recomputed forward's are left out."""
    if not step.plan.sequence_parallel:
        return 0.0
    ops = sum(n * block.sp_norm_ops for block, n in step.stage.kinds)
    return ops * _tp_linear_seconds(step) / DTENSOR_OPS_PER_TP_LINEAR


def num_vocab_splits(step: RankStep) -> int:
    """The stage's modules the layout splits by vocabulary (the input embedding, the output head)
    and a loss run on the logits' shards (``vocab_loss``): each costs the host what a TP Linear
    does (its lookup, projection or loss, gradient and layout changes on DTensors;
    :data:`DTENSOR_OPS_PER_TP_LINEAR`)."""
    return len(step.plan.vocab_tp_styles & step.stage.vocab_shares.keys())


def _tp_linear_seconds(step: RankStep) -> float:
    """Host seconds a TP Linear's forward and backward on DTensors add beyond a plain Linear's:
    calibrated (``NodeSpec.tp_linear_seconds``), else :data:`DTENSOR_OPS_PER_TP_LINEAR` operators
    at DTensor's cost per operator beyond a plain one's."""
    measured = step.cluster.node.tp_linear_seconds
    if measured is not None:
        return measured
    return DTENSOR_OPS_PER_TP_LINEAR * (DTENSOR_OP_SECONDS - _op_seconds(step))


def _op_seconds(step: RankStep) -> float:
    """Host seconds per operator on plain tensors: calibrated, else the estimate."""
    return step.cluster.node.op_seconds or OP_DISPATCH_SECONDS


def _clip_dispatch_seconds(step: RankStep) -> float:
    """Host seconds launching the gradients' clipping (``Workload.grad_clip``): by norm
    :data:`CLIP_NORM_OPS` operators, by value one a gradient tensor, and where the gradients are
    DTensors (FSDP2, TP) each one's local part taken, twice by norm and once by value
    (:data:`TO_LOCAL_OPS` operators each)."""
    if step.grad_clip is None:
        return 0.0
    tensors = step.stage.sums["num_tensors"]
    ops = CLIP_NORM_OPS if step.grad_clip == "norm" else tensors
    if step.plan.uses_fsdp or step.plan.tp > 1:
        ops += (2 if step.grad_clip == "norm" else 1) * tensors * TO_LOCAL_OPS
    return ops * _op_seconds(step)


def _optimizer_dispatch_seconds(step: RankStep) -> float:
    """Host seconds launching the optimizer step's operators: on DTensor parameters (FSDP2, TP) an
    AdamW step's cost per step and per tensor (:func:`dtensor_optimizer_seconds`) scaled by the
    optimizer's operators (:data:`OPTIMIZER_OPS_PER_TENSOR`); on plain tensors the calibrated
    seconds per tensor, else as many operators at a plain one's cost, once a tensor, or once a
    dtype group on torch.optim's ``foreach`` path (:func:`~stratagem.advisor.cost.optimizer.runs_foreach`)."""
    plan, tensors = step.plan, optimizer_tensors(step)
    ops_per_tensor = OPTIMIZER_OPS_PER_TENSOR[step.optimizer]
    if plan.uses_fsdp or plan.tp > 1:
        per_step, per_tensor = dtensor_optimizer_seconds(step)
        return (per_step + per_tensor * tensors) * ops_per_tensor / OPTIMIZER_OPS_PER_TENSOR["adamw"]
    if (measured := calibrated_optimizer(step)) is not None:
        return measured[1] * tensors
    calls = 1 if runs_foreach(plan, on_accelerator=step.cluster.is_accelerator) else tensors
    return _op_seconds(step) * ops_per_tensor * calls
