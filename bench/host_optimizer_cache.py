"""The host's optimizer step by tensor size against its last-level cache: what an offloaded plan's
step costs per parameter where a tensor's fp32 values, gradient and AdamW states (16 bytes a
parameter) fit the cache and where they do not, and what ``calibrate``'s host benchmark solves to
with the shape it times now (:func:`~stratagem.advisor.calibrate.optimizers.host_optimizer_shape`)
and with the shape it timed before 2026-11-28 (eight tensors, 256 MiB in all), whose tensors a
large server cache holds (docs/cost-model.md, "Optimizer step and offload").

    python bench/host_optimizer_cache.py

torch.optim's AdamW on plain CPU tensors, one tensor at a time (its default there) and fused (as
the plugins step an offloaded plan's: plugins/host_optimizer.py), the median of three steps after
one (which makes the states). Prints each size's nanoseconds per parameter and the rate at the
cost model's tensor passes of 4 bytes a parameter (``OPTIMIZER_TENSOR_PASSES``, 20; the fused
kernel's ``FUSED_TENSOR_PASSES``, 7); the solves step DTensors on a one-rank mesh of the node's
devices, pinned on a GPU node, as ``calibrate`` steps FSDP's offloaded shards (fused since format 11).
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from stratagem.advisor.calibrate.optimizers import (HOST_OPTIMIZER_BYTES, benchmark_parameters, host_optimizer_shape,
                                                    optimizer_seconds)
from stratagem.advisor.cost.optimizer import FUSED_TENSOR_PASSES, OPTIMIZER_TENSOR_PASSES
from stratagem.advisor.hardware.host import last_level_cache_bytes
from stratagem.distributed import init_process_group
from stratagem.units import format_bytes
from timing import median_seconds  # bench/timing.py

PASSES, FUSED = OPTIMIZER_TENSOR_PASSES["adamw"], FUSED_TENSOR_PASSES["adamw"]  # 4-byte passes a parameter

TOTAL_PARAMS = 2**24
"""Parameters of each size's step (several tensors where they are small)."""


def per_param_seconds(numel: int, *, pinned: bool = False, fused: bool = False) -> float:
    """Seconds per parameter of an AdamW step over ``TOTAL_PARAMS`` parameters in tensors of
    ``numel``, one tensor at a time or ``fused``; with ``pinned``, the parameters and gradients in
    page-locked memory, as FSDP2's ``CPUOffloadPolicy`` keeps them (its default
    ``pin_memory=True``), the states not."""
    params = benchmark_parameters(max(1, TOTAL_PARAMS // numel), numel, torch.device("cpu"), None, pin_memory=pinned)
    optimizer = torch.optim.AdamW(params, lr=1e-4, **({"fused": True} if fused else {"foreach": False}))
    return median_seconds(optimizer.step, repeats=3) / (numel * len(params))


def main() -> None:
    cache = last_level_cache_bytes()
    print(f"last-level caches: {format_bytes(cache) if cache else 'unknown'}; {torch.get_num_threads()} threads")
    for numel in (2**16, 2**18, 2**20, 2**22, 2**24, 2**26):
        seconds, fused = per_param_seconds(numel), per_param_seconds(numel, fused=True)
        share = f", {16 * numel / cache:.2g}× the cache" if cache else ""
        print(f"  tensors of {numel:>10,} parameters ({format_bytes(16 * numel)} with states{share}): "
              f"{seconds * 1e9:5.2f} ns a parameter, {4 * PASSES / seconds / 1e9:5.1f} GB/s at {PASSES} passes; "
              f"fused {fused * 1e9:5.2f} ns, {4 * FUSED / fused / 1e9:5.1f} GB/s at {FUSED}")
    if torch.cuda.is_available():  # page-locked memory is CUDA's to allocate
        nodes = len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or "unknown"
        pinned = (f"{format_bytes(16 * numel)} with states {per_param_seconds(numel, pinned=True) * 1e9:.2f} ns, "
                  f"fused {per_param_seconds(numel, pinned=True, fused=True) * 1e9:.2f}"
                  for numel in (2**22, 2**24, 2**26))
        print(f"  pinned parameters and gradients, as FSDP2 offloads them ({nodes} NUMA nodes): " + ", ".join(pinned))
    tensors, params = host_optimizer_shape(cache, psutil.virtual_memory().available, ranks=1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29518")
    init_process_group("gloo", rank=0, world_size=1)  # calibrate's timings agree across ranks
    # over DTensors on the node's mesh, as calibrate times FSDP's offloaded shards (their device's
    # mesh: a GPU's, where DTensor.from_local had moved them onto the GPU)
    mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (1,))
    for label, shape in (("before (8 tensors, 256 MiB)", (8, HOST_OPTIMIZER_BYTES // 16)),
                         (f"now ({tensors} tensors, {format_bytes(16 * params)})", (tensors, params))):
        for fused in (False, True):
            per_param, per_tensor = optimizer_seconds(shape[1], torch.device("cpu"), repeats=3, tensors=shape[0],
                                                      mesh=mesh, pin_memory=torch.cuda.is_available(),
                                                      fused=fused)["adamw"]
            print(f"calibrate's solve, {label}, {'fused' if fused else 'one tensor at a time'}: "
                  f"{per_param * 1e9:.2f} ns a parameter, {per_tensor * 1e6:.1f} µs a tensor")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
