"""This host's cores as the catalog prices an uncalibrated CPU rank, against what they run: the
core class, half-precision units and nominal clock read from /proc/cpuinfo, each dtype's peak
(``lookup.core_peaks``) beside the rate of a square Linear's three GEMMs (together, and each in
FLOPs a cycle) and of a 3×3 convolution in that dtype, and a rank's DRAM bandwidth beside
``calibrate``'s copy, on one thread and on all of them.

    .venv/bin/python bench/cpu_rates.py

A ratio above 1 is a core running above its nominal clock (boost); far below 1, a dtype without a
vectorized kernel here. fp16 on cores without fp16 units runs torch's reference GEMMs on one
thread, so its Linear rate is one thread's, as the catalog prices a rank (docs/hardware.md,
"CPU ranks").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from timing import median_seconds

from stratagem.advisor.calibrate.benchmarks import memory_bandwidth
from stratagem.advisor.hardware.host import probe_host
from stratagem.advisor.hardware.lookup import core_peaks, cpu_device

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MATMUL_SIDE = {"fp32": 2048, "bf16": 2048, "fp16": 512}  # fp16 smaller: unvectorized it takes seconds
CONV = {"fp32": (8, 256), "bf16": (8, 256), "fp16": (1, 64)}  # images, channels of a 3×3 convolution at 64×64
COPY_BYTES = 256 * 2**20


def linear_rates(dtype: torch.dtype, side: int) -> list[float]:
    """FLOP/s of a square Linear's three GEMMs: forward ``x @ Wᵀ``, input gradient ``dY @ W`` and
    weight gradient ``dYᵀ @ x``, whose layouts take different kernels where none is vectorized."""
    x, w = torch.randn(side, side, dtype=dtype), torch.randn(side, side, dtype=dtype)
    return [2 * side**3 / median_seconds(product, repeats=3)
            for product in (lambda: x @ w.t(), lambda: x @ w, lambda: x.t() @ w)]


def conv_rate(dtype: torch.dtype, images: int, channels: int, side: int = 64) -> float:
    x = torch.randn(images, channels, side, side, dtype=dtype)
    w = torch.randn(channels, channels, 3, 3, dtype=dtype)
    flops = 2 * images * channels * channels * 9 * side * side
    return flops / median_seconds(lambda: F.conv2d(x, w, padding=1), repeats=3)


def main() -> None:
    host = probe_host()
    threads = torch.get_num_threads()
    clock = f"{host.clock_hz / 1e9:.2f} GHz" if host.clock_hz else "clock unknown"
    print(f"{host.cpu_name}: class {host.core_isa or 'unknown'}, half-precision units "
          f"{', '.join(host.isa_extensions) or 'none'}, {clock}; {host.num_cores} cores, "
          f"{host.num_sockets} socket(s), torch on {threads} threads")
    peaks = core_peaks(host)
    print(f"{'dtype':<6}{'peak/core':>12}{'Linear/core':>13}{'ratio':>7}{'conv/core':>11}{'ratio':>7}  (GFLOP/s)"
          "   the Linear's forward, input and weight gradients (FLOPs a cycle a core)")
    for name, dtype in DTYPES.items():
        # torch's fp16 GEMMs without vector units run on one thread (the catalog prices a rank so)
        cores = 1 if peaks[name] < peaks["fp32"] else threads
        forms = [rate / cores for rate in linear_rates(dtype, MATMUL_SIDE[name])]
        linear = len(forms) / sum(1 / rate for rate in forms)  # the three GEMMs' FLOPs over their time
        conv = conv_rate(dtype, *CONV[name]) / threads
        cycles = "  ".join(f"{rate / host.clock_hz:.2f}" for rate in forms) if host.clock_hz else "-"
        print(f"{name:<6}{peaks[name] / 1e9:>12.1f}{linear / 1e9:>13.1f}{linear / peaks[name]:>7.2f}"
              f"{conv / 1e9:>11.1f}{conv / peaks[name]:>7.2f}   {cycles}")
    for used in sorted({1, threads}):
        torch.set_num_threads(used)
        predicted = cpu_device(host, num_ranks=host.num_cores // used).memory_bandwidth
        measured = memory_bandwidth(COPY_BYTES, torch.device("cpu"), repeats=5)  # calibrate's copy
        print(f"copy on {used} thread(s): {measured / 1e9:.1f} GB/s against a rank of {used} core(s) priced at "
              f"{predicted / 1e9:.1f} GB/s ({measured / predicted:.2f})")
    torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
