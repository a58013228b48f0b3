"""The device memory's latency as kernels with few loads in flight meet it: ATen's per-channel
BatchNorm statistics kernel timed over a bfloat16 NCHW batch with half as many channels as the
GPU has SMs (one block of 512 threads on each of them, one 2-byte load in flight per thread),
its bytes at the measured copy rate taken off (docs/cost-model.md, "BatchNorm's kernels")."""

from __future__ import annotations

import torch

from stratagem.advisor.calibrate.benchmarks import repeated, timed
from stratagem.advisor.cost.batch_norm import THREADS_PER_BLOCK

SHAPE_IMAGES, SHAPE_SIDE = 256, 56
"""The batch timed: 256 images at 56², ResNet-50's first stage (about 100 MB with 66 channels)."""
CALLS = 10
"""Kernels timed back to back per run, so that the host's launch and synchronisation stay out."""


def memory_latency(device: torch.device, seconds_per_byte: float, *, repeats: int) -> float:
    """Seconds a load from device memory takes to come back while each SM holds one block
    streaming (module docstring), given ``seconds_per_byte`` a copy takes. On NVIDIA's CUDA only,
    whose kernels these are (``torch.batch_norm_stats`` is CUDA's; ROCm launches them otherwise)."""
    channels = max(1, torch.cuda.get_device_properties(device).multi_processor_count // 2)
    batch = torch.randn(SHAPE_IMAGES, channels, SHAPE_SIDE, SHAPE_SIDE, device=device, dtype=torch.bfloat16)
    seconds = timed(repeated(lambda: torch.batch_norm_stats(batch, 1e-5), CALLS), device, repeats=repeats) / CALLS
    size = batch.numel() * batch.element_size()
    in_flight = channels * THREADS_PER_BLOCK * batch.element_size()
    return max(0.0, seconds - size * seconds_per_byte) * in_flight / size
