"""Checkpoints of a plan-applied model and its optimizers, with the original model's keys.

Two layouts, both readable whatever plan wrote them:

- **sharded** (a directory): ``torch.distributed.checkpoint`` writes every rank's shards of
  ``{"state_dict": model, "optimizer_0": ..., ...}`` and rank 0 writes everything else (loop
  state, callbacks, hyperparameters) with ``torch.save`` to ``meta.pt``: Lightning's own layout,
  so its ``consolidate_checkpoint`` utility reads it;
- **full** (one file): the states gathered to rank 0 and saved there with ``torch.save``.

ZeRO-1's ``ZeroRedundancyOptimizer`` has no distributed state-dict support: its state is
consolidated on rank 0 and kept whole (in ``meta.pt`` for the sharded layout), and every rank loads
that whole state back (its own API partitions it).

A sharded save survives a rank dying in it: it is written beside the checkpoint it replaces, marked
complete last and swapped in by renames (:mod:`stratagem.plugins.checkpoint_files`); loading refuses
an incomplete directory, saying what it misses.

Loading unpickles (``torch.load`` of the full file or of ``meta.pt``, and DCP's ``.metadata``):
load only checkpoints you trust.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer

from stratagem.errors import UsageError
from stratagem.plugins.checkpoint_files import (
    MANIFEST_FILE,
    META_FILE,
    mark_complete,
    missing_parts,
    new_partial_dir,
    resolve,
    swap_in,
)

__all__ = ["MANIFEST_FILE", "META_FILE", "is_sharded_checkpoint", "load_checkpoint", "mark_complete",
           "model_state_dict", "optimizer_state_dict", "save_sharded_checkpoint"]

T = TypeVar("T")


def _options(*, full: bool, strict: bool = True) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Sharded optimizer states are flattened to one key per parameter ("state.<fqn>.exp_avg",
    # "param_groups.<fqn>.lr"): ranks holding different parameters (pipeline stages) then write
    # different keys, where a nested param_groups list would be one key every rank overwrites.
    return StateDictOptions(full_state_dict=full, cpu_offload=full, strict=strict,
                            flatten_optimizer_state_dict=not full)


def model_state_dict(module: nn.Module, *, full: bool) -> dict[str, Any]:
    """``module``'s state dict: whole tensors on rank 0 (``full``; empty elsewhere for sharded
    modules) or this rank's shards as DTensors. A collective for sharded modules."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(module, options=_options(full=full))


def optimizer_state_dict(module: nn.Module, optimizer: Optimizer, *, full: bool) -> dict[str, Any]:
    """``optimizer``'s state keyed by ``module``'s parameter names (whole or sharded as for
    :func:`model_state_dict`); a ZeRO-1 optimizer's state consolidated whole on rank 0 (empty on the
    other ranks). A collective."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if dist.get_rank() == 0 else {}
    return get_optimizer_state_dict(module, optimizer, options=_options(full=full))


def save_sharded_checkpoint(path: Path, checkpoint: Mapping[str, Any], optimizers: Sequence[Optimizer]) -> None:
    """Write ``checkpoint`` (``state_dict`` and ``optimizer_states`` from the functions above with
    ``full=False``, plus anything else) as the sharded layout in the directory ``path``. Every rank
    calls it. A checkpoint already at ``path`` stays there, complete, until the new one is
    complete: ranks write into a sibling directory that rank 0 then swaps in."""
    import torch.distributed.checkpoint as dcp

    rest = dict(checkpoint)
    shards: dict[str, Any] = {"state_dict": rest.pop("state_dict")}
    whole = []
    for index, (optimizer, state) in enumerate(zip(optimizers, rest.pop("optimizer_states", []), strict=True)):
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            whole.append(state)
        else:
            shards[f"optimizer_{index}"] = state
            whole.append(None)
    partial = _on_rank0(new_partial_dir, path)
    dcp.save(shards, checkpoint_id=partial)
    # dcp.save returns on rank 0 once every rank has written its shards (it gathers their results).
    _on_rank0(_finish, partial, path, {**rest, "optimizer_states": whole})


def _finish(partial: Path, path: Path, meta: dict[str, Any]) -> None:
    """Rank 0, once every rank's shards are written: the meta file, the manifest, the swap."""
    torch.save(meta, partial / META_FILE)
    mark_complete(partial)
    swap_in(partial, path)


def _on_rank0(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` run on rank 0, its result given to every rank; if it raises, every rank
    raises (a UsageError as such, anything else as a RuntimeError naming it), so that no rank
    goes on alone into a collective."""
    outcome: list[Any] = [None, None]
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            outcome[0] = fn(*args)
        except Exception as err:  # every rank must hear of it
            error, usage = err, isinstance(err, UsageError)
            outcome[1] = (usage, str(err) if usage else f"{type(err).__name__}: {err}")
    dist.broadcast_object_list(outcome, src=0)
    if error is not None:
        raise error
    if outcome[1] is not None:
        usage, message = outcome[1]
        raise UsageError(message) if usage else RuntimeError(f"on rank 0: {message}")
    return outcome[0]


def is_sharded_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a complete checkpoint directory in the sharded layout."""
    return path.is_dir() and not missing_parts(path)


def load_checkpoint(path: Path, module: nn.Module, optimizers: Sequence[Optimizer], *, strict: bool = True,
                    weights_only: bool | None = None) -> dict[str, Any]:
    """Load a checkpoint of either layout into ``module`` (already plan-applied) and
    ``optimizers`` (none to skip their state); returns the rest of the checkpoint. Every rank calls it."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    # One rank looks at the files, so that every rank loads the same checkpoint or raises the same error.
    distributed = dist.is_available() and dist.is_initialized()
    found = _on_rank0(resolve, path) if distributed else resolve(path)
    if found != path and (not distributed or dist.get_rank() == 0):
        warnings.warn(f"no checkpoint at {path}: a save died while swapping its new checkpoint in; loading the "
                      f"checkpoint it was replacing, {found}", stacklevel=2)
    path = found
    if path.is_dir():
        return _load_sharded(path, module, optimizers, strict=strict, weights_only=weights_only)
    checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    set_model_state_dict(module, checkpoint.pop("state_dict"), options=_options(full=True, strict=strict))
    states = checkpoint.pop("optimizer_states", [])
    _check_optimizer_count(path, optimizers, states)
    for optimizer, state in zip(optimizers, states):
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            optimizer.load_state_dict(state)
        else:
            set_optimizer_state_dict(module, optimizer, state, options=_options(full=True))
    return checkpoint


def _load_sharded(path: Path, module: nn.Module, optimizers: Sequence[Optimizer], *, strict: bool,
                  weights_only: bool | None) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    rest = torch.load(path / META_FILE, map_location="cpu", weights_only=weights_only)
    whole = rest.pop("optimizer_states", [])
    _check_optimizer_count(path, optimizers, whole)
    # dcp.load fills the tensors it is given, in place: ask for this rank's current shards.
    target = {"state_dict": model_state_dict(module, full=False)}
    for index, optimizer in enumerate(optimizers):
        if not isinstance(optimizer, ZeroRedundancyOptimizer):
            target[f"optimizer_{index}"] = optimizer_state_dict(module, optimizer, full=False)
    dcp.load(target, checkpoint_id=path)
    set_model_state_dict(module, target["state_dict"], options=_options(full=False, strict=strict))
    for index, (optimizer, state) in enumerate(zip(optimizers, whole)):
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            optimizer.load_state_dict(state)
        else:
            set_optimizer_state_dict(module, optimizer, target[f"optimizer_{index}"], options=_options(full=False))
    return rest


def _check_optimizer_count(path: Path, optimizers: Sequence[Optimizer], states: Sequence[Any]) -> None:
    if optimizers and len(optimizers) != len(states):
        raise UsageError(f"the checkpoint {path} holds {len(states)} optimizer state(s) but the run has "
                         f"{len(optimizers)} optimizer(s)\nHINT: resume with the configure_optimizers that saved it")
