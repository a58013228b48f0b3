"""The convolution benchmark ``stratagem calibrate`` runs on every rank: a few of ResNet-50's
convolutions, forward and backward, each one's rate beside its arithmetic intensity
(:func:`conv_rates`). The cost model reads a convolution's rate off them by its own intensity
(:mod:`~stratagem.advisor.cost.rates`, ``_conv_rate``) in place of its implicit GEMMs' modelled
one (docs/cost-model.md, "Calibration").

On GPUs they run channels-last, the layout cuDNN's tensor-core kernels read, so that the time is
the convolutions' own: the cost model prices an NCHW model's layout transforms apart, by the
bytes they move. On CPU ranks they run in torch's default layout, as the presets do, whose cost
the model has no other term for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from stratagem.advisor.calibrate.benchmarks import BUDGET_SECONDS, TORCH_DTYPES, interleaved, sustained
from stratagem.advisor.cost.convolutions import arithmetic_intensity
from stratagem.advisor.profile.model_profile import ConvLayer

__all__ = ["CONV_SHAPES", "QUICK_CONV_SHAPES", "conv_rates"]

CONV_SHAPES = ((256, 64, 1, 56), (64, 64, 3, 56), (128, 128, 3, 28), (256, 256, 3, 14), (512, 512, 3, 7))
"""(input channels, output channels, window side, resolution) of the convolutions timed: the 3×3
of each of ResNet-50's stages (288 to 1947 FLOPs per byte at 256 images in 16 bits) and its
thinnest 1×1, the first of the first stage's later blocks (51 per byte), which memory binds."""

QUICK_CONV_SHAPES = CONV_SHAPES[:1] + CONV_SHAPES[-1:]
"""The shapes ``calibrate --quick`` times: the least and the most intense."""


def conv_rates(dtypes: Sequence[str], device: torch.device, *, batch: int, repeats: int,
               shapes: Sequence[tuple[int, int, int, int]] = CONV_SHAPES) -> dict[str, list[tuple[float, float]]]:
    """Per dtype, ``(FLOPs per byte, FLOP/s)`` of each of ``shapes`` on ``batch`` images: a
    convolution's forward, input gradient and weight gradient (three times its forward's FLOPs),
    repeated for about :data:`~stratagem.advisor.calibrate.benchmarks.SUSTAINED_SECONDS` per timed
    run and timed :func:`~stratagem.advisor.calibrate.benchmarks.interleaved`; its intensity as the
    cost model computes it (:func:`~stratagem.advisor.cost.convolutions.arithmetic_intensity`),
    sorted by it. A shape whose single run would take over
    :data:`~stratagem.advisor.calibrate.benchmarks.BUDGET_SECONDS` (the slowest rank's) is skipped."""
    runs: list[Callable[[], object]] = []
    points: list[tuple[str, float, float]] = []  # (dtype, intensity, FLOPs per run)
    for dtype in dtypes:
        for shape in shapes:
            step, conv = _conv_step(shape, batch, dtype, device)
            run, count, single = sustained(step, device)
            if single > BUDGET_SECONDS:
                continue  # the same on every rank: ``single`` is the slowest rank's
            runs.append(run)
            flops = 3 * 2 * conv.rows * conv.out_channels * conv.in_channels * conv.window * count
            points.append((dtype, arithmetic_intensity(conv, 1.0, TORCH_DTYPES[dtype].itemsize), flops))
    seconds = interleaved(runs, device, repeats=repeats) if runs else []
    rates: dict[str, list[tuple[float, float]]] = {}
    for (dtype, intensity, flops), took in zip(points, seconds):
        rates.setdefault(dtype, []).append((intensity, flops / took))
    return {dtype: sorted(measured) for dtype, measured in rates.items()}


def _conv_step(shape: tuple[int, int, int, int], batch: int, dtype: str,
               device: torch.device) -> tuple[Callable[[], object], ConvLayer]:
    """One forward and backward of the convolution ``shape`` (stride 1, padded to keep the
    resolution) on ``batch`` images in ``dtype``, channels-last on GPUs; and its :class:`ConvLayer`."""
    in_channels, out_channels, side, resolution = shape
    layout = torch.channels_last if device.type == "cuda" else torch.contiguous_format
    kind = dict(device=device, dtype=TORCH_DTYPES[dtype])
    images = torch.randn(batch, in_channels, resolution, resolution, **kind).to(memory_format=layout)
    weight = torch.randn(out_channels, in_channels, side, side, **kind).to(memory_format=layout)
    images.requires_grad_(True)
    weight.requires_grad_(True)
    grad = torch.randn(batch, out_channels, resolution, resolution, **kind).to(memory_format=layout)

    def step() -> None:
        out = F.conv2d(images, weight, padding=side // 2)
        torch.autograd.grad(out, (images, weight), grad)

    positions = batch * resolution * resolution
    conv = ConvLayer(name="benchmark", in_channels=in_channels, out_channels=out_channels, kernel=(side, side),
                     stride=(1, 1), rows=positions, input_rows=positions, channels_last=device.type == "cuda")
    return step, conv
