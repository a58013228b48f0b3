"""The memory model against torch's own count for plans over several GPUs (TP, SP, FSDP and both)
and one (checkpointing; vision models, whose blocks differ), as one rank of the plan holds them,
with no GPU and no second process.

``bench/fake_peak.py`` does this for one-device plans; here each case's plan is applied by the
plugins, as ``verify`` applies it, on rank 0 of a fake process group of the plan's size (torch's
``fake`` backend: every collective returns at once with outputs of the right shapes), the model
built on fake tensors and trained for two steps (forward, the loss and backward of each of the
plan's accumulated micro-batches, AdamW one tensor at a time, ``zero_grad``), the second under
``MemTracker``, which follows every tensor's storage, DTensors' local shards included. CUDA's
attention kernel, autocast lists, fused RMSNorm and dropout stand in as in ``fake_peak.py``; a
Hugging Face model computes its loss from its labels, as ``verify`` runs an ``hf:`` model and its
profile has it; a TP plan runs that loss, or a preset's, on the logits' vocabulary shards
(``vocab_loss``, under ``vocab_parallel_loss``), as ``verify`` does. Printed beside it: the
advisor's predicted peak for the same plan on H100s, without the framework's bytes and the
allocator's rounding, for AdamW stepped as here. What this leaves out is what no tensor holds:
NCCL's buffers, and on CPU ranks gloo's (``verify`` measures those with the
rest of the process); and the ``foreach`` step's temporaries, which GPUs run and the model prices
(``bench/fake_peak.py`` checks them on one device), since MemTracker miscounts that step on DTensors
(``measured``).

    .venv/bin/python bench/fake_parallel_peak.py        # about six minutes on 2 cores
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import time
from unittest import mock
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.testing._internal.distributed.fake_pg import FakeStore

from fake_peak import cuda_step, model_and_step, model_spec  # bench/fake_peak.py
from fake_peak import Case as Shape
from plans import given_plan  # bench/plans.py
from stratagem.advisor.cost.evaluate import evaluate
from stratagem.advisor.hardware import parse_cluster
from stratagem.advisor.profile.cache import profile_spec
from stratagem.advisor.profile.model_profile import ModelProfile
from stratagem.plan import Plan, Workload
from stratagem.plan.precision import get_precision, torch_dtype
from stratagem.plugins import apply_plan, build_mesh, build_optimizer, vocab_parallel_loss

GIB = 2**30


class Case(NamedTuple):
    shape: Shape  # the model, its micro-batch, sequence and precision (fake_peak.py's cases)
    world: int  # GPUs of one node of H100s
    fields: dict[str, Any]  # the plan, completed for the model as --plan completes it


_LLAMA_3_8B = Shape("llama-3-8b", 1, 2048, "bf16-mixed")
_GPT2_LARGE = Shape("gpt2-large", 4, 1024, "bf16-mixed")
CASES = (
    Case(Shape("llama-small", 2, 512, "bf16-mixed"), 4, {"tp": 4}),
    Case(Shape("llama-small", 2, 512, "bf16-mixed"), 4, {"tp": 4, "sequence_parallel": True}),
    Case(Shape("llama-small", 2, 512, "bf16-mixed"), 4, {"dp_shard": 4, "zero": 3}),
    Case(Shape("llama-small", 2, 512, "bf16-mixed"), 4, {"tp": 2, "dp_shard": 2, "zero": 3, "grad_accum": 2}),
    Case(_GPT2_LARGE, 4, {"tp": 4}),
    Case(_GPT2_LARGE, 4, {"tp": 2, "dp_shard": 2, "zero": 3}),
    Case(_LLAMA_3_8B, 8, {"tp": 8}),
    Case(_LLAMA_3_8B, 8, {"tp": 8, "sequence_parallel": True}),
    Case(_LLAMA_3_8B, 8, {"dp_shard": 8, "zero": 3}),
    Case(_LLAMA_3_8B, 8, {"dp_shard": 8, "zero": 3, "grad_accum": 2}),
    Case(_LLAMA_3_8B, 8, {"tp": 4, "dp_shard": 2, "zero": 3}),
    Case(_LLAMA_3_8B, 8, {"tp": 4, "dp_shard": 2, "zero": 3, "sequence_parallel": True}),
    # checkpointing, on one GPU and under FSDP or TP
    Case(Shape("llama-small", 2, 1024, "bf16-mixed"), 1, {"activation_checkpointing": "full"}),
    Case(Shape("gpt2-large", 2, 1024, "bf16-mixed"), 1, {"activation_checkpointing": "full"}),
    Case(Shape("gpt2-large", 2, 1024, "bf16-mixed"), 1, {"activation_checkpointing": "selective"}),
    Case(_LLAMA_3_8B, 8, {"dp_shard": 8, "zero": 3, "activation_checkpointing": "full"}),
    Case(_LLAMA_3_8B, 8, {"tp": 8, "activation_checkpointing": "selective"}),
    # vision models, whose blocks differ (ResNet's shrink with its images) and whose heads are small
    Case(Shape("vit-small", 64, None, "bf16-mixed"), 1, {"activation_checkpointing": "full"}),
    Case(Shape("resnet-50", 64, None, "bf16-mixed"), 1, {}),
    Case(Shape("resnet-50", 64, None, "bf16-mixed"), 1, {"activation_checkpointing": "full"}),
    Case(Shape("resnet-101", 32, None, "bf16-mixed"), 1, {"activation_checkpointing": "full"}),
    # Hugging Face models computing their loss, as verify runs them: FSDP gathers before the loss
    Case(Shape("qwen2-0.5b", 2, 1024, "bf16-mixed"), 4, {"dp_shard": 4, "zero": 3}),
    Case(Shape("llama-1b", 2, 1024, "bf16-mixed"), 4, {"dp_shard": 4, "zero": 3}),
    Case(Shape("llama-1b", 2, 1024, "bf16-mixed"), 4, {"dp_shard": 4, "zero": 3, "activation_checkpointing": "full"}),
)


def _plan(case: Case, folder: Path) -> tuple[Plan, float]:
    """The case's plan and the advisor's peak bytes for it on ``world`` H100s (no framework bytes)."""
    shape = case.shape
    cluster = parse_cluster(f"{case.world}xH100-SXM-80GB")
    fields = {"micro_batch_size": shape.batch, **case.fields}
    replicas = case.world // (fields.get("tp", 1) * fields.get("pp", 1))
    workload = Workload(global_batch_size=shape.batch * replicas * fields.get("grad_accum", 1), seq_len=shape.seq_len,
                        precision=shape.precision)
    profile = profile_spec(model_spec(shape, folder), seq_len=shape.seq_len, precision=shape.precision)
    plan = given_plan(fields, profile, cluster, workload)
    return plan, evaluate(_stepped_per_tensor(profile), cluster, workload, plan).memory.total


def _stepped_per_tensor(profile: ModelProfile) -> ModelProfile:
    """``profile`` with its kernels marked as CPU ranks': the memory model reads them only to tell
    whether AdamW steps on its ``foreach`` path, and this bench steps one tensor at a time."""
    variant = profile.in_compute_dtype
    return dataclasses.replace(profile, kernels="cpu", in_compute_dtype=variant and _stepped_per_tensor(variant))


def measured(case: Case, plan: Plan) -> float:
    """MemTracker's peak bytes on rank 0 over a training step, after one untracked step.

    DTensor derives an operator's output shape by running it on fake tensors of the global shapes,
    and caches what it derived, except where it takes itself to be tracing, which a fake mode
    alone makes it do (``_are_we_tracing``): here, then, every step would make them again, and
    MemTracker would count them as the rank's (torch's ``loss_parallel`` does so for the whole
    logits, twice in fp32, at every ``log_softmax``). A GPU's eager step caches them after the first
    and holds none on the device: the step runs as it does, DTensor told it is not tracing."""
    with mock.patch("torch.distributed.tensor._sharding_prop._are_we_tracing", lambda: False):
        return _measured(case, plan)


def _measured(case: Case, plan: Plan) -> float:
    mesh = build_mesh(plan, device_type="cpu")
    precision = get_precision(plan.precision)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        model, step = model_and_step(case.shape, labels=True)  # an hf: profile's loss is the model's
    module = apply_plan(model, plan, mesh)  # outside the mode, where the mesh's own tensors stay real
    with fake:
        # one tensor at a time: MemTracker counts AdamW's foreach step on DTensors as optimizer
        # states many times the parameters' bytes, which no GPU holds
        optimizer = build_optimizer(module, plan, torch.optim.AdamW, lr=1e-4, foreach=False)
        autocast = torch.autocast("cpu", dtype=torch_dtype(precision.compute_dtype)) if plan.runs_autocast \
            else contextlib.nullcontext()
        tracker = MemTracker()
        for tracked in (False, True):
            # The first step makes the optimizer's states and fills DTensor's sharding caches: the
            # fake tensors DTensor propagates shardings with would count as the rank's (tracked from
            # the first step, a plan measured GiBs less after another that met the same shardings).
            if tracked:
                tracker.track_external(module, optimizer)
            with tracker if tracked else contextlib.nullcontext(), vocab_parallel_loss(plan):
                cuda_step(each_forward(step, tracker.reset_mod_stats), optimizer, autocast,
                          accumulate=plan.grad_accum)
        return max(device["Total"] for device in tracker.get_tracker_snapshot("peak").values())


def each_forward(step: Callable[[], torch.Tensor], reset: Callable[[], None]) -> Callable[[], torch.Tensor]:
    """``step`` after ``reset()`` each time: MemTracker follows one forward of a module per
    context unless its per-module figures are reset (the global peak it keeps)."""

    def run() -> torch.Tensor:
        reset()
        return step()

    return run


def main() -> None:
    started = time.perf_counter()
    folder = Path(tempfile.mkdtemp())
    print(f"{'model':<13} {'mb':>2} {'seq':>5} {'plan':<34} {'predicted':>10} {'MemTracker':>10} {'error':>6}")
    for case in CASES:
        plan, ours = _plan(case, folder)
        dist.init_process_group("fake", rank=0, world_size=case.world, store=FakeStore())
        try:
            torchs = measured(case, plan)
        finally:
            dist.destroy_process_group()
        print(f"{case.shape.model:<13} {case.shape.batch:>2} {case.shape.seq_len or '-':>5} {plan.name:<34} "
              f"{ours / GIB:>8.2f} G {torchs / GIB:>8.2f} G {ours / torchs - 1:>+6.1%}", flush=True)
    print(f"rank 0 of each plan on H100s, bf16-mixed; {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
