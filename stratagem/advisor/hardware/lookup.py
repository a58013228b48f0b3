"""Turn catalog entries into specs: name lookup (GPUs, TPUs), NVML name matching, link and
network specs."""

from __future__ import annotations

import re
from dataclasses import replace

from stratagem.advisor.hardware import catalog
from stratagem.advisor.hardware.catalog import Fig, GpuEntry, LinkEntry, TpuEntry
from stratagem.advisor.hardware.spec import DeviceSpec, HostSpec, LinkSpec, NetworkSpec, NodeSpec


def _key(name: str) -> str:
    """Case-, space- and punctuation-blind form of a device name."""
    return re.sub(r"[^0-9A-Z]", "", name.upper())


_BY_NAME: dict[str, GpuEntry] = {
    _key(alias): entry for entry in catalog.GPUS for alias in (entry.name, *entry.aliases)
}
_TPU_BY_NAME: dict[str, TpuEntry] = {
    _key(alias): entry for entry in catalog.TPUS for alias in (entry.name, *entry.aliases)
}
_BY_NVML: dict[str, GpuEntry] = {
    _key(nvml): entry for entry in catalog.GPUS for nvml in entry.nvml_names
}


def gpu_names() -> list[str]:
    """Canonical names of every catalogued GPU."""
    return [entry.name for entry in catalog.GPUS]


def gpu_aliases() -> dict[str, str]:
    """Short names (aliases) and the catalog name each stands for."""
    return {alias: entry.name for entry in catalog.GPUS for alias in entry.aliases}


def find_gpu(name: str) -> GpuEntry | None:
    """The entry whose name or alias matches ``name`` (ignoring case and punctuation)."""
    return _BY_NAME.get(_key(name))


def tpu_names() -> list[str]:
    """Canonical names of every catalogued TPU chip."""
    return [entry.name for entry in catalog.TPUS]


def find_tpu(name: str) -> TpuEntry | None:
    """The TPU entry whose name or alias matches ``name`` (ignoring case and punctuation)."""
    return _TPU_BY_NAME.get(_key(name))


def tpu_node(entry: TpuEntry, *, num_devices: int) -> NodeSpec:
    """A slice of ``num_devices`` chips of ``entry``: one node whose link is the slice's ICI."""
    device = DeviceSpec(
        name=entry.name, kind="tpu", vendor=entry.vendor, memory_bytes=int(entry.memory.value),
        memory_bandwidth=entry.memory_bandwidth.value, peak_fp32=entry.fp32.value, peak_tf32=None,
        peak_bf16=entry.bf16.value, peak_fp16=None,
        estimated=_estimated(memory_bytes=entry.memory, memory_bandwidth=entry.memory_bandwidth,
                             peak_fp32=entry.fp32, peak_bf16=entry.bf16),
    )
    ici = LinkEntry(entry.ici, catalog.ICI_LATENCY, catalog.ICI_EFFICIENCY, entry.topology)
    link = _link("ici", ici, domain_size=num_devices) if num_devices > 1 else none_link()
    return NodeSpec(device=device, num_devices=num_devices, link=link,
                    host_link=host_link_from_key(entry.host_link), network=None)


def match_nvml_name(nvml_name: str) -> GpuEntry | None:
    """The entry for a name as NVML reports it (e.g. "NVIDIA H100 80GB HBM3"), if catalogued."""
    return _BY_NVML.get(_key(nvml_name)) or _BY_NAME.get(_key(_strip_brand(nvml_name)))


def _strip_brand(nvml_name: str) -> str:
    return re.sub(r"^(NVIDIA|Tesla|GeForce|\s)+", "", nvml_name, flags=re.IGNORECASE)


def _estimated(**figs: Fig | None) -> tuple[str, ...]:
    return tuple(name for name, fig in figs.items() if fig is not None and fig.estimate)


def _value(fig: Fig | None) -> float | None:
    return None if fig is None else fig.value


def device_from_entry(entry: GpuEntry) -> DeviceSpec:
    """The :class:`DeviceSpec` a catalog entry describes."""
    figs = {"memory_bytes": entry.memory, "memory_bandwidth": entry.memory_bandwidth,
            "peak_fp32": entry.fp32, "peak_tf32": entry.tf32, "peak_bf16": entry.bf16,
            "peak_fp16": entry.fp16, "num_sms": entry.sms, "matmul_fraction": entry.matmul,
            "memory_latency": entry.memory_latency}
    sixteen_bit = entry.bf16 or entry.fp16
    return DeviceSpec(
        name=entry.name, vendor=entry.vendor, memory_bytes=int(entry.memory.value),
        memory_bandwidth=entry.memory_bandwidth.value, peak_fp32=entry.fp32.value,
        peak_tf32=_value(entry.tf32), peak_bf16=_value(entry.bf16), peak_fp16=entry.fp16.value,
        compute_capability=entry.compute_capability, estimated=_estimated(**figs),
        num_sms=None if entry.sms is None else int(entry.sms.value),
        matmul_fraction=None if entry.matmul is None else entry.matmul.value / sixteen_bit.value,
        memory_latency=_value(entry.memory_latency),
    )


def estimate_unknown_gpu(
    name: str, *, memory_bytes: int, compute_capability: tuple[int, int] | None
) -> tuple[DeviceSpec, str]:
    """A device for a GPU the catalog lacks: memory as read, the rest borrowed from the slowest
    catalogued GPU of the same compute capability (or the slowest of all); and a note saying so."""
    same_cc = [e for e in catalog.GPUS if e.compute_capability == compute_capability]
    donor = min(same_cc or catalog.GPUS, key=lambda e: e.fp16.value)
    device = replace(
        device_from_entry(donor), name=name, memory_bytes=memory_bytes,
        compute_capability=compute_capability, num_sms=None, matmul_fraction=None,  # the donor's would be guesses
        memory_latency=None,
        estimated=("memory_bandwidth", "peak_fp32", "peak_tf32", "peak_bf16", "peak_fp16"),
    )
    why = f"compute capability {compute_capability}" if same_cc else "no catalogued peer"
    note = (f"GPU {name!r} is not in the catalog: peak FLOP/s and memory bandwidth are "
            f"estimated from {donor.name} ({why}); memory is as the driver reports it")
    return device, note


def _link(kind: str, entry: LinkEntry, *, bandwidth: Fig | None = None,
          domain_size: int) -> LinkSpec:
    bandwidth = bandwidth or entry.bandwidth
    return LinkSpec(
        kind=kind, bandwidth=bandwidth.value, latency=entry.latency.value,
        efficiency=entry.efficiency.value, topology=entry.topology, domain_size=domain_size,
        estimated=_estimated(bandwidth=bandwidth, latency=entry.latency,
                             efficiency=entry.efficiency),
    )


def link_from_key(key: str, *, num_devices: int) -> LinkSpec:
    """The intra-node link a catalog key names, for a node of ``num_devices``."""
    if num_devices == 1:
        return none_link()
    entry = catalog.LINKS[key]
    domain = 2 if entry.topology == "pairs" else num_devices
    return _link(_link_kind(key), entry, domain_size=min(domain, num_devices))


def host_link_from_key(key: str) -> LinkSpec:
    """The device <-> host link a catalog key names (PCIe, NVLink-C2C)."""
    return _link(_link_kind(key), catalog.LINKS[key], domain_size=1)


def _link_kind(key: str) -> str:
    """Catalog key to kind: "nvlink4-nvswitch" -> "nvlink4", "pcie-gen5-est" -> "pcie-gen5"."""
    return key.removesuffix("-nvswitch").removesuffix("-cube-mesh").removesuffix("-est")


def nvlink_spec(*, generation: int, links: int, topology: str, domain_size: int) -> LinkSpec:
    """An NVLink link as probed: ``links`` active links per GPU of NVLink ``generation``."""
    per_link = catalog.NVLINK_PER_LINK.get(generation, catalog.NVLINK_PER_LINK[4])
    entry = catalog.LINKS["nvlink4-nvswitch"]._replace(topology=topology)
    bandwidth = Fig(links * per_link.value, per_link.source, per_link.estimate)
    kind = f"nvlink{generation}" + ("-bridge" if topology == "pairs" else "")
    return _link(kind, entry, bandwidth=bandwidth, domain_size=domain_size)


def pcie_spec(*, generation: int, width: int, domain_size: int = 1) -> LinkSpec:
    """A PCIe link of ``generation`` and ``width`` lanes (bytes/s per direction)."""
    lane = catalog.PCIE_PER_LANE.get(generation, catalog.PCIE_PER_LANE[4])
    entry = catalog.LINKS["pcie-gen4"]
    bandwidth = Fig(width * lane.value, lane.source, lane.estimate)
    return _link(f"pcie-gen{generation}", entry, bandwidth=bandwidth, domain_size=domain_size)


def none_link() -> LinkSpec:
    """The link of a one-device node: nothing to cross."""
    return LinkSpec(kind="none", bandwidth=0.0, latency=0.0, efficiency=1.0, topology="none")


def loopback_link(*, num_ranks: int) -> LinkSpec:
    """gloo between ``num_ranks`` processes on one host."""
    if num_ranks == 1:
        return none_link()
    return _link("loopback", catalog.LINKS["loopback"], domain_size=num_ranks)


def network_names() -> list[str]:
    """Every catalogued network name."""
    return list(catalog.NETWORKS)


def network_from_name(name: str, *, nics_per_node: int) -> NetworkSpec:
    """The catalogued network ``name`` with ``nics_per_node`` NICs (KeyError when unknown)."""
    entry = catalog.NETWORKS[name]
    return NetworkSpec(
        name=name, kind=entry.kind, bandwidth=entry.bandwidth.value, nics_per_node=nics_per_node,
        latency=entry.latency.value, efficiency=entry.efficiency.value,
        estimated=_estimated(bandwidth=entry.bandwidth, latency=entry.latency,
                             efficiency=entry.efficiency),
    )


def default_nics(name: str, *, num_devices: int, is_gpu: bool) -> int:
    """NICs per node when a spec gives no count: fixed by the network (EFA instance types),
    else one per GPU (the DGX/HGX rail layout), else one per CPU node."""
    fixed = catalog.NETWORKS[name].nics_per_node
    return fixed or (num_devices if is_gpu else 1)


def cpu_device(host: HostSpec, *, num_ranks: int) -> DeviceSpec:
    """One gloo rank's share of ``host`` when ``num_ranks`` ranks share it: its whole cores (the
    threads it runs; one for fp16 without vector units), or where ranks outnumber the cores, its
    turn on one (their rates divided); its DRAM bandwidth its cores' streams, up to its share of
    the sockets'."""
    cores = max(1, host.num_cores // num_ranks)
    share = min(cores, host.num_cores / num_ranks)
    core = core_peaks(host)
    sockets = host.num_sockets * catalog.CPU_SOCKET_BANDWIDTH.value
    fp16_share = share if core["fp16"] >= core["fp32"] else min(share, 1.0)  # unvectorized: one thread
    return DeviceSpec(
        name="cpu", kind="cpu", vendor=host.cpu_name or "cpu",
        memory_bytes=host.memory_bytes // num_ranks,
        memory_bandwidth=min(share * catalog.CPU_CORE_STREAM.value, sockets / num_ranks),
        peak_fp32=share * core["fp32"], peak_tf32=share * core["fp32"], peak_bf16=share * core["bf16"],
        peak_fp16=fp16_share * core["fp16"], num_cores=cores,
        estimated=("memory_bandwidth", "peak_fp32", "peak_tf32", "peak_bf16", "peak_fp16"),
    )


def core_peaks(host: HostSpec) -> dict[str, float]:
    """One core's dense FLOP/s by dtype (``fp32``, ``bf16``, ``fp16``): its class's fp32 FLOPs a
    cycle (``catalog.CPU_CORES``) at its nominal clock, the half-precision units it has
    (``catalog.CPU_HALF_UNITS``) multiplying that; :data:`catalog.CPU_FLOPS_PER_CORE` for every
    dtype where the class or the clock is unknown (docs/hardware.md, "CPU ranks")."""
    if host.core_isa not in catalog.CPU_CORES or not host.clock_hz:
        return dict.fromkeys(("fp32", "bf16", "fp16"), catalog.CPU_FLOPS_PER_CORE.value)
    fp32 = catalog.CPU_CORES[host.core_isa].value * host.clock_hz
    units = [catalog.CPU_HALF_UNITS[flag] for flag in host.isa_extensions if flag in catalog.CPU_HALF_UNITS]
    half = {dtype: max((fp32 * ratio.value for unit, ratio in units if unit == dtype), default=None)
            for dtype in ("bf16", "fp16")}
    return {"fp32": fp32, "bf16": half["bf16"] or fp32,
            "fp16": half["fp16"] or catalog.CPU_FP16_UNVECTORIZED.value * host.clock_hz}
