"""Where a single-device training step spends its time and memory, to check the cost model's
terms one by one: forward, backward and optimizer time (device-synchronised), the device time
of the kernels by the kind of ATen operator that launched them (GEMMs, attention, convolutions,
batch norm, the optimizer's multi-tensor operators, everything else: elementwise, norms, reductions, copies; the
largest of those by name) and the peak memory within forward, backward and the optimizer step;
for language models, the memory their forward and loss hold step by step; then the rate of a
GEMM whose widths are multiples of 8 against one whose output width is not.

    python bench/gpu_phases.py [PRESET:MICRO_BATCH[:GRAD_ACCUM][:SEQ_LEN] ...]

Default: gpt2:16::1024 vit-b-16:128 llama-2-7b:1:4:2048, in bf16-mixed with AdamW, as
``stratagem verify`` runs a single-device plan. On CPU it runs too (tiny presets), for checking
the script; the figures that matter are a GPU's.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from stratagem.advisor.hardware import parse_cluster
from stratagem.plan import Plan, Workload
from stratagem.advisor.profile.cache import profile_spec
from stratagem.advisor.cost.rank_step import rank_step
from stratagem.models import get_preset
from timing import median_seconds, sync  # bench/timing.py

KINDS = {
    "attention": ("attention", "flash", "efficient"),
    "gemm": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"),
    "convolution": ("convolution", "cudnn_conv"),
    "batch norm": ("batch_norm",),
    "optimizer": ("_foreach", "_fused_adam"),
}
TOP_OTHER = 12


def kind_of(operator: str) -> str:
    """The kind of an ATen operator by its name: the kernels it launches are counted under it."""
    for kind, marks in KINDS.items():
        if any(mark in operator for mark in marks):
            return kind
    return "other"


def run_case(spec: str, device: torch.device, *, steps: int = 3) -> None:
    name, micro, accum, seq = (spec.split(":") + ["", "", ""])[:4]
    preset = get_preset(name)
    micro_batch, grad_accum = int(micro), int(accum or 1)
    seq_len = int(seq) if seq else None
    torch.manual_seed(0)
    inputs, targets = preset.make_batch(micro_batch, seq_len) if preset.input_kind == "tokens" else \
        preset.make_batch(micro_batch)
    inputs, targets = tuple(t.to(device) for t in inputs), targets.to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    with torch.device(device):
        model = preset.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dtype = torch.bfloat16
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    peaks = {"forward": 0, "backward": 0, "optimizer": 0}  # the highest allocation within each phase

    def phase_peak(phase: str) -> None:
        if device.type == "cuda":
            peaks[phase] = max(peaks[phase], torch.cuda.max_memory_allocated(device) - base)
            torch.cuda.reset_peak_memory_stats(device)

    def step(record: bool) -> None:
        for _ in range(grad_accum):
            sync()
            phase_peak("optimizer")  # what came before this forward
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=dtype):
                loss = preset.loss(model(*inputs), targets) / grad_accum
            sync()
            middle = time.perf_counter()
            phase_peak("forward")
            loss.backward()
            sync()
            phase_peak("backward")
            if record:
                phases["forward"].append(middle - start)
                phases["backward"].append(time.perf_counter() - middle)
        start = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        if record:
            phases["optimizer"].append(time.perf_counter() - start)

    for _ in range(2):
        step(record=False)
    for _ in range(steps):
        step(record=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        step(record=False)
    kinds: dict[str, float] = {}
    others: list[tuple[float, str, int]] = []
    for event in profile.key_averages():
        if not event.key.startswith("aten::"):
            continue
        seconds = (event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total) / 1e6
        kind = kind_of(event.key)
        kinds[kind] = kinds.get(kind, 0.0) + seconds
        if kind == "other" and seconds > 0:
            others.append((seconds, event.key, event.count))
    per_step = {phase: statistics.median(times) * (grad_accum if phase != "optimizer" else 1)
                for phase, times in phases.items()}
    print(f"{spec}: step {sum(per_step.values()) * 1e3:.1f} ms = "
          + " + ".join(f"{phase} {seconds * 1e3:.1f}" for phase, seconds in per_step.items()))
    print("  device time per step by operator kind (ms): " + ", ".join(
        f"{kind} {seconds * 1e3:.1f}" for kind, seconds in sorted(kinds.items(), key=lambda item: -item[1])))
    print("  the other operators' largest (ms, calls): " + ", ".join(
        f"{name[6:]} {seconds * 1e3:.1f} ({count})" for seconds, name, count in sorted(others, reverse=True)[:TOP_OTHER]))
    print(f"  the profile counts them moving {bytes_moved(name, micro_batch, grad_accum, seq_len) / 1e9:.1f} GB a step")
    if device.type == "cuda":
        print("  memory peak within each phase (GiB): " + ", ".join(
            f"{phase} {bytes_ / 2**30:.2f}" for phase, bytes_ in peaks.items()))


def bytes_moved(name: str, micro_batch: int, grad_accum: int, seq_len: int | None) -> float:
    """Bytes the cost model has operators without FLOPs move in a step of one device (its
    ``RankStep``: the profile's per micro-batch, the parameter-sized ones once each)."""
    profile = profile_spec(name, seq_len=seq_len)
    plan = Plan(micro_batch_size=micro_batch, grad_accum=grad_accum)
    step = rank_step(profile, cluster=parse_cluster("1xcpu"), plan=plan,
                     workload=Workload(global_batch_size=plan.global_batch_size, seq_len=profile.seq_len))
    return step.num_microbatches * sum(step.per_microbatch(f"{d}_op_bytes") + step.per_tp_rank(f"{d}_param_op_bytes")
                                       for d in ("fwd", "bwd"))


def gemm_alignment(device: torch.device) -> None:
    """bf16 (fp32 on CPU) rate of [16384×768]·[768×N] for N = 50257 (the GPT-2 vocabulary) and 50304."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = 16384 if device.type == "cuda" else 512
    for width in (50257, 50304):
        a = torch.randn(rows, 768, device=device, dtype=dtype)
        b = torch.randn(768, width, device=device, dtype=dtype)
        grad = torch.randn(rows, width, device=device, dtype=dtype)
        rates = []
        for label, fn in (("forward", lambda: a @ b), ("grad input", lambda: grad @ b.T),
                          ("grad weight", lambda: a.T @ grad)):
            rates.append(f"{label} {2 * rows * 768 * width / median_seconds(fn, repeats=5) / 1e12:.3g}")
        print(f"  GEMM {rows}x768x{width} TFLOP/s: " + ", ".join(rates))


class _AfterEachOperator(TorchDispatchMode):
    """Records each operator's name and ``reading()`` once it has run."""

    def __init__(self, reading: Callable[[], int]) -> None:
        super().__init__()
        self.reading = reading
        self.marks: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.marks.append((func.overloadpacket.__name__, self.reading()))
        return out


def loss_memory(spec: str, device: torch.device) -> None:
    """CUDA: the memory a language model's loss holds, operator by operator, and the peak of its
    backward, in GiB above the model's parameters: what the memory model's loss terms predict."""
    if device.type != "cuda":
        return
    name, micro, _, seq = (spec.split(":") + ["", "", ""])[:4]
    preset = get_preset(name)
    (tokens,), targets = preset.make_batch(int(micro), int(seq) if seq else None, device=device)
    with torch.device(device):
        model = preset.build()
    base = torch.cuda.memory_allocated(device)

    def gib(num_bytes: int) -> str:
        return f"{(num_bytes - base) / 2**30:.2f}"

    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(tokens)
        logged = f"logits {gib(torch.cuda.memory_allocated(device))}"
        with _AfterEachOperator(lambda: torch.cuda.memory_allocated(device)) as loss_ops:
            loss = preset.loss(logits, targets)
    del logits  # as in training, where the model's output goes straight into the loss
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    loss.backward()
    peak = torch.cuda.max_memory_allocated(device)
    print(f"  {spec} GiB live: {logged}; the loss's operators: "
          + ", ".join(f"{op} {gib(after)}" for op, after in loss_ops.marks)
          + f"; backward starts at {gib(start)}, peaks at {gib(peak)} (+{(peak - start) / 2**30:.2f})")


def main(specs: list[str]) -> None:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    specs = specs or ["gpt2:16::1024", "vit-b-16:128", "llama-2-7b:1:4:2048"]
    for spec in specs:
        run_case(spec, device)
        if get_preset(spec.split(":")[0]).input_kind == "tokens":
            loss_memory(spec, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the case's model and optimizer went with it
    gemm_alignment(device)


if __name__ == "__main__":
    main(sys.argv[1:])
