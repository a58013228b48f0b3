"""An offloaded plan's optimizer, which steps on the host: torch's fused implementation.

torch.optim's default on CPU tensors steps one tensor at a time, and Adam's update allocates two
parameter-sized temporaries a tensor (the second moment's square root and its quotient), whose
fresh pages the kernel faults in and zeroes at every step; the fused kernel makes one pass over
each parameter, its gradient and its states. torchtitan builds its optimizers fused by default.
On this project's 2-core host AdamW took 1.3-4.5 ns a parameter one tensor at a time and 0.3-0.7
fused (``bench/host_optimizer_cache.py``; docs/cost-model.md, "Optimizer step and offload"). A
caller that names ``fused`` or ``foreach`` keeps what it named.
"""

from __future__ import annotations

from typing import Any

import torch

from stratagem.plan import Plan
from stratagem.plan.workload import HOST_FUSED_OPTIMIZERS, OPTIMIZER_CLASSES

__all__ = ["FUSED_ON_HOST", "fuse_host_optimizer", "host_optimizer_options"]

FUSED_ON_HOST: tuple[type[torch.optim.Optimizer], ...] = tuple(
    getattr(torch.optim, cls) for name in sorted(HOST_FUSED_OPTIMIZERS) for cls in OPTIMIZER_CLASSES[name])
"""The classes an offloaded plan steps fused: those of
:data:`~stratagem.plan.workload.HOST_FUSED_OPTIMIZERS` (Adam and AdamW; DTensor has no sharding
for the fused SGD kernel)."""


def _chooses_fused(plan: Plan, optimizer_cls: type, options: dict[str, Any]) -> bool:
    """Whether an offloaded plan's optimizer of ``optimizer_cls`` built with ``options`` runs fused:
    one of :data:`FUSED_ON_HOST` whose caller named no implementation and no differentiable step."""
    return (plan.offloads and issubclass(optimizer_cls, FUSED_ON_HOST) and options.get("fused") is None
            and options.get("foreach") is None and not options.get("differentiable", False))


def host_optimizer_options(plan: Plan, optimizer_cls: type, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for building ``optimizer_cls`` under ``plan``: ``fused=True`` added where the
    plan offloads and the caller named no implementation."""
    return {**options, "fused": True} if _chooses_fused(plan, optimizer_cls, options) else options


def fuse_host_optimizer(optimizer: torch.optim.Optimizer, plan: Plan) -> bool:
    """Make an optimizer built for an offloaded plan's parameters step fused, as
    :func:`host_optimizer_options` builds one, before its first step (its states not made yet);
    True where it changed it. A wrapper's inner optimizer (Lightning's) is the caller's to pass."""
    groups = [*optimizer.param_groups, optimizer.defaults]
    if optimizer.state or not all(_chooses_fused(plan, type(optimizer), group) for group in groups):
        return False
    for group in groups:
        group["fused"] = True
    return True
