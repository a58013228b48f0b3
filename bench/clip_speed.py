"""Gradient clipping's time on one process: ``plugins.clip_grad_norm_`` and ``clip_grad_value_``
against torch's own, with its multi-tensor kernels (``foreach=True``, its default on CPU and CUDA
tensors) and one gradient at a time (``foreach=False``), over a model's gradients (fp32, the
parameters of the preset; ``gpt2`` by default) and over as many tiny ones, where launching is all
the time there is. Measured in one run, so the ratios hold on a noisy host. Clipping by value
clamps one gradient at a time, one pass over each, where torch's multi-tensor clamps make two.

Then what the cost model's clipping terms rest on: the time of each clipping of the model's
gradients against its passes (``cost.optimizer.CLIP_GRADIENT_PASSES``) at the rate a copy of the
same gradients streams (what ``estimate_clip_seconds`` charges each byte on the device is the
rate operators without FLOPs stream, a copy's where ``calibrate`` measured one); and the host's
cost of ``DTensor.to_local`` (a one-rank gloo mesh) in plain operators (``cost.host.TO_LOCAL_OPS``).

    python bench/clip_speed.py [PRESET]
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from timing import median_seconds
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from stratagem.advisor.cost.optimizer import CLIP_GRADIENT_PASSES
from stratagem.models import PRESETS
from stratagem.plugins import clip_grad_norm_, clip_grad_value_


def gradients_of(shapes: list[torch.Size]) -> list[torch.nn.Parameter]:
    """Parameters of ``shapes`` on this host's device, each with a random gradient."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    params = [torch.nn.Parameter(torch.empty(shape, device=device)) for shape in shapes]
    for param in params:
        param.grad = torch.randn_like(param)
    return params


def streamed(params: list[torch.nn.Parameter], clipped: dict[str, float]) -> None:
    """Each clipping's time against its passes at the rate a copy of the gradients streams."""
    copies = [torch.empty_like(param.grad) for param in params]
    seconds = median_seconds(lambda: [copy.copy_(param.grad) for copy, param in zip(copies, params)], 5)
    per_byte = seconds / sum(2 * param.grad.nbytes for param in params)
    print(f"a copy of the gradients {seconds * 1e3:.1f} ms ({1e-9 / per_byte:.1f} GB/s read and written); " + "; ".join(
        f"by {how} {measured * 1e3:.1f} ms, its passes at that rate "
        f"{CLIP_GRADIENT_PASSES[how] * sum(param.grad.nbytes for param in params) * per_byte * 1e3:.1f}"
        for how, measured in clipped.items()))


def to_local_cost(calls: int = 300, repeats: int = 20) -> None:
    """``DTensor.to_local`` against an in-place clamp of a plain tensor, per call."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29547")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        shards = [distribute_tensor(torch.randn(4), mesh, [Shard(0)]) for _ in range(calls)]
        plain = [torch.randn(4) for _ in range(calls)]

        def per_call(fn) -> float:
            started = time.perf_counter()
            for _ in range(repeats):
                for tensor in shards if fn is None else plain:
                    tensor.to_local() if fn is None else fn(tensor)
            return (time.perf_counter() - started) / repeats / calls

        local, clamp = per_call(None), per_call(lambda t: t.clamp_(-1, 1))
        print(f"DTensor.to_local {local * 1e6:.2f} µs a call, clamp_ {clamp * 1e6:.2f} µs: "
              f"{local / clamp:.1f} operators")
    finally:
        dist.destroy_process_group()


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
        if label.startswith(name):
            streamed(params, {"norm": ours, "value": ours_value})
    to_local_cost()


if __name__ == "__main__":
    main()
