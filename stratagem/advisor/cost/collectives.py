"""α–β costs of collectives, and which link a mesh-axis group crosses.

A collective over ``n`` ranks costs ``steps · α + factor · bytes / β``: α the per-message
latency, β the bandwidth each rank reaches per direction (after efficiency), ``factor`` the bus
bandwidth factor nccl-tests defines (PERFORMANCE.md: all-reduce moves ``2(n−1)/n`` of the
buffer over each rank's link, reduce-scatter and all-gather ``(n−1)/n``, point-to-point 1).
Latency terms are those of the ring algorithms (Thakur, Rabenseifner & Gropp 2005, §4; Ben-Nun
& Hoefler 2019, Table 4): ``n−1`` steps for reduce-scatter and all-gather, ``2(n−1)`` for
all-reduce. ``num_bytes`` is always the full buffer: for all-gather the gathered result, for
reduce-scatter the unsharded input.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

from stratagem.advisor.hardware.spec import Cluster, LinkSpec, NetworkSpec
from stratagem.advisor.memo import by_identity
from stratagem.plan import MeshAxis, Plan
from stratagem.plan.plan import mesh_strides
from stratagem.errors import UsageError

_Measured = TypeVar("_Measured")


def nearest_measured(points: Sequence[tuple[int, _Measured]], size: int) -> _Measured:
    """What ``points`` ((group size, figure) as calibration measured them) hold for the group size
    nearest ``size``, the larger on a tie: a collective over more ranks takes and waits longer."""
    return min(points, key=lambda point: (abs(point[0] - size), -point[0]))[1]


def estimate_all_reduce_seconds(num_bytes: float, *, group_size: int, bandwidth: float,
                                latency: float) -> float:
    """Seconds for a ring all-reduce of ``num_bytes`` over ``group_size`` ranks, each reaching
    ``bandwidth`` bytes/s per direction with ``latency`` seconds per step.

    Source: Thakur et al. 2005, §4.4 (reduce-scatter + all-gather); busbw factor 2(n−1)/n
    (nccl-tests PERFORMANCE.md)."""
    return _ring_seconds(num_bytes, group_size=group_size, bandwidth=bandwidth, latency=latency,
                         passes=2)


def estimate_all_gather_seconds(num_bytes: float, *, group_size: int, bandwidth: float,
                                latency: float) -> float:
    """Seconds for a ring all-gather whose gathered result is ``num_bytes``.

    Source: Thakur et al. 2005, §4.1; busbw factor (n−1)/n (nccl-tests PERFORMANCE.md)."""
    return _ring_seconds(num_bytes, group_size=group_size, bandwidth=bandwidth, latency=latency,
                         passes=1)


def estimate_reduce_scatter_seconds(num_bytes: float, *, group_size: int, bandwidth: float,
                                    latency: float) -> float:
    """Seconds for a ring reduce-scatter of an unsharded input of ``num_bytes``.

    Source: Thakur et al. 2005, §4.3; busbw factor (n−1)/n (nccl-tests PERFORMANCE.md)."""
    return _ring_seconds(num_bytes, group_size=group_size, bandwidth=bandwidth, latency=latency,
                         passes=1)


def estimate_p2p_seconds(num_bytes: float, *, bandwidth: float, latency: float) -> float:
    """Seconds to send ``num_bytes`` from one rank to another: ``α + bytes/β``.

    Source: the α–β (Hockney) model, Ben-Nun & Hoefler 2019, §3.2."""
    if num_bytes <= 0:
        return 0.0
    return latency + num_bytes / bandwidth


def _ring_seconds(num_bytes: float, *, group_size: int, bandwidth: float, latency: float,
                  passes: int) -> float:
    """``passes`` rounds of ``n−1`` ring steps, each moving ``bytes/n`` per rank."""
    if group_size <= 1 or num_bytes <= 0:
        return 0.0
    steps = passes * (group_size - 1)
    return steps * latency + steps / group_size * num_bytes / bandwidth


# -- which link a group crosses -----------------------------------------------------------


def group_link(cluster: Cluster, plan: Plan, axis: MeshAxis | str) -> tuple[float, float]:
    """``(bandwidth, latency)`` one rank of an ``axis`` group reaches: bytes/s per direction after
    efficiency, and seconds per message (:func:`_group_link` says how it is chosen)."""
    return mesh_links(cluster, plan)[MeshAxis(axis)]


def mesh_links(cluster: Cluster, plan: Plan, op: str | None = None) -> dict[MeshAxis, tuple[float, float]]:
    """:func:`group_link` for every mesh axis of ``plan`` at once (memoized per cluster and
    mesh shape: the search asks for the same few meshes thousands of times). With ``op``
    (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``p2p``), a group inside one node uses
    that collective's own calibrated α and β where the node has them
    (``NodeSpec.collectives``, the fit for the group's size or the nearest measured): backends
    reach different rates for each."""
    return _mesh_links(cluster, plan.mesh_degrees, op)


@by_identity
def _mesh_links(cluster: Cluster, degrees: tuple[int, ...], op: str | None) -> dict[MeshAxis, tuple[float, float]]:
    strides = mesh_strides(degrees)
    return {axis: _group_link(cluster, size, strides[axis], axis, op) for axis, size in zip(MeshAxis, degrees)}


def _group_link(cluster: Cluster, size: int, stride: int, axis: MeshAxis, op: str | None) -> tuple[float, float]:
    """:func:`group_link` of an ``axis`` group of ``size`` ranks ``stride`` apart; one rank crosses
    nothing: ``(inf, 0)``.

    Inside one node (``devices_per_node`` ranks) a group uses the node's link when its span fits
    the link's domain (NVSwitch: the node; bridged pairs: 2), else the host link (PCIe). A group
    spanning nodes runs a ring whose inter-node hops carry each node's whole share (nccl-tests
    busbw across nodes ≈ the node's NIC bandwidth); every group along the axis runs at once, so
    ``m`` members per node get ``m · node_bandwidth · efficiency / devices_per_node``, capped by
    the in-node link. CPU clusters (gloo, ``loopback``) use their link figures as given."""
    if size == 1:
        return math.inf, 0.0
    per_node = cluster.devices_per_node
    members_per_node = max(1, min(size, per_node // stride))
    intra = _in_node_link(cluster, span=stride * (members_per_node - 1) + 1)
    if members_per_node == size:
        fits = [(n, (bandwidth, latency)) for name, n, bandwidth, latency in cluster.node.collectives if name == op]
        if fits:
            return nearest_measured(fits, size)
        return intra.effective_bandwidth, intra.latency
    network = _network(cluster, axis, size)
    per_rank = members_per_node * network.node_bandwidth * network.efficiency / per_node
    if members_per_node > 1:
        per_rank = min(per_rank, intra.effective_bandwidth)
    return per_rank, max(network.latency, intra.latency if members_per_node > 1 else 0.0)


def _in_node_link(cluster: Cluster, *, span: int) -> LinkSpec:
    """The link ranks within ``span`` consecutive devices of a node use."""
    link = cluster.node.link
    if span <= link.domain_size or cluster.node.host_link is None:
        return link
    return cluster.node.host_link


def _network(cluster: Cluster, axis: MeshAxis, size: int) -> NetworkSpec:
    if cluster.network is None:
        raise UsageError(f"a {axis} group of {size} ranks spans nodes, but the cluster "
                         f"{cluster.spec} names no network between its {cluster.num_nodes} nodes\n"
                         "HINT: add the network to the spec, e.g. '4x8xH100:ib-ndr'")
    return cluster.network
