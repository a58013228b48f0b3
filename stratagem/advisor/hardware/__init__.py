"""The cluster a plan runs on: devices, intra-node links, the network between nodes.

Build a :class:`Cluster` from a spec string (``parse_cluster("4x8xH100:ib-ndr")``), by probing
this machine (:func:`probe_local`: NVML, psutil, sysfs), or inside a running job from every
node's probe (:func:`gather_cluster`). Every figure comes from :mod:`.catalog`, which names a
source for each and flags estimates. Importing this package loads neither torch nor pynvml.
"""

from __future__ import annotations

from stratagem.advisor.hardware.gather import combine_clusters, gather_cluster
from stratagem.advisor.hardware.lookup import gpu_names, network_names
from stratagem.advisor.hardware.network import probe_network
from stratagem.advisor.hardware.parse import parse_cluster
from stratagem.advisor.hardware.probe import probe_host, probe_local
from stratagem.advisor.hardware.spec import (
    Cluster,
    DeviceSpec,
    HostSpec,
    LinkSpec,
    NetworkSpec,
    NodeSpec,
)

__all__ = [
    "Cluster",
    "DeviceSpec",
    "HostSpec",
    "LinkSpec",
    "NetworkSpec",
    "NodeSpec",
    "combine_clusters",
    "gather_cluster",
    "gpu_names",
    "network_names",
    "parse_cluster",
    "probe_host",
    "probe_local",
    "probe_network",
]
