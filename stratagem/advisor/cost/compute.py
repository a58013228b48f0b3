"""Compute terms of a step: the forward and backward passes, what checkpointing runs again, and
the copies and additions around gradients that run on the compute stream (or core)."""

from __future__ import annotations

from stratagem.advisor.cost.rank_step import RankStep
from stratagem.advisor.profile.model_profile import policy_field

# Seconds torch.compile takes for one kind of block (its forward and backward graphs) on a GPU, once
# before the first step: 6-8 s for GPT-2 medium, ViT-B/16 and GPT-2 XL (one kind of block each),
# each block compiled, bf16 autocast, AdamW, on one H100 (docs/cost-model.md, "Compilation").
COMPILE_SECONDS_PER_BLOCK_KIND = 7.0


def estimate_compute_seconds(step: RankStep) -> float:
    """Forward and backward of every micro-batch on the rank, seconds: profiled FLOPs scaled to the
    micro-batch (the blocks' divided over TP) at the achievable rate, and the bytes operators
    without FLOPs move (:meth:`RankStep.pass_seconds`), with the data-parallel runtime's copies
    (:func:`estimate_dp_copy_seconds`) and the gradients' accumulation
    (:func:`estimate_grad_accumulation_seconds`). The embedding and head stay whole on every TP
    rank, as the TP plugin applies them (Megatron splits the vocabulary too: Shoeybi et al. 2019, §3).
    A pipeline's micro-batches after the first find autocast's weight casts done
    (:func:`estimate_cached_cast_seconds`)."""
    passes = step.num_microbatches * (step.pass_seconds("fwd") + step.pass_seconds("bwd"))
    return (passes - estimate_cached_cast_seconds(step) + estimate_dp_copy_seconds(step)
            + estimate_grad_accumulation_seconds(step))


def estimate_cached_cast_seconds(step: RankStep) -> float:
    """Autocast's weight casts the forwards of a pipeline's micro-batches after the first do not
    repeat, seconds. The pipeline plugin runs a step's whole schedule under one autocast context,
    and autocast caches its cast of each fp32 leaf tensor that requires grad (a weight) until the
    outermost context exits, so each weight is cast once a step; elsewhere each micro-batch's
    forward runs in a context of its own and casts again. Recomputation casts again either way on
    GPUs: the checkpoint recomputes on autograd's device thread, whose autocast cache is its own
    (CPU ranks run backward on the calling thread and find the casts cached; left priced)."""
    if step.plan.pp == 1 or not step.plan.runs_autocast:
        return 0.0
    return (step.num_microbatches - 1) * step.per_tp_rank("fwd_param_op_bytes") * step.seconds_per_op_byte


def estimate_grad_accumulation_seconds(step: RankStep) -> float:
    """Adding each micro-batch's gradients to those before it, seconds: autograd adds into
    ``.grad`` in place after the first (two tensors read, one written, in the parameter dtype, at
    the rank's cost per byte moved); FSDP2 adds its reduced shards."""
    return ((step.num_microbatches - 1) * 3 * step.gradient_params * step.precision.param_bytes
            * step.seconds_per_op_byte)


def estimate_dp_copy_seconds(step: RankStep) -> float:
    """The data-parallel runtime's copies around its collectives, seconds, each byte read and
    written at the rank's cost per byte moved. DDP copies every gradient into its buckets and back
    (``gradient_as_bucket_view=False``, the plugins' default); FSDP2 copies a unit's shard into
    each all-gather's input and the gathered unit out, in the compute dtype, and the unit's
    gradients into each reduce-scatter's input, in the parameter dtype."""
    plan = step.plan
    if plan.dp == 1:
        return 0.0
    params, prec = step.params_per_rank, step.precision
    if not plan.uses_fsdp:
        copied = 2 * params * prec.param_bytes
    else:
        copied = (step.num_gathers * params * prec.compute_bytes * (1 + 1 / plan.dp_shard)
                  + step.num_reductions * params * prec.param_bytes)
    return 2 * copied * step.seconds_per_op_byte


def estimate_recompute_seconds(step: RankStep) -> float:
    """Forward run again in backward, seconds: every block's forward under ``full``
    checkpointing; under a selective policy, what the profile measured the block recomputing
    (:func:`selective_recompute_seconds`)."""
    plan = step.plan
    if not plan.checkpoints:
        return 0.0
    if plan.recomputes_blocks:
        per_microbatch = step.pass_seconds("fwd", blocks_only=True)
    else:
        per_microbatch = selective_recompute_seconds(step, plan.activation_checkpointing)
    return step.num_microbatches * per_microbatch


def selective_recompute_seconds(step: RankStep, policy: str) -> float:
    """One micro-batch's recomputation under the selective ``policy``, seconds: the recomputed
    forward FLOPs of the rank's blocks (divided over TP) at the blocks' matmul rate, those of fused
    attention kernels at the rate their forward runs where it is priced apart (:attr:`RankStep.attention`),
    and the bytes the recomputed operators without FLOPs move at the cost per byte (parameter-sized
    ones, such as autocast's weight casts, at any micro-batch size; a compiled block's fused in the
    share its forward's are: :attr:`RankStep.fused_share`; what TP leaves whole:
    :attr:`RankStep.tp_whole_op_factor`), with the device's gap after each recomputed kernel
    (fused in the share :attr:`RankStep.fused_ops_share`)."""
    flops = step.per_microbatch(policy_field(policy, "recompute_flops"), blocks_only=True)
    attention = 0.0
    if step.attention is not None and (fused := step.attention[True]).flops["fwd"]:
        recomputed = step.per_microbatch(policy_field(policy, "recompute_attention_flops"), blocks_only=True)
        flops, attention = flops - recomputed, recomputed * fused.seconds["fwd"] / fused.flops["fwd"]
    recomputed_bytes = step.per_microbatch(policy_field(policy, "recompute_op_bytes"), blocks_only=True)
    moved = (recomputed_bytes * step.fused_share * step.tp_whole_op_factor
             + step.per_tp_rank(policy_field(policy, "recompute_param_op_bytes"), blocks_only=True))
    launched = step.stage.block_sums[policy_field(policy, "recompute_ops")] * step.fused_ops_share
    return (attention + flops / step.block_matmul_efficiency / step.flops_per_second
            + moved * step.seconds_per_op_byte + launched * step.kernel_gap_seconds)


def estimate_compile_seconds(step: RankStep) -> float:
    """Compiling the rank's blocks before the first step, seconds: one compilation per kind of
    block (identical blocks share the compiled code); nothing for a plan that does not compile."""
    return COMPILE_SECONDS_PER_BLOCK_KIND * len(step.stage.kinds) if step.plan.compile else 0.0
