"""α–β collective costs against hand-worked numbers, and the link each mesh-axis group
crosses."""

from __future__ import annotations

import math

import pytest

from stratagem.advisor.cost.collectives import (
    estimate_all_gather_seconds,
    estimate_all_reduce_seconds,
    estimate_p2p_seconds,
    estimate_reduce_scatter_seconds,
    group_link,
)
from stratagem.advisor.hardware import parse_cluster
from stratagem.plan import MeshAxis, Plan
from stratagem.errors import UsageError

GIB = 2**30
LINK = {"bandwidth": 100e9, "latency": 5e-6}


def test_all_reduce_of_one_gib_over_eight_ranks():
    expected = 2 * 7 / 8 * GIB / 100e9 + 2 * 7 * 5e-6
    assert estimate_all_reduce_seconds(GIB, group_size=8, **LINK) == pytest.approx(expected)


def test_all_gather_and_reduce_scatter_move_n_minus_1_over_n():
    expected = 7 / 8 * GIB / 100e9 + 7 * 5e-6
    assert estimate_all_gather_seconds(GIB, group_size=8, **LINK) == pytest.approx(expected)
    assert estimate_reduce_scatter_seconds(GIB, group_size=8, **LINK) == pytest.approx(expected)


def test_all_reduce_costs_a_reduce_scatter_plus_an_all_gather():
    split = (estimate_reduce_scatter_seconds(GIB, group_size=4, **LINK)
             + estimate_all_gather_seconds(GIB, group_size=4, **LINK))
    assert estimate_all_reduce_seconds(GIB, group_size=4, **LINK) == pytest.approx(split)


def test_p2p_is_latency_plus_bytes_over_bandwidth():
    assert estimate_p2p_seconds(GIB, **LINK) == pytest.approx(5e-6 + GIB / 100e9)


@pytest.mark.parametrize("estimate", [estimate_all_reduce_seconds, estimate_all_gather_seconds,
                                      estimate_reduce_scatter_seconds])
def test_nothing_to_do_costs_nothing(estimate):
    assert estimate(GIB, group_size=1, **LINK) == 0.0
    assert estimate(0, group_size=8, **LINK) == 0.0
    assert estimate_p2p_seconds(0, **LINK) == 0.0


def test_axis_strides_follow_the_mesh_order():
    plan = Plan(pp=2, dp_replicate=2, dp_shard=2, tp=4, zero=3, microbatches=2)
    strides = dict(plan.mesh_strides)
    assert strides == {MeshAxis.TP: 1, MeshAxis.DP_SHARD: 4, MeshAxis.DP_REPLICATE: 8,
                       MeshAxis.PP: 16}


def test_tp8_on_one_h100_node_uses_nvlink():
    cluster = parse_cluster("1x8xH100")
    assert group_link(cluster, Plan(tp=8), MeshAxis.TP) == (pytest.approx(450e9 * 0.75), 3e-6)


def test_dp_across_four_nodes_gets_one_nic_per_gpu():
    cluster = parse_cluster("4x8xH100:ib-ndr")  # 8 NDR NICs per node (rails)
    plan = Plan(tp=8, dp_replicate=4)
    bandwidth, latency = group_link(cluster, plan, MeshAxis.DP_REPLICATE)
    assert bandwidth == pytest.approx(400e9 / 8 * 0.92)  # 50 GB/s per NIC, 92 % efficiency
    assert latency == 5e-6


def test_group_with_all_ranks_of_each_node_gets_the_node_nics_capped_by_nvlink():
    cluster = parse_cluster("4x8xH100:ib-ndr")
    bandwidth, latency = group_link(cluster, Plan(dp_shard=32, zero=3), MeshAxis.DP_SHARD)
    assert bandwidth == pytest.approx(min(8 * 50e9 * 0.92, 450e9 * 0.75))
    assert latency == 5e-6


def test_one_nic_per_node_is_shared_by_the_node_ranks():
    cluster = parse_cluster("2x8xH100:eth-100-x1")
    bandwidth, _ = group_link(cluster, Plan(tp=8, dp_replicate=2), MeshAxis.DP_REPLICATE)
    assert bandwidth == pytest.approx(100e9 / 8 * 0.7 / 8)


def test_bridged_pairs_fall_back_to_pcie_beyond_a_pair():
    cluster = parse_cluster("1x4xA100-PCIe-80GB+bridge")
    bridge = 300e9 * 0.75
    pcie = cluster.node.host_link.effective_bandwidth
    assert group_link(cluster, Plan(tp=2, dp_replicate=2), MeshAxis.TP)[0] == pytest.approx(bridge)
    assert group_link(cluster, Plan(tp=4), MeshAxis.TP)[0] == pytest.approx(pcie)
    # ranks 0 and 2 sit on different bridges
    dp = group_link(cluster, Plan(tp=2, dp_replicate=2), MeshAxis.DP_REPLICATE)
    assert dp[0] == pytest.approx(pcie)


def test_cpu_ranks_use_the_loopback_figures():
    cluster = parse_cluster("1x2xcpu")
    assert group_link(cluster, Plan(dp_replicate=2), MeshAxis.DP_REPLICATE) == (5e9, 30e-6)


def test_a_group_of_one_crosses_nothing():
    assert group_link(parse_cluster("1x8xH100"), Plan(tp=8), MeshAxis.PP) == (math.inf, 0.0)


def test_spanning_nodes_without_a_network_is_a_usage_error():
    with pytest.raises(UsageError, match="HINT"):
        group_link(parse_cluster("2x8xH100"), Plan(tp=8, dp_replicate=2), MeshAxis.DP_REPLICATE)
