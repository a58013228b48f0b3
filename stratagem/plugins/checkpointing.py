"""Activation checkpointing per block, with torch's composable, non-reentrant ``checkpoint``.

The composable API adds hooks and keeps the module tree (and so every parameter's FQN)
unchanged, unlike ``checkpoint_wrapper``, which inserts a ``_checkpoint_wrapped_module`` level.

* ``full``: each block saves only its inputs; backward recomputes the whole block.
* ``selective`` and ``selective-op``: each block keeps the outputs of the operators the policy
  names and recomputes everything else (:mod:`stratagem.plan.checkpointing`, which the profile
  reads too): ``selective`` its linear layers' matmuls, ``selective-op`` (torchtitan's) the
  attention kernels' and every other matmul's. Matmuls are the expensive ops to redo and their
  outputs are only ``[b, s, width]``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext, create_selective_checkpoint_contexts

from stratagem.plan import Plan
from stratagem.plan.checkpointing import PolicyState
from stratagem.plugins.blocks import find_blocks

__all__ = ["apply_activation_checkpointing", "op_name", "selective_context"]

log = logging.getLogger(__name__)


def op_name(op: object) -> str:
    """``op`` as :mod:`stratagem.plan.checkpointing` names operators: its overload packet
    (``aten.mm`` for ``aten.mm.default``)."""
    return str(getattr(op, "overloadpacket", op))


def selective_context(policy: str) -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """The contexts of one checkpointed call of a block under ``policy``: a fresh policy state
    (its matmul count starts at 0 per call, apart for forward and recompute, as torchtitan's)."""
    states = {False: PolicyState(policy), True: PolicyState(policy)}

    def decide(ctx: SelectiveCheckpointContext, op: Callable, *args: object, **kwargs: object) -> CheckpointPolicy:
        keep = states[ctx.is_recompute].keeps(op_name(op))
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(decide)


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
    options = {"context_fn": partial(selective_context, mode)} if plan.checkpoints_selectively else {}
    for block in blocks:
        checkpoint(block, **options)
    log.info("activation checkpointing: %s on %d blocks of %s", mode, len(blocks), plan.block_container)
