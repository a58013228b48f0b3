"""``torch.compile`` per block, in place: each block's forward (and, through AOTAutograd, its
backward) becomes one compiled graph whose element-wise operators fuse into few kernels.

Per block rather than the whole model, as torchtitan does: every identical block reuses one
compiled graph, compilation stays short, and the hooks FSDP and pipelining put between blocks
stay outside the compiled regions. ``nn.Module.compile`` keeps the module tree, so parameter
names (and checkpoints) are unchanged.
"""

from __future__ import annotations

import logging

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
    for block in blocks:
        block.compile()
    log.info("torch.compile: %d blocks of %s", len(blocks), plan.block_container)
