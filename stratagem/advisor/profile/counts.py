"""What one fake step measured, raw: per segment the counts :mod:`~stratagem.advisor.profile.measure`
makes, which the profiler assembles into :class:`~stratagem.advisor.profile.model_profile.SegmentProfile`."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

from stratagem.advisor.profile.model_profile import BatchNormCall, ConvLayer


@dataclass
class PolicyCounts:
    """One block under one policy: bytes of the outputs it keeps, and the forward work its
    backward runs again (FLOPs, operators, bytes moved by operators without FLOPs: those that grow
    with the batch, and the parameter-sized ones apart)."""

    kept_bytes: int = 0
    recompute_flops: int = 0
    recompute_ops: int = 0
    recompute_op_bytes: int = 0
    recompute_param_op_bytes: int = 0
    recompute_attention_flops: int = 0  # of recompute_flops, fused attention's (priced apart on GPUs)

    def add_work(self, other: PolicyCounts) -> None:
        """Add ``other``'s recomputed work (not its kept bytes)."""
        self.recompute_flops += other.recompute_flops
        self.recompute_ops += other.recompute_ops
        self.recompute_op_bytes += other.recompute_op_bytes
        self.recompute_param_op_bytes += other.recompute_param_op_bytes
        self.recompute_attention_flops += other.recompute_attention_flops


class Fused(NamedTuple):
    """A compiled block's operators without FLOPs in one direction: bytes moved, kernels launched
    (its GEMMs' and attention's included), as ``FusionTracker.fused`` counts them."""

    num_bytes: int
    kernels: int


class CompiledBlock(NamedTuple):
    """What a block does compiled: the bytes it keeps for backward, and the bytes and kernels of
    its operators without FLOPs in forward and backward (profile/compiled.py, compiled_kernels.py)."""

    saved_bytes: int
    forward: Fused
    backward: Fused


@dataclass
class SegmentCounts:
    """What one run attributed to one segment (raw numbers, bytes and FLOPs)."""

    fwd_flops: int = 0
    bwd_flops: int = 0
    saved_bytes: int = 0
    saved_param_copy_bytes: int = 0
    forward_param_copy_bytes: int = 0  # the forward's copies of parameters (autocast's casts), saved or not
    bwd_held_bytes: int = 0  # what its backward held at once beyond what it kept and rebuilt (backward_held)
    fwd_peak_bytes: int = 0  # the most its forward held at once: what it wrote and saved, alive (forward_held)
    rebuilt_bytes: int = 0  # what a rerun of the block's forward in backward held (profile.own_checkpoints)
    attention_fwd_flops: int = 0
    attention_saved_bytes: int = 0
    input_bytes: int = 0
    input_saved_bytes: int = 0  # of input_bytes, what the segment saved itself (block_reuse)
    input_elements: int = 0  # input_bytes' elements
    output_bytes: int = 0
    fwd_ops: int = 0
    bwd_ops: int = 0
    fwd_op_bytes: int = 0
    bwd_op_bytes: int = 0
    fwd_unaligned_flops: int = 0
    bwd_unaligned_flops: int = 0
    fwd_param_op_bytes: int = 0
    bwd_param_op_bytes: int = 0
    bwd_largest_output_bytes: int = 0
    fwd_fused_op_bytes: int = 0  # what the operators without FLOPs move fused (fusion.FusionTracker)
    bwd_fused_op_bytes: int = 0
    fwd_fused_ops: int = 0  # kernels launched fused: the fused groups, and every other operator
    bwd_fused_ops: int = 0
    sp_norm_ops: int = 0  # of fwd_ops and bwd_ops, those inside the block's sequence norms
    compiled: CompiledBlock | None = None  # the block compiled (profile.compiled); None: not measured
    policies: dict[str, PolicyCounts] = field(default_factory=dict)  # a block's, per selective policy
    convs: list[ConvLayer] = field(default_factory=list)  # the convolutions its forward ran, in order
    batch_norms: list[BatchNormCall] = field(default_factory=list)  # its BatchNorms on batch statistics, in order
    # its fused attention kernels' FLOPs by (seq_q, seq_kv, head_dim, causal, kv_group): [forward, backward]
    # By the last dimension of an operator's widest tensor (the head's: its logits' vocabulary, or
    # the hidden width), [saved, forward op bytes, backward op bytes]: what splits with the vocabulary.
    by_width: dict[int, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0, 0]))
    fused_attention: dict[tuple[int, int, int, bool, int], list[int]] = field(default_factory=dict)


@dataclass
class RunRecord:
    """Everything one fake run measured."""

    segments: dict[str, SegmentCounts] = field(default_factory=lambda: defaultdict(SegmentCounts))
    param_segment: dict[str, str] = field(default_factory=dict)  # state name -> first segment to use it
    measured_as: dict[str, str] = field(default_factory=dict)  # duplicate block -> representative
    output_bytes: int = 0
    loss_in_forward: bool = False  # the model's forward returned a scalar that needs a gradient: the loss
    math_attention_reasons: set[str] = field(default_factory=set)  # why SDPA calls run CUDA's math path (profile.attention)
    block_inputs: dict[str, tuple[tuple, dict]] = field(default_factory=dict)  # each block's first call (block_inputs)
    compiled_note: str = ""  # what the blocks' compiled activations were not measured with, or why not (profile.compiled)
    unused_params: tuple[str, ...] = ()  # trainable parameters the step's backward gives no gradient
    cache_note: str = ""  # the blocks ran with a key/value cache, which compiles each apart (profile.compiled)
