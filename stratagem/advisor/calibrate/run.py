"""``calibrate()``: run the benchmarks on every rank, fit them, and return a :class:`Calibration`.

Inside a launched job (``torchrun``, a Slurm step: ``RANK``/``WORLD_SIZE`` set, or a process
group already up) every rank of the job takes part and groups across nodes are measured too;
otherwise ``nproc`` local processes are spawned (gloo on CPU, NCCL on GPUs), meeting at a store
this process hosts. A single process (one GPU) measures its compute, memory and optimizer figures;
collectives need two, so catalog figures stand for them and a note in the calibration says so. A
rank that dies ends the calibration with :class:`~stratagem.errors.PeerLost` naming it.
"""

from __future__ import annotations

import datetime
import functools
import os
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stratagem.advisor.calibrate.attention import ATTENTION_SEQUENCES, attention_rates
from stratagem.advisor.calibrate.benchmarks import (
    collective_seconds,
    compute_rates,
    framework_bytes,
    memory_bandwidth,
    overlap_fraction,
    sync_seconds,
    tp_linear_seconds,
)
from stratagem.advisor.calibrate.calibration import COLLECTIVES, Calibration, LinkFit, fit_link, hardware_key
from stratagem.advisor.calibrate.convolutions import CONV_SHAPES, QUICK_CONV_SHAPES, conv_rates
from stratagem.advisor.calibrate.optimizers import host_optimizer_shape, optimizer_seconds, small_step_seconds
from stratagem.advisor.calibrate.memory_latency import memory_latency
from stratagem.advisor.cost.attention import ATTENTION_DTYPES
from stratagem.advisor.hardware.host import last_level_cache_bytes
from stratagem.distributed import (
    across_ranks,
    host_store,
    init_process_group,
    join_group,
    launched_job,
    leave_spawned_process,
    leaving_process_group,
    naming_lost_peers,
    rank_died,
    ranks_on_this_host,
    share_host_cores,
)
from stratagem.errors import PeerLost, UsageError
from stratagem.progress import Progress

__all__ = ["Settings", "calibrate", "calibrate_on_group"]

_Group = tuple[str, int, "dist.ProcessGroup | None", "dist.ProcessGroup | None"]
"""Scope, size, this rank's group of that size (None: the world) and the group of ranks across
it (one of each of those groups; None when the group is the world)."""

LOST_HINT = "HINT: run stratagem calibrate again once every rank can run"
"""What the ranks left say when one of them died: a calibration is measured whole or not at all."""
ONE_PROCESS_NOTE = ("one process: collectives, their overlap with compute and their wait after compute were not "
                    "measured (they need two); the catalog's figures stand for them")

COPY_RATE_FLOOR_NOTE = ("per byte moved: the reference step beyond its matmuls and operators left less time than its "
                        "bytes take at the measured copy rate (a busy host); the copy rate stands for it")
"""The note a CPU calibration carries when its per-byte cost is floored at the copy's rate."""


@dataclass(frozen=True, slots=True)
class Settings:
    """Sizes and repeats; :meth:`for_device` picks them for GPUs or CPU ranks."""

    matmul_sizes: tuple[int, ...]
    message_bytes: tuple[int, ...]
    copy_bytes: int
    repeats: int
    # Timings of each collective and of the wait after compute. CPU ranks sharing cores vary most
    # there: bench/calibration_spread.py prints how far three calibrations move the predictions
    # (docs/benchmarks.md, "Calibration's collectives on shared cores": the TP plans' 31-34 % at
    # 5 timings, 1-6 % at 15 in its run of 2026-11-27).
    collective_repeats: int
    conv_batch: int = 1  # images per convolution timed (CONV_SHAPES)
    conv_shapes: tuple[tuple[int, int, int, int], ...] = QUICK_CONV_SHAPES
    attention_sequences: tuple[int, ...] = ()  # of fused attention timed (GPUs: ATTENTION_SEQUENCES)

    @classmethod
    def for_device(cls, device: torch.device, *, quick: bool = False) -> Settings:
        """The full settings (≈ a minute per node) or ``quick`` ones (seconds, for tests)."""
        if quick:
            return cls(matmul_sizes=(128, 256), message_bytes=(2**12, 2**16, 2**20), copy_bytes=2**22, repeats=2,
                       collective_repeats=2)
        if device.type == "cuda":  # convolutions at ResNet-50's 256 images per GPU
            return cls(matmul_sizes=(1024, 2048, 4096, 8192), message_bytes=tuple(2**k for k in range(16, 29, 2)),
                       copy_bytes=2**30, repeats=5, collective_repeats=5, conv_batch=256, conv_shapes=CONV_SHAPES,
                       attention_sequences=ATTENTION_SEQUENCES)
        return cls(matmul_sizes=(128, 256, 512, 1024), message_bytes=tuple(2**k for k in range(12, 25, 2)),
                   copy_bytes=2**26, repeats=5, collective_repeats=15, conv_batch=2, conv_shapes=CONV_SHAPES)


def calibrate(*, nproc: int | None = None, quick: bool = False, progress: bool = False) -> Calibration:
    """Measure this cluster: in the launched job when there is one, else on ``nproc`` local
    processes (default: the GPUs, or 2 CPU ranks without GPUs). ``progress``: rank 0 shows each
    benchmark as it starts and ends, on stderr (:class:`~stratagem.progress.Progress`)."""
    initialized = dist.is_available() and dist.is_initialized()
    if (initialized or launched_job()) and nproc is not None:
        raise UsageError("--nproc sets the processes calibrate spawns; in a launched job every rank measures\n"
                         "HINT: the launcher's --nproc-per-node sets the ranks")
    if initialized:
        return calibrate_on_group(quick=quick, progress=progress)
    if launched_job():
        init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if not torch.cuda.is_available():  # as verify's ranks run (and _worker's): a share of this host
            share_host_cores(ranks_on_this_host())
        with leaving_process_group():
            calibration = calibrate_on_group(quick=quick, progress=progress)
        return calibration
    nproc = nproc or torch.cuda.device_count() or 2
    if nproc < 1:
        raise UsageError(f"--nproc {nproc}: calibration needs at least one process")
    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        raise UsageError(f"--nproc {nproc}: this host has {torch.cuda.device_count()} GPUs, one process each")
    return _spawn(nproc, quick=quick, progress=progress)


def _spawn(nproc: int, *, quick: bool, progress: bool) -> Calibration:
    import torch.multiprocessing as mp

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    Progress(enabled=progress).note("calibrate", f"spawning {nproc} rank{'s' if nproc > 1 else ''} ({backend}); "
                                    "rank 0 shows each benchmark")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "calibration.json"
        store = host_store()  # referenced until the ranks are done
        try:
            mp.start_processes(_worker, args=(nproc, store.port, quick, progress, out), nprocs=nproc,
                               start_method="spawn")
        except mp.ProcessExitedException as err:  # a rank died (its peers, stopped with it, could not say)
            raise PeerLost(f"calibration {rank_died(err, list(range(nproc)), nproc)}\n{LOST_HINT}") from None
        except mp.ProcessRaisedException:
            usage = sorted(Path(tmp).glob("usage-error-*.txt"))
            if usage:  # bad input found on a rank: the message alone, as in this process
                raise UsageError(usage[0].read_text()) from None
            lost = sorted(Path(tmp).glob("peer-lost-*.txt"))
            if lost:  # a rank saw a peer die first: its message names it
                raise PeerLost(lost[0].read_text()) from None
            raise
        return Calibration.load(out)


def _worker(rank: int, nproc: int, port: int, quick: bool, progress: bool, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(nproc),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    else:
        share_host_cores(nproc)
    join_group("nccl" if cuda else "gloo", ("127.0.0.1", port), rank=rank, world_size=nproc)
    try:
        with leaving_process_group():
            calibration = calibrate_on_group(quick=quick, progress=progress)
            if rank == 0:
                calibration.save(out)
    except (UsageError, PeerLost) as err:
        kind = "usage-error" if isinstance(err, UsageError) else "peer-lost"
        (out.parent / f"{kind}-{rank}.txt").write_text(str(err))
        raise
    leave_spawned_process()


@naming_lost_peers(LOST_HINT)
def calibrate_on_group(*, quick: bool = False, progress: bool = False) -> Calibration:
    """Every rank of the default process group runs this; each returns the same Calibration (or
    :class:`~stratagem.errors.PeerLost` naming a rank that died). ``progress``: rank 0 shows each
    benchmark as it starts and ends (stderr)."""
    from stratagem.advisor.hardware import gather_cluster, probe_local

    started = time.perf_counter()
    with Progress(enabled=progress and dist.get_rank() == 0) as display:
        with display.phase("calibrate", "probing the cluster"):
            cluster = gather_cluster(probe_local())
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        settings = Settings.for_device(device, quick=quick)
        groups = measured_groups(cluster.num_nodes, cluster.devices_per_node)
        dtypes = ["fp32", "bf16"] if device.type == "cpu" or torch.cuda.is_bf16_supported() else ["fp32"]
        phase = functools.partial(display.phase, "calibrate")
        measured = {**_measure_compute(device, settings, dtypes, phase), **_measure_links(device, settings, groups, phase)}
    alone = dist.get_world_size() == 1
    notes = measured.pop("notes")
    return Calibration(
        hardware=hardware_key(cluster), backend=dist.get_backend(), world_size=dist.get_world_size(),
        **measured, seconds=time.perf_counter() - started,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        notes=(*notes, *((ONE_PROCESS_NOTE,) if alone else ())))


_Phase = Callable[[str], AbstractContextManager]
"""``phase(what)``: a ``with`` block shown as one benchmark (``calibrate: what …``) on rank 0."""


def _measure_compute(device: torch.device, settings: Settings, dtypes: list[str], phase: _Phase) -> dict[str, Any]:
    """The benchmarks of one rank: framework memory, matmuls and operators, convolutions, fused
    attention (GPUs), memory bandwidth, optimizer steps, DTensor dispatch; Calibration's fields
    and its notes."""
    with phase("framework memory"):
        framework = across_ranks(framework_bytes(device))  # first: what a fresh process's first steps take
    with phase(f"matmuls and operators ({', '.join(dtypes)})"):
        compute = compute_rates(settings.matmul_sizes, dtypes, device, repeats=settings.repeats)
    with phase(f"convolutions ({', '.join(dtypes)})"):
        convs = conv_rates(dtypes, device, batch=settings.conv_batch, repeats=settings.repeats,
                           shapes=settings.conv_shapes)
    attention = {}
    halves = [dtype for dtype in dtypes if dtype in ATTENTION_DTYPES]  # CPU ranks keep it among the matmuls
    if settings.attention_sequences and halves:
        with phase(f"attention ({', '.join(halves)})"):
            attention = attention_rates(halves, device, repeats=settings.repeats, sequences=settings.attention_sequences)
    with phase("memory bandwidth"):
        bandwidth = across_ranks(memory_bandwidth(settings.copy_bytes, device, repeats=settings.repeats),
                                 smallest=True)
    with phase("optimizer steps"):
        # Parameters whose fp32 values, gradients and AdamW states (16 bytes each) fill the copy's buffer.
        optimizers = optimizer_seconds(settings.copy_bytes // 16, device, repeats=settings.repeats)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))  # FSDP's: DTensors sharded over every rank
    host = None
    if device.type == "cuda":  # an offloaded plan's step runs on the host's CPU, over FSDP's DTensors
        with phase("optimizer steps on the host"):
            import psutil

            tensors, params = host_optimizer_shape(last_level_cache_bytes(), psutil.virtual_memory().available,
                                                   ranks=ranks_on_this_host())
            host = optimizer_seconds(params, torch.device("cpu"), repeats=settings.repeats, mesh=mesh,
                                     tensors=tensors, pin_memory=True, fused=True)  # as the plugins step them
    with phase("DTensor dispatch: optimizer operators, TP Linears"):
        dtensor_optimizer = small_step_seconds(device, repeats=settings.repeats, mesh=mesh)
        per_tp_linear = tp_linear_seconds(device, repeats=settings.repeats)
    per_byte, byte_notes = op_byte_seconds_at_least_a_copy(compute.op_byte_seconds, bandwidth)
    latency = None
    if device.type == "cuda" and torch.version.hip is None:  # NVIDIA's kernels (memory_latency's docstring)
        with phase("memory latency (BatchNorm's per-channel kernel)"):
            latency = across_ranks(memory_latency(device, 1 / bandwidth, repeats=settings.repeats))
    return dict(
        matmul={dtype: tuple(points) for dtype, points in compute.matmul.items()}, memory_bandwidth=bandwidth,
        conv={dtype: tuple(points) for dtype, points in convs.items()},
        attention={dtype: tuple(points) for dtype, points in attention.items()},
        unaligned_matmul=compute.unaligned, op_seconds=compute.op_seconds,
        op_byte_seconds=per_byte,
        dtensor_optimizer_seconds=dtensor_optimizer, tp_linear_seconds=per_tp_linear, optimizer_seconds=optimizers,
        host_optimizer_seconds=host,
        framework_bytes=framework, memory_latency=latency, notes=byte_notes)


def op_byte_seconds_at_least_a_copy(measured: float | None, bandwidth: float) -> tuple[float, tuple[str, ...]]:
    """Seconds per byte operators without FLOPs move, and the notes it needs: ``measured`` by the
    CPU reference step, but no less than a copy at ``bandwidth`` bytes/s takes (a busy host can
    leave the step less time beyond its matmuls and operators than its bytes need:
    :data:`COPY_RATE_FLOOR_NOTE`); the copy's where nothing was measured (GPUs, whose host hides it:
    :data:`~stratagem.advisor.calibrate.benchmarks.BYTES_REFERENCE`)."""
    copy = 1 / bandwidth
    if measured is not None and measured < copy:
        return copy, (COPY_RATE_FLOOR_NOTE,)
    return (copy if measured is None else measured), ()


def _measure_links(device: torch.device, settings: Settings, groups: list[_Group], phase: _Phase) -> dict[str, Any]:
    """The collectives per group: their wait after compute and each one's time; their overlap with
    compute (none with one process: the catalog's figures stand); Calibration's fields."""
    if dist.get_world_size() == 1:
        return dict(links={}, overlap=None, sync_seconds=None)
    links: dict[str, dict[str, dict[int, LinkFit]]] = {}
    sync: dict[int, float] = {}
    for scope, size, group, across in groups:
        with phase(f"collectives after compute {scope} ×{size}"):
            sync[size] = sync_seconds(device, repeats=settings.collective_repeats, group=group, across=across)
        for op in COLLECTIVES:
            with phase(f"{op} {scope} ×{size}"):
                seconds = collective_seconds(op, settings.message_bytes, device, group=group,
                                             repeats=settings.collective_repeats)
            links.setdefault(scope, {}).setdefault(op, {})[size] = fit_link(
                op, size, list(zip(settings.message_bytes, seconds)))
    with phase("overlap of collectives and compute"):
        overlap = across_ranks(overlap_fraction(settings.matmul_sizes[-1], settings.message_bytes[-1], device,
                                                repeats=settings.repeats), smallest=True)
    return dict(links=links, overlap=overlap, sync_seconds=sync)


def group_sizes(per_node: int) -> list[int]:
    """The sizes of the groups of consecutive ranks measured inside a node of ``per_node`` ranks:
    each power of two that divides it, and the node itself."""
    powers = {2**k for k in range(1, per_node.bit_length()) if per_node % 2**k == 0}
    return sorted(powers | {per_node}) if per_node > 1 else []


def measured_groups(num_nodes: int, per_node: int) -> list[_Group]:
    """The groups measured: consecutive ranks inside a node for each size :func:`group_sizes` names,
    with the groups across them (ranks as many apart: a plan's other mesh axis), and the whole
    world across nodes."""
    world = num_nodes * per_node
    groups: list[_Group] = []
    for size in group_sizes(per_node):
        if size == world:
            groups.append(("intra", size, None, None))
            continue
        mine = _new_groups([list(range(start, start + size)) for start in range(0, world, size)])
        across = _new_groups([list(range(offset, world, size)) for offset in range(size)])
        groups.append(("intra", size, mine, across))
    if num_nodes > 1:
        groups.append(("inter", world, None, None))
    return groups


def _new_groups(partition: list[list[int]]) -> dist.ProcessGroup:
    """This rank's group of the groups ``partition`` lists. Every rank creates every group
    (``new_group`` is a collective)."""
    mine = None
    for ranks in partition:
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    assert mine is not None, "the partition leaves this rank out"
    return mine
