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

Recomputing a block runs its BatchNorm layers' forward again, which would update their running
statistics a second time per micro-batch (fairscale's ``patch_batchnorm`` guards reentrant
checkpointing against the same); the recompute updates copies instead, so the trained
statistics are those of the same training without checkpointing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.nn.modules.batchnorm import _BatchNorm
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
    for block in blocks:
        norms = [m for m in block.modules() if isinstance(m, _BatchNorm)]
        if mode == "selective" or norms:
            checkpoint(block, context_fn=partial(_contexts, selective=mode == "selective", norms=norms))
        else:
            checkpoint(block)
    log.info("activation checkpointing: %s on %d blocks of %s", mode, len(blocks), plan.block_container)


def _contexts(*, selective: bool, norms: list[_BatchNorm]) -> tuple[AbstractContextManager, AbstractContextManager]:
    """The contexts a checkpointed block's forward and its recompute run in (``context_fn``):
    selective checkpointing's policy, if asked for, and BatchNorm statistics left as the forward
    left them by the recompute."""
    forward, recompute = (create_selective_checkpoint_contexts(selective_policy) if selective
                          else (nullcontext(), nullcontext()))
    return forward, _statistics_kept(norms, recompute)


@contextmanager
def _statistics_kept(norms: list[_BatchNorm], inner: AbstractContextManager) -> Iterator[None]:
    """``inner`` with ``norms``' buffers swapped for copies, which the recompute updates and then
    drops. The recompute runs the ops the forward ran (checkpointing checks that it saves the same
    tensors), and the buffers it saves for backward are never written again."""
    kept = [(norm, name, buffer) for norm in norms for name, buffer in norm.named_buffers(recurse=False)]
    for norm, name, buffer in kept:
        setattr(norm, name, buffer.clone())
    try:
        with inner:
            yield
    finally:
        for norm, name, buffer in kept:
            setattr(norm, name, buffer)
