"""A fake NVML topology patched onto the real ``pynvml`` module, raising real NVMLErrors.

Tests build :class:`FakeGpu` lists (see the ``*_topology`` helpers) and call
:func:`install` with pytest's ``monkeypatch``; ``unsupported`` names NVML functions that raise
``NVMLError_NotSupported`` (or pass an error code per name in ``errors``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml

SWITCH_BUS = "00000000:C1:00.0"
GIB = 2**30


@dataclass
class FakeGpu:
    """One GPU as the fake driver reports it; ``links`` are remote bus ids (None: NVSwitch)."""

    name: str
    bus_id: str
    memory: int = 80 * GIB
    cc: tuple[int, int] = (9, 0)
    pcie: tuple[int, int] = (5, 16)
    mig: bool = False
    links: list[str | None] = field(default_factory=list)
    nvlink_version: int = pynvml.NVML_NVLINK_VERSION_4_0


def err(code: int) -> pynvml.NVMLError:
    """A real NVMLError for ``code`` (pynvml maps it to its subclass)."""
    return pynvml.NVMLError(code)


def bus(i: int) -> str:
    return f"00000000:{0x10 + i:02X}:00.0"


def h100_nvswitch(n: int = 8) -> list[FakeGpu]:
    """n x H100 SXM, 18 NVLink4 links each, all to NVSwitches."""
    return [FakeGpu("NVIDIA H100 80GB HBM3", bus(i), links=[None] * 18) for i in range(n)]


def a100_pcie_bridged_pairs() -> list[FakeGpu]:
    """4 x A100 PCIe, bridged 0-1 and 2-3 with 12 NVLink3 links per pair."""
    peer = {0: 1, 1: 0, 2: 3, 3: 2}
    return [FakeGpu("NVIDIA A100 80GB PCIe", bus(i), cc=(8, 0), pcie=(4, 16),
                    links=[bus(peer[i])] * 12, nvlink_version=pynvml.NVML_NVLINK_VERSION_3_0)
            for i in range(4)]


def install(monkeypatch, gpus: list[FakeGpu], *, unsupported: tuple[str, ...] = (),
            errors: dict[str, int] | None = None) -> None:
    """Patch pynvml's functions to describe ``gpus``."""
    failing = {name: pynvml.NVML_ERROR_NOT_SUPPORTED for name in unsupported} | (errors or {})

    def gpu(handle: int) -> FakeGpu:
        return gpus[handle]

    def link_of(handle: int, link: int) -> str | None:
        links = gpu(handle).links
        if not links:
            raise err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if link >= len(links):
            raise err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return links[link]

    def link_state(h: int, link: int) -> int:
        link_of(h, link)  # raises past the last link
        return pynvml.NVML_FEATURE_ENABLED

    def remote_type(h: int, link: int) -> int:
        if link_of(h, link) is None:
            return pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
        return pynvml.NVML_NVLINK_DEVICE_TYPE_GPU

    def remote_pci(h: int, link: int) -> SimpleNamespace:
        return SimpleNamespace(busId=(link_of(h, link) or SWITCH_BUS).encode())

    fakes = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetCount": lambda: len(gpus),
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetName": lambda h: gpu(h).name,
        "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(total=gpu(h).memory, free=0, used=0),
        "nvmlDeviceGetPciInfo": lambda h: SimpleNamespace(busId=gpu(h).bus_id.encode()),
        "nvmlDeviceGetCudaComputeCapability": lambda h: gpu(h).cc,
        "nvmlDeviceGetMigMode": lambda h: [int(gpu(h).mig), int(gpu(h).mig)],
        "nvmlDeviceGetMaxPcieLinkGeneration": lambda h: gpu(h).pcie[0],
        "nvmlDeviceGetMaxPcieLinkWidth": lambda h: gpu(h).pcie[1],
        "nvmlDeviceGetNvLinkState": link_state,
        "nvmlDeviceGetNvLinkVersion": lambda h, link: gpu(h).nvlink_version,
        "nvmlDeviceGetNvLinkRemoteDeviceType": remote_type,
        "nvmlDeviceGetNvLinkRemotePciInfo": remote_pci,
    }
    for name, fake in fakes.items():
        monkeypatch.setattr(pynvml, name, _failing(failing[name]) if name in failing else fake)


def _failing(code: int):
    def fail(*args: object) -> None:
        raise err(code)

    return fail
