"""What a model costs, per segment: the data a profile produces and the cost models read.

Plain frozen data with no torch import, so that planning from a stored profile stays light;
:func:`stratagem.advisor.profile.profiler.profile_model` measures one. Bytes are bytes, FLOPs are
floating-point operations (a multiply-add is 2), all for one training step of the profiled batch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class LinearLayer:
    """A Linear layer inside a block: the pieces tensor parallelism splits."""

    name: str  # FQN relative to the block
    in_features: int
    out_features: int
    bias: bool
    rows: int = 0  # rows (tokens) it multiplied in the profiled step, 0 where not recorded; fewer
    # than the block's other Linears: a routed expert's share of the tokens

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
    attention_fwd_flops: int  # forward FLOPs of the attention core (what selective recompute redoes)
    attention_saved_bytes: int  # of saved_bytes, the s×s score-shaped tensors (what it drops)
    input_bytes: int
    output_bytes: int  # what a pipeline stage ending here sends; what full checkpointing keeps
    num_tensors: int = 0  # parameter tensors (what a per-tensor optimizer loops over)
    fwd_ops: int = 0  # operators dispatched in forward
    bwd_ops: int = 0  # operators dispatched in backward
    fwd_op_bytes: int = 0  # bytes read and written in forward by operators without FLOPs (norms, elementwise)
    bwd_op_bytes: int = 0  # the same in backward
    fwd_unaligned_flops: int = 0  # of fwd_flops, GEMMs with a leading dimension off 16 bytes (slow kernels)
    bwd_unaligned_flops: int = 0  # of bwd_flops, the same
    fwd_param_op_bytes: int = 0  # moved by parameter-sized ops (autocast's weight casts), as many at any batch; apart
    bwd_param_op_bytes: int = 0  # the same in backward (gradient casts, embedding gradients); not in *_op_bytes
    bwd_largest_output_bytes: int = 0  # the largest non-weight-shaped tensor a backward op writes (the head's: loss grad)
    linears: tuple[LinearLayer, ...] = ()
    measured_as: str | None = None  # identical block whose measurement this one reuses

    @property
    def flops(self) -> int:
        """Forward plus backward FLOPs."""
        return self.fwd_flops + self.bwd_flops

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["linears"] = [linear.to_dict() for linear in self.linears]
        out["flops"] = self.flops
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SegmentProfile:
        """The inverse of :meth:`to_dict` (derived keys are ignored)."""
        values = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        values["linears"] = tuple(LinearLayer(**x) for x in data.get("linears", ()))
        return cls(**values)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelProfile:
    """Per-segment costs of one training step at ``batch_size`` samples (``seq_len`` tokens each,
    for sequence models), with parameters in ``precision``'s parameter dtype."""

    name: str
    precision: str
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
    notes: tuple[str, ...] = ()
    profile_seconds: float = 0.0

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
            "name": self.name,
            "precision": self.precision,
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
            "embed": self.embed.to_dict(),
            "blocks": [b.to_dict() for b in self.blocks],
            "head": self.head.to_dict(),
            "notes": list(self.notes),
            "profile_seconds": self.profile_seconds,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelProfile:
        """The inverse of :meth:`to_dict` (totals are recomputed, not read)."""
        values = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        values["embed"] = SegmentProfile.from_dict(data["embed"])
        values["head"] = SegmentProfile.from_dict(data["head"])
        values["blocks"] = tuple(SegmentProfile.from_dict(b) for b in data["blocks"])
        values["notes"] = tuple(data.get("notes", ()))
        values["tp_layout"] = tuple(tuple(pair) for pair in data.get("tp_layout", ()))
        return cls(**values)
