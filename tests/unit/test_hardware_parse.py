"""Cluster spec strings, the specs they build, JSON round trips and the catalog's integrity."""

from __future__ import annotations

import json

import pytest

from stratagem.advisor.hardware import Cluster, catalog, gpu_names, network_names, parse_cluster
from stratagem.advisor.hardware import probe as probe_module
from stratagem.advisor.hardware.lookup import match_nvml_name
from stratagem.errors import UsageError


def test_one_node_of_eight():
    cluster = parse_cluster("8xA100-SXM4-80GB")
    assert (cluster.num_nodes, cluster.devices_per_node, cluster.world_size) == (1, 8, 8)
    assert cluster.is_gpu and cluster.backend == "nccl" and cluster.network is None
    assert cluster.device.peak_flops("bf16") == 312e12
    assert cluster.device.memory_bandwidth == 2039e9
    link = cluster.node.link
    assert (link.kind, link.topology, link.bandwidth) == ("nvlink3", "switch", 300e9)
    assert cluster.source == "catalog"


def test_multi_node_infiniband_one_nic_per_gpu():
    cluster = parse_cluster("4x8xH100-SXM-80GB:ib-ndr")
    assert (cluster.num_nodes, cluster.world_size) == (4, 32)
    assert cluster.device.name == "H100-SXM5-80GB"
    net = cluster.network
    assert (net.name, net.kind, net.nics_per_node) == ("ib-ndr", "infiniband", 8)
    assert net.bandwidth == 50e9 and net.node_bandwidth == 400e9


def test_pcie_cards_over_ethernet():
    cluster = parse_cluster("2x4xL4:eth-100")
    assert cluster.world_size == 8
    assert cluster.node.link.kind == "pcie-gen4"
    assert cluster.network.name == "eth-100" and cluster.network.nics_per_node == 4


@pytest.mark.parametrize("spec", ["H100", "h100", "H100-SXM-80GB", "h100-sxm5-80gb", "1x1xH100"])
def test_aliases_and_case(spec):
    cluster = parse_cluster(spec)
    assert cluster.device.name == "H100-SXM5-80GB" and cluster.world_size == 1
    assert cluster.node.link.kind == "none"


def test_nic_count_override_and_fixed_efa_counts():
    assert parse_cluster("2x8xH100:ib-ndr-x4").network.nics_per_node == 4
    p4d = parse_cluster("2x8xA100-SXM4-40GB:efa-p4d").network
    assert p4d.nics_per_node == 4 and p4d.node_bandwidth == 4 * 100e9 / 8
    assert parse_cluster("2x8xH100:efa-p5").network.node_bandwidth == 3200e9 / 8


@pytest.mark.parametrize("name", ["ib-hdr", "ib-ndr", "ib-xdr", "roce-100", "roce-200",
                                  "roce-400", "eth-25", "eth-100", "efa"])
def test_every_required_network_parses(name):
    assert parse_cluster(f"2x8xH100:{name}").network.name == name


def test_bridged_pcie_pairs():
    cluster = parse_cluster("4xA100-PCIe-80GB+bridge")
    link = cluster.node.link
    assert (link.kind, link.topology, link.domain_size) == ("nvlink3-bridge", "pairs", 2)
    assert parse_cluster("4xA100-PCIe-80GB").node.link.kind == "pcie-gen4"


def test_cpu_cluster_shares_the_host():
    cluster = parse_cluster("2x2xcpu:eth-25")
    assert not cluster.is_gpu and cluster.backend == "gloo" and cluster.world_size == 4
    host = cluster.node.host
    assert cluster.device.memory_bytes == host.memory_bytes // 2
    assert cluster.network.nics_per_node == 1 and cluster.node.link.kind == "loopback"


def test_local_is_the_probe(monkeypatch):
    probed = parse_cluster("8xH100")
    monkeypatch.setattr(probe_module, "probe_local", lambda: probed)
    assert parse_cluster(" LOCAL ") is probed


@pytest.mark.parametrize("spec", ["8xA100-SXM4-80GB", "4x8xH100:ib-ndr-x4", "2x4xL4:eth-100",
                                  "4xA100-PCIe-40GB+bridge", "2x8xMI300X:roce-400", "V100"])
def test_canonical_spec_and_json_round_trip(spec):
    cluster = parse_cluster(spec)
    assert parse_cluster(cluster.spec) == cluster
    data = json.loads(json.dumps(cluster.to_dict()))
    assert data["world_size"] == cluster.world_size
    assert Cluster.from_dict(data) == cluster


@pytest.mark.parametrize(("spec", "expected"), [
    ("4xH900", ["unknown device 'H900' in '4xH900'", "known: V100-SXM2-32GB", "HINT:"]),
    ("2x8xH100:ib-fdr", ["unknown network 'ib-fdr'", "did you mean", "ib-hdr", "known: ib-edr", "HINT:"]),
    ("2x8xL40S:eth-100g", ["(did you mean eth-100", "HINT: add '-xN'"]),
    ("8xA100:nvlink", ["unknown network 'nvlink'", "HINT: ':NETWORK' names the network between nodes"]),
    ("4x8xH100", ["spans 4 nodes but names no network", "ib-ndr", "HINT:"]),
    ("0x8xH100:ib-ndr", ["at least 1", "HINT:"]),
    ("8xH100:", ["cannot read cluster spec", "HINT:"]),
    ("x8", ["unknown device 'x8'"]),
    (":ib-ndr", ["cannot read cluster spec"]),
    ("8xL4+bridge", ["takes no NVLink bridge", "A100-PCIe-80GB", "HINT:"]),
    ("2x8xH100:ib-ndr-x0", ["at least 1"]),
])
def test_errors_name_the_bad_part_and_list_known(spec, expected):
    with pytest.raises(UsageError) as info:
        parse_cluster(spec)
    for text in expected:
        assert text in str(info.value)


def test_peak_flops_of_missing_math_is_a_usage_error():
    v100 = parse_cluster("V100").device
    assert v100.peak_flops("fp16") == 125e12 and v100.peak_bf16 is None
    with pytest.raises(UsageError, match="no bf16 math.*fp16"):
        v100.peak_flops("bf16")
    with pytest.raises(UsageError, match="known: fp32, tf32, bf16, fp16"):
        v100.peak_flops("int8")


def test_catalog_is_complete_and_unambiguous():
    names = [alias.upper() for e in catalog.GPUS for alias in (e.name, *e.aliases)]
    assert len(names) == len(set(names)), "an alias names two GPUs"
    for entry in catalog.GPUS:
        assert entry.link in catalog.LINKS and entry.host_link in catalog.LINKS
        assert entry.bridge is None or entry.bridge in catalog.LINKS
        figs = [entry.memory, entry.memory_bandwidth, entry.fp32, entry.tf32, entry.bf16,
                entry.fp16]
        assert all(f.value > 0 and f.source for f in figs if f is not None)
    assert {"H100-SXM5-80GB", "A100-SXM4-80GB", "L4", "H200-SXM-141GB"} <= set(gpu_names())
    assert {"ib-hdr", "ib-ndr", "ib-xdr", "efa-p4d", "efa-p5"} <= set(network_names())


def test_estimates_are_flagged():
    assert "memory_bandwidth" in parse_cluster("V100").device.estimated
    assert parse_cluster("H100").device.estimated == ()
    assert "efficiency" in parse_cluster("2x8xH100:ib-ndr").network.estimated


@pytest.mark.parametrize(("nvml", "name"), [
    ("NVIDIA H100 80GB HBM3", "H100-SXM5-80GB"), ("NVIDIA A100-SXM4-40GB", "A100-SXM4-40GB"),
    ("NVIDIA A100 80GB PCIe", "A100-PCIe-80GB"), ("NVIDIA GeForce RTX 4090", "RTX-4090"),
    ("Tesla V100-SXM2-32GB", "V100-SXM2-32GB"), ("NVIDIA L4", "L4"),
])
def test_nvml_names_match_the_catalog(nvml, name):
    assert match_nvml_name(nvml).name == name


def test_unknown_nvml_name_is_none():
    assert match_nvml_name("NVIDIA H100 NVL") is None
