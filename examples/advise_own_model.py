"""Advise on your own model: any nn.Module, profiled on fake tensors, planned for a cluster.

    .venv/bin/python examples/advise_own_model.py [CLUSTER]

The same model from the command line (the factory is called under FakeTensorMode):

    PYTHONPATH=examples .venv/bin/advise --model advise_own_model:build --cluster 8xA100
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode


class UNetish(nn.Module):
    """A convolutional encoder with a stack of residual blocks: no attention, no tokens."""

    def __init__(self, channels: int = 256, depth: int = 24, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, kernel_size=4, stride=4)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.GroupNorm(32, channels), nn.Conv2d(channels, channels, 3, padding=1), nn.GELU())
            for _ in range(depth)
        )
        self.head = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean(dim=(2, 3)))


def build(batch_size: int = 8):
    """A factory as ``advise --model module:build`` expects: (module, example inputs, loss).

    It declares ``batch_size``, so it is told the batch to build (the inputs may lay it out as
    they like); one that does not is profiled at what its first input holds in dimension 0. Its
    loss closes over the batch's labels, so no pipeline plan is offered for it: a pipeline would
    apply the loss to each micro-batch's output."""
    model = UNetish()
    images = torch.randn(batch_size, 3, 256, 256)
    labels = torch.randint(0, 1000, (batch_size,))
    return model, (images,), lambda logits: nn.functional.cross_entropy(logits.float(), labels)


def main(cluster_spec: str = "8xA100") -> None:
    from rich.console import Console

    from stratagem.advisor.hardware import parse_cluster
    from stratagem.plan import Workload
    from stratagem.advisor.profile.profiler import profile_model
    from stratagem.advisor.report.render import render_table
    from stratagem.advisor.search.advice import advise

    # Fake tensors allocate nothing; the profile reuses this mode, so the loss's labels fit in.
    with FakeTensorMode():
        model, inputs, loss = build(batch_size=1)
    profile = profile_model(model, inputs, loss_fn=loss, precision="bf16-mixed", name="UNetish")
    cluster = parse_cluster(cluster_spec)
    advice = advise(profile, cluster, Workload(global_batch_size=8 * cluster.world_size))
    Console().print(render_table(advice))


if __name__ == "__main__":
    main(*sys.argv[1:2])
