"""Find a model's blocks: the children of the Plan's ``block_container``.

Blocks are the units the plugins work on: each is checkpointed as a whole and each becomes its
own FSDP unit (the root takes what is left: embeddings, final norm, output layer).
"""

from __future__ import annotations

from torch import nn

from stratagem.plan import Plan
from stratagem.errors import UsageError

__all__ = ["find_blocks", "module_lists"]


def module_lists(module: nn.Module) -> str:
    """The FQNs of ``module``'s ``ModuleList``s, quoted, for a hint ("none" where it has none)."""
    return ", ".join(repr(name) for name, sub in module.named_modules() if isinstance(sub, nn.ModuleList)) or "none"


def find_blocks(module: nn.Module, plan: Plan) -> list[nn.Module]:
    """The children of ``module``'s submodule ``plan.block_container``, in order.

    Raises :class:`UsageError` when the plan names no container, when the name is not a
    submodule of ``module``, or when the container has no children.
    """
    if plan.block_container is None:
        raise UsageError("the plan names no block_container, so there are no blocks to work on\n"
                         "HINT: set Plan.block_container to the FQN of the ModuleList holding the "
                         "blocks (e.g. 'layers'), as the advisor's profile reports it")
    try:
        container = module.get_submodule(plan.block_container)
    except AttributeError:
        raise UsageError(f"Plan.block_container={plan.block_container!r} is not a submodule of "
                         f"{type(module).__name__}\nHINT: module lists in this model: {module_lists(module)}") from None
    blocks = list(container.children())
    if not blocks:
        raise UsageError(f"Plan.block_container={plan.block_container!r} has no children\n"
                         "HINT: name the ModuleList whose children are the blocks")
    return blocks
