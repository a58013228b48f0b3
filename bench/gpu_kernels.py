"""Where one training step's device time goes, by kernel family, for a preset trained as
``stratagem verify`` trains a single-device plan (bf16 autocast, AdamW), eager, with each block
compiled by the plugin (``compiled``) or compiled whole, one graph (``whole``): GEMMs (cuBLAS, CUTLASS), attention (flash and memory-efficient), cuDNN's
convolutions and their layout transforms, batch norm, Triton (what compilation fused), the
optimizer's multi-tensor kernels and everything else, each with its time and kernel count, and
the largest kernels by name. It prints the median step beside the device time, so the time
between kernels shows (the profiler's own ranges, such as the optimizer's step, are left out:
they would count their kernels twice), and on a GPU how much of that the device waited for the
host to launch the next kernel, against gaps with the next kernel launched already, in each phase
of the step (forward with the loss, backward, the optimizer's step, the rest).

    python bench/gpu_kernels.py MODEL:MICRO_BATCH[:SEQ_LEN][:compiled|:whole][+channels-last] ...

MODEL a preset or ``hf:PATH`` (a Hugging Face config, random weights), e.g. ``gpt2-large:8:1024:compiled
vit-l-16:64::compiled hf:bench/configs/pythia-410m:8:1024:compiled resnet-50:256::whole``. On CPU it
runs too (tiny models, eager), for checking the script; the figures that matter are a GPU's.

With Nsight Compute, the bytes each family moves to and from device memory, and at what rate
(one step, each kernel replayed; minutes for a step of a few thousand kernels):

    ncu --nvtx --nvtx-include measured/ --metrics gpu__time_duration.sum,dram__bytes.sum --csv \
        --page raw python bench/gpu_kernels.py --ncu gpt2-large:8:1024:compiled > kernels.csv
    python bench/gpu_kernels.py --summarize kernels.csv
"""

from __future__ import annotations

import contextlib
import csv
import statistics
import sys
import time
from collections.abc import Callable

import torch

from stratagem.advisor.profile.structure import find_blocks
from stratagem.plan import Plan
from stratagem.plugins import apply_compile
from stratagem.verify.models import Batch, real_model
from timing import sync  # bench/timing.py

FAMILIES = (  # the first family whose marks a kernel's name holds (lower case) takes it
    ("attention", ("flash", "fmha", "attention", "efficient")),
    ("batch norm", ("batch_norm", "batchnorm", "bn_fw", "bn_bw")),
    ("layout", ("nchwtonhwc", "nhwctonchw")),
    ("optimizer", ("multi_tensor", "foreach", "adam")),
    ("triton", ("triton",)),
    ("gemm/conv", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "conv", "cudnn", "wgrad", "dgrad")),
)
TOP = 8


def family(kernel: str) -> str:
    """The family of a kernel by its name."""
    name = kernel.lower()
    return next((label for label, marks in FAMILIES if any(mark in name for mark in marks)), "other")


def build_step(spec: str, device: torch.device) -> tuple[Callable[[], None], float]:
    """One training step of ``spec`` (``MODEL:MICRO_BATCH[:SEQ_LEN][:MODES]``, the model a preset or
    ``hf:PATH``, built as ``verify`` builds it; ``MODES`` joined by ``+``: ``compiled`` or ``whole``,
    and ``channels-last``, the model and its 4-D inputs in ``torch.channels_last``) and the seconds
    its first run took (compilation included), after two more warm-up steps."""
    prefix = "hf:" if spec.startswith("hf:") else ""
    name, micro, seq, mode = (spec.removeprefix(prefix).split(":") + ["", "", ""])[:4]
    modes = set(mode.split("+")) - {""}
    model_spec = real_model(prefix + name, seq_len=int(seq) if seq else None)
    torch.manual_seed(0)
    batch = model_spec.make_batch(int(micro)).to(device)
    with torch.device(device):
        built = model_spec.build(int(micro), batch)
    model = built.module
    if "channels-last" in modes:
        model = model.to(memory_format=torch.channels_last)
        batch = Batch(tuple(a.contiguous(memory_format=torch.channels_last) if isinstance(a, torch.Tensor)
                            and a.dim() == 4 else a for a in batch.args), batch.kwargs, batch.targets)
    if "compiled" in modes:
        apply_compile(model, Plan(compile=True, block_container=find_blocks(model).container))
    elif "whole" in modes:
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = built.loss(model(*batch.args, **batch.kwargs), batch.targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    started = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - started
    for _ in range(2):
        step()
    return step, first


def run_case(spec: str, device: torch.device, *, steps: int = 5) -> None:
    step, first = build_step(spec, device)
    times = []
    for _ in range(steps):
        sync()
        started = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - started)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        step()
        sync()
    kernels = [(event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total, event.key,
                event.count) for event in profile.key_averages()
               if not event.is_user_annotation  # a profiler range (the optimizer's step) repeats its kernels
               and (event.device_type == torch.autograd.DeviceType.CUDA) == (device.type == "cuda")
               and (device.type == "cuda" or event.key.startswith("aten::"))]
    families: dict[str, tuple[float, int]] = {}
    for micros, key, count in kernels:
        ms, calls = families.get(family(key), (0.0, 0))
        families[family(key)] = (ms + micros / 1e3, calls + count)
    step_ms, device_ms = statistics.median(times) * 1e3, sum(ms for ms, _ in families.values())
    print(f"{spec}: step {step_ms:.1f} ms (first {first:.1f} s), device {device_ms:.1f} ms in "
          f"{sum(calls for _, calls in families.values())} kernels, {step_ms - device_ms:.1f} ms between them: "
          + ", ".join(f"{label} {ms:.1f} ({calls})" for label, (ms, calls) in
                      sorted(families.items(), key=lambda item: -item[1][0])), flush=True)
    if device.type == "cuda":
        gaps, span = gap_sources(profile.profiler.kineto_results.events())
        host, queued = sum(g[0] for g in gaps.values()), sum(g[1] for g in gaps.values())
        print(f"  kernels span {span:.1f} ms; gaps between them {host + queued:.1f} ms: {host:.1f} waiting for the "
              f"host to launch the next kernel, {queued:.1f} with it launched already; by phase (waiting / "
              "launched already, ms, kernels): "
              + ", ".join(f"{label} {h:.1f} / {q:.1f} ({n})" for label, (h, q, n) in gaps.items()), flush=True)
    print("  largest: " + "; ".join(f"{key[:64]} {micros / 1e3:.2f} ms ({count})"
                                    for micros, key, count in sorted(kernels, reverse=True)[:TOP]), flush=True)


PHASES = ("forward", "backward", "optimizer", "other")


def gap_sources(events: list) -> tuple[dict[str, tuple[float, float, int]], float]:
    """From a profiled step's events (kineto's, one stream): per phase of the step, the
    milliseconds between consecutive kernels the device spent waiting for the host (the next
    kernel's launch call ended after its predecessor did), those it spent with the next kernel
    launched already (the device's own gap), and the kernels; and the span from the first kernel's
    start to the last's end. A kernel's phase is its launch's: on autograd's device thread the
    backward, inside the ``Optimizer.step`` range the optimizer, on the main thread before the
    backward's first launch the forward (the loss included), else other (``zero_grad``, what
    follows the optimizer)."""
    cuda = torch.autograd.DeviceType.CUDA
    kernels = sorted((e.start_ns(), e.end_ns(), e.correlation_id()) for e in events
                     if e.device_type() == cuda and not e.name().startswith(("Memcpy", "Memset")))
    launches = {e.correlation_id(): e for e in events if e.device_type() != cuda and "launch" in e.name().lower()}
    ranges = [(e.start_ns(), e.end_ns()) for e in events
              if e.device_type() != cuda and e.name().startswith("Optimizer.step")]
    first = min(launches.values(), key=lambda e: e.start_ns(), default=None)
    main = first.start_thread_id() if first is not None else None
    backward_from = min((e.start_ns() for e in launches.values() if e.start_thread_id() != main), default=None)

    def phase(correlation: int) -> str:
        launch = launches.get(correlation)
        if launch is None:
            return "other"
        if launch.start_thread_id() != main:
            return "backward"
        if any(start <= launch.start_ns() <= end for start, end in ranges):
            return "optimizer"
        return "forward" if backward_from is None or launch.start_ns() < backward_from else "other"

    gaps = {label: [0.0, 0.0, 0] for label in PHASES}
    for (_, end, _), (start, _, correlation) in zip(kernels, kernels[1:]):
        totals = gaps[phase(correlation)]
        totals[2] += 1
        gap = start - end
        if gap <= 0:
            continue
        launched = launches[correlation].end_ns() if correlation in launches else end
        waiting = min(gap, max(0, launched - end))
        totals[0] += waiting / 1e6
        totals[1] += (gap - waiting) / 1e6
    span = kernels[-1][1] - kernels[0][0] if kernels else 0
    return {label: (host, queued, count) for label, (host, queued, count) in gaps.items()}, span / 1e6


def ncu_case(spec: str, device: torch.device) -> None:
    """One step of ``spec`` after its warm-up, inside the NVTX range ``measured``: for Nsight
    Compute to replay kernel by kernel (``ncu --nvtx --nvtx-include measured/``)."""
    step, _ = build_step(spec, device)
    sync()
    with torch.cuda.nvtx.range("measured") if device.type == "cuda" else contextlib.nullcontext():
        step()
        sync()


def summarize_ncu(path: str) -> None:
    """Per kernel family, from Nsight Compute's raw CSV (``--csv --page raw`` with the metrics
    ``gpu__time_duration.sum`` and ``dram__bytes.sum``): kernels, time, bytes moved to and from
    device memory and the rate they moved at."""
    with open(path, newline="") as handle:
        lines = [line for line in handle if line.startswith('"')]  # ncu's own messages are not quoted
    rows = [row for row in csv.DictReader(lines) if row.get("ID", "").isdigit()]  # the units row has no ID
    families: dict[str, list[float]] = {}
    for row in rows:
        totals = families.setdefault(family(row["Kernel Name"]), [0, 0.0, 0.0])
        totals[0] += 1
        totals[1] += _number(row["gpu__time_duration.sum"]) * 1e-9  # ns
        totals[2] += _number(row["dram__bytes.sum"])
    print(f"{path}: {len(rows)} kernels")
    for label, (count, seconds, moved) in sorted(families.items(), key=lambda item: -item[1][1]):
        print(f"  {label:<11} {count:>6} kernels {seconds * 1e3:8.2f} ms {moved / 1e9:8.2f} GB "
              f"{moved / seconds / 1e9 if seconds else 0:8.0f} GB/s")


def _number(text: str) -> float:
    return float(text.replace(",", "")) if text.strip() else 0.0


def main(args: list[str]) -> None:
    if args[:1] == ["--summarize"]:
        for path in args[1:]:
            summarize_ncu(path)
        return
    ncu = args[:1] == ["--ncu"]
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    for spec in (args[1:] if ncu else args) or ["gpt2-tiny:4:64", "resnet-tiny:8"]:
        ncu_case(spec, device) if ncu else run_case(spec, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
