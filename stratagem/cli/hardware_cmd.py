"""``stratagem hardware``: the cluster the advisor plans for, probed or named."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.table import Table

    from stratagem.advisor.hardware import Cluster, HostSpec, LinkSpec


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``hardware`` subcommand."""
    parser = subparsers.add_parser(
        "hardware",
        help="show the cluster: devices, memory, peak FLOP/s, links, network",
        description="Describe a cluster: probe this machine (NVML, psutil, sysfs) or read a "
        "spec such as '8xA100-SXM4-80GB', '4x8xH100:ib-ndr', '2x4xL4:eth-100', 'H100' or '8xTPU-v5e'.",
    )
    parser.add_argument("--cluster", metavar="SPEC", default="local",
                        help="cluster spec, or 'local' to probe this machine (default: local)")
    parser.add_argument("--json", action="store_true", help="print the cluster as JSON")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Describe the cluster; returns the exit status."""
    from stratagem.advisor.calibrate import calibrated
    from stratagem.advisor.hardware import parse_cluster

    cluster = calibrated(parse_cluster(args.cluster))
    if args.json:
        print(json.dumps(cluster.to_dict(), indent=2))
        return 0
    from rich.console import Console

    Console().print(cluster_table(cluster))
    return 0


def cluster_table(cluster: Cluster) -> Table:
    """A two-column rich table summarizing ``cluster``; ``~`` marks estimated figures."""
    from rich.table import Table

    device = cluster.device
    table = Table(title=f"{cluster.spec}  ({cluster.source})", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    rows = {
        "device": f"{device.name} ({device.kind}, {device.vendor})",
        "devices": f"{cluster.num_nodes} node(s) x {cluster.devices_per_node} = "
                   f"{cluster.world_size} rank(s) ({cluster.backend})",
        "memory / device": f"{device.memory_bytes / 2**30:,.1f} GiB",
        "peak bf16 dense": _tflops(device.peak_bf16, "peak_bf16" in device.estimated),
        "peak fp32": _tflops(device.peak_fp32, "peak_fp32" in device.estimated),
        **_large_gemms(cluster),
        "memory bandwidth": _rate(device.memory_bandwidth,
                                  "memory_bandwidth" in device.estimated),
        **({"memory latency": f"{device.memory_latency * 1e9:.0f} ns (few loads in flight)"}
           if device.memory_latency is not None else {}),
        "intra-node link": _link(cluster.node.link),
        "host link": _link(cluster.node.host_link) if cluster.node.host_link else "-",
        "network": _network(cluster),
    }
    host = cluster.node.host
    if host is not None:
        rows["host / node"] = (f"{host.num_cores} cores, {host.memory_bytes / 2**30:,.1f} GiB RAM"
                               + (f" ({host.cpu_name})" if host.cpu_name else "") + _cores(host))
    for name, value in rows.items():
        table.add_row(name, value)
    for note in cluster.notes:
        table.add_row("note", note)
    return table


def _large_gemms(cluster: Cluster) -> dict[str, str]:
    """The row of the rate the cost model gives a step's largest 16-bit GEMMs
    (:func:`~stratagem.advisor.cost.rates.large_gemm_rate`), on GPUs whose GEMMs it models by shape."""
    from stratagem.advisor.cost.rates import large_gemm_rate, matmul_curve, matmul_dtype

    device = cluster.device
    precision = "bf16-mixed" if device.peak_bf16 else "fp16-mixed"
    if not (cluster.is_accelerator and device.num_sms and (device.peak_bf16 or device.peak_fp16)):
        return {}
    rate = large_gemm_rate(cluster, precision)
    if matmul_curve(cluster, precision):
        return {"large GEMMs, 16-bit": _tflops(rate, False) + " (measured by stratagem calibrate)"}
    estimated = device.matmul_fraction is None or "matmul_fraction" in device.estimated  # LARGE_GEMM_FRACTION
    return {"large GEMMs, 16-bit": _tflops(rate, estimated)
            + f" ({rate / device.peak_flops(matmul_dtype(cluster, precision)):.0%} of the peak: what a step's "
              "largest GEMMs sustain)"}


def _cores(host: HostSpec) -> str:
    """The cores' vector class, half-precision units and nominal clock, where read."""
    if not host.core_isa:
        return ""
    units = "".join(f" + {unit}" for unit in host.isa_extensions)
    clock = f" at {host.clock_hz / 1e9:.2f} GHz" if host.clock_hz else ""
    return f"; cores {host.core_isa}{units}{clock}, {host.num_sockets} socket(s)"


def _tflops(value: float | None, estimated: bool) -> str:
    if value is None:
        return "not supported"
    tflops = value / 1e12
    number = f"{tflops:,.1f}" if tflops >= 10 else f"{tflops:.3g}"
    return f"{'~' if estimated else ''}{number} TFLOP/s"


def _rate(value: float, estimated: bool) -> str:
    return f"{'~' if estimated else ''}{value / 1e9:,.0f} GB/s"


def _link(link: LinkSpec) -> str:
    if link.kind == "none":
        return "none (one device per node)"
    return (f"{link.kind} {link.topology}, {_rate(link.bandwidth, 'bandwidth' in link.estimated)}"
            f" per device per direction, x{link.efficiency:.2f} efficiency, "
            f"{link.domain_size} per domain")


def _network(cluster: Cluster) -> str:
    net = cluster.network
    if net is None:
        return "none (single node)" if cluster.num_nodes == 1 else "unknown"
    return (f"{net.name} ({net.kind}): {net.nics_per_node} NIC(s) x "
            f"{net.bandwidth * 8 / 1e9:g} Gb/s = {_rate(net.node_bandwidth, False)} per node "
            f"per direction, x{net.efficiency:.2f} efficiency")
