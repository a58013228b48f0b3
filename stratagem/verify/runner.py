"""One rank of a verification run: build the real model, apply the plan, train a few steps and
measure the step time and this rank's peak memory.

Peak memory is what the cost model predicts, over the model's construction and the warm-up
steps (:data:`MEMORY_STEPS` at least), above the process as it stands with its process groups
(and, for a pipeline, the machinery that traces stages: :func:`_load_tracing`) just before the
model is built (:class:`~stratagem.peak_memory.PeakMemory`): on
CUDA ``max_memory_allocated`` (and ``max_memory_reserved`` beside it); on CPU the anonymous
resident set, the allocator handing freed tensors back. What the framework takes beyond the
plan's tensors is in it, as the calibrated cost model's ``framework`` term. A plan that gives each
rank a part of the model (FSDP, TP, pipeline stages built by removal; not under DDP) builds it on
``meta`` and materializes the parts (:func:`_build`): no rank holds the whole model. Otherwise the
whole model is built before the plan splits it, and a pipeline rank then keeps its own stages
alone: the other stages' parameters count only while the model is built. Step time is the
median over the measured steps (after the warm-up steps and one more) of the time from the first
forward to the optimizer step's end (the gradients' clipping before it, where asked),
devices synchronised, less the time DTensor spent deciding
how to shard operators on shapes it had not met before
(:class:`~stratagem.verify.sharding_cache.ShardingCacheMisses`): a warm-up cost, which a
tensor-parallel MoE keeps paying for as long as its routing produces new expert row counts; the
advisor predicts the steady state. What was left out is reported beside, and so is every measured
step's time on its slowest rank, whose range says how noisy the median is.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from stratagem.advisor.calibrate.optimizers import optimizer_class
from stratagem.distributed import across_ranks
from stratagem.peak_memory import PeakMemory
from stratagem.plan import Plan
from stratagem.plan.stages import removal_convention
from stratagem.plan.workload import OPTIMIZER_OPTIONS
from stratagem.plugins import (
    apply_plan,
    autocast_context,
    build_mesh,
    build_optimizer,
    clip_grad_norm_,
    clip_grad_value_,
    vocab_parallel_loss,
)
from stratagem.plugins.materialize import materialize
from stratagem.errors import UsageError
from stratagem.verify.models import Batch, Built, RealModel, real_model
from stratagem.verify.sharding_cache import ShardingCacheMisses

__all__ = ["Measured", "RealModel", "measure_plan", "real_model"]

StepEvent = Callable[..., None]
"""``on_event(kind, **fields)``: what rank 0 has done, as it happens: ``"built"`` (the model
built, the plan applied, the optimizer made: ``seconds``) and ``"step"`` (``phase``: ``"warm-up"``
or ``"measured"``, ``index`` from 1, ``total``, ``seconds``)."""

MEMORY_STEPS = 3
"""Steps the peak memory is measured over, at least: the first of the steady state. The second is
the first to run its forward beside the optimizer's states, and DDP rebuilds its gradient buckets
as that forward starts (``_rebuild_buckets``, in the order the first backward made the gradients
ready), so on CPU, where a tensor's pages count once written, the new buckets hold nothing
resident until that step's backward: only the third forward runs beside them."""

CLIP_AT = 1.0
"""The global norm, or the value, gradients are clipped at where a verification clips them: the time
does not depend on it (scaling multiplies every gradient, however little)."""


@dataclass(frozen=True, slots=True)
class Measured:
    """What one plan measured: seconds per step (median, slowest rank; first-time sharding
    decisions left out) and peak bytes per rank (the largest over ranks); ``reserved_bytes`` on
    CUDA only; ``sharding_seconds``: the first-time sharding decisions' seconds per step (median,
    the largest over ranks) that ``step_seconds`` leaves out. ``step_times``: each measured step's
    seconds on its slowest rank, sharding left out, over every one of ``repeats`` runs
    (:meth:`pooled`): their range is the noise beside the median. ``graph_breaks``: for a plan
    that compiles its blocks, the graph breaks torch.compile met in them on the busiest rank (each
    splits a block into graphs compiled apart, which the advisor does not predict), and the first
    one's reason."""

    step_seconds: float
    peak_bytes: int
    reserved_bytes: int | None
    steps: int
    sharding_seconds: float = 0.0
    step_times: tuple[float, ...] = ()
    repeats: int = 1
    graph_breaks: int = 0
    graph_break: str = ""

    @property
    def fastest(self) -> float:
        """The fastest measured step's seconds (the median when steps were not kept)."""
        return min(self.step_times, default=self.step_seconds)

    @property
    def slowest(self) -> float:
        """The slowest measured step's seconds (the median when steps were not kept)."""
        return max(self.step_times, default=self.step_seconds)

    @property
    def spread(self) -> float:
        """The measured steps' range over their median: ``(slowest − fastest) / step_seconds``."""
        return (self.slowest - self.fastest) / self.step_seconds

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Measured:
        """Inverse of :meth:`to_dict`."""
        return cls(**{**data, "step_times": tuple(data.get("step_times", ()))})

    @classmethod
    def pooled(cls, runs: list[Measured]) -> Measured:
        """One measurement of runs of the same plan: the median of their medians, every step's
        time, the fullest peak and the largest sharding time."""
        reserved = [run.reserved_bytes for run in runs if run.reserved_bytes is not None]
        return cls(step_seconds=statistics.median(run.step_seconds for run in runs),
                   peak_bytes=max(run.peak_bytes for run in runs), reserved_bytes=max(reserved, default=None),
                   steps=runs[0].steps, sharding_seconds=max(run.sharding_seconds for run in runs),
                   step_times=tuple(t for run in runs for t in run.step_times),
                   repeats=sum(run.repeats for run in runs), graph_breaks=max(run.graph_breaks for run in runs),
                   graph_break=next((run.graph_break for run in runs if run.graph_break), ""))


def measure_plan(model: RealModel, plan: Plan, *, optimizer: str, steps: int, warmup: int,
                 grad_clip: str | None = None, on_event: StepEvent | None = None) -> Measured:
    """On every rank of the default process group (``plan.world_size`` of them): train
    ``max(warmup, MEMORY_STEPS) + 1 + steps`` steps of ``plan`` on the model's batch and measure
    (module docstring), the gradients clipped before each optimizer step as ``grad_clip`` says
    (``Workload.grad_clip``: by the global norm, or by value, at :data:`CLIP_AT`); ``on_event``
    hears of the build and of each step as it ends."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    samples = plan.micro_batch_size * plan.microbatches
    report = on_event or (lambda kind, **fields: None)
    if model.prepare is not None:
        model.prepare(samples)
    torch.manual_seed(0)  # every rank draws the same batch and weights
    early = model.make_batch(samples).to(device) if model.make_batch is not None else None
    mesh = build_mesh(plan, device_type=device.type)
    if plan.pp > 1:
        _load_tracing()
    memory = PeakMemory(device)
    started = time.perf_counter()
    built = _build(model, plan, samples, early, device)
    step = _pipeline_step if plan.pp > 1 else _data_parallel_step
    with warnings.catch_warnings():
        # A meta-built model's shards drawn on a CPU mesh come from each rank's own generator, which
        # torch warns of on every rank; a measurement does not depend on the weights' values.
        warnings.filterwarnings("ignore", "DTensor random operators may not have complete support")
        run, parameters, clip = step(built, plan, mesh, built.batch.to(device), device)
    del built  # a pipeline rank keeps its stages alone (the run holds what a data-parallel one needs)
    opt = build_optimizer(parameters, plan, optimizer_class(optimizer), lr=1e-4, **OPTIMIZER_OPTIONS[optimizer])
    report("built", seconds=time.perf_counter() - started)

    def train_step(phase: str, index: int, total: int) -> tuple[float, float]:
        """Seconds of one step, and of the first-time sharding decisions in it."""
        with ShardingCacheMisses() as misses:
            _sync(device)
            start = time.perf_counter()
            for micro_step in range(plan.grad_accum):
                run(micro_step == plan.grad_accum - 1)
            if grad_clip is not None:
                clip(grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            seconds = time.perf_counter() - start, misses.seconds
        report("step", phase=phase, index=index, total=total, seconds=seconds[0])
        return seconds

    warm = max(warmup, MEMORY_STEPS)
    for index in range(1, warm + 1):
        train_step("warm-up", index, warm + 1)
    peak = across_ranks(memory.stop())
    reserved = int(across_ranks(torch.cuda.max_memory_reserved(device))) if device.type == "cuda" else None
    train_step("warm-up", warm + 1, warm + 1)  # one more warm-up step, malloc's policy back
    timed = [train_step("measured", index, steps) for index in range(1, steps + 1)]
    breaks, reason = _graph_breaks() if plan.compile else (0, "")
    return Measured(step_seconds=across_ranks(statistics.median(total - sharding for total, sharding in timed)),
                    peak_bytes=int(peak), reserved_bytes=reserved, steps=steps,
                    sharding_seconds=across_ranks(statistics.median(sharding for _, sharding in timed)),
                    step_times=_slowest_per_step([total - sharding for total, sharding in timed], device),
                    graph_breaks=int(across_ranks(breaks)), graph_break=reason)


def _graph_breaks() -> tuple[int, str]:
    """The graph breaks torch.compile met in this process, and the first one's reason."""
    from torch._dynamo.utils import counters

    breaks = counters["graph_break"]
    return sum(breaks.values()), next(iter(breaks), "")


def _slowest_per_step(seconds: list[float], device: torch.device) -> tuple[float, ...]:
    """Each step's largest ``seconds`` over the ranks of the default group. A collective."""
    import torch.distributed as dist

    tensor = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tuple(tensor.tolist())


def _load_tracing() -> None:
    """Load what tracing a model into pipeline stages runs (torch.export's modules and caches,
    loaded once per process whatever the model) by tracing a two-Linear model into two stages:
    library code, left in the baseline as torch's own is."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    tiny = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    pipeline(tiny, mb_args=(torch.zeros(1, 1),), split_spec={"1": SplitPoint.BEGINNING})


def _build(model: RealModel, plan: Plan, samples: int, batch: Batch | None, device: torch.device) -> Built:
    """The model as this rank builds it: on ``meta`` where the plan gives the rank a part of it
    (FSDP shards, TP slices, pipeline stages built by removal) and nothing wraps it in DDP, for a
    model that builds apart from its batch (a preset, ``hf:``), each part materialized once the
    plan is applied, as ``Trainer.init_module(empty_init=True)`` builds for FSDP on GPUs (on CPU
    ranks the strategies initialise the whole model first, for its values: a measurement needs none
    of them, and builds on meta there too); else on
    ``device`` (DDP broadcasts real tensors, tracing runs the model, a factory returns its batch)."""
    splits = (plan.uses_fsdp or plan.tp > 1 or plan.pp > 1) and not plan.uses_ddp
    if splits and model.builds_module_alone:
        with torch.device("meta"):
            built = model.build(samples, batch)
        if plan.pp == 1 or removal_convention(built.module, block_container=plan.block_container) is not None:
            return built
    with torch.device(device):
        return model.build(samples, batch)


def _data_parallel_step(built: Built, plan: Plan, mesh: Any, batch: Batch,
                        device: torch.device) -> tuple[Callable[[bool], None], nn.Module, Callable[[str], None]]:
    if plan.uses_ddp:
        materialize(built.module, device)  # DDP broadcasts real tensors; FSDP and TP split meta ones first
    parallel = apply_plan(built.module, plan, mesh)
    materialize(built.module, device, params_on_host=plan.offloads_parameters)

    # DDP reduces only the last accumulation step's backward, as Lightning's does (FSDP reduces each)
    ddp = isinstance(parallel, DistributedDataParallel)

    def run(last: bool) -> None:
        with parallel.no_sync() if ddp and not last else contextlib.nullcontext(), vocab_parallel_loss(plan):
            with autocast_context(plan, device.type):
                loss = built.loss(parallel(*batch.args, **batch.kwargs), batch.targets) / plan.grad_accum
            loss.backward()

    def clip(how: str) -> None:
        clip_grad_norm_(parallel.parameters(), CLIP_AT) if how == "norm" else clip_grad_value_(parallel.parameters(),
                                                                                                CLIP_AT)

    return run, parallel, clip


def _pipeline_step(built: Built, plan: Plan, mesh: Any, batch: Batch,
                   device: torch.device) -> tuple[Callable[[bool], None], Any, Callable[[str], None]]:
    if not batch.args:
        raise UsageError(f"plan {plan.name} is a pipeline, whose stages take positional inputs, and the model's "
                         "inputs are keyword arguments\nHINT: return the example inputs as a tuple, or verify "
                         "plans with pp=1")
    # A loss of the output alone (a factory's) still needs a target the schedule can split.
    targets = batch.targets if batch.targets is not None else torch.zeros(len(batch.args[0]), device=device)
    example = tuple(t[:plan.micro_batch_size] for t in batch.args)
    pipe = apply_plan(built.module, plan, mesh, loss_fn=built.loss, example_inputs=example)
    for stage in pipe.modules:
        materialize(stage, device, params_on_host=plan.offloads_parameters)

    def clip(how: str) -> None:
        if how == "norm":
            pipe.clip_grad_norm_(CLIP_AT)
        else:
            clip_grad_value_([param for stage in pipe.modules for param in stage.parameters()], CLIP_AT)

    return (lambda last: pipe.step(*batch.args, target=targets)), pipe.modules, clip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

