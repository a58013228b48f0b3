"""Give a module built on ``meta`` real storage and initial values, after ``apply_plan``
sharded it (FSDP, TP) or before DDP wraps it."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from stratagem.errors import UsageError
from stratagem.plan import Plan

__all__ = ["has_meta_tensors", "initialises_after_sharding", "materialize"]


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` lives on ``meta``."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def initialises_after_sharding(plan: Plan, device: torch.device) -> bool:
    """Whether a module built on ``meta`` gets its values after ``apply_plan`` has sharded it (each
    rank initialising its own shards) rather than whole before. Only FSDP shards on an accelerator:
    there DTensor's random operators give each shard its own part of one random stream (torch's
    offset-based tracker), so the shards hold what the whole tensor would. On CPU meshes every rank
    draws from its own generator, and each shard of a weight got the same values (llama-tiny's
    ``wq`` under dp_shard=2: its two halves equal); DDP broadcasts rank 0's whole values, and TP
    on a CPU mesh would repeat heads likewise. The others initialise the whole module first."""
    return plan.uses_fsdp and device.type != "cpu"


def materialize(module: nn.Module, device: torch.device, *, params_on_host: bool = False) -> None:
    """Allocate ``module``'s meta tensors on ``device`` (``to_empty``; with ``params_on_host``, the
    parameters in host memory and the buffers on ``device``: FSDP2's CPU offload keeps the
    parameter shards there, and refuses them elsewhere) and initialise them: a
    submodule with an ``init_weights()`` that takes no arguments (the torchtitan convention, as the
    reference models have) initialises itself and everything under it; any other submodule
    holding tensors runs its ``reset_parameters()``. Sharded parameters are initialised shard-wise
    (DTensor random ops). A module holding tensors with neither method raises :class:`UsageError`."""
    if not has_meta_tensors(module):
        return
    hooks = _gradient_hooks(module)
    module.to_empty(device="cpu" if params_on_host else device)
    for (owner, name), registered in hooks.items():
        owner._parameters[name]._backward_hooks = registered  # attached anew, once (the setter clears)
    if params_on_host:
        for sub in module.modules():
            sub._buffers.update({name: b.to(device) for name, b in sub._buffers.items() if b is not None})
    missing: set[str] = set()
    with torch.no_grad():
        _initialise(module, missing)
    if missing:
        raise UsageError(f"cannot initialise a model built on meta: {', '.join(sorted(missing))} "
                         "define neither init_weights() nor reset_parameters()\nHINT: add one, or build the "
                         "model on a real device (trainer.init_module(empty_init=False))")


def _gradient_hooks(module: nn.Module) -> dict[tuple[nn.Module, str], dict]:
    """The hooks registered on ``module``'s parameters, by owner and name, for ``materialize`` to
    attach to what ``to_empty`` leaves in their place: a new parameter where it was on ``meta``,
    the same one for a tensor subclass (DTensor), swapped in place (``torch.utils.swap_tensors``),
    which keeps its dict of hooks while the autograd engine's hook that calls them stays with the
    tensor swapped out (torch 2.13). Either way they never ran: the TP plugin's hook, which keeps a
    split embedding's gradient to the rank's rows, was lost, and every rank kept the whole table's."""
    return {(owner, name): parameter._backward_hooks for owner in module.modules()
            for name, parameter in owner._parameters.items() if parameter is not None and parameter._backward_hooks}


def _initialise(module: nn.Module, missing: set[str]) -> None:
    init_weights = getattr(module, "init_weights", None)
    if callable(init_weights) and _takes_no_arguments(init_weights):
        init_weights()
        return
    holds = any(True for _ in (*module.parameters(recurse=False), *module.buffers(recurse=False)))
    if holds:
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
        else:
            missing.add(type(module).__name__)
    for child in module.children():
        _initialise(child, missing)


def _takes_no_arguments(method: object) -> bool:
    parameters = inspect.signature(method).parameters.values()  # type: ignore[arg-type]
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters)
