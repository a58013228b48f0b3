"""Probe this machine: GPUs through NVML, the host through psutil, the network through sysfs.

Never crashes for want of hardware: without the NVML library, a driver or a GPU, the host is a
CPU cluster (gloo). Every NVML call may raise ``pynvml.NVMLError`` (NotSupported,
FunctionNotFound on old drivers, NoPermission); each is caught, and what could not be read
ends up in the cluster's ``notes``. NVML ignores ``CUDA_VISIBLE_DEVICES``, so when torch sees
CUDA the GPUs are matched to torch's devices by PCI bus id.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any

from stratagem.advisor.hardware import lookup
from stratagem.advisor.hardware.network import probe_network
from stratagem.advisor.hardware.host import cpu_node, probe_host
from stratagem.advisor.hardware.spec import (
    Cluster,
    DeviceSpec,
    HostSpec,
    LinkSpec,
    NetworkSpec,
    NodeSpec,
)

MAX_NVLINKS = 64  # safety cap; the loop stops at NotSupported/InvalidArgument first
# nvmlDeviceGetNvLinkVersion returns an enum (NVML_NVLINK_VERSION_*), not the generation.
NVLINK_VERSION_TO_GEN = {1: 1, 2: 2, 3: 2, 4: 3, 5: 3, 6: 4, 7: 5, 8: 6}
GEN_BY_CC_MAJOR = {7: 2, 8: 3, 9: 4, 10: 5}  # NVLink generation of SXM parts, by architecture


def probe_local(*, sysfs_root: str | Path = "/sys") -> Cluster:
    """This machine as a one-node :class:`Cluster` (``source="probe"``).

    GPUs come from NVML (names, memory, compute capability, NVLink peers, PCIe, MIG) with peak
    FLOP/s from the catalog; with no usable NVIDIA GPU the host's cores and RAM make a CPU
    cluster of one gloo rank. ``sysfs_root`` is read for InfiniBand/RoCE/EFA/Ethernet.
    """
    host = probe_host()
    network, notes = probe_network(sysfs_root=sysfs_root)
    gpus, gpu_notes = _read_gpus()
    notes = [*gpu_notes, *notes]
    if not gpus:
        node = cpu_node(host, num_ranks=1, network=network)
        notes.insert(0, "no usable NVIDIA GPU: this host is a CPU cluster (gloo)")
    else:
        node, node_notes = _gpu_node(gpus, host=host, network=network)
        notes.extend(node_notes)
    return Cluster(num_nodes=1, node=node, source="probe", notes=tuple(dict.fromkeys(notes)))


@dataclass(slots=True, kw_only=True)
class GpuReading:
    """What NVML told us about one GPU (``None`` where a call failed)."""

    index: int
    name: str
    bus_id: str | None
    memory_bytes: int | None
    compute_capability: tuple[int, int] | None
    pcie: tuple[int, int] | None  # (generation, lanes)
    mig: bool = False
    nvlink_peers: Counter[str] = field(default_factory=Counter)  # bus id -> active links
    nvlink_switch_links: int = 0
    nvlink_generation: int | None = None


class _Nvml:
    """Calls into pynvml that turn any NVMLError into ``None`` plus a note."""

    def __init__(self, module: ModuleType) -> None:
        self.m = module
        self.notes: list[str] = []

    def call(self, what: str, fn_name: str, *args: Any) -> Any:
        try:
            return getattr(self.m, fn_name)(*args)
        except self.m.NVMLError as err:
            self.notes.append(f"NVML could not read {what}: {err}")
            return None


def _read_gpus() -> tuple[list[GpuReading], list[str]]:
    """Every visible GPU as NVML reports it, or ``[]`` (with the reason) when there is none."""
    try:
        import pynvml
    except ImportError:
        return [], ["nvidia-ml-py (pynvml) is not installed: GPUs not probed"]
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        return [], [f"NVML unavailable ({err}): no NVIDIA driver or GPU"]
    nvml = _Nvml(pynvml)
    try:
        count = nvml.call("the GPU count", "nvmlDeviceGetCount") or 0
        gpus = [g for g in (_read_gpu(nvml, i) for i in range(count)) if g is not None]
    finally:
        nvml.call("shutdown", "nvmlShutdown")
    gpus, notes = _only_visible(gpus)
    return gpus, nvml.notes + notes


def _read_gpu(nvml: _Nvml, index: int) -> GpuReading | None:
    handle = nvml.call(f"GPU {index}", "nvmlDeviceGetHandleByIndex", index)
    if handle is None:
        return None
    memory = nvml.call("memory", "nvmlDeviceGetMemoryInfo", handle)
    pci = nvml.call("the PCI bus id", "nvmlDeviceGetPciInfo", handle)
    cc = nvml.call("the compute capability", "nvmlDeviceGetCudaComputeCapability", handle)
    mig = nvml.call("the MIG mode", "nvmlDeviceGetMigMode", handle)
    gpu = GpuReading(
        index=index, name=_text(nvml.call("the name", "nvmlDeviceGetName", handle) or "GPU"),
        bus_id=normalize_bus_id(_text(pci.busId)) if pci is not None else None,
        memory_bytes=int(memory.total) if memory is not None else None,
        compute_capability=tuple(cc) if cc else None, pcie=_read_pcie(nvml, handle),
        mig=bool(mig) and mig[0] == nvml.m.NVML_DEVICE_MIG_ENABLE,
    )
    _read_nvlinks(nvml, handle, gpu)
    return gpu


def _read_pcie(nvml: _Nvml, handle: Any) -> tuple[int, int] | None:
    """Max generation and width the device and slot support (the current ones drop at idle)."""
    gen = nvml.call("the PCIe generation", "nvmlDeviceGetMaxPcieLinkGeneration", handle)
    width = nvml.call("the PCIe width", "nvmlDeviceGetMaxPcieLinkWidth", handle)
    return (int(gen), int(width)) if gen and width else None


def _read_nvlinks(nvml: _Nvml, handle: Any, gpu: GpuReading) -> None:
    """Count active links per peer; stop at the first link NVML says does not exist."""
    m = nvml.m
    for link in range(MAX_NVLINKS):
        try:
            active = m.nvmlDeviceGetNvLinkState(handle, link)
        except (m.NVMLError_NotSupported, m.NVMLError_InvalidArgument):
            return
        except m.NVMLError as err:
            nvml.notes.append(f"NVML could not read NVLink state: {err}")
            return
        if active:
            _read_nvlink(nvml, handle, link, gpu)


def _read_nvlink(nvml: _Nvml, handle: Any, link: int, gpu: GpuReading) -> None:
    if gpu.nvlink_generation is None:
        version = nvml.call("the NVLink version", "nvmlDeviceGetNvLinkVersion", handle, link)
        gpu.nvlink_generation = NVLINK_VERSION_TO_GEN.get(version)
    remote = nvml.call("the NVLink peer type", "nvmlDeviceGetNvLinkRemoteDeviceType",
                       handle, link)
    if remote == nvml.m.NVML_NVLINK_DEVICE_TYPE_SWITCH:
        gpu.nvlink_switch_links += 1
        return
    pci = nvml.call("the NVLink peer", "nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
    if pci is not None:
        gpu.nvlink_peers[normalize_bus_id(_text(pci.busId))] += 1


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def normalize_bus_id(bus_id: str) -> str:
    """``00000000:07:00.0`` (NVML) and torch's ids alike -> ``0000:07:00`` (else as given)."""
    try:
        domain, bus, device = bus_id.lower().split(".")[0].split(":")
        return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}"
    except ValueError:
        return bus_id.lower()


def _only_visible(gpus: list[GpuReading]) -> tuple[list[GpuReading], list[str]]:
    """Keep the GPUs torch can see (CUDA_VISIBLE_DEVICES), matched by PCI bus id."""
    visible = _torch_bus_ids()
    if visible is None:
        return gpus, []
    if any(g.bus_id is None for g in gpus):
        return gpus, ["PCI bus ids unreadable: CUDA_VISIBLE_DEVICES not applied"]
    kept = [g for g in gpus if g.bus_id in visible]
    if len(kept) == len(gpus):
        return gpus, []
    return kept, [f"{len(kept)} of {len(gpus)} GPUs visible to this process (CUDA_VISIBLE_DEVICES)"]


def _torch_bus_ids() -> set[str] | None:
    """PCI bus ids of the CUDA devices torch sees, or None when torch has no CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    return {f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}" for p in props}


def _gpu_node(gpus: list[GpuReading], *, host: HostSpec,
              network: NetworkSpec | None) -> tuple[NodeSpec, list[str]]:
    device, notes = _device(gpus)
    link, link_notes = gpu_link(gpus)
    host_link, host_notes = _host_link(gpus, device)
    node = NodeSpec(device=device, num_devices=len(gpus), link=link, host_link=host_link,
                    network=network, host=host)
    return node, notes + link_notes + host_notes


def _device(gpus: list[GpuReading]) -> tuple[DeviceSpec, list[str]]:
    """The catalog device for these GPUs (the smallest, if they differ), memory as NVML reads."""
    notes = [f"MIG is enabled on GPU {g.index}: figures are for the whole GPU, and NCCL "
             "cannot span MIG instances" for g in gpus if g.mig]
    if len({g.name for g in gpus}) > 1:
        notes.append(f"GPUs differ ({', '.join(sorted({g.name for g in gpus}))}): "
                     "planning for the smallest")
    gpu = min(gpus, key=lambda g: g.memory_bytes or 0)
    entry = lookup.match_nvml_name(gpu.name)
    if entry is None:
        memory = gpu.memory_bytes or 0
        device, note = lookup.estimate_unknown_gpu(
            gpu.name, memory_bytes=memory, compute_capability=gpu.compute_capability)
        return device, [*notes, note]
    device = lookup.device_from_entry(entry)
    if gpu.memory_bytes:
        device = replace(device, memory_bytes=gpu.memory_bytes)
    return device, notes


def _host_link(gpus: list[GpuReading], device: DeviceSpec) -> tuple[LinkSpec, list[str]]:
    pcie = [g.pcie for g in gpus if g.pcie]
    if pcie:
        return lookup.pcie_spec(generation=min(p[0] for p in pcie),
                                width=min(p[1] for p in pcie)), []
    entry = lookup.find_gpu(device.name)
    key = entry.host_link if entry else "pcie-gen4"
    return lookup.host_link_from_key(key), [f"PCIe link unreadable: assumed {key} x16"]


def gpu_link(gpus: list[GpuReading]) -> tuple[LinkSpec, list[str]]:
    """The slowest path between these GPUs: NVSwitch, NVLink pairs or mesh, else PCIe."""
    if len(gpus) == 1:
        return lookup.none_link(), []
    generation = _nvlink_generation(gpus)
    if all(g.nvlink_switch_links for g in gpus):
        links = min(g.nvlink_switch_links for g in gpus)
        return lookup.nvlink_spec(generation=generation, links=links, topology="switch",
                                  domain_size=len(gpus)), []
    return _direct_nvlink(gpus, generation) or _pcie_between(gpus)


def _nvlink_generation(gpus: list[GpuReading]) -> int:
    read = [g.nvlink_generation for g in gpus if g.nvlink_generation]
    if read:
        return min(read)
    cc = gpus[0].compute_capability
    return GEN_BY_CC_MAJOR.get(cc[0], 4) if cc else 4


def _direct_nvlink(gpus: list[GpuReading], generation: int) -> tuple[LinkSpec, list[str]] | None:
    """GPU-to-GPU NVLink without a switch: bridged pairs, a full mesh, or a partial mesh."""
    ids = {g.bus_id for g in gpus}
    peers = [{b: n for b, n in g.nvlink_peers.items() if b in ids} for g in gpus]
    if not all(peers):
        return None
    links = min(sum(p.values()) for p in peers)
    if all(len(p) == 1 for p in peers):
        spec = lookup.nvlink_spec(generation=generation, links=links, topology="pairs",
                                  domain_size=2)
        return spec, ["NVLink joins GPUs in pairs; other pairs talk over PCIe"]
    if all(len(p) == len(gpus) - 1 for p in peers):
        return lookup.nvlink_spec(generation=generation, links=links, topology="mesh",
                                  domain_size=len(gpus)), []
    spec = lookup.nvlink_spec(generation=generation, links=links, topology="cube-mesh",
                              domain_size=len(gpus))
    return spec, ["NVLink does not join every pair of GPUs: some traffic takes two hops"]


def _pcie_between(gpus: list[GpuReading]) -> tuple[LinkSpec, list[str]]:
    pcie = [g.pcie for g in gpus if g.pcie]
    if not pcie:
        return lookup.pcie_spec(generation=4, width=16, domain_size=len(gpus)), [
            "no NVLink and PCIe unreadable: GPUs assumed on PCIe gen4 x16"]
    return lookup.pcie_spec(generation=min(p[0] for p in pcie), width=min(p[1] for p in pcie),
                            domain_size=len(gpus)), []
