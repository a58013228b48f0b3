"""How fast a GPU moves the bytes of a training step's operators without FLOPs, by kind: a copy,
a sum over the tokens (a bias's gradient), a sum over the width (a norm's statistics), LayerNorm
and RMSNorm forward and backward with their weights' gradients, GELU forward and backward. Each
at transformer sizes (16,384 tokens of widths 768 to 4,096, bf16 and fp32), as GB/s of the bytes
the operator must read and write at least, beside the copy's rate. On a GPU each operator's time is
its kernels' (the profiler's device time), without the host's launch and synchronisation, which
a call timed from the host carries too: the rates of 2026-11-27 (docs/benchmarks.md) were timed
so, and the copy's own rose from 1.7 to 2.6 TB/s between 25 and 134 MB, as a fixed cost per call
would make it.

The lead this follows (docs/benchmarks.md, "GPU figures"): Llama 2 7B's operators without FLOPs
ran at the copy's rate on an H200, GPT-2's and ViT's, which have biases and LayerNorm, at about
55 % of it; their gradients are sums over every token.

Then, by size: a copy and a sum over the tokens at one width and 1,024 to 65,536 tokens, each
kernel's time against its bytes fitted as ``time = fixed + bytes / rate`` (least squares). A
fixed time per kernel (its ramp-up and tail) and a rate below the copy's are the two mechanisms a
compiled step's memory-bound kernels could be slow by (docs/benchmarks.md, "GPU figures": they
took 1.7-1.9 times the bytes at a copy's rate); the fit tells them apart.

    python bench/reduction_rate.py            # on a GPU; on CPU at 1,024 tokens, to check the script
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from timing import kernel_seconds

WIDTHS = (768, 1024, 3072, 4096)
SWEEP_WIDTH = 1280  # GPT-2 large's
SWEEP_TOKENS = (1024, 4096, 16384, 65536)


def cases(x: torch.Tensor) -> dict[str, tuple[Callable[[], object], int]]:
    """Each operator on ``x`` ([tokens, width]) and the tensors of ``x``'s size it must move."""
    width = x.shape[-1]
    weight = torch.ones(width, device=x.device, dtype=x.dtype, requires_grad=True)
    bias = torch.zeros(width, device=x.device, dtype=x.dtype, requires_grad=True)
    leaf = x.detach().requires_grad_(True)
    grad = torch.randn_like(x)

    # torch.autograd.grad, not backward: nothing accumulates into .grad between calls
    def layer_norm() -> None:
        torch.autograd.grad(F.layer_norm(leaf, (width,), weight, bias), (leaf, weight, bias), grad)

    def rms_norm() -> None:
        torch.autograd.grad(F.rms_norm(leaf, (width,), weight), (leaf, weight), grad)

    def gelu() -> None:
        torch.autograd.grad(F.gelu(leaf, approximate="tanh"), leaf, grad)

    return {
        "copy": (lambda: x.clone(), 2),
        "sum over tokens": (lambda: x.sum(0), 1),
        "sum over width": (lambda: x.sum(-1), 1),
        "layer norm fwd+bwd": (layer_norm, 5),  # x and y; x, dy and dx (the statistics are small)
        "rms norm fwd+bwd": (rms_norm, 5),
        "gelu fwd+bwd": (gelu, 5),  # x and y; x, dy and dx
    }


def main() -> None:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    tokens = 16384 if device.type == "cuda" else 1024
    for dtype in (torch.bfloat16, torch.float32):
        for width in WIDTHS:
            x = torch.randn(tokens, width, device=device, dtype=dtype)
            size = x.numel() * x.element_size()
            rates = {name: passes * size / kernel_seconds(fn) / 1e9 for name, (fn, passes) in cases(x).items()}
            copy = rates["copy"]
            print(f"{tokens} × {width} {str(dtype)[6:]}: " + ", ".join(
                f"{name} {rate:.0f} GB/s ({rate / copy:.0%})" for name, rate in rates.items()), flush=True)
    sweep(device, SWEEP_TOKENS if device.type == "cuda" else SWEEP_TOKENS[:2])


def sweep(device: torch.device, token_counts: tuple[int, ...]) -> None:
    """A copy's and a sum over the tokens' kernel time by size, bf16, and the fit of each."""
    for name in ("copy", "sum over tokens"):
        points = []
        for tokens in token_counts:
            x = torch.randn(tokens, SWEEP_WIDTH, device=device, dtype=torch.bfloat16)
            fn, passes = cases(x)[name]
            points.append((passes * x.numel() * x.element_size(), kernel_seconds(fn)))
        fixed, rate = _fit(points)
        print(f"{name}, {SWEEP_WIDTH} wide, bf16: " + ", ".join(
            f"{moved / 2**20:.0f} MiB {seconds * 1e6:.1f} µs" for moved, seconds in points)
            + f"; fit {fixed * 1e6:.1f} µs + bytes at {rate / 1e9:.0f} GB/s", flush=True)


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(fixed seconds, bytes per second) of ``seconds = fixed + bytes / rate`` through ``points``."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return mean_y - slope * mean_x, 1 / slope


if __name__ == "__main__":
    main()
