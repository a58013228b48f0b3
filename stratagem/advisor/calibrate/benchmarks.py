"""The micro-benchmarks ``stratagem calibrate`` runs on every rank of a live process group.

Each returns plain numbers; :mod:`~stratagem.advisor.calibrate.run` fits and stores them. Every
rank runs every benchmark at the same time, as in training: a CPU rank's matmul rate is its
share of the host with the others busy, a collective's time includes every rank's traffic.
Timings take the median of repeats after a warm-up, synchronised with a barrier so no rank
starts early. The compute benchmarks (:func:`compute_rates`), and each collective's message
sizes, run interleaved: each round times every one of them once, so a host whose speed drifts
while it calibrates (a shared machine's neighbours) moves them all alike and the figures derived
from their differences hold.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from stratagem.advisor.calibrate.calibration import COLLECTIVES
from stratagem.distributed import across_ranks
from stratagem.peak_memory import PeakMemory
from stratagem.advisor.profile.model_profile import ModelProfile

__all__ = ["TORCH_DTYPES", "ComputeRates", "collective_seconds", "compute_rates", "framework_bytes", "interleaved",
           "memory_bandwidth", "op_byte_seconds", "op_seconds", "overlap_fraction", "repeated", "sync_seconds", "timed",
           "tp_linear_seconds"]

BUDGET_SECONDS = 1.0
"""Time one measurement may take after its warm-up (the calibration aims at a minute per node)."""

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The torch dtype of each dtype the benchmarks name."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _once(fn: Callable[[], object], device: torch.device, group: dist.ProcessGroup | None = None) -> float:
    """Seconds of one ``fn()``, every rank of ``group`` starting together (a barrier) and the
    device synchronised before the clock stops."""
    if dist.is_initialized():
        dist.barrier(group=group)
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def timed(fn: Callable[[], object], device: torch.device, *, repeats: int, group: dist.ProcessGroup | None = None,
          budget: float = BUDGET_SECONDS) -> float:
    """Median seconds of ``fn()`` after one warm-up run (:func:`_once`). Runs ``repeats`` times,
    fewer when the warm-up says they would exceed ``budget`` seconds (the slowest rank decides,
    so every rank runs as often)."""
    warmup = _once(fn, device, group)
    if dist.is_initialized():
        slowest = torch.tensor([warmup], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        warmup = float(slowest.item())
    runs = max(1, min(repeats, int(budget / max(warmup, 1e-9))))
    return statistics.median(_once(fn, device, group) for _ in range(runs))


def interleaved(fns: Sequence[Callable[[], object]], device: torch.device, *, repeats: int,
                group: dist.ProcessGroup | None = None) -> list[float]:
    """Median seconds of each of ``fns`` (the slowest rank's), timed in ``repeats`` rounds that run
    each once in turn (:func:`_once` over ``group``), after a warm-up round: what the host's drift
    does to one, it does to all."""
    for fn in fns:
        _once(fn, device, group)
    rounds = [[_once(fn, device, group) for fn in fns] for _ in range(repeats)]
    return [across_ranks(statistics.median(column)) for column in zip(*rounds)]


SUSTAINED_SECONDS = 0.2
"""How long each timed run of a matmul benchmark keeps every rank multiplying."""


@dataclass(frozen=True, slots=True)
class _Benchmark:
    """A function to time and the FLOPs one call does."""

    run: Callable[[], object]
    flops: float


def sustained(fn: Callable[[], object], device: torch.device, *,
              seconds: float = SUSTAINED_SECONDS) -> tuple[Callable[[], object], int, float]:
    """``fn`` run back to back for about ``seconds`` (the same count on every rank), so that every
    rank computes for the whole run as in training (timed one call at a time, ranks that share
    cores measure whichever the scheduler ran first, alone): that run, its count of calls, and the
    slowest rank's seconds for one call (after a warm-up)."""
    single = across_ranks(timed(fn, device, repeats=1))
    count = max(1, int(seconds / single))
    return repeated(fn, count), count, single


def repeated(fn: Callable[[], object], count: int) -> Callable[[], None]:
    """``fn`` called ``count`` times, each result dropped as the next call starts (a run that kept
    them in a list held some 4,000 outputs of 8 MiB at once for an H100's n = 2048 matmuls: more
    memory than many GPUs have)."""

    def run() -> None:
        for _ in range(count):
            fn()

    return run


def _sustained_matmul(n: int, dtype: str, device: torch.device, *, width: int | None = None) -> tuple[_Benchmark, float]:
    """``n×n @ n×width`` matmuls (``width`` n unless given) in ``dtype`` (2n²·width FLOPs each),
    :func:`sustained`; and the slowest rank's seconds for one."""
    width = width or n
    a = torch.randn(n, n, device=device, dtype=TORCH_DTYPES[dtype])
    b = torch.randn(n, width, device=device, dtype=TORCH_DTYPES[dtype])
    run, count, single = sustained(lambda: a @ b, device)
    return _Benchmark(run, 2 * n * n * width * count), single


@dataclass(frozen=True, slots=True)
class ComputeRates:
    """What :func:`compute_rates` measured: per dtype the (n, FLOP/s) of the matmul sizes run and
    the share of the largest one's rate that the same matmul one column narrower reaches (its
    rows off 16 bytes: cuBLAS's unaligned kernels), seconds per operator beyond FLOPs, and (on
    CPU ranks: :data:`BYTES_REFERENCE`) per byte operators without FLOPs move."""

    matmul: dict[str, list[tuple[int, float]]]
    unaligned: dict[str, float]
    op_seconds: float
    op_byte_seconds: float | None


def compute_rates(sizes: Sequence[int], dtypes: Sequence[str], device: torch.device, *,
                  repeats: int) -> ComputeRates:
    """Sustained square matmuls of each of ``sizes`` in each of ``dtypes`` and the training steps
    of the two reference models (:func:`op_seconds`, :func:`op_byte_seconds`), all timed
    :func:`interleaved` (the second on CPU ranks only). The per-operator and per-byte costs are
    what the steps take beyond their matmuls at the rates measured in the same rounds. A size
    whose single matmul would take longer than :data:`BUDGET_SECONDS` (predicted from the size
    below it) is skipped."""
    benchmarks: dict[tuple[str, int], _Benchmark] = {}
    narrower: dict[str, _Benchmark] = {}
    for dtype in dtypes:
        single, previous = 0.0, 1
        for n in sizes:
            if single * (n / previous) ** 3 > BUDGET_SECONDS:
                break  # the same on every rank: ``single`` is the slowest rank's
            benchmarks[dtype, n], single = _sustained_matmul(n, dtype, device)
            previous = n
        narrower[dtype], _ = _sustained_matmul(previous, dtype, device, width=previous - 1)
    ops = _reference_step(REFERENCE_MODEL, 1, 32, device)
    data = _reference_step(*BYTES_REFERENCE, device) if device.type == "cpu" else None
    matmuls = [*benchmarks.values(), *narrower.values()]
    steps = [ops, data] if data else [ops]
    seconds = interleaved([b.run for b in matmuls + steps], device, repeats=repeats)
    rates = [benchmark.flops / took for benchmark, took in zip(matmuls, seconds)]
    matmul: dict[str, list[tuple[int, float]]] = {}
    for (dtype, n), rate in zip(benchmarks, rates):
        matmul.setdefault(dtype, []).append((n, rate))
    unaligned = {dtype: min(1.0, rate / max(matmul[dtype])[1]) for dtype, rate in zip(narrower, rates[len(benchmarks):])}
    per_op = op_seconds(seconds[len(matmuls)] / ops.runs, ops.profile, max(matmul["fp32"])[1])
    per_byte = data and op_byte_seconds(seconds[-1] / data.runs, data.profile, data.batch, matmul["fp32"], per_op)
    return ComputeRates(matmul, unaligned, per_op, per_byte)


def memory_bandwidth(num_bytes: int, device: torch.device, *, repeats: int) -> float:
    """Bytes/s of copying a ``num_bytes`` buffer (read + write counted)."""
    src = torch.empty(num_bytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), device, repeats=repeats)


def collective_seconds(op: str, sizes: Sequence[int], device: torch.device, *, group: dist.ProcessGroup | None,
                       repeats: int) -> list[float]:
    """Median seconds of one ``op`` (all_reduce, all_gather, reduce_scatter, p2p) on each of
    ``sizes`` bytes per rank, timed :func:`interleaved` — the full buffer for all-reduce, the
    gathered output for all-gather and the input for reduce-scatter (the cost model's
    convention), for p2p one message sent to the next rank of the group and one received from the
    one before (a ring, as pipeline stages pass activations on; pairs swap)."""
    if op not in COLLECTIVES:
        raise ValueError(f"unknown collective {op!r}")
    return interleaved([_collective(op, num_bytes, device, group) for num_bytes in sizes], device, repeats=repeats,
                       group=group)


def _collective(op: str, num_bytes: int, device: torch.device, group: dist.ProcessGroup | None) -> Callable[[], None]:
    size = dist.get_world_size(group)
    numel = max(size, num_bytes // 4 // size * size)
    full = torch.ones(numel, device=device)
    shard = torch.ones(numel // size, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if op == "all_gather":
        return lambda: dist.all_gather_single(full, shard, group=group)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(shard, full, group=group)
    rank = dist.get_rank(group)
    after, before = ((rank + step) % size for step in (1, -1))
    if group is not None:
        after, before = dist.get_global_rank(group, after), dist.get_global_rank(group, before)

    def p2p() -> None:
        ops = [dist.P2POp(dist.isend, full, after, group=group),
               dist.P2POp(dist.irecv, shard.new_empty(numel), before, group=group)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()

    return p2p


SYNC_BURST_SECONDS = 0.01
"""Compute between two collectives in :func:`sync_seconds` (a block's forward or backward on a
small rank; TP's collectives come more often, FSDP's less)."""


def sync_seconds(device: torch.device, *, repeats: int, group: dist.ProcessGroup | None = None,
                 across: dist.ProcessGroup | None = None, collectives: int = 8) -> float:
    """Seconds a blocking collective over ``group`` (default: every rank) waits for its ranks when
    it follows compute, beyond what the calibrated compute rates hold: the mean over the group's
    ranks of a small all-reduce's time after :data:`SYNC_BURST_SECONDS` of matmuls (ranks that
    share cores drift apart; GPUs hardly), less the share a :data:`SUSTAINED_SECONDS` burst
    already puts in the rates (the slowest rank's). Every group of a size runs at once, as a
    plan's TP or DP groups do, and with ``across`` (the group of ranks across them, a plan's other
    mesh axis) each all-reduce alternates with one over it after as much compute, as a plan's
    collectives over two axes keep every rank in step (docs/cost-model.md); as many collectives
    run either way."""
    per_call = 1 if across is None else 2
    burst = _mean_wait(SYNC_BURST_SECONDS, device, group, across, calls=max(1, repeats * collectives // per_call))
    sustained = _mean_wait(SUSTAINED_SECONDS, device, group, across, calls=max(1, repeats // per_call))
    return max(0.0, burst - SYNC_BURST_SECONDS * sustained / SUSTAINED_SECONDS)


def _mean_wait(burst: float, device: torch.device, group: dist.ProcessGroup | None,
               across: dist.ProcessGroup | None, *, calls: int) -> float:
    """The mean over ``group``'s ranks and ``calls`` of an all-reduce's time after ``burst`` seconds
    of matmuls, beyond its last rank's (who arrives last waits for nobody), averaged over the groups
    of its size: the same on every rank. With ``across``, an untimed all-reduce over it after as
    many matmuls follows each."""
    a = torch.randn(256, 256, device=device)
    buffer = torch.ones(1024, device=device)
    count = max(1, round(burst / across_ranks(timed(lambda: a @ a, device, repeats=3))))

    def compute() -> None:
        for _ in range(count):
            a @ a
        _sync(device)

    times = []
    for _ in range(1 + calls):  # the first call is a warm-up
        compute()
        start = time.perf_counter()
        dist.all_reduce(buffer, group=group)
        _sync(device)
        times.append(time.perf_counter() - start)
        if across is not None:
            compute()
            dist.all_reduce(buffer, group=across)
    mine = torch.tensor(times[1:], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    table = torch.stack(every)  # the group's ranks × calls
    wait = (table.mean(dim=0) - table.min(dim=0).values).mean().reshape(1)
    dist.all_reduce(wait)  # each rank adds its group's: the groups are the same size
    return float(wait.item()) / dist.get_world_size()


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

BYTES_REFERENCE = ("llama-small", 2, 128)
"""(model, batch, tokens) whose training step measures, on CPU ranks, the cost per byte that
operators without FLOPs move: a Llama at a size where those bytes, not launching operators,
take the time beyond its matmuls. Not on GPUs, whose host launches operators while the device
runs the ones before: what a step takes beyond its matmuls is then not the sum of its parts (on
an H200 `calibrate` printed 0.36 µs per MiB written in fp32 and 0 in bf16-mixed, where the
operators of bench/gpu_phases.py's steps took 0.6-1.2 µs per MiB they wrote); the copy's
bandwidth prices their bytes there."""


@dataclass(frozen=True, slots=True)
class _ReferenceStep:
    """Forward and backward of a preset on ``batch`` sequences, ``runs`` times per call, and its profile."""

    run: Callable[[], object]
    runs: int
    profile: ModelProfile
    batch: int


def _reference_step(model: str, batch: int, seq_len: int, device: torch.device) -> _ReferenceStep:
    """Forward and backward of ``model`` on ``batch`` sequences of ``seq_len`` tokens (ten at a
    time for a step of at most 64 tokens), and its profile (taken at one sequence)."""
    from stratagem.advisor.profile.cache import profile_spec
    from stratagem.advisor.profile.model_profile import kernels_for
    from stratagem.models import PRESETS

    profile = profile_spec(model, seq_len=seq_len, precision="fp32", kernels=kernels_for(accelerator=device.type == "cuda"))
    preset = PRESETS[model]
    inputs, targets = preset.make_batch(batch, seq_len)
    inputs, targets = tuple(t.to(device) for t in inputs), targets.to(device)
    with torch.device(device):
        module = preset.build()

    def step() -> None:
        preset.loss(module(*inputs), targets).backward()
        module.zero_grad(set_to_none=True)

    runs = 10 if batch * seq_len <= 64 else 1
    return _ReferenceStep(lambda: [step() for _ in range(runs)], runs, profile, batch)


def _total(profile: ModelProfile, *fields: str) -> int:
    """``fields`` summed over every segment of ``profile``."""
    return sum(getattr(s, f) for s in profile.segments for f in fields)


def op_seconds(step_seconds: float, profile: ModelProfile, flops_per_second: float) -> float:
    """Host seconds per operator: ``step_seconds`` of forward and backward of
    :data:`REFERENCE_MODEL` on one 32-token sequence beyond its matmul FLOPs at
    ``flops_per_second``, over the operators its profile counts (the same count the cost model
    multiplies by)."""
    flops = _total(profile, "fwd_flops", "bwd_flops") / profile.batch_size
    return max(step_seconds - flops / flops_per_second, 0.0) / _total(profile, "fwd_ops", "bwd_ops")


def op_byte_seconds(step_seconds: float, profile: ModelProfile, batch: int, curve: list[tuple[int, float]],
                    per_op: float) -> float:
    """Seconds per byte operators without FLOPs (norms, activations, softmax, reductions,
    elementwise arithmetic) read or write: ``step_seconds`` of forward and backward of
    :data:`BYTES_REFERENCE` on ``batch`` sequences beyond its matmuls (at the measured ``curve``'s
    rates for their sizes, as the cost model runs them:
    :func:`~stratagem.advisor.cost.rates.block_matmul_efficiency`) and its operators at ``per_op``
    seconds each, over the bytes its profile counts them moving (the count the cost model
    multiplies by). What the curve misses of the model's own matmuls lands here too."""
    from stratagem.plan import Plan
    from stratagem.advisor.cost.stages import whole_model
    from stratagem.advisor.cost.rates import block_matmul_efficiency

    scale = batch / profile.batch_size
    stage = whole_model(profile)
    efficiency = block_matmul_efficiency(profile, Plan(micro_batch_size=batch, precision="fp32"), stage, curve)
    blocks = scale * sum(stage.block_sums[f] for f in ("fwd_flops", "bwd_flops"))
    other = scale * _total(profile, "fwd_flops", "bwd_flops") - blocks
    matmuls = (blocks / efficiency + other) / curve[-1][1]
    ops = _total(profile, "fwd_ops", "bwd_ops")
    moved = scale * _total(profile, "fwd_op_bytes", "bwd_op_bytes") + _total(profile, "fwd_param_op_bytes",
                                                                            "bwd_param_op_bytes")
    return max(step_seconds - matmuls - ops * per_op, 0.0) / moved


TP_LINEAR_SHAPE = (2, 16, 64, 20)
"""(rows, width, hidden, steps per timing) of the MLP whose steps on DTensors measure a TP
Linear's host time: small enough that its matmuls cost nothing beside the dispatch."""


def tp_linear_seconds(device: torch.device, *, repeats: int) -> float:
    """Host seconds a tensor-parallel Linear adds to a micro-batch's forward and backward on
    DTensors beyond the same Linear on plain tensors (DTensor's dispatch, sharding propagation and
    layout changes): a two-Linear MLP, column- then row-wise as the TP plugin splits a block,
    stepped on a TP mesh of this rank alone (its collectives then cost nothing: the TP time model
    prices them apart) against the plain MLP, timed :func:`interleaved`, the difference halved.
    Every rank runs at once, as in training."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    rows, width, hidden, steps = TP_LINEAR_SHAPE
    mesh = init_device_mesh(device.type, (dist.get_world_size(), 1), mesh_dim_names=("rank", "tp"))["tp"]

    def mlp() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(width, hidden, bias=False), torch.nn.GELU(),
                                   torch.nn.Linear(hidden, width, bias=False)).to(device)

    x = torch.randn(rows, width, device=device)

    def train(module: torch.nn.Module) -> Callable[[], None]:
        def run() -> None:
            for _ in range(steps):
                module(x).sum().backward()
        return run

    split = parallelize_module(mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    plain, tensor_parallel = interleaved([train(mlp()), train(split)], device, repeats=repeats)
    return max(tensor_parallel - plain, 0.0) / (2 * steps)


WORKSPACE_GEMM = 1024
"""Rows and columns of the matmul that brings the kernel library's workspace to a layer's size."""


def framework_bytes(device: torch.device) -> float:
    """Memory a training process takes beyond its tensors, bytes: how far a matmul's forward and
    backward at :data:`WORKSPACE_GEMM` and two AdamW steps of the tiny reference Llama
    (``llama-tiny``, one sequence of 8 tokens) raise the process's peak
    (:class:`~stratagem.peak_memory.PeakMemory`, as verification measures), less
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
