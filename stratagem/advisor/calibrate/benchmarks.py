"""The micro-benchmarks ``stratagem calibrate`` runs on every rank of a live process group.

Each returns plain numbers; :mod:`~stratagem.advisor.calibrate.run` fits and stores them. Every
rank runs every benchmark at the same time, as in training: a CPU rank's matmul rate is its
share of the host with the others busy, a collective's time includes every rank's traffic.
Timings take the median of repeats after a warm-up, synchronised with a barrier so no rank
starts early.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from stratagem.advisor.calibrate.processes import PeakMemory, across_ranks
from stratagem.advisor.model_profile import ModelProfile

__all__ = ["collective_seconds", "dtensor_op_seconds", "framework_bytes", "matmul_rate", "memory_bandwidth",
           "op_byte_seconds", "op_seconds", "overlap_fraction", "timed"]

BUDGET_SECONDS = 1.0
"""Time one measurement may take after its warm-up (the calibration aims at a minute per node)."""

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, *, repeats: int, group: dist.ProcessGroup | None = None,
          budget: float = BUDGET_SECONDS) -> float:
    """Median seconds of ``fn()`` after one warm-up run, every rank of ``group`` starting each run
    together (a barrier) and the device synchronised before the clock stops. Runs ``repeats``
    times, fewer when the warm-up says they would exceed ``budget`` seconds (the slowest rank
    decides, so every rank runs as often)."""

    def once() -> float:
        if dist.is_initialized():
            dist.barrier(group=group)
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - start

    warmup = once()
    if dist.is_initialized():
        slowest = torch.tensor([warmup], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        warmup = float(slowest.item())
    runs = max(1, min(repeats, int(budget / max(warmup, 1e-9))))
    return statistics.median(once() for _ in range(runs))


SUSTAINED_SECONDS = 0.2
"""How long each timed run of :func:`matmul_rate` keeps every rank multiplying."""


def matmul_rate(n: int, dtype: str, device: torch.device, *, repeats: int) -> float:
    """FLOP/s of ``n×n @ n×n`` matmuls in ``dtype`` (2n³ FLOPs each), sustained: each timed run
    multiplies back to back for about :data:`SUSTAINED_SECONDS` (the same count on every rank),
    so that every rank computes for the whole run as in training (timed one matmul at a time,
    ranks that share cores measure whichever the scheduler ran first, alone)."""
    a = torch.randn(n, n, device=device, dtype=_DTYPES[dtype])
    b = torch.randn(n, n, device=device, dtype=_DTYPES[dtype])
    single = timed(lambda: a @ b, device, repeats=1)
    count = max(1, int(SUSTAINED_SECONDS / across_ranks(single)))
    return 2 * n**3 * count / timed(lambda: [a @ b for _ in range(count)], device, repeats=repeats)


def memory_bandwidth(num_bytes: int, device: torch.device, *, repeats: int) -> float:
    """Bytes/s of copying a ``num_bytes`` buffer (read + write counted)."""
    src = torch.empty(num_bytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), device, repeats=repeats)


def collective_seconds(op: str, num_bytes: int, device: torch.device, *, group: dist.ProcessGroup | None,
                       repeats: int) -> float:
    """Median seconds of one ``op`` (all_reduce, all_gather, reduce_scatter, p2p) on ``num_bytes``
    per rank — the full buffer for all-reduce, the gathered output for all-gather and the input
    for reduce-scatter (the cost model's convention), one message each way for p2p (ranks paired
    0↔1, 2↔3, …)."""
    size = dist.get_world_size(group)
    numel = max(size, num_bytes // 4 // size * size)
    full = torch.ones(numel, device=device)
    shard = torch.ones(numel // size, device=device)
    if op == "all_reduce":
        run = lambda: dist.all_reduce(full, group=group)  # noqa: E731
    elif op == "all_gather":
        run = lambda: dist.all_gather_single(full, shard, group=group)  # noqa: E731
    elif op == "reduce_scatter":
        run = lambda: dist.reduce_scatter_single(shard, full, group=group)  # noqa: E731
    elif op == "p2p":
        rank = dist.get_rank(group)
        peer = dist.get_global_rank(group, rank ^ 1) if group is not None else rank ^ 1

        def run() -> None:
            ops = [dist.P2POp(dist.isend, full, peer, group=group), dist.P2POp(dist.irecv, shard.new_empty(numel),
                                                                               peer, group=group)]
            for request in dist.batch_isend_irecv(ops):
                request.wait()
    else:
        raise ValueError(f"unknown collective {op!r}")
    return timed(run, device, repeats=repeats, group=group)


def overlap_fraction(n: int, num_bytes: int, device: torch.device, *, repeats: int) -> float:
    """How much of an all-reduce of ``num_bytes`` hides under ``n×n`` matmuls run meanwhile:
    ``(t_matmul + t_comm − t_both) / min(t_matmul, t_comm)``, clamped to [0, 1]."""
    a = torch.randn(n, n, device=device)
    buffer = torch.ones(num_bytes // 4, device=device)
    comm = timed(lambda: dist.all_reduce(buffer), device, repeats=repeats)
    matmuls = max(1, round(comm / timed(lambda: a @ a, device, repeats=repeats)))
    compute = timed(lambda: [a @ a for _ in range(matmuls)], device, repeats=repeats)

    def both() -> None:
        work = dist.all_reduce(buffer, async_op=True)
        for _ in range(matmuls):
            a @ a
        work.wait()

    together = timed(both, device, repeats=repeats)
    return min(1.0, max(0.0, (compute + comm - together) / min(compute, comm)))


REFERENCE_MODEL = "gpt2-tiny"
"""The small reference model whose training step measures the per-operator cost (a GPT-2 of
width 64: layer norms, GELU, attention and embeddings at tensor sizes where launching an
operator costs more than its arithmetic)."""

BYTES_REFERENCE = {"cpu": ("llama-small", 2, 128), "cuda": ("llama-small", 64, 512)}
"""(model, batch, tokens) whose training step measures the cost per byte that operators without
FLOPs write, per device type: a Llama at a size where those bytes, not launching operators,
take the time beyond its matmuls."""


def _reference_step(model: str, batch: int, seq_len: int, device: torch.device, *,
                    repeats: int) -> tuple[float, ModelProfile]:
    """Seconds of forward and backward of ``model`` on ``batch`` sequences of ``seq_len``
    tokens, and its profile (taken at one sequence)."""
    from stratagem.advisor.profiles import profile_spec
    from stratagem.models import PRESETS

    profile = profile_spec(model, seq_len=seq_len, precision="fp32")
    preset = PRESETS[model]
    inputs, targets = preset.make_batch(batch, seq_len)
    inputs, targets = tuple(t.to(device) for t in inputs), targets.to(device)
    with torch.device(device):
        module = preset.build()

    def step() -> None:
        preset.loss(module(*inputs), targets).backward()
        module.zero_grad(set_to_none=True)

    runs = 10 if batch * seq_len <= 64 else 1  # a small step is timed ten at a time
    return timed(lambda: [step() for _ in range(runs)], device, repeats=repeats) / runs, profile


def _total(profile: ModelProfile, *fields: str) -> int:
    """``fields`` summed over every segment of ``profile``."""
    return sum(getattr(s, f) for s in profile.segments for f in fields)


def op_seconds(device: torch.device, flops_per_second: float, *, repeats: int) -> float:
    """Host seconds per operator: the time of forward and backward of :data:`REFERENCE_MODEL` on
    one 32-token sequence beyond its matmul FLOPs at ``flops_per_second``, over the operators its
    profile counts (the same count the cost model multiplies by)."""
    seconds, profile = _reference_step(REFERENCE_MODEL, 1, 32, device, repeats=repeats)
    flops = _total(profile, "fwd_flops", "bwd_flops") / profile.batch_size
    return max(seconds - flops / flops_per_second, 0.0) / _total(profile, "fwd_ops", "bwd_ops")


def op_byte_seconds(device: torch.device, curve: list[tuple[int, float]], per_op: float, *, repeats: int) -> float:
    """Seconds per byte written by operators without FLOPs (norms, activations, softmax,
    elementwise arithmetic): the time of forward and backward of :data:`BYTES_REFERENCE` beyond its
    matmuls (at the measured ``curve``'s rates for their sizes, as the cost model runs them:
    :func:`~stratagem.advisor.timing.block_matmul_efficiency`) and its operators at ``per_op``
    seconds each, over the bytes its profile counts them writing (the count the cost model
    multiplies by). What the curve misses of the model's own matmuls lands here too."""
    from stratagem.advisor.plan import Plan
    from stratagem.advisor.stage import whole_model
    from stratagem.advisor.timing import block_matmul_efficiency

    model, batch, seq_len = BYTES_REFERENCE["cuda" if device.type == "cuda" else "cpu"]
    seconds, profile = _reference_step(model, batch, seq_len, device, repeats=repeats)
    scale = batch / profile.batch_size
    stage = whole_model(profile)
    efficiency = block_matmul_efficiency(profile, Plan(micro_batch_size=batch, precision="fp32"), stage, curve)
    blocks = scale * sum(stage.block_sums[f] for f in ("fwd_flops", "bwd_flops"))
    other = scale * _total(profile, "fwd_flops", "bwd_flops") - blocks
    matmuls = (blocks / efficiency + other) / curve[-1][1]
    ops = _total(profile, "fwd_ops", "bwd_ops")
    return max(seconds - matmuls - ops * per_op, 0.0) / (scale * _total(profile, "fwd_op_bytes", "bwd_op_bytes"))


def dtensor_op_seconds(device: torch.device, *, repeats: int) -> float:
    """Host seconds per operator of an AdamW step over parameters that are DTensors sharded over
    every rank (what FSDP2 and TP parameters are): the step's time over eight small parameters,
    over the operators it runs per tensor (:data:`~stratagem.advisor.timing.OPTIMIZER_OPS_PER_TENSOR`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from stratagem.advisor.timing import OPTIMIZER_OPS_PER_TENSOR

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    params = [torch.nn.Parameter(distribute_tensor(torch.ones(64 * mesh.size(), device=device), mesh, [Shard(0)]))
              for _ in range(8)]
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer = torch.optim.AdamW(params)
    return timed(optimizer.step, device, repeats=repeats) / (len(params) * OPTIMIZER_OPS_PER_TENSOR["adamw"])


WORKSPACE_GEMM = 1024
"""Rows and columns of the matmul that brings the kernel library's workspace to a layer's size."""


def framework_bytes(device: torch.device) -> float:
    """Memory a training process takes beyond its tensors, bytes: how far a matmul's forward and
    backward at :data:`WORKSPACE_GEMM` and two AdamW steps of the tiny reference Llama
    (``llama-tiny``, one sequence of 8 tokens) raise the process's peak
    (:class:`~stratagem.advisor.calibrate.processes.PeakMemory`, as verification measures), less
    the Llama's parameters, gradients and optimizer states (its activations are a few KiB).
    Kernel libraries' workspaces (on CPU they depend on the matrices' shapes), the autograd
    engine and allocator bookkeeping remain. Run it first in a fresh process: it measures what a
    process's first training steps pull in, with the training stack imported beforehand as a
    training script has it (imports are the program's, not the plan's)."""
    import torch.distributed.fsdp  # noqa: F401  (FSDP2, DTensor, pipelining and the optimizers'
    import torch.distributed.pipelining  # noqa: F401  compile hooks: what a training run imports)
    import torch.distributed.tensor  # noqa: F401

    from stratagem.models import PRESETS

    preset = PRESETS["llama-tiny"]
    inputs, targets = preset.make_batch(1, 8)
    inputs, targets = tuple(t.to(device) for t in inputs), targets.to(device)
    memory = PeakMemory(device)
    with torch.device(device):
        weight = torch.randn(WORKSPACE_GEMM, WORKSPACE_GEMM, requires_grad=True)
        (torch.randn(WORKSPACE_GEMM, WORKSPACE_GEMM) @ weight).sum().backward()
        del weight  # the kernel library keeps its workspace for layers this large
        memory.reset_peak()  # the matmul's own tensors are gone
        model = preset.build()
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        preset.loss(model(*inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    states = 4 * sum(p.numel() * p.element_size() for p in model.parameters())  # weights, grads, 2 AdamW states
    return max(0.0, memory.stop() - states)
