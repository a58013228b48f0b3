"""Gradient clipping's time on one process: ``plugins.clip_grad_norm_`` and ``clip_grad_value_``
against torch's own, with its multi-tensor kernels (``foreach=True``, its default on CPU and CUDA
tensors) and one gradient at a time (``foreach=False``), over a model's gradients (fp32, the
parameters of the preset; ``gpt2`` by default) and over as many tiny ones, where launching is all
the time there is. Measured in one run, so the ratios hold on a noisy host. Clipping by value
clamps one gradient at a time, one pass over each, where torch's multi-tensor clamps make two.

    python bench/clip_speed.py [PRESET]
"""

from __future__ import annotations

import sys

import torch
from timing import median_seconds

from stratagem.models import PRESETS
from stratagem.plugins import clip_grad_norm_, clip_grad_value_


def gradients_of(shapes: list[torch.Size]) -> list[torch.nn.Parameter]:
    """Parameters of ``shapes`` on this host's device, each with a random gradient."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    params = [torch.nn.Parameter(torch.empty(shape, device=device)) for shape in shapes]
    for param in params:
        param.grad = torch.randn_like(param)
    return params


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "gpt2"
    with torch.device("meta"):
        shapes = [p.shape for p in PRESETS[name].build().parameters()]
    for label, params in ((f"{name}'s {len(shapes)} gradients", gradients_of(shapes)),
                          (f"{len(shapes)} gradients of 16 elements", gradients_of([torch.Size([16])] * len(shapes)))):
        big = 1e9  # a norm no gradient reaches: the same work, nothing changed
        ours = median_seconds(lambda: clip_grad_norm_(params, big))
        fused = median_seconds(lambda: torch.nn.utils.clip_grad_norm_(params, big, foreach=True))
        loop = median_seconds(lambda: torch.nn.utils.clip_grad_norm_(params, big, foreach=False))
        ours_value = median_seconds(lambda: clip_grad_value_(params, big))
        fused_value = median_seconds(lambda: torch.nn.utils.clip_grad_value_(params, big, foreach=True))
        loop_value = median_seconds(lambda: torch.nn.utils.clip_grad_value_(params, big, foreach=False))
        print(f"{label}: by norm {ours * 1e3:.2f} ms (torch foreach {fused * 1e3:.2f}, one at a time "
              f"{loop * 1e3:.2f}; ours / foreach {ours / fused:.2f}); by value {ours_value * 1e3:.2f} ms "
              f"(torch foreach {fused_value * 1e3:.2f}, one at a time {loop_value * 1e3:.2f}; "
              f"ours / foreach {ours_value / fused_value:.2f})")


if __name__ == "__main__":
    main()
