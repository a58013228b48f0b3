"""Activation checkpointing per block, with torch's composable, non-reentrant ``checkpoint``.

The composable API adds hooks and keeps the module tree (and so every parameter's FQN)
unchanged, unlike ``checkpoint_wrapper``, which inserts a ``_checkpoint_wrapped_module`` level.

* ``full``: each block saves only its inputs; backward recomputes the whole block.
* ``selective``: each block saves the outputs of its linear layers' matrix multiplies
  (:data:`SAVED_OPS`) and recomputes everything else: norms, activations, element-wise ops,
  rotary embedding and the attention core (SDPA, or the explicit scores-softmax-``bmm`` path).
  Matmuls are the expensive ops to redo and their outputs are only ``[b, s, width]``; the
  attention core's ``s × s`` intermediates cost the most memory for the least compute
  (Korthikanti et al., 2022, "selective activation recomputation").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from stratagem.plan import Plan
from stratagem.plugins.blocks import find_blocks

__all__ = ["SAVED_OPS", "apply_activation_checkpointing", "selective_policy"]

log = logging.getLogger(__name__)

_aten = torch.ops.aten

SAVED_OPS = frozenset({_aten.mm.default, _aten.addmm.default})
"""Ops whose outputs selective checkpointing keeps: the linear layers' matrix multiplies.

``aten.bmm`` is left out on purpose: in a transformer block it is the attention core
(``q·kᵀ`` and ``probs·v`` of the explicit path), which selective checkpointing recomputes.
"""


def selective_policy(ctx: object, op: Callable, *args: object, **kwargs: object) -> CheckpointPolicy:
    """Save the outputs of :data:`SAVED_OPS`, recompute every other op (a policy for
    ``create_selective_checkpoint_contexts``)."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(module: nn.Module, plan: Plan) -> None:
    """Checkpoint each block of ``module`` (the children of ``plan.block_container``) in place,
    as ``plan.activation_checkpointing`` says; ``none`` does nothing.

    Raises :class:`UsageError` when checkpointing is asked for and the plan names no blocks.
    """
    mode = plan.activation_checkpointing
    if mode == "none":
        log.info("activation checkpointing: none")
        return
    blocks = find_blocks(module, plan)
    options = {"context_fn": partial(create_selective_checkpoint_contexts, selective_policy)} \
        if mode == "selective" else {}
    for block in blocks:
        checkpoint(block, **options)
    log.info("activation checkpointing: %s on %d blocks of %s", mode, len(blocks), plan.block_container)
