"""``torch.compile`` per block, in place: each block's forward (and, through AOTAutograd, its
backward) becomes one compiled graph whose element-wise operators fuse into few kernels.

Per block rather than the whole model, as torchtitan does: every identical block reuses one
compiled graph, compilation stays short, and the hooks FSDP and pipelining put between blocks
stay outside the compiled regions. ``nn.Module.compile`` keeps the module tree, so parameter
names (and checkpoints) are unchanged.

Blocks that share a forward's code but read constants of their own (a Hugging Face decoder
layer's ``layer_idx``, its cache entry) each compile a graph. Dynamo keeps eight per code object
(``torch._dynamo.config.recompile_limit``) and runs the rest eager: a TinyLlama-shaped Llama's
"compiled" plan ran 14 of its 22 layers so on one H100 (docs/benchmarks.md, "GPU figures"). The
limit is raised to the number of blocks compiled, so every block runs compiled; each such block
then costs a compilation of its own.
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
        block.compile()
    log.info("torch.compile: %d blocks of %s", len(blocks), plan.block_container)
