"""The sysfs network probe against fake /sys trees."""

from __future__ import annotations

from pathlib import Path

import pytest

from stratagem.advisor.hardware import probe_network

NDR = "400 Gb/sec (4X NDR)"


def add_port(root: Path, device: str, *, rate: str, layer: str = "InfiniBand",
             state: str = "4: ACTIVE", port: str = "1") -> None:
    port_dir = root / "class" / "infiniband" / device / "ports" / port
    port_dir.mkdir(parents=True)
    (port_dir / "rate").write_text(rate + "\n")
    (port_dir / "link_layer").write_text(layer + "\n")
    (port_dir / "state").write_text(state + "\n")


def add_iface(root: Path, name: str, *, speed: str, physical: bool = True) -> None:
    iface = root / "class" / "net" / name
    iface.mkdir(parents=True)
    (iface / "speed").write_text(speed + "\n")
    if physical:
        (iface / "device").mkdir()


def test_ib_ndr_x8_ignores_storage_and_down_ports(tmp_path):
    for i in range(8):
        add_port(tmp_path, f"mlx5_{i}", rate=NDR)
    add_port(tmp_path, "mlx5_8", rate="200 Gb/sec (4X HDR)", layer="Ethernet")
    add_port(tmp_path, "mlx5_9", rate=NDR, state="1: DOWN")
    network, notes = probe_network(sysfs_root=tmp_path)
    assert (network.name, network.kind, network.nics_per_node) == ("ib-ndr", "infiniband", 8)
    assert network.bandwidth == 50e9 and network.node_bandwidth == 400e9
    assert any("1 other active RDMA port" in note for note in notes)


def test_roce_reads_ethernet_link_layer(tmp_path):
    for i in range(2):
        add_port(tmp_path, f"mlx5_{i}", rate="200 Gb/sec (4X HDR)", layer="Ethernet")
    network, _ = probe_network(sysfs_root=tmp_path)
    assert (network.name, network.kind, network.nics_per_node) == ("roce-200", "roce", 2)


def test_efa_devices_are_counted_not_rated(tmp_path):
    for i in range(4):
        add_port(tmp_path, f"rdmap{16 + i}s27", rate="25 Gb/sec (1X EDR)", layer="Unspecified")
    network, notes = probe_network(sysfs_root=tmp_path)
    assert (network.kind, network.nics_per_node) == ("efa", 4)
    assert network.node_bandwidth == pytest.approx(4 * 100e9 / 8)
    assert "counted" in notes[0]


def test_uncatalogued_ib_rate_keeps_the_rate(tmp_path):
    add_port(tmp_path, "mlx4_0", rate="56 Gb/sec (4X FDR)")
    network, _ = probe_network(sysfs_root=tmp_path)
    assert network.name == "ib-56g" and network.bandwidth == 56e9 / 8


def test_ethernet_fallback_takes_the_fastest_physical_interface(tmp_path):
    add_iface(tmp_path, "eth0", speed="100000")
    add_iface(tmp_path, "eth1", speed="25000")
    add_iface(tmp_path, "docker0", speed="-1")
    add_iface(tmp_path, "veth9", speed="400000", physical=False)
    network, notes = probe_network(sysfs_root=tmp_path)
    assert (network.name, network.kind, network.nics_per_node) == ("eth-100", "ethernet", 1)
    assert "eth0" in notes[0]


def test_nothing_readable_means_no_network(tmp_path):
    network, notes = probe_network(sysfs_root=tmp_path)
    assert network is None and "unknown" in notes[0]
