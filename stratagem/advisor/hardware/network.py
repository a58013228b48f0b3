"""The inter-node network as Linux shows it in sysfs.

RDMA ports live under ``<root>/class/infiniband/<dev>/ports/<n>/{rate,link_layer,state}``
(``rate`` reads like ``400 Gb/sec (4X NDR)``; RoCE ports read ``link_layer`` Ethernet). The
most common (link layer, rate) among active ports is taken as the compute network, so a DGX's
two storage NICs do not water down its eight compute NICs. AWS EFA devices (``efa*``,
``rdmap*``) report no trustworthy rate: they are counted, at 100 Gb/s each. Without RDMA, the
fastest physical Ethernet interface under ``<root>/class/net`` stands in (TCP sockets).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from stratagem.advisor.hardware import catalog, lookup
from stratagem.advisor.hardware.spec import NetworkSpec

_RATE = re.compile(r"^\s*([\d.]+)\s*Gb/sec")
EFA_PREFIXES = ("efa", "rdmap")


@dataclass(frozen=True, slots=True)
class RdmaPort:
    """One active RDMA port: its device, link layer ("InfiniBand"/"Ethernet"), rate in Gb/s."""

    device: str
    port: str
    link_layer: str
    rate_gbit: float


def probe_network(*, sysfs_root: str | Path = "/sys") -> tuple[NetworkSpec | None, list[str]]:
    """The node's inter-node network read from sysfs, and notes on what was assumed or missed."""
    root = Path(sysfs_root)
    ib_root = root / "class" / "infiniband"
    devices = sorted(p.name for p in ib_root.iterdir()) if ib_root.is_dir() else []
    efa = [d for d in devices if d.startswith(EFA_PREFIXES)]
    if efa:
        return lookup.network_from_name("efa", nics_per_node=len(efa)), [
            f"EFA: {len(efa)} device(s) counted at 100 Gb/s each (sysfs rate is not trusted)"]
    ports = [p for d in devices if d not in efa for p in _read_ports(ib_root / d)]
    if ports:
        return _rdma_network(ports)
    return _ethernet_network(root / "class" / "net")


def _read_ports(device_dir: Path) -> list[RdmaPort]:
    ports = []
    for port_dir in sorted((device_dir / "ports").glob("*")):
        state = _read(port_dir / "state")
        rate = _RATE.match(_read(port_dir / "rate"))
        if "ACTIVE" in state.upper() and rate:
            layer = _read(port_dir / "link_layer") or "InfiniBand"
            ports.append(RdmaPort(device_dir.name, port_dir.name, layer, float(rate[1])))
    return ports


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _rdma_network(ports: list[RdmaPort]) -> tuple[NetworkSpec, list[str]]:
    groups = Counter((p.link_layer.lower(), p.rate_gbit) for p in ports)
    (layer, rate), count = groups.most_common(1)[0]
    kind = "infiniband" if layer == "infiniband" else "roce"
    notes = [f"network: {count} active {kind} port(s) at {rate:g} Gb/s"]
    others = sum(groups.values()) - count
    if others:
        notes.append(f"network: {others} other active RDMA port(s) (storage?) not counted")
    return _network(kind, rate, count), notes


def _network(kind: str, rate_gbit: float, nics: int) -> NetworkSpec:
    """A catalogued network when the rate is a known one, else the nearest kind at this rate."""
    names = {"infiniband": catalog.IB_RATES.get(int(rate_gbit)),
             "roce": f"roce-{rate_gbit:g}", "ethernet": f"eth-{rate_gbit:g}"}
    name = names[kind]
    if name in catalog.NETWORKS:
        return lookup.network_from_name(name, nics_per_node=nics)
    template = {"infiniband": "ib-ndr", "roce": "roce-100", "ethernet": "eth-100"}[kind]
    spec = lookup.network_from_name(template, nics_per_node=nics)
    prefix = {"infiniband": "ib", "roce": "roce", "ethernet": "eth"}[kind]
    return replace(spec, name=f"{prefix}-{rate_gbit:g}g", bandwidth=rate_gbit * catalog.GBIT)


def _ethernet_network(net_root: Path) -> tuple[NetworkSpec | None, list[str]]:
    speeds = {}
    for iface in sorted(net_root.glob("*")) if net_root.is_dir() else []:
        speed = _read(iface / "speed")
        if (iface / "device").exists() and speed.lstrip("-").isdigit() and int(speed) > 0:
            speeds[iface.name] = int(speed) / 1000  # Mb/s -> Gb/s
    if not speeds:
        return None, ["network: no RDMA device and no Ethernet speed readable: unknown"]
    fastest = max(speeds.values())
    ifaces = [name for name, gbit in speeds.items() if gbit == fastest]
    return _network("ethernet", fastest, len(ifaces)), [
        f"network: no RDMA device; Ethernet {', '.join(ifaces)} at {fastest:g} Gb/s (TCP)"]
