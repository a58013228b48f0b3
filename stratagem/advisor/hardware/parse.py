"""Cluster spec strings.

Grammar (case-insensitive, spaces ignored)::

    local                                   this machine, probed (see probe_local)
    [NODES x] [DEVICES x] DEVICE[+bridge][:NETWORK[-xNICS]]

``8xA100-SXM4-80GB`` is one node of 8; ``4x8xH100:ib-ndr`` is 4 nodes of 8; ``H100`` is one
device. DEVICE is a catalog name or alias (``H100`` = ``H100-SXM5-80GB``, ``v5e`` = ``TPU-v5e``) or
``cpu`` (gloo ranks sharing this host's cores and RAM). A TPU spec names one slice of chips
joined by ICI (``16xv5p``): one node, no network. ``+bridge`` joins PCIe cards in NVLink-bridged
pairs; without it they talk over PCIe. NETWORK is a catalog name; it means one NIC per GPU
(the DGX/HGX rail layout) unless the network fixes its count (``efa-p4d``: 4, ``efa-p5``: 32)
or ``-xNICS`` says otherwise. A multi-node spec must name its network: there is no default,
because a guessed network would silently drive the advice.
"""

from __future__ import annotations

import re
from dataclasses import replace

from stratagem.advisor.hardware import lookup, probe
from stratagem.advisor.hardware.host import cpu_node, probe_host
from stratagem.advisor.hardware.catalog import TpuEntry
from stratagem.advisor.hardware.spec import Cluster, NetworkSpec, NodeSpec
from stratagem.errors import UsageError, close_matches
from stratagem.plan.checks import MAX_WORLD_SIZE, check_positive, shown

_SPEC = re.compile(r"^(?:(\d+)x)?(?:(\d+)x)?([^:+]+)(\+bridge)?(?::(.+))?$", re.IGNORECASE)
_NETWORK = re.compile(r"^(.+?)(?:-x(\d+))?$", re.IGNORECASE)
_CHARACTERS = re.compile(r"^[A-Za-z0-9.+:_-]+$")  # what catalog names, counts and separators use
FORM = "[NODES x] [DEVICES x] DEVICE[+bridge][:NETWORK[-xNICS]], e.g. '4x8xH100-SXM5-80GB:ib-ndr'"
MAX_DEVICES_PER_NODE = 1024
"""Devices a node may hold: above the largest NVLink domains (72 GPUs built, 576 announced)."""
MAX_NICS_PER_NODE = MAX_DEVICES_PER_NODE
"""NICs a node may carry: one per device of the largest node (DGX: 8 compute NICs; AWS p5: 32 EFA;
a GB200 NVL72 rack: 72, one per GPU)."""
TPU_NOTES = (
    "TPU chips: stratagem's plugins and exported configs apply plans with torch.distributed on CUDA GPUs "
    "or CPU ranks; applying this plan on TPUs needs torch_xla (its SPMD sharding or FSDPv2), so --emit "
    "and verify refuse TPU clusters.",
    "TPU estimates: beyond the catalog's chip figures the cost model uses its GPU estimates (achievable "
    "FLOP/s, host dispatch, reserved memory) and treats the ICI torus as a switch at each chip's full "
    "ICI bandwidth (a group along one torus axis reaches less).",
)
"""The notes a TPU cluster carries into ``stratagem hardware`` and the advice."""


def parse_cluster(spec: str) -> Cluster:
    """The :class:`Cluster` a spec string names (see the module docstring for the grammar)."""
    text = re.sub(r"\s+", "", spec)
    if text.lower() == "local":
        return probe.probe_local()
    match = _SPEC.match(text) if _CHARACTERS.match(text) else None
    if not match:
        raise UsageError(f"cannot read cluster spec {spec!r}: expected {FORM}"
                         "\nHINT: or 'local' to probe this machine")
    first, second, device, bridge, network = match.groups()
    num_nodes, num_devices = (int(first), int(second)) if second else (1, int(first or 1))
    if num_nodes < 1 or num_devices < 1:
        raise UsageError(f"counts in {spec!r} must be at least 1: got {num_nodes} node(s) "
                         f"x {num_devices} device(s)\nHINT: write e.g. '2x8xH100:ib-ndr'")
    tpu = lookup.find_tpu(device)
    if tpu is not None:
        return _tpu_slice(spec, tpu, num_nodes=num_nodes, num_devices=num_devices, extra=bridge or network)
    check_positive(f"the devices per node of {shown(spec)}", num_devices, maximum=MAX_DEVICES_PER_NODE,
                   why="more than any node or NVLink domain holds")
    check_positive(f"the world size of {shown(spec)}", num_nodes * num_devices, maximum=MAX_WORLD_SIZE,
                   why="more ranks than any cluster holds")
    node = _node(spec, device=device, num_devices=num_devices, bridge=bool(bridge), num_nodes=num_nodes)
    host = node.host
    shared = (f"{num_devices} CPU ranks share this host's {host.num_cores} cores: each runs at "
              f"{host.num_cores}/{num_devices} of one core's rate",) if (
        node.device.kind == "cpu" and host is not None and num_devices > host.num_cores) else ()
    return Cluster(num_nodes=num_nodes, notes=shared,
                   node=_with_network(spec, node=node, network=network, num_nodes=num_nodes))


def _node(spec: str, *, device: str, num_devices: int, bridge: bool, num_nodes: int) -> NodeSpec:
    if device.lower() == "cpu":
        if bridge:
            raise UsageError(f"'+bridge' in {spec!r} applies to GPUs, not cpu"
                             "\nHINT: drop '+bridge'")
        return cpu_node(probe_host(), num_ranks=num_devices, network=None)
    entry = lookup.find_gpu(device)
    if entry is None:
        if re.fullmatch(r"(?:\d+x)+", device, re.IGNORECASE):
            raise UsageError(f"{spec!r} names no device after its counts; a cluster is {FORM}\n"
                             f"HINT: e.g. '{spec.strip()}H100'")
        if re.match(r"^\d+x", device, re.IGNORECASE):
            raise UsageError(f"{spec!r} has more than two counts; a cluster is {FORM}\n"
                             "HINT: the nodes, then the devices per node, then the device: e.g. '4x8xH100'")
        raise UsageError(
            f"unknown device {device!r} in {spec!r}: known: {', '.join(lookup.gpu_names())}; TPUs: "
            f"{', '.join(lookup.tpu_names())}; cpu\nHINT: use a catalog name or a short name "
            f"({_aliases_hint()}, v5e = TPU-v5e), or 'local' to probe this machine"
        )
    if bridge and entry.bridge is None:
        bridged = [e.name for e in lookup.catalog.GPUS if e.bridge]
        raise UsageError(f"{entry.name} in {spec!r} takes no NVLink bridge: bridged cards are "
                         f"{', '.join(bridged)}\nHINT: drop '+bridge'")
    link_key = entry.bridge if bridge and entry.bridge else entry.link
    _check_domain(spec, entry.name, link_key, num_devices, num_nodes)
    return NodeSpec(
        device=lookup.device_from_entry(entry), num_devices=num_devices,
        link=lookup.link_from_key(link_key, num_devices=num_devices),
        host_link=lookup.host_link_from_key(entry.host_link), network=None,
    )


def _check_domain(spec: str, device: str, link_key: str, num_devices: int, num_nodes: int) -> None:
    """Refuse a node of more devices than its link has ever joined: the cost model would give every
    pair of them that link's bandwidth (e.g. '1024xH100' read as one NVLink domain of 1,024 GPUs)."""
    largest = lookup.catalog.LINKS[link_key].largest_domain
    if largest is None or num_devices <= largest.value:
        return
    total = num_nodes * num_devices
    example = f"e.g. '{total // 8}x8x{device}:ib-ndr' for nodes of 8" if total % 8 == 0 else FORM
    raise UsageError(f"{spec!r} puts {num_devices} {device} in a node, joined by {link_key}, which joins at most "
                     f"{largest.value:g} ({largest.source})\nHINT: name the nodes and their network: {example}")


def _tpu_slice(spec: str, entry: TpuEntry, *, num_nodes: int, num_devices: int, extra: str | None) -> Cluster:
    """One slice of ``num_devices`` chips: a single ICI domain, with the notes every TPU cluster carries."""
    if num_nodes > 1 or extra:
        raise UsageError(f"{spec!r}: a TPU cluster is one slice of chips joined by ICI; slices joined over "
                         "the data-center network (Multislice) and '+bridge' or ':NETWORK' are not modelled"
                         f"\nHINT: describe one slice, e.g. '{num_nodes * num_devices}x{entry.name}'")
    largest = int(entry.max_slice.value)
    if num_devices > largest:
        raise UsageError(f"{spec!r} asks for a slice of {num_devices:,} {entry.name} chips, more than the largest "
                         f"one holds ({entry.max_slice.source})\nHINT: at most '{largest}x{entry.name}'")
    return Cluster(num_nodes=1, node=lookup.tpu_node(entry, num_devices=num_devices), notes=TPU_NOTES)


def _aliases_hint() -> str:
    aliases = lookup.gpu_aliases()
    return ", ".join(f"{a} = {aliases[a]}" for a in ("H100", "A100", "H200") if a in aliases)


def _with_network(spec: str, *, node: NodeSpec, network: str | None,
                  num_nodes: int) -> NodeSpec:
    if network is None:
        if num_nodes > 1:
            example = f"'{spec}:eth-100'" if node.device.kind == "cpu" else \
                f"'{spec}:ib-ndr' (one NIC per GPU) or '{spec}:eth-100'"
            raise UsageError(f"{spec!r} spans {num_nodes} nodes but names no network between them: "
                             f"known: {', '.join(lookup.network_names())}\nHINT: append one, e.g. {example}")
        return node
    return replace(node, network=parse_network(network, spec=spec, node=node))


# Links inside a node, which a user may write where the network between nodes goes.
_DEVICE_LINKS = ("nvlink", "nvswitch", "pcie", "xgmi", "infinity")
_LINK_HINT = ("':NETWORK' names the network between nodes; the links inside a node come with the device (SXM "
              "cards over NVLink, PCIe cards over PCIe, '+bridge' for NVLink-bridged pairs): "
              "`stratagem hardware --cluster SPEC` shows them")


def parse_network(text: str, *, spec: str, node: NodeSpec) -> NetworkSpec:
    """The network ``NAME[-xNICS]`` for ``node`` (``spec`` is quoted in errors)."""
    match = _NETWORK.match(text)
    assert match, "the pattern matches any non-empty text"
    name, count = match[1].lower(), match[2]
    if name not in lookup.network_names():
        hint = (_LINK_HINT if name.startswith(_DEVICE_LINKS) else
                "add '-xN' for N NICs per node, e.g. 'ib-ndr-x4'")
        raise UsageError(f"unknown network {text!r} in {spec!r}{close_matches(name, list(lookup.network_names()))}: "
                         f"known: {', '.join(lookup.network_names())}\nHINT: {hint}")
    nics = int(count) if count else lookup.default_nics(
        name, num_devices=node.num_devices, is_gpu=node.device.is_gpu)
    if nics < 1:
        raise UsageError(f"NIC count in {text!r} must be at least 1\nHINT: e.g. '{name}-x4'")
    check_positive(f"the NICs per node of {shown(spec)}", nics, maximum=MAX_NICS_PER_NODE,
                   why="more than one per device of the largest node")
    return lookup.network_from_name(name, nics_per_node=nics)


