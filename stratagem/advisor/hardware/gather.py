"""One cluster from every node's probe, inside a running torch.distributed job."""

from __future__ import annotations

import os
import socket
from collections import Counter
from dataclasses import replace
from typing import Any

from stratagem.advisor.hardware import lookup
from stratagem.advisor.hardware.parse import cpu_node
from stratagem.advisor.hardware.spec import Cluster, NetworkSpec, NodeSpec
from stratagem.errors import UsageError

DEFAULT_NETWORK = "eth-10"  # assumed when no node found any network: the slow, safe guess

LAUNCHER_NODE_RANKS = ("GROUP_RANK", "SLURM_NODEID")
"""Where a launcher puts the rank of this process's node: torchrun (its agent's rank), Slurm."""


def node_name(node_rank: int | str) -> str:
    """The key naming the node of rank ``node_rank`` in :func:`gather_cluster`."""
    return f"node {node_rank}"


def this_node() -> str:
    """What names this process's node: the launcher's node rank (:data:`LAUNCHER_NODE_RANKS`),
    as Lightning's and Fabric's strategies name it, else the host name."""
    for name in LAUNCHER_NODE_RANKS:
        if name in os.environ:
            return node_name(os.environ[name])
    return socket.gethostname()


def gather_cluster(local: Cluster, *, group: Any = None, node_key: str | None = None) -> Cluster:
    """Every rank's ``local`` probe, all-gathered and combined (see :func:`combine_clusters`).

    Without an initialized process group, returns ``local``. A collective: every rank of
    ``group`` must call it. Ranks sharing ``node_key`` (default: :func:`this_node`) are one node.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return local
    gathered: list[Any] = [None] * dist.get_world_size(group)
    mine = (node_key or this_node(), socket.gethostname(), local.to_dict())
    dist.all_gather_object(gathered, mine, group=group)
    return combine_clusters([(key, Cluster.from_dict(data)) for key, _, data in gathered],
                            hosts=[host for _, host, _ in gathered])


def combine_clusters(per_rank: list[tuple[str, Cluster]], *, hosts: list[str] | None = None) -> Cluster:
    """One :class:`Cluster` from each rank's ``(node key, probe)``, rank order, and each rank's
    host name (``hosts``, when known).

    Nodes are the distinct keys, devices per node the ranks per node (CPU ranks split their
    host, among every rank on it when nodes share one: ``torchrun --nnodes 2`` on one machine).
    Nodes that differ are noted and the weakest one (least memory per device) is
    planned for; the network is the slowest any node reported, or :data:`DEFAULT_NETWORK`.
    """
    probes: dict[str, Cluster] = {}  # node key -> its first rank's probe
    for key, cluster in per_rank:
        probes.setdefault(key, cluster)
    ranks = Counter(key for key, _ in per_rank)
    if len(set(ranks.values())) > 1:
        raise UsageError(
            f"ranks per node differ: {dict(ranks)}: the cluster model needs the same count on "
            "every node\nHINT: launch as many processes on every node (torchrun --nproc-per-node)"
        )
    weakest_key = min(probes, key=lambda k: probes[k].device.memory_bytes)
    notes = _merged_notes(probes) + _differences(probes, weakest_key)
    sharing = max(Counter(hosts).values()) if hosts else ranks[weakest_key]
    node, fit_notes = _fit_ranks(probes[weakest_key].node, ranks[weakest_key], sharing)
    network, net_notes = _network(probes) if len(probes) > 1 else (node.network, [])
    return Cluster(num_nodes=len(probes), node=replace(node, network=network), source="gather",
                   notes=tuple(dict.fromkeys(notes + fit_notes + net_notes)))


def _merged_notes(probes: dict[str, Cluster]) -> list[str]:
    """Notes every node shares as they are; the rest prefixed with their node's key."""
    merged = []
    for key, cluster in probes.items():
        for note in cluster.notes:
            shared = all(note in other.notes for other in probes.values())
            merged.append(note if shared else f"{key}: {note}")
    return merged


def _differences(probes: dict[str, Cluster], weakest_key: str) -> list[str]:
    shapes = {key: f"{c.devices_per_node}x{c.device.name}" for key, c in probes.items()}
    if len(set(shapes.values())) == 1:
        return []
    listed = ", ".join(f"{key}: {shape}" for key, shape in shapes.items())
    return [f"nodes differ ({listed}): planning for {weakest_key}'s {shapes[weakest_key]}"]


def _fit_ranks(node: NodeSpec, num_ranks: int, sharing: int) -> tuple[NodeSpec, list[str]]:
    """The node as ``num_ranks`` ranks see it: CPU ranks share the host (with every one of the
    ``sharing`` ranks on it), GPU ranks one GPU each."""
    if not node.device.is_accelerator and node.host is not None:
        if num_ranks == node.num_devices and sharing == num_ranks:
            return node, []
        notes = [] if sharing == num_ranks else [
            f"{sharing} ranks share each host: each rank gets 1/{sharing} of its cores and memory"]
        return cpu_node(node.host, num_ranks=num_ranks, network=node.network, sharing=sharing), notes
    if num_ranks == node.num_devices:
        return node, []
    note = (f"{num_ranks} rank(s) per node on {node.num_devices} device(s): "
            f"planning for {num_ranks} per node")
    link = node.link if num_ranks > 1 else lookup.none_link()
    link = replace(link, domain_size=min(link.domain_size, num_ranks))
    return replace(node, num_devices=num_ranks, link=link), [note]


def _network(probes: dict[str, Cluster]) -> tuple[NetworkSpec, list[str]]:
    found = {key: c.network for key, c in probes.items() if c.network is not None}
    if not found:
        nics = lookup.network_from_name(DEFAULT_NETWORK, nics_per_node=1)
        return nics, [f"no node reported a network: assuming {DEFAULT_NETWORK} (TCP), one NIC"]
    slowest = min(found.values(), key=lambda n: n.node_bandwidth * n.efficiency)
    notes = []
    if len(found) < len(probes) or len({n.name for n in found.values()}) > 1:
        seen = ", ".join(f"{k}: {n.name}-x{n.nics_per_node}" for k, n in found.items())
        notes.append(f"nodes report different networks ({seen}): planning for the slowest, "
                     f"{slowest.name}-x{slowest.nics_per_node}")
    return slowest, notes
