"""probe_local against fake NVML topologies, and the real no-driver path of this machine."""

from __future__ import annotations

from types import SimpleNamespace

import pynvml
import pytest
import torch
from fake_nvml import (
    FakeGpu,
    a100_pcie_bridged_pairs,
    bus,
    h100_nvswitch,
    install,
)

from stratagem.advisor.hardware import probe_local
from stratagem.advisor.hardware.host import last_level_cache_bytes


@pytest.fixture
def no_cuda(monkeypatch, tmp_path):
    """torch sees no CUDA (so every NVML GPU counts); sysfs is an empty tree."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return tmp_path


def test_h100_nvswitch_is_one_nvlink4_domain(monkeypatch, no_cuda):
    install(monkeypatch, h100_nvswitch())
    cluster = probe_local(sysfs_root=no_cuda)
    assert cluster.source == "probe" and cluster.is_gpu and cluster.world_size == 8
    assert cluster.device.name == "H100-SXM5-80GB"
    assert cluster.device.peak_bf16 == 989e12
    assert cluster.device.memory_bytes == 80 * 2**30  # as NVML reports it
    link = cluster.node.link
    assert (link.kind, link.topology, link.domain_size) == ("nvlink4", "switch", 8)
    assert link.bandwidth == 18 * 25e9
    assert cluster.node.host_link.kind == "pcie-gen5"
    assert cluster.node.host_link.bandwidth == pytest.approx(16 * 3.938e9)


def test_a100_pcie_bridged_pairs(monkeypatch, no_cuda):
    install(monkeypatch, a100_pcie_bridged_pairs())
    cluster = probe_local(sysfs_root=no_cuda)
    assert cluster.device.name == "A100-PCIe-80GB"
    link = cluster.node.link
    assert (link.kind, link.topology, link.domain_size) == ("nvlink3-bridge", "pairs", 2)
    assert link.bandwidth == 12 * 25e9
    assert any("pairs" in note for note in cluster.notes)
    assert cluster.spec == "1x4xA100-PCIe-80GB+bridge"


def test_no_nvlink_falls_back_to_pcie_of_the_slowest_card(monkeypatch, no_cuda):
    gpus = [FakeGpu("NVIDIA L4", bus(0), cc=(8, 9), pcie=(4, 16)),
            FakeGpu("NVIDIA L4", bus(1), cc=(8, 9), pcie=(4, 8))]
    install(monkeypatch, gpus)
    link = probe_local(sysfs_root=no_cuda).node.link
    assert (link.kind, link.topology) == ("pcie-gen4", "tree")
    assert link.bandwidth == pytest.approx(8 * 1.969e9)


def test_mig_gpu_is_noted(monkeypatch, no_cuda):
    install(monkeypatch, [FakeGpu("NVIDIA A100-SXM4-40GB", bus(0), memory=40 * 2**30,
                                  cc=(8, 0), pcie=(4, 16), mig=True)])
    cluster = probe_local(sysfs_root=no_cuda)
    assert cluster.device.name == "A100-SXM4-40GB" and cluster.world_size == 1
    assert cluster.node.link.kind == "none"
    assert any("MIG is enabled on GPU 0" in note for note in cluster.notes)


def test_unknown_gpu_and_unsupported_calls_never_crash(monkeypatch, no_cuda):
    gpus = [FakeGpu("NVIDIA Mystery 48GB", bus(i), memory=48 * 2**30, cc=(8, 9), links=[bus(1 - i)])
            for i in range(2)]
    unsupported = ("nvmlDeviceGetNvLinkState", "nvmlDeviceGetMaxPcieLinkGeneration",
                   "nvmlDeviceGetMigMode")
    install(monkeypatch, gpus, unsupported=unsupported,
            errors={"nvmlDeviceGetNvLinkRemoteDeviceType": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND})
    cluster = probe_local(sysfs_root=no_cuda)
    device = cluster.device
    assert device.name == "NVIDIA Mystery 48GB" and device.memory_bytes == 48 * 2**30
    assert device.peak_bf16 == 121e12  # borrowed from L4, the slowest catalogued cc 8.9 GPU
    assert "peak_bf16" in device.estimated and "memory_bytes" not in device.estimated
    assert cluster.node.link.kind == "pcie-gen4"  # NVLink unreadable, PCIe assumed
    notes = " | ".join(cluster.notes)
    assert "not in the catalog" in notes and "Not Supported" in notes
    assert "PCIe link unreadable" in notes


def test_remote_type_unreadable_still_counts_gpu_peers(monkeypatch, no_cuda):
    install(monkeypatch, a100_pcie_bridged_pairs(),
            errors={"nvmlDeviceGetNvLinkRemoteDeviceType": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND})
    cluster = probe_local(sysfs_root=no_cuda)
    assert cluster.node.link.topology == "pairs"
    assert any("Function Not Found" in note for note in cluster.notes)


def test_cuda_visible_devices_matched_by_bus_id(monkeypatch, tmp_path):
    install(monkeypatch, h100_nvswitch())
    visible = [SimpleNamespace(pci_domain_id=0, pci_bus_id=0x10 + i, pci_device_id=0)
               for i in (2, 5)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(visible))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: visible[i])
    cluster = probe_local(sysfs_root=tmp_path)
    assert cluster.world_size == 2 and cluster.node.link.domain_size == 2
    assert any("2 of 8 GPUs visible" in note for note in cluster.notes)


def test_nvml_init_failure_gives_cpu_cluster(monkeypatch, no_cuda):
    install(monkeypatch, h100_nvswitch(), errors={"nvmlInit": pynvml.NVML_ERROR_DRIVER_NOT_LOADED})
    cluster = probe_local(sysfs_root=no_cuda)
    assert not cluster.is_gpu and cluster.backend == "gloo"
    assert any("Driver Not Loaded" in note for note in cluster.notes)


def test_real_machine_without_driver_is_a_cpu_cluster():
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVIDIA driver")
    cluster = probe_local()
    assert cluster.source == "probe" and not cluster.is_gpu and cluster.world_size == 1
    assert cluster.device.kind == "cpu" and cluster.device.num_cores >= 1
    assert cluster.device.memory_bytes == cluster.node.host.memory_bytes > 0
    assert any("NVML" in note for note in cluster.notes)


def _cache(cpus, cpu: int, index: int, level: int, kind: str, size: str, shared: str) -> None:
    folder = cpus / f"cpu{cpu}" / "cache" / f"index{index}"
    folder.mkdir(parents=True)
    for name, text in (("level", str(level)), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
        (folder / name).write_text(text + "\n")


def test_last_level_caches_count_each_socket_once(tmp_path):
    """A fake sysfs of two sockets of two cores: each core's L1 and L2 its own, each socket's L3
    shared by its cores; the L3s count once each (2 × 32 MiB), the instruction cache never."""
    for cpu in range(4):
        _cache(tmp_path, cpu, 0, 1, "Data", "48K", str(cpu))
        _cache(tmp_path, cpu, 1, 1, "Instruction", "32K", str(cpu))
        _cache(tmp_path, cpu, 2, 2, "Unified", "2048K", str(cpu))
        _cache(tmp_path, cpu, 3, 3, "Unified", "32768K", "0-1" if cpu < 2 else "2-3")
    assert last_level_cache_bytes(tmp_path) == 64 * 2**20
    assert last_level_cache_bytes(tmp_path / "absent") is None


def test_this_hosts_last_level_cache_is_what_lscpu_reads():
    """The real sysfs of this machine, against util-linux's own reading of it: lscpu's total of its
    highest cache level, every instance counted (skipped where lscpu or the caches are missing)."""
    import re
    import shutil
    import subprocess

    if shutil.which("lscpu") is None:
        pytest.skip("no lscpu here")
    caches = re.findall(r"^L(\d)\w? cache:\s+(\d+)", subprocess.run(["lscpu", "-B"], capture_output=True, text=True,
                                                                 check=True).stdout, re.MULTILINE)
    if not caches:
        pytest.skip("lscpu names no caches here")
    top = max(int(level) for level, _ in caches)
    assert last_level_cache_bytes() == sum(int(size) for level, size in caches if int(level) == top)
