"""What the cost models predict for one Plan: memory per rank and time per step, term by term."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryBreakdown:
    """Bytes per rank on the most loaded rank (the first pipeline stage), at peak."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float  # transient: gathered FSDP units, prefetch, DDP buckets, logits, allocator slack

    @property
    def total(self) -> float:
        """Sum of the terms, bytes per rank."""
        return sum(getattr(self, f.name) for f in fields(self))

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True, slots=True, kw_only=True)
class TimeBreakdown:
    """Seconds per optimizer step, each term as it adds to the step (communication: its exposed,
    not-overlapped part). ``*_total`` fields hold the full communication time before overlap."""

    compute: float
    recompute: float
    dp_comm: float
    tp_comm: float
    pp_comm: float
    bubble: float
    optimizer: float
    offload: float
    dp_comm_total: float = 0.0
    tp_comm_total: float = 0.0
    pp_comm_total: float = 0.0

    @property
    def step_seconds(self) -> float:
        """Predicted wall time of one optimizer step, seconds."""
        return (self.compute + self.recompute + self.dp_comm + self.tp_comm + self.pp_comm
                + self.bubble + self.optimizer + self.offload)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "step_seconds": self.step_seconds}
