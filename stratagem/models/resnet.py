"""ResNet with bottleneck blocks (He et al., 2016; stride on the 3×3 conv, "v1.5", as torchvision)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

__all__ = ["Bottleneck", "ResNet"]

EXPANSION = 4
"""A bottleneck's output has ``EXPANSION`` times the channels of its inner 3×3 conv."""


class Bottleneck(nn.Module):
    """1×1 reduce → 3×3 (carries the stride) → 1×1 expand, each with BatchNorm, plus a shortcut."""

    def __init__(self, in_channels: int, width: int, *, stride: int) -> None:
        super().__init__()
        out_channels = width * EXPANSION
        self.conv1 = nn.Conv2d(in_channels, width, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: Tensor) -> Tensor:
        """``x`` ``[b, in_channels, H, W]`` → ``[b, 4·width, H/stride, W/stride]``."""
        h = self.bn1(self.conv1(x)).relu()
        h = self.bn2(self.conv2(h)).relu()
        h = self.bn3(self.conv3(h))
        shortcut = x if self.downsample is None else self.downsample(x)
        return (h + shortcut).relu()


class ResNet(nn.Module):
    """Image classifier: ``images [b, channels, H, W]`` → ``logits [b, num_classes]``.

    ``stem`` (7×7 conv, stride 2, and 3×3 max-pool) → ``layers``: every bottleneck of every
    stage in order, in one ``ModuleList`` → global average pool → ``fc``. Stage ``i`` has
    ``blocks_per_stage[i]`` bottlenecks of inner width ``width·2^i``; stages after the first
    halve the resolution in their first block. ResNet-50 is ``(3, 4, 6, 3)``, ResNet-101
    ``(3, 4, 23, 3)``. Built on the ambient default device and dtype; call
    :meth:`init_weights` after ``to_empty``.
    """

    def __init__(
        self, blocks_per_stage: Sequence[int], *, width: int = 64, num_classes: int = 1000, in_channels: int = 3
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, kernel_size=7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
        )
        self.layers = nn.ModuleList(_bottlenecks(blocks_per_stage, width=width))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width * 2 ** (len(blocks_per_stage) - 1) * EXPANSION, num_classes)
        if not next(self.parameters()).is_meta:  # meta tensors hold no values to initialise
            self.init_weights()

    def init_weights(self) -> None:
        """(Re)initialise in place: He-normal convs (fan-out), unit BatchNorm with fresh running
        statistics, and PyTorch's default for ``fc`` — torchvision's choices."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, (nn.BatchNorm2d, nn.Linear)):
                module.reset_parameters()

    def forward(self, images: Tensor) -> Tensor:
        """``images`` ``[b, channels, H, W]`` → logits ``[b, num_classes]``."""
        h = self.stem(images)
        for layer in self.layers:
            h = layer(h)
        return self.fc(self.pool(h).flatten(1))


def _bottlenecks(blocks_per_stage: Sequence[int], *, width: int) -> list[Bottleneck]:
    blocks, in_channels = [], width
    for stage, count in enumerate(blocks_per_stage):
        stage_width = width * 2**stage
        for i in range(count):
            stride = 2 if stage > 0 and i == 0 else 1
            blocks.append(Bottleneck(in_channels, stage_width, stride=stride))
            in_channels = stage_width * EXPANSION
    return blocks
