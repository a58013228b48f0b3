"""Every hardware figure stratagem uses, each with its source next to it.

This is the one place numbers about GPUs, TPUs, links and networks live. A figure is a
:class:`Fig`: a value in SI units (bytes, bytes/s, FLOP/s, seconds, fractions), the source it
came from, and whether it is an estimate (a number no primary source confirmed, or a rule of
thumb). FLOP/s are dense (datasheets print 2:4-sparse tensor-core figures, twice these).
Memory capacities are the datasheet's "GB", which for HBM/GDDR means GiB (the driver reports
slightly less, e.g. 81,559 MiB on an H100 80GB); bandwidths are decimal (1 GB/s = 1e9 B/s).

Google Cloud TPUs (v4, v5e, v5p, v6e) are catalogued for advice: their plans are applied
with torch_xla, which stratagem does not drive. Not catalogued: GPUs older than V100.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

GIB = 2**30
GB = 1e9
TFLOPS = 1e12
GBIT = 1e9 / 8  # bytes/s in one Gb/s


class Fig(NamedTuple):
    """One catalogued number: ``value`` in SI units, its source, and whether it is an estimate."""

    value: float
    source: str
    estimate: bool = False


def est(value: float, source: str) -> Fig:
    """A figure no primary source confirmed (or a rule of thumb): flagged as an estimate."""
    return Fig(value, source, estimate=True)


MAMF_SUSTAINED = 0.88
"""Share of a best-shape MAMF figure the large GEMMs of a training step sustain. MAMF is the fastest
shape a search found; large square bf16 GEMMs on the GH100 chip, timed by ``stratagem calibrate``
from n = 2048 up, ran at 671-704 TFLOP/s on one H200 and 668-711 on two H100 SXM5
(``bench/calibrations/``), 0.85-0.90 of the H100 SXM's best shape, 792.1; the H100s' mean at
n = 4096 and 8192, 694, is 0.88 of it (docs/hardware.md, "GEMM rates")."""


def sustained_mamf(value: float, chip: str, *, estimate: bool = False) -> Fig:
    """A best-shape MAMF figure of ``chip`` as the rate a step's large GEMMs sustain:
    × :data:`MAMF_SUSTAINED`."""
    return Fig(value * MAMF_SUSTAINED, f"{MAMF}: {chip}; × {MAMF_SUSTAINED}, what a step's large GEMMs sustain",
               estimate)


# Sources, named once.
V100_DS = "NVIDIA V100 datasheet"
A100_DS = "NVIDIA A100 datasheet and A100 whitepaper (dense = sparse / 2)"
H100_DS = "NVIDIA H100 datasheet (dense = sparse / 2)"
H200_DS = "NVIDIA H200 datasheet; MLCommons system descriptions"
B200_DS = "NVIDIA DGX B200 / HGX B200 specifications (dense = sparse / 2)"
GB200_DS = "NVIDIA GB200 NVL72 specifications, per GPU (dense = sparse / 2)"
L4_DS = "NVIDIA L4 datasheet (dense = sparse / 2)"
L40S_DS = "NVIDIA L40S datasheet (dense = sparse / 2)"
A10G_SRC = "A10 datasheet scaled to the AWS A10G; measured BF16 GEMM 69.5 TFLOP/s"
ADA_WP = "NVIDIA Ada Lovelace whitepaper, appendix (FP32 accumulate)"
AMPERE_GA102_WP = "NVIDIA GA102 (Ampere) whitepaper (FP32 accumulate)"
MI300X_DS = "AMD Instinct MI300X datasheet"
NVLINK_SRC = "NVIDIA NVLink page; A100/H100 whitepapers; nccl src/graph/topo.h"
PCIE_SRC = "PCI-SIG base specs: GT/s per lane with 8b/10b (gen1-2) or 128b/130b (gen3-5)"
NCCL_TESTS = "nccl-tests PERFORMANCE.md busbw; 8xA100 all-reduce busbw 200-208 of 300 GB/s"
IBTA = "IBTA roadmap / NVIDIA ConnectX datasheets: 4X EDR 100, HDR 200, NDR 400, XDR 800 Gb/s"
IB_EFF = "all-reduce busbw about 90-96 % of line rate (46-48 GB/s per NDR NIC)"
EFA_SRC = "AWS: p4d 4 x 100 Gb/s EFA per node; p5 3,200 Gb/s per node (32 x 100 Gb/s)"
LATENCY_RULE = "rule of thumb for small-message collective latency; calibrate to replace"
V100_WP = "NVIDIA Tesla V100 whitepaper: 80 SMs"
A100_WP = "NVIDIA A100 whitepaper: 108 SMs"
H100_WP = "NVIDIA H100 whitepaper: 132 SMs (SXM5), 114 (PCIe)"
H200_SMS = "the H100 SXM5's GH100 configuration (132 SMs), which the H200 keeps"
ADA_SMS = "NVIDIA Ada Lovelace whitepaper / datasheet: CUDA cores / 128 per SM"
MAMF = ("maximum achievable matmul FLOPS, bf16, best shape found (Bekman, ml-engineering, "
        "compute/accelerator: MAMF comparison table)")
H100_LATENCY = ("bench/batch_norm_rate.py on one H100 SXM5 80GB (2026-11-26): ATen's batch-statistics kernel read "
                "(256, 64, 112, 112) in bfloat16, 411 MB, in 2.62 ms, one 2-byte load in flight per thread of "
                "64 blocks of 512; less the bytes at 0.7 of 3.35 TB/s (docs/cost-model.md, \"BatchNorm's kernels\")")
H200_LATENCY = ("stratagem calibrate on one H200 (2026-11-28, torch 2.11, CUDA 13; bench/calibrations/"
                "h200-sxm-141gb-2026-11-28.json): ATen's BatchNorm statistics kernel with few loads in flight, less "
                "its bytes at the measured copy rate (docs/cost-model.md, \"BatchNorm's kernels\")")
H200_MATMUL = "stratagem calibrate on one H200 (torch 2.11, CUDA 13; bf16 671-704 TFLOP/s from n = 2048): docs/benchmarks.md"


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuEntry:
    """One GPU model as catalogued: figures per device, its links by key into :data:`LINKS`."""

    name: str
    aliases: tuple[str, ...]
    nvml_names: tuple[str, ...]
    compute_capability: tuple[int, int] | None
    memory: Fig  # bytes
    memory_bandwidth: Fig  # bytes/s
    fp32: Fig  # FLOP/s, dense, here and below
    tf32: Fig | None
    bf16: Fig | None
    fp16: Fig
    link: str  # how GPUs of one node talk: a key of LINKS
    host_link: str  # GPU <-> host: a key of LINKS
    vendor: str = "nvidia"
    bridge: str | None = None  # optional pairwise bridge for PCIe cards ("+bridge" in a spec)
    sms: Fig | None = None  # streaming multiprocessors (AMD: compute units): what GEMM tiles run on
    matmul: Fig | None = None  # FLOP/s the largest 16-bit GEMMs reach, measured
    memory_latency: Fig | None = None  # seconds a load from device memory takes with few in flight, measured


GPUS: tuple[GpuEntry, ...] = (
    GpuEntry(name="V100-SXM2-32GB", aliases=("V100", "V100-32GB", "V100-SXM2"),
             nvml_names=("Tesla V100-SXM2-32GB",), compute_capability=(7, 0),
             memory=Fig(32 * GIB, V100_DS), memory_bandwidth=est(900 * GB, V100_DS),
             fp32=Fig(15.7 * TFLOPS, V100_DS), tf32=None, bf16=None,
             fp16=Fig(125 * TFLOPS, V100_DS + " (tensor cores)"),
             link="nvlink2-cube-mesh", host_link="pcie-gen3",
             sms=Fig(80, V100_WP)),
    GpuEntry(name="A100-SXM4-40GB", aliases=("A100-40GB", "A100-SXM-40GB", "A100-SXM4"),
             nvml_names=("NVIDIA A100-SXM4-40GB",), compute_capability=(8, 0),
             memory=Fig(40 * GIB, A100_DS), memory_bandwidth=Fig(1555 * GB, A100_DS),
             fp32=Fig(19.5 * TFLOPS, A100_DS), tf32=Fig(156 * TFLOPS, A100_DS),
             bf16=Fig(312 * TFLOPS, A100_DS), fp16=Fig(312 * TFLOPS, A100_DS),
             link="nvlink3-nvswitch", host_link="pcie-gen4",
             sms=Fig(108, A100_WP), matmul=sustained_mamf(267.9 * TFLOPS, "the A100 SXM 80 GB's; same chip",
                                                             estimate=True)),
    GpuEntry(name="A100-SXM4-80GB", aliases=("A100", "A100-80GB", "A100-SXM-80GB", "A100-SXM"),
             nvml_names=("NVIDIA A100-SXM4-80GB",), compute_capability=(8, 0),
             memory=Fig(80 * GIB, A100_DS), memory_bandwidth=Fig(2039 * GB, A100_DS),
             fp32=Fig(19.5 * TFLOPS, A100_DS), tf32=Fig(156 * TFLOPS, A100_DS),
             bf16=Fig(312 * TFLOPS, A100_DS), fp16=Fig(312 * TFLOPS, A100_DS),
             link="nvlink3-nvswitch", host_link="pcie-gen4",
             sms=Fig(108, A100_WP), matmul=sustained_mamf(267.9 * TFLOPS, "A100 SXM, CUDA 12.1")),
    GpuEntry(name="A100-PCIe-40GB", aliases=("A100-PCIE-40G",),
             nvml_names=("NVIDIA A100-PCIE-40GB",), compute_capability=(8, 0),
             memory=Fig(40 * GIB, A100_DS), memory_bandwidth=Fig(1555 * GB, A100_DS),
             fp32=Fig(19.5 * TFLOPS, A100_DS), tf32=Fig(156 * TFLOPS, A100_DS),
             bf16=Fig(312 * TFLOPS, A100_DS), fp16=Fig(312 * TFLOPS, A100_DS),
             link="pcie-gen4", host_link="pcie-gen4", bridge="nvlink3-bridge",
             sms=Fig(108, A100_WP), matmul=sustained_mamf(256.4 * TFLOPS, "the A100 PCIe 80 GB's; same chip",
                                                             estimate=True)),
    GpuEntry(name="A100-PCIe-80GB", aliases=("A100-PCIe", "A100-80GB-PCIe"),
             nvml_names=("NVIDIA A100 80GB PCIe",), compute_capability=(8, 0),
             memory=Fig(80 * GIB, A100_DS), memory_bandwidth=Fig(1935 * GB, A100_DS),
             fp32=Fig(19.5 * TFLOPS, A100_DS), tf32=Fig(156 * TFLOPS, A100_DS),
             bf16=Fig(312 * TFLOPS, A100_DS), fp16=Fig(312 * TFLOPS, A100_DS),
             link="pcie-gen4", host_link="pcie-gen4", bridge="nvlink3-bridge",
             sms=Fig(108, A100_WP), matmul=sustained_mamf(256.4 * TFLOPS, "A100 PCIe, CUDA 12.1")),
    GpuEntry(name="H100-SXM5-80GB",
             aliases=("H100", "H100-SXM", "H100-SXM5", "H100-SXM-80GB", "H100-80GB"),
             nvml_names=("NVIDIA H100 80GB HBM3",), compute_capability=(9, 0),
             memory=Fig(80 * GIB, H100_DS), memory_bandwidth=Fig(3350 * GB, H100_DS),
             fp32=Fig(67 * TFLOPS, H100_DS), tf32=Fig(495 * TFLOPS, H100_DS),
             bf16=Fig(989 * TFLOPS, H100_DS), fp16=Fig(989 * TFLOPS, H100_DS),
             link="nvlink4-nvswitch", host_link="pcie-gen5",
             sms=Fig(132, H100_WP), matmul=sustained_mamf(792.1 * TFLOPS, "H100 SXM, CUDA 12.1"),
             memory_latency=Fig(390e-9, H100_LATENCY)),
    GpuEntry(name="H100-PCIe-80GB", aliases=("H100-PCIe",),
             nvml_names=("NVIDIA H100 PCIe",), compute_capability=(9, 0),
             memory=Fig(80 * GIB, H100_DS), memory_bandwidth=Fig(2000 * GB, H100_DS),
             fp32=Fig(51 * TFLOPS, H100_DS), tf32=Fig(378 * TFLOPS, H100_DS),
             bf16=Fig(756 * TFLOPS, H100_DS), fp16=Fig(756 * TFLOPS, H100_DS),
             link="pcie-gen5", host_link="pcie-gen5", bridge="nvlink4-bridge",
             sms=Fig(114, H100_WP)),
    GpuEntry(name="H200-SXM-141GB", aliases=("H200", "H200-SXM", "H200-141GB"),
             nvml_names=("NVIDIA H200",), compute_capability=(9, 0),
             memory=Fig(141 * GIB, H200_DS), memory_bandwidth=Fig(4800 * GB, H200_DS),
             fp32=Fig(67 * TFLOPS, H200_DS), tf32=Fig(495 * TFLOPS, H200_DS),
             bf16=Fig(989 * TFLOPS, H200_DS), fp16=Fig(989 * TFLOPS, H200_DS),
             link="nvlink4-nvswitch", host_link="pcie-gen5",
             sms=est(132, H200_SMS), matmul=Fig(704 * TFLOPS, H200_MATMUL),
             memory_latency=Fig(459e-9, H200_LATENCY)),
    GpuEntry(name="B200", aliases=("B200-SXM", "B200-180GB"),
             nvml_names=("NVIDIA B200",), compute_capability=(10, 0),
             memory=Fig(180 * GIB, B200_DS), memory_bandwidth=est(8000 * GB, B200_DS),
             fp32=est(75 * TFLOPS, B200_DS + "; 75-80 quoted, lower end taken"),
             tf32=Fig(1100 * TFLOPS, B200_DS), bf16=Fig(2250 * TFLOPS, B200_DS),
             fp16=Fig(2250 * TFLOPS, B200_DS),
             link="nvlink5-nvswitch", host_link="pcie-gen5-est"),
    GpuEntry(name="GB200", aliases=("GB200-NVL72",),
             nvml_names=("NVIDIA GB200",), compute_capability=(10, 0),
             memory=est(186 * GIB, GB200_DS), memory_bandwidth=Fig(8000 * GB, GB200_DS),
             fp32=est(90 * TFLOPS, GB200_DS), tf32=Fig(1250 * TFLOPS, GB200_DS),
             bf16=Fig(2500 * TFLOPS, GB200_DS), fp16=Fig(2500 * TFLOPS, GB200_DS),
             link="nvlink5-nvswitch", host_link="nvlink-c2c"),
    GpuEntry(name="L4", aliases=("L4-24GB",),
             nvml_names=("NVIDIA L4",), compute_capability=(8, 9),
             memory=Fig(24 * GIB, L4_DS), memory_bandwidth=Fig(300 * GB, L4_DS),
             fp32=Fig(30.3 * TFLOPS, L4_DS), tf32=Fig(60 * TFLOPS, L4_DS),
             bf16=Fig(121 * TFLOPS, L4_DS), fp16=Fig(121 * TFLOPS, L4_DS),
             link="pcie-gen4", host_link="pcie-gen4",
             sms=Fig(58, ADA_SMS + ": 7,424 CUDA cores")),
    GpuEntry(name="L40S", aliases=("L40S-48GB",),
             nvml_names=("NVIDIA L40S",), compute_capability=(8, 9),
             memory=Fig(48 * GIB, L40S_DS), memory_bandwidth=Fig(864 * GB, L40S_DS),
             fp32=Fig(91.6 * TFLOPS, L40S_DS), tf32=Fig(183 * TFLOPS, L40S_DS),
             bf16=Fig(362 * TFLOPS, L40S_DS), fp16=Fig(362 * TFLOPS, L40S_DS),
             link="pcie-gen4", host_link="pcie-gen4",
             sms=Fig(142, ADA_SMS + ": 18,176 CUDA cores")),
    GpuEntry(name="A10G", aliases=("A10G-24GB",),
             nvml_names=("NVIDIA A10G",), compute_capability=(8, 6),
             memory=Fig(24 * GIB, A10G_SRC), memory_bandwidth=est(600 * GB, A10G_SRC),
             fp32=est(31.2 * TFLOPS, A10G_SRC + "; 31-35 quoted"), tf32=est(35 * TFLOPS, A10G_SRC),
             bf16=est(70 * TFLOPS, A10G_SRC), fp16=est(70 * TFLOPS, A10G_SRC),
             link="pcie-gen4", host_link="pcie-gen4"),
    GpuEntry(name="RTX-4090", aliases=("4090", "RTX4090", "GeForce-RTX-4090"),
             nvml_names=("NVIDIA GeForce RTX 4090",), compute_capability=(8, 9),
             memory=Fig(24 * GIB, ADA_WP), memory_bandwidth=Fig(1008 * GB, ADA_WP),
             fp32=Fig(82.6 * TFLOPS, ADA_WP), tf32=Fig(82.6 * TFLOPS, ADA_WP),
             bf16=Fig(165.2 * TFLOPS, ADA_WP), fp16=Fig(165.2 * TFLOPS, ADA_WP),
             link="pcie-gen4", host_link="pcie-gen4",
             sms=Fig(128, ADA_WP + ": 16,384 CUDA cores in 128 SMs")),
    GpuEntry(name="RTX-3090", aliases=("3090", "RTX3090", "GeForce-RTX-3090"),
             nvml_names=("NVIDIA GeForce RTX 3090",), compute_capability=(8, 6),
             memory=Fig(24 * GIB, AMPERE_GA102_WP), memory_bandwidth=Fig(936 * GB, AMPERE_GA102_WP),
             fp32=Fig(35.6 * TFLOPS, AMPERE_GA102_WP), tf32=Fig(35.6 * TFLOPS, AMPERE_GA102_WP),
             bf16=Fig(71 * TFLOPS, AMPERE_GA102_WP), fp16=Fig(71 * TFLOPS, AMPERE_GA102_WP),
             link="pcie-gen4", host_link="pcie-gen4", bridge="nvlink3-bridge-geforce",
             sms=Fig(82, AMPERE_GA102_WP + ": 10,496 CUDA cores in 82 SMs")),
    GpuEntry(name="MI300X", vendor="amd", aliases=("MI300X-192GB",),
             nvml_names=(), compute_capability=None,
             memory=Fig(192 * GIB, MI300X_DS), memory_bandwidth=Fig(5300 * GB, MI300X_DS),
             fp32=Fig(163.4 * TFLOPS, MI300X_DS), tf32=est(654 * TFLOPS, MI300X_DS),
             bf16=Fig(1307 * TFLOPS, MI300X_DS), fp16=Fig(1307 * TFLOPS, MI300X_DS),
             link="infinity-fabric", host_link="pcie-gen5",
             sms=Fig(304, MI300X_DS + ": 304 compute units"), matmul=sustained_mamf(781.9 * TFLOPS, "MI300X, ROCm 6.2")),
)


class LinkEntry(NamedTuple):
    """An intra-node link: bytes/s per device per direction, seconds, fraction, shape."""

    bandwidth: Fig
    latency: Fig
    efficiency: Fig
    topology: str  # "switch" (all-to-all), "pairs", "mesh", "cube-mesh", "tree", "loopback"
    largest_domain: Fig | None = None  # the most devices one such link has joined (built or announced); None: no limit known


NVLINK_PER_LINK = {  # bytes/s per link per direction, by NVLink generation
    1: Fig(20 * GB, NVLINK_SRC), 2: Fig(25 * GB, NVLINK_SRC), 3: Fig(25 * GB, NVLINK_SRC),
    4: Fig(25 * GB, NVLINK_SRC), 5: Fig(50 * GB, NVLINK_SRC),
}
PCIE_PER_LANE = {  # bytes/s per lane per direction, by PCIe generation
    1: Fig(0.25 * GB, PCIE_SRC), 2: Fig(0.5 * GB, PCIE_SRC), 3: Fig(0.985 * GB, PCIE_SRC),
    4: Fig(1.969 * GB, PCIE_SRC), 5: Fig(3.938 * GB, PCIE_SRC),
}
NVLINK_EFFICIENCY = est(0.75, NCCL_TESTS + "; 75-80 % of raw; NCCL assumes 20 of 25 GB/s per link")
PCIE_EFFICIENCY = est(0.8, "rule of thumb: TLP/DLLP overhead and P2P through the root complex")
NVLINK_LATENCY = est(3e-6, LATENCY_RULE)
PCIE_LATENCY = est(5e-6, LATENCY_RULE)


def _nvlink(gen: int, links: int, topology: str, largest_domain: Fig) -> LinkEntry:
    bw = NVLINK_PER_LINK[gen]
    return LinkEntry(Fig(links * bw.value, f"{links} links x {bw.value / GB:g} GB/s; {bw.source}"),
                     NVLINK_LATENCY, NVLINK_EFFICIENCY, topology, largest_domain)


def _pcie(gen: int, lanes: int = 16) -> LinkEntry:
    lane = PCIE_PER_LANE[gen]
    return LinkEntry(Fig(lanes * lane.value, f"x{lanes}; {lane.source}"),
                     PCIE_LATENCY, PCIE_EFFICIENCY, "tree")


LINKS: dict[str, LinkEntry] = {
    "nvlink2-cube-mesh": _nvlink(2, 6, "cube-mesh",  # DGX-1: not every pair is direct
                                 Fig(16, "NVIDIA DGX-2: 16 V100s on NVSwitch (DGX-1's cube mesh: 8)")),
    "nvlink3-nvswitch": _nvlink(3, 12, "switch", Fig(16, "NVIDIA HGX A100: 4-, 8- and 16-GPU boards")),
    "nvlink4-nvswitch": _nvlink(4, 18, "switch",
                                Fig(256, "NVIDIA H100 whitepaper: the NVLink Switch System joins up to 256 GPUs")),
    "nvlink5-nvswitch": _nvlink(5, 18, "switch",
                                Fig(576, "NVIDIA Blackwell platform: NVLink domains of up to 576 GPUs "
                                         "(GB200 NVL72 built with 72)")),
    "nvlink3-bridge": LinkEntry(est(300 * GB, A100_DS + ": bridge 600 GB/s bidirectional, pairs"),
                                NVLINK_LATENCY, NVLINK_EFFICIENCY, "pairs"),
    "nvlink4-bridge": LinkEntry(Fig(300 * GB, H100_DS + ": bridge 600 GB/s bidirectional, pairs"),
                                NVLINK_LATENCY, NVLINK_EFFICIENCY, "pairs"),
    "nvlink3-bridge-geforce": LinkEntry(
        est(56.25 * GB, AMPERE_GA102_WP + ": bridge 112.5 GB/s bidirectional, pairs"),
        NVLINK_LATENCY, NVLINK_EFFICIENCY, "pairs"),
    "infinity-fabric": LinkEntry(est(448 * GB, MI300X_DS + ": 896 GB/s bidirectional, 7 peers"),
                                 NVLINK_LATENCY, est(0.75, "assumed like NVLink"), "mesh",
                                 Fig(8, MI300X_DS + ": 8 GPUs, each linked to its 7 peers")),
    "nvlink-c2c": LinkEntry(est(225 * GB, "NVLink-C2C 900 GB/s bidirectional per Grace, "
                                          "shared by two GPUs in GB200"),
                            NVLINK_LATENCY, NVLINK_EFFICIENCY, "tree"),
    "pcie-gen3": _pcie(3), "pcie-gen4": _pcie(4), "pcie-gen5": _pcie(5),
    "pcie-gen5-est": LinkEntry(est(16 * PCIE_PER_LANE[5].value, "Gen5/6 quoted; Gen5 x16 assumed"),
                               PCIE_LATENCY, PCIE_EFFICIENCY, "tree"),
    "pcie-gen4-est": LinkEntry(est(16 * PCIE_PER_LANE[4].value, "host interface not in the chip's Cloud TPU "
                                                                "page; Gen4 x16 assumed"),
                               PCIE_LATENCY, PCIE_EFFICIENCY, "tree"),
    "loopback": LinkEntry(est(5 * GB, "gloo over shared memory / TCP loopback, rough"),
                          est(30e-6, LATENCY_RULE), est(1.0, "folded into the bandwidth"),
                          "loopback"),
}


class NetworkEntry(NamedTuple):
    """Inter-node network: bytes/s per NIC per direction; NICs per node fixed, or None (per GPU)."""

    kind: str  # "infiniband", "roce", "ethernet", "efa"
    bandwidth: Fig
    latency: Fig
    efficiency: Fig
    nics_per_node: int | None = None


def _ib(gbit: int) -> NetworkEntry:
    return NetworkEntry("infiniband", Fig(gbit * GBIT, IBTA), est(5e-6, LATENCY_RULE),
                        est(0.92, IB_EFF))


def _roce(gbit: int) -> NetworkEntry:
    return NetworkEntry("roce", Fig(gbit * GBIT, f"{gbit} GbE line rate"),
                        est(8e-6, LATENCY_RULE), est(0.9, "assumed a little under InfiniBand"))


def _eth(gbit: int) -> NetworkEntry:
    return NetworkEntry("ethernet", Fig(gbit * GBIT, f"{gbit} GbE line rate"),
                        est(30e-6, LATENCY_RULE), est(0.7, "TCP sockets (NCCL/gloo), rough"))


def _efa(nics: int | None) -> NetworkEntry:
    return NetworkEntry("efa", Fig(100 * GBIT, EFA_SRC), est(15e-6, LATENCY_RULE),
                        est(0.8, "assumed; EFA SRD below InfiniBand"), nics)


NETWORKS: dict[str, NetworkEntry] = {
    "ib-edr": _ib(100), "ib-hdr": _ib(200), "ib-ndr": _ib(400), "ib-xdr": _ib(800),
    "roce-100": _roce(100), "roce-200": _roce(200), "roce-400": _roce(400),
    "eth-10": _eth(10), "eth-25": _eth(25), "eth-50": _eth(50), "eth-100": _eth(100),
    "eth-200": _eth(200), "eth-400": _eth(400),
    "efa": _efa(None), "efa-p4d": _efa(4), "efa-p5": _efa(32),
}
IB_RATES = {100: "ib-edr", 200: "ib-hdr", 400: "ib-ndr", 800: "ib-xdr"}  # Gb/s -> name

# The host as a device (gloo). A core's dense fp32 peak is its FMA units × their fp32 lanes × 2
# FLOPs a cycle, at its clock; the class is read from /proc/cpuinfo (hardware/cpu_cores.py).
INTEL_OPT = "Intel 64 and IA-32 Architectures Optimization Reference Manual"
AMD_OPT = "AMD Software Optimization Guide for {}"
CPU_CORES: dict[str, Fig] = {  # fp32 FLOPs a cycle a core
    "avx512": Fig(64, f"two 512-bit FMA units: Xeon Scalable Gold/Platinum ({INTEL_OPT}; Silver and "
                      "Bronze parts have one), AMD Zen 5's full-width pipes"),
    "avx512-256": Fig(32, AMD_OPT.format("the Zen4 Microarchitecture: 512-bit operations run as two "
                                         "halves on two 256-bit FMA pipes")),
    "avx2": Fig(32, f"two 256-bit FMA units: Intel since Haswell ({INTEL_OPT}), AMD since Zen 2 "
                    f"({AMD_OPT.format('Family 17h Models 30h and Greater')})"),
    "avx2-128": Fig(16, AMD_OPT.format("Family 17h Processors (Zen, Zen+): two 128-bit FMA pipes")),
    "avx": Fig(16, f"a 256-bit add and a 256-bit multiply unit, no FMA: Sandy and Ivy Bridge ({INTEL_OPT})"),
    "sse": est(8, "a 128-bit add and a 128-bit multiply unit"),
    "neon": est(16, "two 128-bit FMA pipes (Arm Neoverse N1 and N2 Software Optimization Guides); "
                    "Neoverse V1 and V2 have four"),
}
# Half-precision units: cpuinfo flag -> (dtype, its rate over the fp32 FMA's). A core without one
# runs bf16 at the fp32 rate (oneDNN widens bf16 to fp32 for the FMA) and fp16 as below.
CPU_HALF_UNITS: dict[str, tuple[str, Fig]] = {
    "avx512_bf16": ("bf16", Fig(2, "VDPBF16PS: two bf16 products into each fp32 lane (Intel's ISA reference)")),
    "avx512_fp16": ("fp16", Fig(2, "AVX512-FP16: 32 fp16 lanes a 512-bit FMA (Intel's ISA reference)")),
    "amx_bf16": ("bf16", est(2, "AMX tiles' rate in torch's GEMMs not measured: counted as AVX512-BF16")),
    "amx_fp16": ("fp16", est(2, "AMX tiles' rate in torch's GEMMs not measured: counted as AVX512-FP16")),
}
CPU_FP16_UNVECTORIZED = est(2, "FLOPs a cycle of a rank's fp16 Linears on cores without AVX512-FP16 or "
                               "AMX-FP16: torch's reference GEMMs, the gradients' on one thread; on an AMD "
                               "EPYC Zen 4 the forward 14.3-14.6 on two threads, the input and weight "
                               "gradients 1.0-1.1 and 2.6, 5.3-5.7 GFLOP/s together at 2.6 GHz; its "
                               "convolutions 0.3 GFLOP/s a core (bench/cpu_rates.py)")
# Where the class or clock cannot be read: a core of two AVX2 FMA units at ~3 GHz, about half reached.
CPU_FLOPS_PER_CORE = est(50e9, "x86 core with 2 AVX2 FMA units at ~3 GHz: 96 GFLOP/s peak, about half reached")
# A rank's DRAM bandwidth: its cores' streams, up to its share of its sockets' channels.
CPU_CORE_STREAM = est(16 * GB, "one core's stream: its L2's ~32 misses in flight × 64 B over ~130 ns "
                               "(Little's law); bench/cpu_rates.py measures it (a Zen 4 core: 21-27 GB/s)")
CPU_SOCKET_BANDWIDTH = est(205 * GB, "8 channels of DDR4-3200 at 25.6 GB/s; DDR5 sockets have more")


# Google Cloud TPUs. One chip is one rank; the chips of a slice talk over ICI (a torus), so a slice
# is one stratagem node. ICI figures are per chip, all ports together, per direction: the pages
# give the bidirectional total, halved here (v5e's older page: 1,600 Gbps = 200 GB/s one way).
TPU_DOCS = "Google Cloud TPU documentation, cloud.google.com/tpu/docs/{page} (read 2026-11-26)"
V4_DOC = TPU_DOCS.format(page="v4")
V5E_DOC = TPU_DOCS.format(page="v5e")
V5P_DOC = TPU_DOCS.format(page="v5p")
V6E_DOC = TPU_DOCS.format(page="v6e")
TPU_FP32 = ("no fp32 peak published; torch_xla's 'highest' matmul precision takes 6 bf16 passes "
            "(torch_xla.backends.set_mat_mul_precision; its 'default' takes 1, at the bf16 rate)")
ICI_EFFICIENCY = est(0.75, "assumed like NVLink; not measured on TPUs")
ICI_LATENCY = est(3e-6, LATENCY_RULE)


@dataclass(frozen=True, slots=True, kw_only=True)
class TpuEntry:
    """One Cloud TPU chip as catalogued: figures per chip, its ICI and the largest slice."""

    name: str
    aliases: tuple[str, ...]
    memory: Fig  # bytes of HBM
    memory_bandwidth: Fig  # bytes/s
    bf16: Fig  # FLOP/s, dense
    fp32: Fig  # FLOP/s of fp32 matmuls at full precision
    ici: Fig  # bytes/s per chip per direction over all its ICI ports
    topology: str  # "2d-torus" or "3d-torus"
    max_slice: Fig  # chips in the largest slice (one ICI domain)
    host_link: str  # chip <-> host: a key of LINKS
    vendor: str = "google"


def _tpu_fp32(bf16: float) -> Fig:
    return est(bf16 / 6, TPU_FP32)


TPUS: tuple[TpuEntry, ...] = (
    TpuEntry(name="TPU-v4", aliases=("v4", "TPUv4"),
             memory=Fig(32 * GIB, V4_DOC + ": HBM2 32 GiB"),
             memory_bandwidth=Fig(1200 * GB, V4_DOC + ": HBM2 1200 GBps"),
             bf16=Fig(275 * TFLOPS, V4_DOC + ": 275 teraflops (bf16 or int8)"), fp32=_tpu_fp32(275 * TFLOPS),
             ici=est(1.1e15 / 4096, V4_DOC + ": no per-chip ICI figure; all-reduce bandwidth per Pod 1.1 PB/s "
                     "over 4096 chips (on the v5e and v6e pages that ratio is the one-way ICI per chip)"),
             topology="3d-torus", max_slice=Fig(4096, V4_DOC + ": TPU Pod size 4096 chips, 3D mesh/torus"),
             host_link="pcie-gen4-est"),
    TpuEntry(name="TPU-v5e", aliases=("v5e", "TPUv5e", "v5litepod", "TPU-v5-lite"),
             memory=Fig(16 * GIB, V5E_DOC + ": HBM2 16 GB"),
             memory_bandwidth=Fig(819 * GB, V5E_DOC + ": HBM2 819 GBps"),
             bf16=Fig(197 * TFLOPS, V5E_DOC + ": 197 TFLOPs bf16"), fp32=_tpu_fp32(197 * TFLOPS),
             ici=Fig(200 * GB, V5E_DOC + ": bidirectional ICI 400 GBps per chip, 4 ports"),
             topology="2d-torus", max_slice=Fig(256, V5E_DOC + ": TPU Pod size 256 chips, 2D torus"),
             host_link="pcie-gen4-est"),
    TpuEntry(name="TPU-v5p", aliases=("v5p", "TPUv5p"),
             memory=Fig(95 * GIB, V5P_DOC + ": HBM 95 GiB per chip"),
             memory_bandwidth=Fig(2765 * GB, V5P_DOC + ": HBM 2765 GBps per chip"),
             bf16=Fig(459 * TFLOPS, V5P_DOC + ": 459 TFLOPs bf16"), fp32=_tpu_fp32(459 * TFLOPS),
             ici=Fig(600 * GB, V5P_DOC + ": bidirectional ICI 1200 GBps per chip (4800 Gbps one way)"),
             topology="3d-torus",
             max_slice=Fig(6144, V5P_DOC + ": 8960 chips per Pod, largest job 6144 chips, 3D torus"),
             host_link="pcie-gen4-est"),
    TpuEntry(name="TPU-v6e", aliases=("v6e", "TPUv6e", "Trillium", "TPU-Trillium"),
             memory=Fig(32 * GIB, V6E_DOC + ": HBM 32 GB per chip"),
             memory_bandwidth=Fig(1638 * GB, V6E_DOC + ": HBM 1638 GBps per chip"),
             bf16=Fig(918 * TFLOPS, V6E_DOC + ": 918 TFLOPs bf16"), fp32=_tpu_fp32(918 * TFLOPS),
             ici=Fig(400 * GB, V6E_DOC + ": bidirectional ICI 800 GBps per chip, 4 ports"),
             topology="2d-torus", max_slice=Fig(256, V6E_DOC + ": TPU Pod size 256 chips, 2D torus"),
             host_link="pcie-gen5"),  # the v6e page: "connects to the host through a PCIe Gen5 interface"
)
