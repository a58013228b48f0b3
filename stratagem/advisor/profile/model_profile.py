"""What a model costs, per segment: the data a profile produces and the cost models read.

Plain frozen data with no torch import, so that planning from a stored profile stays light;
:func:`stratagem.advisor.profile.profiler.profile_model` measures one. Bytes are bytes, FLOPs are
floating-point operations (a multiply-add is 2), all for one training step of the profiled batch.
``from_dict`` checks what it reads (types, and the invariants the cost models rely on): a stored
profile is data from disk, not to be trusted blindly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from stratagem.advisor.profile.stored_fields import (
    ProfileDataError,
    as_count,
    as_list,
    as_pair,
    as_text,
    checked_fields,
    require,
)
from stratagem.plan.precision import PRECISIONS, in_compute_dtype

if TYPE_CHECKING:
    from stratagem.plan import Plan

KERNELS = ("gpu", "cpu")
"""Whose kernels a profile counts: a GPU's (CUDA's fused kernels, one-byte dropout masks) or what
CPU ranks run (:mod:`~stratagem.advisor.profile.measure`)."""

def kernels_for(*, accelerator: bool) -> str:
    """The :data:`KERNELS` a profile for devices of a kind counts: a GPU's for accelerators (a TPU's
    compiler fuses at least as much), the CPU's for CPU ranks."""
    return "gpu" if accelerator else "cpu"


SCHEMA_VERSION = 29
"""Version of the layout ``ModelProfile.to_dict`` writes and ``from_dict`` reads. Bump it whenever
a field of ModelProfile, SegmentProfile, LinearLayer, ConvLayer, BatchNormCall or AttentionCall is added, removed, renamed or changes
meaning (tests/unit/test_profile_cache_checks.py pins the fields to this number)."""


def policy_field(policy: str, quantity: str) -> str:
    """The :class:`SegmentProfile` field of ``quantity`` (``kept_bytes``, ``recompute_flops``,
    ``recompute_ops``, ``recompute_op_bytes``, ``recompute_param_op_bytes``,
    ``recompute_attention_flops``) under the selective
    checkpointing policy ``policy`` (``selective-op`` → ``selective_op_kept_bytes``)."""
    return f"{policy.replace('-', '_')}_{quantity}"


@dataclass(frozen=True, slots=True, kw_only=True)
class LinearLayer:
    """A Linear layer inside a block, or the output head's vocabulary projection: the pieces
    tensor parallelism splits."""

    name: str  # FQN relative to the block (the head's: from the model's root)
    in_features: int
    out_features: int
    bias: bool
    rows: int = 0  # rows (tokens) it multiplied in the profiled step, 0 where not recorded; fewer
    # than the block's other Linears: a routed expert's share of the tokens

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str = "linear") -> LinearLayer:
        """The inverse of :meth:`to_dict`, checked (:class:`ProfileDataError` if it does not hold)."""
        return cls(**checked_fields(cls, data, where))


@dataclass(frozen=True, slots=True, kw_only=True)
class ConvLayer:
    """A convolution a segment's forward ran (``aten.convolution``, not transposed): the shapes
    its implicit GEMMs and layout transforms follow from (docs/cost-model.md, "Rates")."""

    name: str  # the innermost module that ran it, relative to its block (to the model outside the blocks)
    in_channels: int
    out_channels: int
    kernel: tuple[int, ...]  # the window per spatial dimension: (3, 3)
    stride: tuple[int, ...]
    groups: int = 1
    rows: int  # output positions at the profiled batch: N·H_out·W_out
    input_rows: int  # input positions at the profiled batch: N·H_in·W_in
    channels_last: bool = False  # its input laid out channels-last (NHWC), as cuDNN's tensor-core kernels read
    input_grad: bool = True  # backward computes its input's gradient (not the first conv of an image model)

    @property
    def window(self) -> int:
        """Elements of one filter window: kh·kw (9 for 3×3)."""
        return math.prod(self.kernel)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "kernel": list(self.kernel), "stride": list(self.stride)}

    @classmethod
    def from_dict(cls, data: Any, where: str = "conv") -> ConvLayer:
        """The inverse of :meth:`to_dict`, checked (:class:`ProfileDataError` if it does not hold)."""
        values = checked_fields(cls, data, where)
        for key in ("kernel", "stride"):
            items = as_list(require(data, key, where), f"{where}.{key}")
            values[key] = tuple(as_count(x, f"{where}.{key}[{i}]", minimum=1) for i, x in enumerate(items))
        return cls(**values)


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchNormCall:
    """A BatchNorm a segment's forward ran on batch statistics (``aten.native_batch_norm`` in
    training): what the kernels a GPU runs it with follow from (docs/cost-model.md, "BatchNorm's
    kernels")."""

    channels: int
    elements: int  # of its input at the profiled batch: N·C·H·W
    dtype: str  # its input's (torch.bfloat16 → "bfloat16")
    weight_dtype: str | None  # its weight's; None without an affine weight
    channels_last: bool = False  # its input laid out channels-last

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str = "batch_norm") -> BatchNormCall:
        """The inverse of :meth:`to_dict`, checked (:class:`ProfileDataError` if it does not hold)."""
        return cls(**checked_fields(cls, data, where))


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionCall:
    """A segment's calls of a fused attention kernel of one shape (SDPA on the flash,
    memory-efficient or cuDNN kernel, not its math path): what the attention core's time follows
    from (docs/cost-model.md, "Attention"). FLOPs as torch's counter counts them: the whole
    ``s_q × s_kv`` causal or not, the backward's five products over the forward's two."""

    seq_q: int  # query rows per head
    seq_kv: int  # key and value rows per head
    head_dim: int
    causal: bool  # the kernel skips the scores above the diagonal
    fwd_flops: int  # of these calls at the profiled batch, summed
    bwd_flops: int  # of their backward
    kv_group: int = 1  # query heads per key and value head (grouped-query attention; 1: multi-head)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str = "attention") -> AttentionCall:
        """The inverse of :meth:`to_dict`, checked (:class:`ProfileDataError` if it does not hold)."""
        return cls(**checked_fields(cls, data, where))


@dataclass(frozen=True, slots=True, kw_only=True)
class SegmentProfile:
    """Costs of one segment (the embedding, one block, or the head) for one step of the
    profiled batch. Bytes are bytes, FLOPs are floating-point operations (a multiply-add is 2)."""

    name: str  # block FQN, or "embed" / "head"
    kind: str  # the block's class name; "embed" / "head" for the parts outside the blocks
    num_params: int
    param_bytes: int
    buffer_bytes: int
    fwd_flops: int
    bwd_flops: int
    saved_bytes: int  # activations saved for backward (parameters excluded)
    saved_param_copy_bytes: int  # compute-dtype copies of parameters saved for backward (autocast)
    forward_param_copy_bytes: int = 0  # the forward's copies of its parameters, which autocast's cache holds to its end
    bwd_held_bytes: int = 0  # the most its backward holds at once beyond what it kept and rebuilt (backward_held.py)
    fwd_held_bytes: int = 0  # the most its forward holds at once beyond what it saves (forward_held.py)
    rebuilt_bytes: int = 0  # what the model's own checkpoint of the block rebuilds in backward (own_checkpoints.py)
    attention_fwd_flops: int  # forward FLOPs of the attention core (QKᵀ, AV, fused attention kernels)
    attention_saved_bytes: int  # of saved_bytes, the s×s score-shaped tensors (Korthikanti's 5as²b)
    input_bytes: int
    input_saved_bytes: int = 0  # of input_bytes, what the block saves itself (as does a full checkpoint's rerun)
    input_elements: int = 0  # input_bytes' elements: the blocks of a kind take inputs of one size where alike
    output_bytes: int  # what a pipeline stage ending here sends; what full checkpointing keeps
    num_tensors: int = 0  # parameter tensors (what a per-tensor optimizer loops over)
    largest_tensor_params: int = 0  # the largest parameter tensor's elements (a per-tensor step's temporaries)
    fwd_ops: int = 0  # operators dispatched in forward
    bwd_ops: int = 0  # operators dispatched in backward
    fwd_op_bytes: int = 0  # bytes read and written in forward by operators without FLOPs (norms, elementwise)
    bwd_op_bytes: int = 0  # the same in backward
    fwd_unaligned_flops: int = 0  # of fwd_flops, GEMMs with a leading dimension off 16 bytes (slow kernels)
    bwd_unaligned_flops: int = 0  # of bwd_flops, the same
    fwd_param_op_bytes: int = 0  # moved by parameter-sized ops (autocast's weight casts), as many at any batch; apart
    bwd_param_op_bytes: int = 0  # the same in backward (gradient casts, embedding gradients); not in *_op_bytes
    bwd_largest_output_bytes: int = 0  # the largest non-weight-shaped tensor a backward op writes (the head's: loss grad)
    fwd_fused_op_bytes: int = 0  # fwd_op_bytes as a fusing compiler moves them (torch.compile, Megatron's kernels)
    bwd_fused_op_bytes: int = 0  # the same in backward
    fwd_fused_ops: int = 0  # kernels forward launches fused: the fused groups and every other operator
    bwd_fused_ops: int = 0  # the same in backward
    sp_norm_ops: int = 0  # operators its sequence norms dispatch, forward and backward (on DTensors under SP)
    compiled_saved_bytes: int = 0  # saved_bytes of a block compiled by torch.compile (0: not measured)
    tp_replicated_bytes: int = 0  # of saved_bytes, what TP without SP leaves whole on each rank (tp_layout.py)
    tp_gathered_bytes: int = 0  # of saved_bytes, the column Linears' inputs, which TP with SP keeps gathered
    tp_replicated_op_bytes: int = 0  # of fwd_op_bytes, what TP without SP moves whole on each rank (tp_layout.py)
    # A block checkpointed under each selective policy (stratagem.plan.checkpointing; 0 outside
    # the blocks): the bytes it keeps (its input and the kept operators' outputs), of them what TP
    # without SP leaves whole on each rank (tp_layout.py), and the forward work its backward runs
    # again: FLOPs, operators, bytes moved (batch-sized, parameter-sized), and of its FLOPs those
    # of fused attention kernels.
    selective_kept_bytes: int = 0
    selective_tp_replicated_bytes: int = 0
    selective_recompute_flops: int = 0
    selective_recompute_ops: int = 0
    selective_recompute_op_bytes: int = 0
    selective_recompute_param_op_bytes: int = 0
    selective_recompute_attention_flops: int = 0
    selective_op_kept_bytes: int = 0
    selective_op_tp_replicated_bytes: int = 0
    selective_op_recompute_flops: int = 0
    selective_op_recompute_ops: int = 0
    selective_op_recompute_op_bytes: int = 0
    selective_op_recompute_param_op_bytes: int = 0
    selective_op_recompute_attention_flops: int = 0
    # Tensor parallelism's split of the vocabulary (the vocab_embedding and vocab_head styles):
    # of num_params, those of the split input embedding or output head this segment owns (a tied
    # weight counts where it is first used: the embedding).
    vocab_params: int = 0
    # The head's alone: of saved_bytes and its op bytes, those of tensors as wide as the vocabulary
    # (the logits and the loss over them), which a loss on the vocabulary shards splits (vocab_loss).
    vocab_saved_bytes: int = 0
    vocab_fwd_op_bytes: int = 0
    vocab_bwd_op_bytes: int = 0
    linears: tuple[LinearLayer, ...] = ()  # a block's Linears; the head's: the vocabulary projection TP splits
    convs: tuple[ConvLayer, ...] = ()  # every convolution its forward ran, in order
    batch_norms: tuple[BatchNormCall, ...] = ()  # every BatchNorm on batch statistics its forward ran, in order
    fused_attention: tuple[AttentionCall, ...] = ()  # its fused attention kernels' calls, by shape
    measured_as: str | None = None  # identical block whose measurement this one reuses

    @property
    def measurement(self) -> str:
        """The block whose measurement this one holds: ``measured_as``, else its own name. Blocks
        of one measurement are identical: one kind, as the cost models fold them."""
        return self.measured_as or self.name

    @property
    def flops(self) -> int:
        """Forward plus backward FLOPs."""
        return self.fwd_flops + self.bwd_flops

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["linears"] = [linear.to_dict() for linear in self.linears]
        out["convs"] = [conv.to_dict() for conv in self.convs]
        out["batch_norms"] = [call.to_dict() for call in self.batch_norms]
        out["fused_attention"] = [call.to_dict() for call in self.fused_attention]
        out["flops"] = self.flops
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str = "segment") -> SegmentProfile:
        """The inverse of :meth:`to_dict`, checked: every count a non-negative integer, the
        derived ``flops`` (if present) their sum (:class:`ProfileDataError` otherwise)."""
        values = checked_fields(cls, data, where)
        linears = as_list(data.get("linears", []), f"{where}.linears")
        values["linears"] = tuple(LinearLayer.from_dict(x, f"{where}.linears[{i}]") for i, x in enumerate(linears))
        convs = as_list(data.get("convs", []), f"{where}.convs")
        values["convs"] = tuple(ConvLayer.from_dict(x, f"{where}.convs[{i}]") for i, x in enumerate(convs))
        norms = as_list(data.get("batch_norms", []), f"{where}.batch_norms")
        values["batch_norms"] = tuple(BatchNormCall.from_dict(x, f"{where}.batch_norms[{i}]")
                                      for i, x in enumerate(norms))
        calls = as_list(data.get("fused_attention", []), f"{where}.fused_attention")
        values["fused_attention"] = tuple(AttentionCall.from_dict(x, f"{where}.fused_attention[{i}]")
                                          for i, x in enumerate(calls))
        segment = cls(**values)
        if "flops" in data and data["flops"] != segment.flops:
            raise ProfileDataError(f"{where}.flops: {data['flops']!r} is not fwd_flops + bwd_flops ({segment.flops})")
        return segment


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelProfile:
    """Per-segment costs of one training step at ``batch_size`` samples (``seq_len`` tokens each,
    for sequence models), with parameters in ``precision``'s parameter dtype."""

    name: str
    precision: str
    kernels: str = "gpu"  # whose kernels it counts: a GPU's (fused) or CPU ranks' (KERNELS)
    batch_size: int
    seq_len: int | None
    embed: SegmentProfile
    blocks: tuple[SegmentProfile, ...]
    head: SegmentProfile
    block_container: str | None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    tp_layout: tuple[tuple[str, str], ...] = ()  # how TP splits it (Plan.tp_layout); () if it cannot
    tp_unavailable: str | None = None  # why there is no TP layout
    pp_unavailable: str | None = None  # why the blocks cannot become pipeline stages
    pp_traced: bool = False  # its pipeline stages are traced graphs (stratagem.plan.stages), not built by removal
    pp_tied_params: int = 0  # elements of the tied weights the first and last stage each copy (structure.pp_tied_params)
    ddp_unavailable: str | None = None  # why DDP cannot train it: parameters without a gradient (profiler.ddp_refusal)
    class_wrap_extra: str | None = None  # modules beside the blocks of a block's class name (structure.class_wrap_extra)
    sp_unavailable: str | None = None  # why sequence parallelism cannot split the blocks' inputs (profiler.sp_refusal)
    block_sequence: int | None = None  # the sequence SP splits: dim 1 of the blocks' inputs (profiler.block_sequence)
    loss_in_forward: bool = False  # the loss runs in the model's forward (step._ModelOutput, with_loss_in_forward)
    notes: tuple[str, ...] = ()
    profile_seconds: float = 0.0
    # The same step with parameters in the compute dtype and no autocast: how FSDP2's mixed
    # precision runs it (residual stream, norms and loss in 16 bits). None without autocast.
    in_compute_dtype: ModelProfile | None = None
    # Why the step cannot run under autocast (then this profile is in_compute_dtype's, relabelled,
    # and only plans without autocast, FSDP's, can train it); None where it can.
    autocast_refused: str | None = None

    def computed_by(self, plan: Plan) -> ModelProfile:
        """The profile of what ``plan`` computes: :attr:`in_compute_dtype` where the plan's
        ``*-mixed`` precision runs without autocast (FSDP: ``Plan.runs_autocast``), else this one."""
        if self.in_compute_dtype is not None and not plan.runs_autocast:
            return self.in_compute_dtype
        return self

    def with_loss_in_forward(self) -> ModelProfile:
        """This profile, and :attr:`in_compute_dtype`'s, for a step whose loss runs inside the
        model's forward wherever the profiled step computed it (a strategy that runs the whole
        step as the forward)."""
        variant = self.in_compute_dtype and self.in_compute_dtype.with_loss_in_forward()
        return replace(self, loss_in_forward=True, in_compute_dtype=variant)

    def with_head_style(self, head: str) -> ModelProfile:
        """This profile, and :attr:`in_compute_dtype`'s, with the TP layout's split output head
        made ``head``: ``vocab_loss`` for a step whose loss stratagem runs on the logits' vocabulary
        shards (a preset's or a Hugging Face model's, which ``verify`` computes), ``vocab_head``
        for one whose loss the user's code computes on gathered logits (the strategies')."""
        layout = tuple((pattern, head if style in ("vocab_head", "vocab_loss") else style)
                       for pattern, style in self.tp_layout)
        variant = self.in_compute_dtype and self.in_compute_dtype.with_head_style(head)
        return replace(self, tp_layout=layout, in_compute_dtype=variant)

    def without_head_outputs(self) -> ModelProfile:
        """This profile, and :attr:`in_compute_dtype`'s, as if the head wrote nothing batch-sized:
        no logits, no loss over them, nothing saved or held for their backward (what they add to a
        plan's peak is the difference)."""
        head = replace(self.head, saved_bytes=0, output_bytes=0, bwd_largest_output_bytes=0, bwd_held_bytes=0,
                       fwd_held_bytes=0)
        variant = self.in_compute_dtype and self.in_compute_dtype.without_head_outputs()
        return replace(self, head=head, in_compute_dtype=variant)

    def in_channels_last(self) -> ModelProfile:
        """This profile, and :attr:`in_compute_dtype`'s, as the model would run with it and its
        inputs in ``torch.channels_last``: every convolution's and BatchNorm's input laid out
        channels-last."""

        def nhwc(segment: SegmentProfile) -> SegmentProfile:
            return replace(segment, convs=tuple(replace(conv, channels_last=True) for conv in segment.convs),
                           batch_norms=tuple(replace(call, channels_last=True) for call in segment.batch_norms))

        variant = self.in_compute_dtype and self.in_compute_dtype.in_channels_last()
        return replace(self, embed=nhwc(self.embed), blocks=tuple(map(nhwc, self.blocks)), head=nhwc(self.head),
                       in_compute_dtype=variant)

    @property
    def segments(self) -> tuple[SegmentProfile, ...]:
        """Embedding, blocks, head: in execution order."""
        return (self.embed, *self.blocks, self.head)

    @property
    def block_classes(self) -> tuple[str, ...]:
        """Class names of the blocks, each once in order: the units FSDP wraps by class."""
        return tuple(dict.fromkeys(b.kind for b in self.blocks))

    @property
    def num_params(self) -> int:
        return sum(s.num_params for s in self.segments)

    @property
    def param_bytes(self) -> int:
        return sum(s.param_bytes for s in self.segments)

    @property
    def buffer_bytes(self) -> int:
        return sum(s.buffer_bytes for s in self.segments)

    @property
    def fwd_flops(self) -> int:
        return sum(s.fwd_flops for s in self.segments)

    @property
    def bwd_flops(self) -> int:
        return sum(s.bwd_flops for s in self.segments)

    @property
    def flops_per_step(self) -> int:
        """Forward plus backward FLOPs of one step at ``batch_size``."""
        return self.fwd_flops + self.bwd_flops

    @property
    def saved_bytes(self) -> int:
        return sum(s.saved_bytes for s in self.segments)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the fields, the totals, and each segment."""
        return {
            "schema_version": SCHEMA_VERSION,
            "name": self.name,
            "precision": self.precision,
            "kernels": self.kernels,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "parameters": self.num_params,
            "param_bytes": self.param_bytes,
            "buffer_bytes": self.buffer_bytes,
            "fwd_flops": self.fwd_flops,
            "bwd_flops": self.bwd_flops,
            "flops_per_step": self.flops_per_step,
            "saved_bytes": self.saved_bytes,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "block_container": self.block_container,
            "tp_layout": [list(pair) for pair in self.tp_layout],
            "tp_unavailable": self.tp_unavailable,
            "pp_unavailable": self.pp_unavailable,
            "pp_traced": self.pp_traced,
            "pp_tied_params": self.pp_tied_params,
            "ddp_unavailable": self.ddp_unavailable,
            "class_wrap_extra": self.class_wrap_extra,
            "sp_unavailable": self.sp_unavailable,
            "block_sequence": self.block_sequence,
            "loss_in_forward": self.loss_in_forward,
            "embed": self.embed.to_dict(),
            "blocks": [b.to_dict() for b in self.blocks],
            "head": self.head.to_dict(),
            "notes": list(self.notes),
            "profile_seconds": self.profile_seconds,
            "in_compute_dtype": None if self.in_compute_dtype is None else self.in_compute_dtype.to_dict(),
            "autocast_refused": self.autocast_refused,
        }

    @classmethod
    def from_dict(cls, data: Any) -> ModelProfile:
        """The inverse of :meth:`to_dict`, checked: the schema version, every field's type and the
        invariants the cost models rely on; totals, where present, must match the segments.
        Raises :class:`ProfileDataError` naming the first field that does not hold."""
        if not isinstance(data, Mapping):
            raise ProfileDataError(f"a profile is a JSON object, not {type(data).__name__}")
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ProfileDataError(f"schema_version is {data.get('schema_version')!r}, this stratagem reads "
                                   f"{SCHEMA_VERSION} (written by another version)")
        values = checked_fields(cls, data, "profile")
        values["embed"] = SegmentProfile.from_dict(require(data, "embed", "profile"), "embed")
        values["head"] = SegmentProfile.from_dict(require(data, "head", "profile"), "head")
        blocks = as_list(require(data, "blocks", "profile"), "blocks")
        values["blocks"] = tuple(SegmentProfile.from_dict(b, f"blocks[{i}]") for i, b in enumerate(blocks))
        notes = as_list(data.get("notes", []), "notes")
        values["notes"] = tuple(as_text(n, f"notes[{i}]") for i, n in enumerate(notes))
        values["tp_layout"] = tuple(as_pair(p, f"tp_layout[{i}]")
                                    for i, p in enumerate(as_list(data.get("tp_layout", []), "tp_layout")))
        if data.get("in_compute_dtype") is not None:
            values["in_compute_dtype"] = cls.from_dict(data["in_compute_dtype"])
        profile = cls(**values)
        _check_invariants(profile, data)
        return profile


# What holds between a stored profile's fields, beyond each one's type (stored_fields).

_TOTALS = {"parameters": "num_params", "param_bytes": "param_bytes", "buffer_bytes": "buffer_bytes",
           "fwd_flops": "fwd_flops", "bwd_flops": "bwd_flops", "flops_per_step": "flops_per_step",
           "saved_bytes": "saved_bytes"}


def _check_invariants(profile: ModelProfile, data: Mapping[str, Any]) -> None:
    """What the cost models assume of a profile beyond each field's type."""
    if profile.kernels not in KERNELS:
        raise ProfileDataError(f"kernels: {profile.kernels!r} is none of {', '.join(KERNELS)}")
    if profile.precision not in PRECISIONS:
        raise ProfileDataError(f"precision: {profile.precision!r} is none of {', '.join(PRECISIONS)}")
    variant = profile.in_compute_dtype
    if variant is not None and (variant.precision != in_compute_dtype(profile.precision) or variant.kernels != profile.kernels
                                or len(variant.blocks) != len(profile.blocks)):
        raise ProfileDataError(f"in_compute_dtype: a {variant.precision} profile of {len(variant.blocks)} blocks "
                               f"does not describe this {profile.precision} one of {len(profile.blocks)}")
    if profile.block_container is not None and not profile.blocks:
        raise ProfileDataError(f"blocks: empty although block_container is {profile.block_container!r}")
    if profile.block_container is None and profile.blocks:
        raise ProfileDataError("blocks: present although block_container is null")
    names = [block.name for block in profile.blocks]
    if len(set(names)) != len(names):
        raise ProfileDataError("blocks: two blocks share a name")
    for i, block in enumerate(profile.blocks):
        if block.measured_as is not None and block.measured_as not in names[:i]:
            raise ProfileDataError(f"blocks[{i}].measured_as: {block.measured_as!r} is no earlier block")
    for key, attribute in _TOTALS.items():
        if key in data and data[key] != getattr(profile, attribute):
            raise ProfileDataError(f"{key}: {data[key]!r} disagrees with the segments' sum "
                                   f"({getattr(profile, attribute)})")
