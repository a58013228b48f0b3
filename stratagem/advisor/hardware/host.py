"""This host's cores and RAM, and the CPU node of gloo ranks that share them."""

from __future__ import annotations

import os
import platform
from pathlib import Path

from stratagem.advisor.hardware import lookup
from stratagem.advisor.hardware.spec import HostSpec, NetworkSpec, NodeSpec


def probe_host() -> HostSpec:
    """This host's usable cores (CPU affinity) and RAM, via psutil."""
    import psutil

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return HostSpec(num_cores=cores or psutil.cpu_count(logical=True) or 1,
                    num_physical_cores=psutil.cpu_count(logical=False),
                    memory_bytes=psutil.virtual_memory().total, cpu_name=_cpu_name())


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_node(host: HostSpec, *, num_ranks: int, network: NetworkSpec | None, sharing: int | None = None) -> NodeSpec:
    """A node of ``num_ranks`` gloo ranks on ``host``, each with its share of the host among
    ``sharing`` ranks (default ``num_ranks``; more when a launcher's nodes share one host)."""
    return NodeSpec(device=lookup.cpu_device(host, num_ranks=sharing or num_ranks), num_devices=num_ranks,
                    link=lookup.loopback_link(num_ranks=num_ranks), host_link=None,
                    network=network, host=host)
