"""Each block's first call in the profile's fake step, kept to run the block again after it: the
tensor-parallel layout search splits it on them (:mod:`.tp_layout`), the compiled measurement
traces it on them (:mod:`.compiled`).

Objects other than tensors are copied as the call receives them, before the block changes them,
and each run on a kept call gets a copy of its own: a Hugging Face layer adds its keys and values
to the cache it is handed, and run again on that cache attends over its own keys twice (splitting
a Llama's layer two ways for tensor parallelism failed so, under the Lightning strategy's
``training_step``). An object that cannot be copied (a cache that earlier blocks filled with
tensors autograd computed) is kept as it is.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

if TYPE_CHECKING:
    from stratagem.advisor.profile.measure import CostCounter


class BlockInputs:
    """Forward pre-hooks keeping each block's first ``(args, kwargs)`` in :attr:`calls`, with
    ``counter``'s counting suppressed while objects are copied."""

    def __init__(self, model: nn.Module, blocks: tuple[str, ...], counter: CostCounter) -> None:
        self.modules = {fqn: model.get_submodule(fqn) for fqn in blocks}  # the blocks by FQN
        self._counter = counter
        self.calls: dict[str, tuple[tuple, dict]] = {}
        self._handles: list = []

    def __enter__(self) -> BlockInputs:
        for fqn, module in self.modules.items():
            self._handles.append(module.register_forward_pre_hook(
                lambda _module, args, kwargs, fqn=fqn: self._record(fqn, args, kwargs), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()

    def _record(self, fqn: str, args: tuple, kwargs: dict) -> None:
        if fqn in self.calls:
            return
        self._counter.suppressed += 1
        try:
            self.calls[fqn] = fresh(args, kwargs)
        finally:
            self._counter.suppressed -= 1


def fresh(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with their objects other than tensors copied: what each run of a
    block on a kept call gets, so that no run sees what another added to a cache."""
    leaves, spec = tree_flatten((args, kwargs))
    return tree_unflatten([x if isinstance(x, torch.Tensor) else _snapshot(x) for x in leaves], spec)


def _snapshot(value: object) -> object:
    """A copy of ``value``; itself where it cannot be copied (an object holding tensors autograd
    computed, such as a cache the earlier blocks filled, or anything deepcopy refuses: a lock, a
    stream, a generator)."""
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001  (whatever an object's copying raises, the call keeps the object)
        return value
