"""``torch.compile`` per block, in place: each block's forward (and, through AOTAutograd, its
backward) becomes one compiled graph whose element-wise operators fuse into few kernels.

Per block rather than the whole model, as torchtitan does: every identical block reuses one
compiled graph, compilation stays short, and the hooks FSDP and pipelining put between blocks
stay outside the compiled regions. ``nn.Module.compile`` keeps the module tree, so parameter
names (and checkpoints) are unchanged.

Blocks that share a forward's code but not its input shapes (a ResNet's stages) or the constants
it reads (a Hugging Face layer's ``layer_idx``) each need a graph of their own. Dynamo allows eight
per code object (``torch._dynamo.config.recompile_limit``) and, after a shape has changed once,
recompiles with that dimension symbolic: a ResNet-101 compiled so ran its later blocks eager or on
dynamic-shape kernels, 75 ms a step where its blocks compiled static run in (docs/benchmarks.md,
"GPU figures"). So each block compiles for static shapes, and the limit is raised to the blocks
compiled: one graph per distinct block at most.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from stratagem.plan import Plan
from stratagem.plugins.blocks import find_blocks

__all__ = ["apply_compile"]

log = logging.getLogger(__name__)


def apply_compile(module: nn.Module, plan: Plan) -> None:
    """Compile each block of ``module`` (the children of ``plan.block_container``) in place when
    ``plan.compile``; otherwise do nothing."""
    if not plan.compile:
        log.info("torch.compile: off")
        return
    blocks = find_blocks(module, plan)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(blocks))
    for block in blocks:
        block.compile(dynamic=False)
    log.info("torch.compile: %d blocks of %s", len(blocks), plan.block_container)
