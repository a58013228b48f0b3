"""A calibration: what the cluster measured, fitted to the cost model's terms, and applied to a
:class:`Cluster` in place of catalog figures. Plain data (no torch), stored as JSON.

The fits follow the cost model's own forms (:mod:`stratagem.advisor.cost.collectives`): a ring
collective over ``n`` ranks takes ``steps·α + (steps/n)·bytes/β`` with ``steps = 2(n−1)`` for
all-reduce and ``n−1`` for all-gather and reduce-scatter; point-to-point ``α + bytes/β``. A
least-squares line through the measured (bytes, seconds) points gives α and β per collective
and group size, for groups inside a node and across nodes.

A calibration applies to the cluster it was taken on: same spec (nodes × devices × device,
network) and same device vendor string (the CPU model for gloo ranks). ``advise``,
``evaluate`` and ``auto-parallel`` look one up by that key (:func:`find_calibration`) and say in
the report when they use it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stratagem.advisor.hardware.spec import Cluster, LinkSpec, NetworkSpec
from stratagem.errors import UsageError

__all__ = ["COLLECTIVES", "Calibration", "LinkFit", "calibrated", "calibration_path", "find_calibration",
           "fit_link", "hardware_key", "ring_steps"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
FORMAT_VERSION = 13  # 6: op_byte_seconds per byte moved, not written; unaligned_matmul. 7: tp_linear_seconds.
# 8: dtensor_optimizer_seconds (per step, per tensor) in place of dtensor_op_seconds (per operator);
# host_optimizer_seconds over DTensors. 9: host_optimizer_seconds over tensors larger than the host's cache.
# 10: host_optimizer_seconds over DTensors whose shards stay on the host, pinned as FSDP2 keeps them.
# 11: host_optimizer_seconds of torch's fused kernel, which the plugins step offloaded parameters with.
# 12: SGD timed with momentum (OPTIMIZER_OPTIONS), as the memory model counts its buffer.
# 13: sync_seconds per group size measured (the world's alone before: read as that size's).
READABLE_FORMATS = (8, 9, 10, 11, 12, FORMAT_VERSION)
SGD_WITH_MOMENTUM_FORMAT = 12
STALE_HOST_OPTIMIZER_NOTES = {
    8: "timed by a calibration of format 8, over tensors small enough for a server's CPU cache to hold",
    9: "timed by a calibration of format 9, whose DTensors on a GPU mesh moved their shards onto the GPU",
    10: "timed by a calibration of format 10, one tensor at a time, where the plugins now step fused",
}
"""Why the host optimizer figure of an older calibration format is dropped when it is read, by format."""


def stale_sgd_note(version: int) -> str:
    """What reading a calibration of format ``version`` (before SGD was timed with momentum) says
    of the SGD figures it drops."""
    return (f"SGD's step: timed without momentum by a calibration of format {version}, where the cost model's SGD "
            "keeps momentum; its streaming estimate stands until `stratagem calibrate` runs again")


def stale_host_optimizer_note(version: int) -> str:
    """What reading a calibration of format ``version`` says of the host optimizer figure it drops."""
    return (f"host optimizer step: {STALE_HOST_OPTIMIZER_NOTES[version]} (docs/cost-model.md, \"Optimizer step and "
            "offload\"); the catalog's figure stands for it until `stratagem calibrate` runs again")


def ring_steps(op: str, group_size: int) -> int:
    """Latency steps of ``op`` over ``group_size`` ranks in the cost model's ring form."""
    if op == "p2p":
        return 1
    return (2 if op == "all_reduce" else 1) * (group_size - 1)


@dataclass(frozen=True, slots=True)
class LinkFit:
    """α (seconds per step) and β (bytes/s per rank per direction) fitted for one collective and
    group size, with the points measured (bytes, seconds)."""

    latency: float
    bandwidth: float
    points: tuple[tuple[int, float], ...]

    def seconds(self, op: str, group_size: int, num_bytes: float) -> float:
        """The fitted time of ``op`` on ``num_bytes`` (the cost model's form)."""
        steps = ring_steps(op, group_size)
        share = 1.0 if op == "p2p" else steps / group_size
        return steps * self.latency + share * num_bytes / self.bandwidth


def fit_link(op: str, group_size: int, points: list[tuple[int, float]]) -> LinkFit:
    """Least-squares ``seconds = a + b·bytes`` through ``points``, turned into α = a/steps and
    β = share/b (share = steps/n for rings, 1 for point-to-point). A negative intercept (noise at
    small sizes) is clamped to zero latency."""
    if len(points) < 2:
        raise UsageError(f"fitting {op} needs at least two message sizes, got {len(points)}")
    xs = [float(b) for b, _ in points]
    ys = [s for _, s in points]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var
    slope = max(slope, 1e-18)  # time grows with size; noise cannot make bandwidth infinite
    intercept = max(mean_y - slope * mean_x, 0.0)
    steps = ring_steps(op, group_size)
    share = 1.0 if op == "p2p" else steps / group_size
    return LinkFit(latency=intercept / steps, bandwidth=share / slope, points=tuple(points))


STALE_ATTENTION_NOTE = ("this calibration has no attention rates (an earlier stratagem took it): fused attention "
                        "is priced at the GEMMs' calibrated rate; run `stratagem calibrate` again to measure it")
"""The note a GPU cluster's calibration without fused attention's rates adds (cost.attention)."""


def _without_stale_figures(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a calibration's dict) less the figures its format timed otherwise than the cost
    model prices now, each with a note: the host optimizer's before format 11
    (:func:`stale_host_optimizer_note`), SGD's before format 12 (:func:`stale_sgd_note`)."""
    version, notes = data["version"], list(data.get("notes", ()))
    if version in STALE_HOST_OPTIMIZER_NOTES and data.get("host_optimizer_seconds"):
        data = {**data, "host_optimizer_seconds": None}
        notes.append(stale_host_optimizer_note(version))
    timed = {key: data[key] for key in ("optimizer_seconds", "host_optimizer_seconds") if data.get(key)}
    if version < SGD_WITH_MOMENTUM_FORMAT and any("sgd" in figures for figures in timed.values()):
        data = {**data, **{key: {name: costs for name, costs in figures.items() if name != "sgd"}
                           for key, figures in timed.items()}}
        notes.append(stale_sgd_note(version))
    return {**data, "notes": notes}


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    """What ``stratagem calibrate`` measured on one cluster.

    ``matmul``: per dtype, (n, FLOP/s) for square n×n matmuls, each rank running at once (the
    largest n is the rate the cost model uses). ``conv``: per dtype, (FLOPs per byte, FLOP/s) of
    convolutions' forward and backward by arithmetic intensity (empty where not measured: a
    calibration of an earlier stratagem). ``attention``: per dtype, (head width, causal, sequence,
    forward FLOP/s, backward FLOP/s) of fused attention as torch's counter counts its FLOPs
    (GPUs; empty on CPU ranks and in earlier calibrations). ``memory_bandwidth``: bytes/s of a large copy.
    ``links``: per scope (``"intra"`` inside a node, ``"inter"`` across nodes) per collective per
    group size, the fit. ``unaligned_matmul``: per dtype, the share of the largest matmul's rate
    that one with a matrix's rows off 16 bytes reaches (one column narrower). ``overlap``: the
    fraction of an all-reduce hidden under concurrent matmuls. ``op_seconds``: host seconds per
    operator of a small model's training step beyond its matmul FLOPs; ``op_byte_seconds``:
    seconds per byte operators without FLOPs move, beyond those and the matmuls, in a larger
    model's step (CPU ranks), or at the copy's bandwidth (GPUs); ``dtensor_optimizer_seconds``:
    an AdamW step over DTensor parameters on the device, seconds per step and per parameter
    tensor; ``tp_linear_seconds``: what a tensor-parallel Linear's forward and backward on
    DTensors add to the host's time beyond a plain Linear's; ``optimizer_seconds``: per
    optimizer, its step's seconds per fp32 parameter and per parameter tensor. ``sync_seconds``:
    per group size measured, what a blocking collective waits beyond its own time when it follows
    compute (the ranks arriving apart). ``framework_bytes``: the memory a fresh process's first
    training steps take beyond their tensors. ``memory_latency``: seconds a load from device memory takes to come back
    with few in flight (GPUs; None on CPU ranks and in earlier calibrations).
    ``host_optimizer_seconds``: ``optimizer_seconds`` as the host's CPU runs the step over DTensor
    parameters, which an offloaded plan's optimizer does (GPUs; None on CPU ranks, whose
    ``optimizer_seconds`` are the host's, and in earlier calibrations).
    """

    hardware: str
    backend: str
    world_size: int
    matmul: dict[str, tuple[tuple[int, float], ...]]
    unaligned_matmul: dict[str, float]
    memory_bandwidth: float
    links: dict[str, dict[str, dict[int, LinkFit]]]
    overlap: float | None
    op_seconds: float | None
    op_byte_seconds: float | None
    dtensor_optimizer_seconds: tuple[float, float] | None
    tp_linear_seconds: float
    optimizer_seconds: dict[str, tuple[float, float]] | None
    sync_seconds: dict[int, float] | None
    framework_bytes: float | None
    seconds: float
    created: str
    version: int = FORMAT_VERSION
    notes: tuple[str, ...] = field(default=())
    conv: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    attention: dict[str, tuple[tuple[int, bool, int, float, float], ...]] = field(default_factory=dict)
    memory_latency: float | None = None
    host_optimizer_seconds: dict[str, tuple[float, float]] | None = None

    def matmul_rate(self, dtype: str) -> float | None:
        """FLOP/s of the largest measured matmul in ``dtype``, or None when not measured."""
        points = self.matmul.get(dtype)
        return max(points)[1] if points else None

    def link(self, scope: str, op: str = "all_reduce") -> LinkFit | None:
        """The fit for ``op`` over the largest group measured in ``scope``, or None."""
        fits = self.links.get(scope, {}).get(op, {})
        return fits[max(fits)] if fits else None

    def apply(self, cluster: Cluster) -> Cluster:
        """``cluster`` with measured figures in place of catalog ones: device peaks (the dtypes
        measured), memory bandwidth, the in-node link (the all-reduce fit) and each collective's
        own fit per group size inside a node, the network (α, β, efficiency 1: the fit already is
        what collectives reach), how much communication hides under compute, the host seconds per
        operator and per byte its operators without FLOPs move, a TP Linear's on DTensors, the
        optimizers' steps (on the device, and on the host where measured), the wait
        of a collective after compute, and the framework's memory. The
        matmul rates of every size measured go along (``NodeSpec.matmul_curve``), the share
        of them unaligned GEMMs reach (``NodeSpec.unaligned_matmul``), the convolutions' rates
        (``NodeSpec.conv_curve``) and fused attention's (``NodeSpec.attention_curve``), and the
        memory's latency where measured. A note says so."""
        node = cluster.node
        measured = {f"peak_{dtype}": rate for dtype in ("fp32", "tf32", "bf16", "fp16")
                    if (rate := self.matmul_rate(dtype)) is not None}
        if self.memory_latency is not None:
            measured["memory_latency"] = self.memory_latency
        device = dataclasses.replace(
            node.device, **measured, memory_bandwidth=self.memory_bandwidth,
            estimated=tuple(f for f in node.device.estimated if f not in measured and f != "memory_bandwidth"))
        link = node.link
        if (intra := self.link("intra")) is not None:
            link = LinkSpec(kind=link.kind, bandwidth=intra.bandwidth, latency=intra.latency, efficiency=1.0,
                            topology=link.topology, domain_size=max(link.domain_size, node.num_devices))
        network = node.network
        if (inter := self.link("inter")) is not None and network is not None:
            # Measured over every rank at once: each rank's share of the node's NICs.
            network = NetworkSpec(name=network.name, kind=network.kind, nics_per_node=1, efficiency=1.0,
                                  bandwidth=inter.bandwidth * node.num_devices, latency=inter.latency)
        note = f"calibrated: measured on this cluster {self.created} ({self.backend}, {self.seconds:.0f} s)"
        overlap = node.comm_overlap if self.overlap is None else self.overlap
        collectives = tuple((op, n, fit.bandwidth, fit.latency)
                            for op, fits in self.links.get("intra", {}).items() for n, fit in fits.items())
        node = dataclasses.replace(node, device=device, link=link, network=network, comm_overlap=overlap,
                                   collectives=collectives, op_seconds=self.op_seconds,
                                   matmul_curve=tuple((dtype, n, rate) for dtype, points in self.matmul.items()
                                                      for n, rate in points),
                                   unaligned_matmul=tuple(self.unaligned_matmul.items()),
                                   conv_curve=tuple((dtype, intensity, rate) for dtype, points in self.conv.items()
                                                    for intensity, rate in points),
                                   attention_curve=tuple((dtype, *point) for dtype, points in self.attention.items()
                                                         for point in points),
                                   op_byte_seconds=self.op_byte_seconds,
                                   dtensor_optimizer_seconds=self.dtensor_optimizer_seconds,
                                   tp_linear_seconds=self.tp_linear_seconds,
                                   optimizer_seconds=tuple((name, *costs) for name, costs
                                                           in (self.optimizer_seconds or {}).items()),
                                   host_optimizer_seconds=tuple((name, *costs) for name, costs
                                                                in (self.host_optimizer_seconds or {}).items()),
                                   sync_seconds=tuple(sorted((self.sync_seconds or {}).items())),
                                   framework_bytes=self.framework_bytes)
        notes = (note, STALE_ATTENTION_NOTE) if cluster.is_accelerator and not self.attention else (note,)
        return dataclasses.replace(cluster, node=node, notes=(*cluster.notes, *notes))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (group sizes as strings)."""
        data = dataclasses.asdict(self)
        data["links"] = {scope: {op: {str(n): dataclasses.asdict(fit) for n, fit in fits.items()}
                                 for op, fits in ops.items()} for scope, ops in self.links.items()}
        if self.sync_seconds is not None:
            data["sync_seconds"] = {str(n): seconds for n, seconds in self.sync_seconds.items()}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        """Inverse of :meth:`to_dict`; what an older format timed otherwise than the cost model
        prices now is dropped (:func:`_without_stale_figures`)."""
        if data.get("version") not in READABLE_FORMATS:
            raise UsageError(f"calibration format {data.get('version')} is not {FORMAT_VERSION}\n"
                             "HINT: run `stratagem calibrate` again")
        data = {**_without_stale_figures(data), "version": FORMAT_VERSION}
        links = {scope: {op: {int(n): LinkFit(fit["latency"], fit["bandwidth"], tuple(map(tuple, fit["points"])))
                              for n, fit in fits.items()} for op, fits in ops.items()}
                 for scope, ops in data["links"].items()}
        matmul = {dtype: tuple(map(tuple, points)) for dtype, points in data["matmul"].items()}
        conv = {dtype: tuple(map(tuple, points)) for dtype, points in data.get("conv", {}).items()}
        attention = {dtype: tuple(map(tuple, points)) for dtype, points in data.get("attention", {}).items()}
        optimizers, host = (data.get(key) and {name: tuple(costs) for name, costs in data[key].items()}
                            for key in ("optimizer_seconds", "host_optimizer_seconds"))
        dtensor, sync = data["dtensor_optimizer_seconds"], data["sync_seconds"]
        if isinstance(sync, (int, float)):  # before format 13: measured over every rank
            sync = {str(data["world_size"]): sync}
        return cls(**{**data, "links": links, "matmul": matmul, "conv": conv, "attention": attention,
                      "sync_seconds": sync and {int(n): seconds for n, seconds in sync.items()},
                      "optimizer_seconds": optimizers, "host_optimizer_seconds": host,
                      "dtensor_optimizer_seconds": dtensor and tuple(dtensor), "notes": tuple(data.get("notes", ()))})

    def save(self, path: Path) -> None:
        """Write as JSON to ``path``."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> Calibration:
        """Read a file :meth:`save` wrote."""
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise UsageError(f"cannot read the calibration {path}: {err}") from None


def hardware_key(cluster: Cluster) -> str:
    """What a calibration is keyed to: the cluster's spec and its device's vendor string."""
    return f"{cluster.spec} {cluster.device.vendor}"


def calibration_path(hardware: str) -> Path:
    """Where the calibration of the hardware keyed ``hardware`` (:func:`hardware_key`) is stored,
    in the profile cache's directory."""
    from stratagem.advisor.profile.cache import cache_dir

    slug = re.sub(r"[^A-Za-z0-9.+-]+", "_", hardware).strip("_")
    return cache_dir() / "calibration" / f"{slug}.json"


def find_calibration(cluster: Cluster) -> Calibration | None:
    """The stored calibration taken on ``cluster``'s hardware, or None."""
    path = calibration_path(hardware_key(cluster))
    if not path.is_file():
        return None
    calibration = Calibration.load(path)
    return calibration if calibration.hardware == hardware_key(cluster) else None


UNCALIBRATED_NOTE = ("uncalibrated: rates from the catalog's figures and the cost model's estimates (GEMMs by "
                     "shape, attention, memory-bound work, host time); `stratagem calibrate` on this cluster "
                     "measures them")
"""The note a cluster with no stored calibration carries (docs/cost-model.md, "Calibration"): CPU
ranks too, whose catalog figures are their cores' vector peaks and a core's stream (docs/hardware.md)."""


def calibrated(cluster: Cluster) -> Cluster:
    """``cluster`` with its stored calibration applied, or as it is with :data:`UNCALIBRATED_NOTE`
    when there is none."""
    calibration = find_calibration(cluster)
    if calibration is not None:
        return calibration.apply(cluster)
    return dataclasses.replace(cluster, notes=(*cluster.notes, UNCALIBRATED_NOTE))
