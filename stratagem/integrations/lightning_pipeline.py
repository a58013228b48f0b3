"""How the auto-parallel strategy pipelines a LightningModule: it splits the child module that
holds the blocks (``self.model``, as ``block_container`` names it from the LightningModule) into
stages, and its last stage computes the loss with the module's ``loss_fn(output, target)``."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from stratagem.errors import UsageError
from stratagem.plan import Plan
from stratagem.plan.stages import removal_convention
from stratagem.plugins.blocks import module_lists

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule

    from stratagem.advisor.profile.model_profile import ModelProfile


def pipelined_child(module: LightningModule, plan: Plan) -> tuple[str, Plan]:
    """The child of ``module`` that holds the blocks (the first part of ``plan.block_container``),
    and the plan with its FQNs relative to that child."""
    name, container = _child_path(plan.block_container)
    if not container:
        raise UsageError(f"a pipeline plan splits a child module of {type(module).__name__} holding the blocks, but "
                         f"block_container={plan.block_container!r} names none\nHINT: keep the model in an attribute "
                         "(self.model = ...) and set block_container to its blocks' ModuleList as the "
                         f"LightningModule names it (as the advisor does); module lists: {module_lists(module)}")
    prefix = f"{name}."
    layout = tuple((pattern.removeprefix(prefix), style) for pattern, style in plan.tp_layout)
    return name, dataclasses.replace(plan, block_container=container, tp_layout=layout)


def as_pipelined(module: LightningModule, profile: ModelProfile) -> ModelProfile:
    """``profile`` (of ``module``) with the pipeline facts of what pipeline plans split: the
    child holding the blocks (see :func:`pipelined_child`), and the loss its last stage computes."""
    name, container = _child_path(profile.block_container)
    why = ("the auto-parallel strategy splits a child module holding the blocks, and they are not in one"
           if not container else None if callable(getattr(module, "loss_fn", None)) else
           f"the last stage computes the loss with loss_fn(output, target), which {type(module).__name__} lacks")
    if why:
        return dataclasses.replace(profile, pp_unavailable=profile.pp_unavailable or why)
    traced = removal_convention(module.get_submodule(name), block_container=container) is None
    return dataclasses.replace(profile, pp_traced=traced)


def _child_path(block_container: str | None) -> tuple[str, str]:
    """The child of the LightningModule holding the blocks and the container's FQN inside it
    (``"model.layers"`` → ``("model", "layers")``); the second is empty when there is no child."""
    name, _, container = (block_container or "").partition(".")
    return name, container
