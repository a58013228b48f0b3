"""This host's cores (their vector units: hardware/cpu_cores.py), RAM and last-level caches, and the
CPU node of gloo ranks that share them."""

from __future__ import annotations

import os
import platform
from pathlib import Path

from stratagem.advisor.hardware import lookup
from stratagem.advisor.hardware.cpu_cores import probe_cores
from stratagem.advisor.hardware.spec import HostSpec, NetworkSpec, NodeSpec


def probe_host() -> HostSpec:
    """This host's usable cores (CPU affinity) and RAM, via psutil."""
    import psutil

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    core = probe_cores()
    return HostSpec(num_cores=cores or psutil.cpu_count(logical=True) or 1,
                    num_physical_cores=psutil.cpu_count(logical=False),
                    memory_bytes=psutil.virtual_memory().total,
                    cpu_name=core.name or platform.processor() or platform.machine(),
                    core_isa=core.isa, isa_extensions=core.extensions, clock_hz=core.clock_hz,
                    num_sockets=num_sockets())


def num_sockets(cpus: Path = Path("/sys/devices/system/cpu")) -> int:
    """The host's CPU packages, by sysfs's ``physical_package_id`` (1 where sysfs says nothing)."""
    packages = set()
    for package in cpus.glob("cpu[0-9]*/topology/physical_package_id"):
        try:
            packages.add(package.read_text().strip())
        except OSError:
            continue
    return len(packages) or 1


def last_level_cache_bytes(cpus: Path = Path("/sys/devices/system/cpu")) -> int | None:
    """Bytes of this host's last-level CPU caches, each instance once (a two-socket host has two):
    sysfs's ``cpuN/cache/indexM`` of the highest ``level``, told apart by ``shared_cpu_list``.
    None where sysfs says nothing (not Linux, a container that hides it)."""
    caches: dict[str, tuple[int, int]] = {}  # shared_cpu_list -> (level, bytes)
    for index in cpus.glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level = int((index / "level").read_text())
            size = _cache_size((index / "size").read_text().strip())
            shared = (index / "shared_cpu_list").read_text().strip()
        except (OSError, ValueError):
            continue
        if shared not in caches or caches[shared][0] < level:
            caches[shared] = (level, size)
    if not caches:
        return None
    top = max(level for level, _ in caches.values())
    return sum(size for level, size in caches.values() if level == top)


def _cache_size(text: str) -> int:
    """Bytes of a sysfs cache ``size`` (``32768K``, ``1M``, ``512``)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)


def cpu_node(host: HostSpec, *, num_ranks: int, network: NetworkSpec | None, sharing: int | None = None) -> NodeSpec:
    """A node of ``num_ranks`` gloo ranks on ``host``, each with its share of the host among
    ``sharing`` ranks (default ``num_ranks``; more when a launcher's nodes share one host)."""
    return NodeSpec(device=lookup.cpu_device(host, num_ranks=sharing or num_ranks), num_devices=num_ranks,
                    link=lookup.loopback_link(num_ranks=num_ranks), host_link=None,
                    network=network, host=host)
