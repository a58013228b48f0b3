"""What a cluster is made of: devices, the links inside a node, the network between nodes.

All classes are frozen plain data in SI units (bytes, bytes/s, FLOP/s, seconds) and round-trip
through ``to_dict``/``from_dict`` for JSON. A :class:`Cluster` is ``num_nodes`` identical
:class:`NodeSpec`\\ s; build one with :func:`parse_cluster` (a spec string, or ``"local"``),
:func:`~stratagem.advisor.hardware.probe_local` or
:func:`~stratagem.advisor.hardware.gather_cluster`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from stratagem.errors import UsageError

DTYPES = ("fp32", "tf32", "bf16", "fp16")


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSpec:
    """One accelerator (a GPU, or with ``kind="tpu"`` a TPU chip) or, with ``kind="cpu"``, one
    gloo rank's share of the host.

    Peaks are dense FLOP/s per device; ``None`` means the device has no such math (V100 has
    no bf16). ``estimated`` names the fields whose values are estimates, not datasheet figures.
    """

    name: str
    kind: str = "gpu"  # "gpu", "tpu" or "cpu"
    vendor: str = "nvidia"
    memory_bytes: int  # bytes per device
    memory_bandwidth: float  # bytes/s
    peak_fp32: float  # FLOP/s
    peak_tf32: float | None  # FLOP/s
    peak_bf16: float | None  # FLOP/s
    peak_fp16: float | None  # FLOP/s
    compute_capability: tuple[int, int] | None = None
    num_cores: int | None = None  # CPU cores per rank; None for GPUs
    num_sms: int | None = None  # streaming multiprocessors (compute units), where catalogued
    matmul_fraction: float | None = None  # share of the 16-bit peak the largest GEMMs reach, where measured
    # Seconds a load from device memory takes to come back while few warps stream, where measured:
    # what bounds kernels with few loads in flight (stratagem.advisor.cost.batch_norm).
    memory_latency: float | None = None
    estimated: tuple[str, ...] = ()

    @property
    def is_gpu(self) -> bool:
        """True for a GPU (NCCL), False for a TPU chip or a CPU rank."""
        return self.kind == "gpu"

    @property
    def is_accelerator(self) -> bool:
        """True for a device with its own memory that the host runs ahead of (GPU, TPU), False
        for a CPU rank, which runs each operator as the host launches it."""
        return self.kind != "cpu"

    @property
    def noun(self) -> str:
        """What reports call one of these: ``'GPU'``, ``'TPU chip'`` or ``'rank'`` (a CPU rank)."""
        return {"gpu": "GPU", "tpu": "TPU chip"}.get(self.kind, "rank")

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype`` (one of fp32, tf32, bf16, fp16)."""
        if dtype not in DTYPES:
            raise UsageError(f"unknown dtype {dtype!r}: known: {', '.join(DTYPES)}")
        value = getattr(self, f"peak_{dtype}")
        if value is None:
            supported = [d for d in DTYPES if getattr(self, f"peak_{d}") is not None]
            example = ("fp16-mixed instead of bf16-mixed" if "fp16" in supported
                       else "bf16-mixed instead of fp16-mixed")
            raise UsageError(
                f"{self.name} has no {dtype} math: it supports {', '.join(supported)}"
                f"\nHINT: choose a precision from those, e.g. {example}"
            )
        return value

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceSpec:
        """Inverse of :meth:`to_dict`."""
        cc = data.get("compute_capability")
        return cls(**{**data, "compute_capability": tuple(cc) if cc else None,
                      "estimated": tuple(data.get("estimated", ()))})


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkSpec:
    """How devices of one node (or a device and its host) exchange data.

    ``kind``: e.g. ``nvlink4``, ``nvlink3-bridge``, ``pcie-gen5``, ``infinity-fabric``,
    ``loopback`` (gloo on one host) or ``none`` (one device per node: nothing to cross).
    ``bandwidth`` is bytes/s per device per direction, raw; multiply by ``efficiency`` for what
    collectives reach. ``domain_size`` devices share this link (2 for bridged pairs); traffic
    beyond a domain falls back to the node's ``host_link``.
    """

    kind: str
    bandwidth: float  # bytes/s per device per direction
    latency: float  # seconds
    efficiency: float  # fraction of bandwidth collectives reach
    topology: str  # "switch", "pairs", "mesh", "cube-mesh", "2d-torus", "3d-torus", "tree", "loopback", "none"
    domain_size: int = 1  # devices joined at this bandwidth
    estimated: tuple[str, ...] = ()

    @property
    def effective_bandwidth(self) -> float:
        """bytes/s per device per direction that collectives reach."""
        return self.bandwidth * self.efficiency

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LinkSpec:
        """Inverse of :meth:`to_dict`."""
        return cls(**{**data, "estimated": tuple(data.get("estimated", ()))})


@dataclass(frozen=True, slots=True, kw_only=True)
class NetworkSpec:
    """The network between nodes: ``nics_per_node`` NICs of ``bandwidth`` bytes/s per direction."""

    name: str  # e.g. "ib-ndr", "roce-200", "eth-100", "efa-p5"
    kind: str  # "infiniband", "roce", "ethernet", "efa"
    bandwidth: float  # bytes/s per NIC per direction
    nics_per_node: int
    latency: float  # seconds
    efficiency: float  # fraction of line rate collectives reach
    estimated: tuple[str, ...] = ()

    @property
    def node_bandwidth(self) -> float:
        """Raw bytes/s per node per direction over all NICs."""
        return self.bandwidth * self.nics_per_node

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NetworkSpec:
        """Inverse of :meth:`to_dict`."""
        return cls(**{**data, "estimated": tuple(data.get("estimated", ()))})


@dataclass(frozen=True, slots=True, kw_only=True)
class HostSpec:
    """The host CPU and RAM of one node (known for probed nodes and CPU clusters)."""

    num_cores: int  # logical cores
    num_physical_cores: int | None
    memory_bytes: int  # host RAM, bytes
    cpu_name: str = ""
    core_isa: str = ""  # a key of catalog.CPU_CORES ("" where unknown)
    isa_extensions: tuple[str, ...] = ()  # its half-precision units: keys of catalog.CPU_HALF_UNITS
    clock_hz: float | None = None  # the cores' nominal clock
    num_sockets: int = 1

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HostSpec:
        """Inverse of :meth:`to_dict`."""
        return cls(**{**data, "isa_extensions": tuple(data.get("isa_extensions", ()))})


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeSpec:
    """One node: ``num_devices`` identical devices, their link, the host and the network."""

    device: DeviceSpec
    num_devices: int
    link: LinkSpec  # device <-> device inside the node
    host_link: LinkSpec | None  # device <-> host memory (PCIe, C2C); None for CPU ranks
    network: NetworkSpec | None  # node <-> node; None for a lone node or when unknown
    host: HostSpec | None = None
    comm_overlap: float | None = None  # measured fraction of communication hidden under compute
    # Measured (collective, group size, bytes/s, seconds per step) for groups inside the node: a
    # backend reaches different rates for each collective (``stratagem calibrate``); () uses ``link``.
    collectives: tuple[tuple[str, int, float, float], ...] = ()
    # Measured (dtype, n, FLOP/s) of n×n matmuls: how a rank's rate falls with a GEMM's size
    # (``stratagem calibrate``); () leaves every GEMM at the device's peak.
    matmul_curve: tuple[tuple[str, int, float], ...] = ()
    # Measured (dtype, share of the aligned rate) of GEMMs whose matrices' leading dimensions are
    # not multiples of 16 bytes (``stratagem calibrate``); () takes the cost model's estimate.
    unaligned_matmul: tuple[tuple[str, float], ...] = ()
    # Measured (dtype, FLOPs per byte, FLOP/s) of convolutions' forward and backward by arithmetic
    # intensity (``stratagem calibrate``); () runs them at the matmul curve's rates.
    conv_curve: tuple[tuple[str, float, float], ...] = ()
    # Measured (dtype, head width, causal, sequence, forward FLOP/s, backward FLOP/s) of fused
    # attention, FLOPs as torch's counter counts them (``stratagem calibrate``, GPUs); () prices it
    # by the tile model (stratagem.advisor.cost.attention).
    attention_curve: tuple[tuple[str, int, bool, int, float, float], ...] = ()
    op_seconds: float | None = None  # measured host seconds per operator of a small model's step
    op_byte_seconds: float | None = None  # measured seconds per byte operators without FLOPs read or write
    # Measured host seconds of an AdamW step over DTensor parameters on the device, per step and
    # per parameter tensor (``stratagem calibrate``); None takes the cost model's estimates.
    dtensor_optimizer_seconds: tuple[float, float] | None = None
    tp_linear_seconds: float | None = None  # measured host seconds a TP Linear adds on DTensors, fwd + bwd
    # Measured (optimizer, seconds per fp32 parameter, seconds per parameter tensor) of a step as
    # torch.optim runs it by default (``stratagem calibrate``); () costs it from memory bandwidth.
    optimizer_seconds: tuple[tuple[str, float, float], ...] = ()
    # The same as the host's CPU runs the step, which an offloaded plan's optimizer does (GPUs,
    # ``stratagem calibrate``); () costs it from HOST_OPTIMIZER_BANDWIDTH_PER_NODE.
    host_optimizer_seconds: tuple[tuple[str, float, float], ...] = ()
    # Measured (group size, seconds) a blocking collective waits after compute beyond its own time, the
    # ranks arriving apart (``stratagem calibrate``); () waits for nothing.
    sync_seconds: tuple[tuple[int, float], ...] = ()
    framework_bytes: float | None = None  # measured memory a training process takes beyond its tensors

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NodeSpec:
        """Inverse of :meth:`to_dict`."""
        return cls(
            device=DeviceSpec.from_dict(data["device"]),
            num_devices=data["num_devices"],
            link=LinkSpec.from_dict(data["link"]),
            host_link=_maybe(LinkSpec.from_dict, data.get("host_link")),
            network=_maybe(NetworkSpec.from_dict, data.get("network")),
            host=_maybe(HostSpec.from_dict, data.get("host")),
            comm_overlap=data.get("comm_overlap"),
            collectives=tuple(tuple(c) for c in data.get("collectives", ())),
            matmul_curve=tuple(tuple(c) for c in data.get("matmul_curve", ())),
            unaligned_matmul=tuple(tuple(c) for c in data.get("unaligned_matmul", ())),
            conv_curve=tuple(tuple(c) for c in data.get("conv_curve", ())),
            attention_curve=tuple(tuple(c) for c in data.get("attention_curve", ())),
            op_seconds=data.get("op_seconds"),
            op_byte_seconds=data.get("op_byte_seconds"),
            dtensor_optimizer_seconds=_maybe(tuple, data.get("dtensor_optimizer_seconds")),
            tp_linear_seconds=data.get("tp_linear_seconds"),
            optimizer_seconds=tuple(tuple(c) for c in data.get("optimizer_seconds", ())),
            host_optimizer_seconds=tuple(tuple(c) for c in data.get("host_optimizer_seconds", ())),
            sync_seconds=tuple(tuple(c) for c in data.get("sync_seconds", ())),
            framework_bytes=data.get("framework_bytes"),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    """``num_nodes`` identical nodes. ``source`` says where it came from ("catalog", "probe",
    "gather"); ``notes`` say what could not be read or was assumed."""

    num_nodes: int
    node: NodeSpec
    source: str = "catalog"
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        assert self.num_nodes >= 1 and self.node.num_devices >= 1, "a cluster needs devices"

    @property
    def devices_per_node(self) -> int:
        """Devices (ranks) per node."""
        return self.node.num_devices

    @property
    def world_size(self) -> int:
        """Devices (ranks) in the cluster."""
        return self.num_nodes * self.node.num_devices

    @property
    def device(self) -> DeviceSpec:
        """The device every rank runs on."""
        return self.node.device

    @property
    def network(self) -> NetworkSpec | None:
        """The inter-node network, if any."""
        return self.node.network

    @property
    def is_gpu(self) -> bool:
        """True when the ranks are GPUs (NCCL); False for TPU chips and for a CPU cluster (gloo)."""
        return self.node.device.is_gpu

    @property
    def is_tpu(self) -> bool:
        """True when the ranks are TPU chips (run through torch_xla, not torch.distributed)."""
        return self.node.device.kind == "tpu"

    @property
    def is_accelerator(self) -> bool:
        """True when the ranks are accelerators (GPUs, TPU chips), False for a CPU cluster."""
        return self.node.device.is_accelerator

    def check_runnable(self, what: str) -> None:
        """Raise :class:`UsageError` when ``what`` (e.g. ``"--emit accelerate"``), which runs a
        plan with torch.distributed on CUDA GPUs or CPU ranks, is asked of TPU chips."""
        if self.is_tpu:
            raise UsageError(
                f"{what} is for plans run with torch.distributed on CUDA GPUs or CPU ranks, but {self.spec} "
                f"is a slice of {self.device.name} chips, which PyTorch drives through torch_xla\nHINT: "
                "advise without --emit or --verify and apply the plan with torch_xla (its SPMD sharding or "
                "FSDPv2), or advise for a GPU cluster"
            )

    @property
    def ranks_per_core(self) -> float:
        """How many ranks share each of a node's cores: above 1 only where CPU ranks (each using
        ``device.num_cores`` threads) outnumber their host's cores; 1 for accelerators and
        unknown hosts."""
        host = self.node.host
        if self.is_accelerator or host is None or not host.num_cores:
            return 1.0
        return max(1.0, self.devices_per_node * (self.device.num_cores or 1) / host.num_cores)

    @property
    def backend(self) -> str:
        """The backend the ranks communicate through: "nccl", "gloo", or "xla" for TPU chips."""
        return "nccl" if self.is_gpu else "xla" if self.is_tpu else "gloo"

    @property
    def spec(self) -> str:
        """The canonical spec string, e.g. ``4x8xH100-SXM5-80GB:ib-ndr-x8``."""
        text = f"{self.num_nodes}x{self.devices_per_node}x{self.device.name}"
        if self.link_is_bridge:
            text += "+bridge"
        net = self.network
        return f"{text}:{net.name}-x{net.nics_per_node}" if net else text

    @property
    def link_is_bridge(self) -> bool:
        """True when devices are joined in bridged pairs rather than by the catalog default."""
        return self.node.link.topology == "pairs"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict, with the derived ``spec`` and ``world_size`` for readers."""
        return {"spec": self.spec, "world_size": self.world_size, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cluster:
        """Inverse of :meth:`to_dict` (derived keys are ignored)."""
        return cls(num_nodes=data["num_nodes"], node=NodeSpec.from_dict(data["node"]),
                   source=data.get("source", "catalog"), notes=tuple(data.get("notes", ())))


def _maybe(build: Any, data: dict[str, Any] | None) -> Any:
    return None if data is None else build(data)
