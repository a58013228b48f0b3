"""What the cost models predict for one Plan: memory per rank and time per step, term by term."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from stratagem.plan import Plan


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryBreakdown:
    """Bytes per rank on the fullest pipeline rank, at peak."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float  # transient: gathered FSDP units, prefetch, DDP buckets, logits, allocator slack
    framework: float = 0.0  # what the training framework itself takes beyond the plan's tensors
    host: float = 0.0  # offloaded model states in host memory, bytes per rank (not in ``total``)

    @property
    def total(self) -> float:
        """Device bytes per rank: the sum of the terms except ``host`` (:func:`device_bytes`)."""
        return device_bytes(self.parameters, self.gradients, self.optimizer, self.activations, self.buffers,
                            self.framework)

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


def device_bytes(parameters: float, gradients: float, optimizer: float, activations: float, buffers: float,
                 framework: float) -> float:
    """Bytes per rank on the device of a :class:`MemoryBreakdown` with these terms (its ``total``),
    for comparing breakdowns without building them."""
    return parameters + gradients + optimizer + activations + buffers + framework


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
    dispatch: float = 0.0  # host time launching operators that the device work does not hide
    dp_comm_total: float = 0.0
    tp_comm_total: float = 0.0
    pp_comm_total: float = 0.0
    compile_once: float = 0.0  # compiling the blocks before the first step: paid once, not in step_seconds
    paced_rank: int = 0  # the pipeline rank whose work the terms are: the busiest (cost/pace.py)

    @property
    def step_seconds(self) -> float:
        """Predicted wall time of one optimizer step, seconds."""
        return (self.compute + self.recompute + self.dp_comm + self.tp_comm + self.pp_comm
                + self.bubble + self.optimizer + self.offload + self.dispatch)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "step_seconds": self.step_seconds}


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
    """One plan, costed: memory per rank against what the device offers, time per step, and
    the throughput and model FLOPs utilisation that follow."""

    plan: Plan
    memory: MemoryBreakdown
    time: TimeBreakdown
    capacity_bytes: float  # usable bytes per device (capacity less the reserve)
    host_capacity_bytes: float  # usable host memory per rank, for offloaded states
    throughput: float  # tokens/s for sequence models, samples/s otherwise
    throughput_unit: str  # "tokens/s" or "samples/s"
    mfu: float  # model FLOPs (no recompute) per second / (world × peak), 0..1
    device: str  # what one rank runs on, as reports name it (DeviceSpec.noun)

    @property
    def fits(self) -> bool:
        """Whether the most loaded rank's peak fits in usable device memory, and what it
        offloads in its share of host memory."""
        return self.memory.total <= self.capacity_bytes and self.memory.host <= self.host_capacity_bytes

    @property
    def headroom_bytes(self) -> float:
        """Usable bytes left on the most loaded rank (negative: short by that much)."""
        return self.capacity_bytes - self.memory.total

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape of one ranked entry of ``advise --format json``."""
        unit = "tokens_per_second" if self.throughput_unit == "tokens/s" else "samples_per_second"
        return {
            "name": self.plan.name,
            "plan": self.plan.to_dict(),
            "memory": self.memory.to_dict(),
            "capacity_bytes": self.capacity_bytes,
            "host_capacity_bytes": self.host_capacity_bytes,
            "time": self.time.to_dict(),
            unit: self.throughput,
            "mfu": self.mfu,
            "fits": self.fits,
        }
