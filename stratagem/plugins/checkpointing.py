"""Activation checkpointing per block, with torch's composable, non-reentrant ``checkpoint``.

The composable API adds hooks and keeps the module tree (and so every parameter's FQN)
unchanged, unlike ``checkpoint_wrapper``, which inserts a ``_checkpoint_wrapped_module`` level.

* ``full``: each block saves only its inputs; backward recomputes the whole block.
* ``selective`` and ``selective-op``: each block keeps the outputs of the operators the policy
  names and recomputes everything else (:mod:`stratagem.plan.checkpointing`, which the profile
  reads too): ``selective`` its linear layers' matmuls, ``selective-op`` (torchtitan's) the
  attention kernels' and every other matmul's. Matmuls are the expensive ops to redo and their
  outputs are only ``[b, s, width]``.

Recomputing a block runs its BatchNorm layers' forward again, which would update their running
statistics a second time per micro-batch (fairscale's ``patch_batchnorm`` guards reentrant
checkpointing against the same); the recompute updates copies instead, so the trained
statistics are those of the same training without checkpointing.

A Hugging Face model keeps a key/value cache in training where its config says ``use_cache``
(most causal LMs' default): the cache holds every layer's keys and values from the forward to the
end of the step, and each recompute adds its own, so a checkpointed block frees little. The plugin
turns the cache off, as Hugging Face's own ``gradient_checkpointing_enable`` does, and says so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial

from torch import nn
from torch.distributed._composable import checkpoint
from torch.nn.modules.batchnorm import _BatchNorm
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
    _disable_key_value_caches(module)
    for block in blocks:
        norms = [m for m in block.modules() if isinstance(m, _BatchNorm)]
        if plan.checkpoints_selectively or norms:
            policy = mode if plan.checkpoints_selectively else None
            checkpoint(block, context_fn=partial(_contexts, policy=policy, norms=norms))
        else:
            checkpoint(block)
    log.info("activation checkpointing: %s on %d blocks of %s", mode, len(blocks), plan.block_container)


def _disable_key_value_caches(module: nn.Module) -> None:
    """Set ``config.use_cache`` false on every Hugging Face model in ``module`` that has it true,
    with a warning for each: its cache would keep what checkpointing frees (module docstring)."""
    for name, sub in module.named_modules():  # a model's inner modules share its config: one warning
        config = getattr(sub, "config", None)
        if getattr(config, "use_cache", None) is not True:
            continue
        config.use_cache = False
        log.warning("activation checkpointing: set %s.config.use_cache = False: a key/value cache keeps every "
                    "layer's keys and values through the step, which checkpointing frees (as Hugging Face's "
                    "gradient_checkpointing_enable does)", name or type(sub).__name__)


def _contexts(*, policy: str | None, norms: list[_BatchNorm]) -> tuple[AbstractContextManager, AbstractContextManager]:
    """The contexts a checkpointed block's forward and its recompute run in (``context_fn``):
    a selective ``policy``'s (:func:`selective_context`), if any, and BatchNorm statistics left
    as the forward left them by the recompute."""
    forward, recompute = selective_context(policy) if policy else (nullcontext(), nullcontext())
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
