"""Where an offloaded step's time goes, to check the cost model's offload terms one by one: the
host link's copy rate (pinned and pageable, one large tensor and the model's own parameter sizes,
each way), then a plan ``single zero3 offload=params`` (FSDP2's ``CPUOffloadPolicy``, bf16
autocast, AdamW), as ``stratagem verify`` applies it, timed by phase (forward with the loss,
backward, the optimizer's step on the host, with the kernel's share of it and the page faults it
took), the same step over DTensors of the model's parameter sizes as ``calibrate`` builds them,
with the profiler's device time of its copies each way against its kernels, and the host's own
time in the optimizer's step.

    python bench/offload_phases.py [MODEL:MICRO_BATCH[:SEQ_LEN] ...]

Default ``hf:bench/configs/bloom-560m:8:1024`` (``bench/gpu_check.sh`` measured its offloaded step
at 1.13 s on one H200 where 286 ms were predicted). MODEL a preset or ``hf:PATH``. On CPU it runs
too (tiny models, gloo, no host link), for checking the script; the figures that matter are a
GPU's.
"""

from __future__ import annotations

import contextlib
import os
import resource
import statistics
import sys
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from stratagem.advisor.calibrate.optimizers import benchmark_parameters
from stratagem.advisor.profile.cache import profile_spec
from stratagem.distributed import init_process_group
from stratagem.plan import Plan
from stratagem.plugins import apply_plan, autocast_context, build_mesh, build_optimizer
from stratagem.plugins.host_optimizer import host_optimizer_options
from stratagem.plugins.materialize import materialize
from stratagem.verify.models import real_model
from timing import median_seconds, sync  # bench/timing.py

LARGE_COPY_BYTES = 2**28


def copy_rates(device: torch.device, sizes: list[int]) -> None:
    """GB/s of host-to-device and device-to-host copies, pinned and pageable: one tensor of
    :data:`LARGE_COPY_BYTES`, and fp32 tensors of ``sizes`` elements one after the other (as an
    offloaded model's parameters travel), each timed whole."""
    if device.type != "cuda":
        print("host link: none (CPU ranks)")
        return
    cases = {"one 256 MiB tensor": [LARGE_COPY_BYTES // 4], f"{len(sizes)} parameter tensors": sizes}
    for label, numels in cases.items():
        total = 4 * sum(numels)
        for pinned in (True, False):
            up, down = _copy_seconds(numels, device, pinned=pinned)
            print(f"host link, {label} ({total / 1e9:.2f} GB), {'pinned' if pinned else 'pageable'}: "
                  f"to device {total / up / 1e9:.1f} GB/s, to host {total / down / 1e9:.1f} GB/s")


def _copy_seconds(numels: list[int], device: torch.device, *, pinned: bool) -> tuple[float, float]:
    """Seconds to copy fp32 tensors of ``numels`` elements to ``device`` and back, each way whole."""
    host = [torch.empty(n, pin_memory=pinned) for n in numels]
    dev = [torch.empty(n, device=device) for n in numels]
    return (median_seconds(lambda: [d.copy_(h, non_blocking=True) for d, h in zip(dev, host)], repeats=5),
            median_seconds(lambda: [h.copy_(d, non_blocking=True) for d, h in zip(dev, host)], repeats=5))


def offloaded_step(spec: str, device: torch.device, *, steps: int = 3) -> None:
    """Time ``spec``'s offloaded step by phase, then profile one step's copies and kernels."""
    name, micro, seq = (spec.rsplit(":", 2) + ["", ""])[:3] if spec.startswith("hf:") else \
        (spec.split(":") + ["", ""])[:3]
    seq_len = int(seq) if seq else None
    profile = profile_spec(name, seq_len=seq_len)
    plan = Plan(zero=3, offload="params", micro_batch_size=int(micro), block_container=profile.block_container)
    model = real_model(name, seq_len=seq_len)
    if model.prepare is not None:
        model.prepare(plan.micro_batch_size)
    torch.manual_seed(0)
    batch = model.make_batch(plan.micro_batch_size).to(device)
    with torch.device("meta"):
        built = model.build(plan.micro_batch_size, batch)
    parallel = apply_plan(built.module, plan, build_mesh(plan, device_type=device.type))
    materialize(built.module, device, params_on_host=True)
    sizes = [p.numel() for p in parallel.parameters()]
    copy_rates(device, sizes)
    optimizer = build_optimizer(parallel, plan, torch.optim.AdamW, lr=1e-4)
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    kernel_side: list[tuple[float, float, float]] = []  # the optimizer's (wall, system, faults)

    def step(record: bool) -> None:
        marks = [time.perf_counter()]
        with autocast_context(plan, device.type):
            loss = built.loss(parallel(*batch.args, **batch.kwargs), batch.targets)
        sync()
        marks.append(time.perf_counter())
        loss.backward()
        sync()
        marks.append(time.perf_counter())
        with kernel_time(kernel_side if record else []):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        marks.append(time.perf_counter())
        if record:
            for phase, start, end in zip(phases, marks, marks[1:]):
                phases[phase].append(end - start)

    for _ in range(2):
        step(record=False)
    for _ in range(steps):
        step(record=True)
    medians = {phase: statistics.median(times) for phase, times in phases.items()}
    print(f"{spec} offload=params, {sum(sizes) / 1e6:.0f}M parameters in {len(sizes)} tensors: step "
          f"{sum(medians.values()) * 1e3:.0f} ms = " + " + ".join(f"{p} {s * 1e3:.0f}" for p, s in medians.items()))
    print("  the optimizer's step: " + _kernel_side(kernel_side))
    same_shapes(sizes, device, next(parallel.parameters()).device_mesh, plan)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step(record=False)
    copies: dict[str, tuple[float, int]] = {}
    kernels = 0.0
    for event in prof.key_averages():
        seconds = event.self_device_time_total / 1e6
        if event.key.startswith("Memcpy") or event.key.startswith("Memset"):
            copies[event.key] = (seconds, event.count)
        elif event.device_type == torch.autograd.DeviceType.CUDA:
            kernels += seconds
    print("  device time of one step (ms): kernels %.0f; " % (kernels * 1e3) + ", ".join(
        f"{key} {seconds * 1e3:.0f} ({count})" for key, (seconds, count) in sorted(copies.items())))
    # the fused kernel; one tensor at a time, the in-place passes and the two that allocate a
    # parameter-sized temporary each (sqrt, div)
    optimizer_ops = ("aten::_fused", "aten::_foreach", "aten::add_", "aten::addcmul_", "aten::addcdiv_", "aten::mul",
                     "aten::lerp", "aten::sqrt", "aten::div")
    host_ops = [e for e in prof.key_averages() if e.key.startswith(optimizer_ops)]
    print("  host time of the optimizer's operators (ms, calls): " + ", ".join(
        f"{e.key[6:]} {e.self_cpu_time_total / 1e3:.0f} ({e.count})"
        for e in sorted(host_ops, key=lambda e: -e.self_cpu_time_total)[:8]))


@contextlib.contextmanager
def kernel_time(out: list[tuple[float, float, float]]) -> Iterator[None]:
    """Append the wall seconds, the kernel's seconds in this process and its minor page faults
    (fresh pages: a temporary above glibc's mmap threshold faults its pages in at every step)."""
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    yield
    after = resource.getrusage(resource.RUSAGE_SELF)
    out.append((time.perf_counter() - started, after.ru_stime - before.ru_stime, after.ru_minflt - before.ru_minflt))


def _kernel_side(rows: list[tuple[float, float, float]]) -> str:
    wall, system, faults = (statistics.median(column) for column in zip(*rows))
    return f"{wall * 1e3:.0f} ms, {system * 1e3:.0f} ms of it in the kernel, {faults / 1e3:.0f}k page faults"


def same_shapes(sizes: list[int], device: torch.device, mesh: DeviceMesh, plan: Plan) -> None:
    """AdamW over DTensors of the model's own parameter sizes on its mesh, shards on the host,
    pinned on a GPU node, on the path the plugins take for ``plan`` (fused), as ``calibrate``
    times its two large tensors: what the real step adds beyond them is FSDP's, not the shapes'."""
    params = [param for numel in sizes for param in benchmark_parameters(
        1, numel, torch.device("cpu"), mesh, pin_memory=device.type == "cuda")]
    optimizer = torch.optim.AdamW(params, **host_optimizer_options(plan, torch.optim.AdamW, {"lr": 1e-4}))
    optimizer.step()  # makes the states
    rows: list[tuple[float, float, float]] = []
    for _ in range(3):
        with kernel_time(rows):
            optimizer.step()
    print("  the same sizes as calibrate builds them: " + _kernel_side(rows))


def main(specs: list[str]) -> None:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        for spec in specs or ["hf:bench/configs/bloom-560m:8:1024"]:
            offloaded_step(spec, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
