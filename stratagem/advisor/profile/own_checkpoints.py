"""What a model that checkpoints its own blocks keeps and rebuilds, as the profile's fake step runs
it (:func:`~stratagem.advisor.profile.step.run_fake_step`).

A model may run ``torch.utils.checkpoint`` on its blocks itself: inside each block (Hugging Face's
``gradient_checkpointing_enable()``, torch's ``checkpoint_wrapper``) or around it, from the code
that calls it (``x = checkpoint(block, x, use_reentrant=...)`` in a loop), reentrant or not. Its
forward then keeps each block's input, and its backward reruns each block's forward before that
block's gradients, holding what the rerun saves until they are done (docs/cost-model.md,
"A model that checkpoints itself").

* The input: torch's checkpoint saves it through the saved-tensor hooks as it starts (a reentrant
  one once the block returned), so one placed around a block saves it outside the block, where the
  step counts what runs outside the blocks (in the embedding or head). :class:`ClaimedInputs` hands
  each block its inputs, and a tensor saved outside the blocks counts in the block that takes it.
* The rerun: it runs in backward with autograd on (torch's non-reentrant recompute and the reentrant
  ``CheckpointFunction.backward`` both turn it on), where backward's own operators run with it off.
  The non-reentrant rerun saves through checkpoint's own hooks, which the step's do not see, so
  :class:`RebuiltBytes` follows the storages the rerun's operators write: those still alive when
  backward goes on (its next operator with autograd off) are what the rerun left held, the
  block's ``rebuilt_bytes``. What a reentrant rerun saves reaches the step's hooks as well; it is
  not what the forward keeps (:class:`~stratagem.advisor.profile.measure.SavedTensorCounter`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from stratagem.advisor.profile.backward_held import alive_bytes, follow_written, storages
from stratagem.advisor.profile.block_reuse import tensor_leaves

if TYPE_CHECKING:
    from collections.abc import Callable

    from stratagem.advisor.profile.counts import RunRecord


class RebuiltBytes:
    """Per block, the most bytes a rerun of its forward in backward left held (module docstring)."""

    def __init__(self, record: RunRecord) -> None:
        self._record = record
        self._written: dict[str, dict[StorageWeakRef, int]] = {}  # segment -> storages its rerun wrote
        self._task: int | None = None  # the step's backward: its graph task
        self._rerun: str | None = None  # the segment whose rerun ran last

    def nested_segment(self) -> str | None:
        """The segment a backward run inside the step's own belongs to (a reentrant checkpoint's,
        through its rerun's graph, in which the module tracker follows no module): the one whose
        rerun ran last; None in the step's backward."""
        task = torch._C._current_graph_task_id()
        if self._task is None:
            self._task = task
        return self._rerun if task != self._task else None

    def op(self, segment: str, args: Any, out: Any) -> None:
        """Follow one operator dispatched in backward, in ``segment``, by the storages it writes
        (a view writes none): with autograd on, a rerun's, followed; with it off, backward's own,
        before which those followed so far are counted. (Autograd turns it off in a pack hook
        too, where the rerun's saves are detached: views.)"""
        read, written = storages(args), storages(out)
        if not torch.is_grad_enabled():
            if written.keys() - read.keys():
                self.settle()
        elif follow_written(self._written.setdefault(segment, {}), written, read):
            self._rerun = segment

    def settle(self) -> None:
        """Count, per segment, the bytes of the storages its rerun wrote that are still alive."""
        for segment, written in self._written.items():
            counts = self._record.segments[segment]
            counts.rebuilt_bytes = max(counts.rebuilt_bytes, alive_bytes(written))
        self._written.clear()


class ClaimedInputs:
    """Forward pre-hooks on the blocks that hand each block the tensors among its inputs that were
    saved outside the blocks (``claim(fqn, tensors)``): a checkpoint placed around the block saved
    them for it."""

    def __init__(self, blocks: dict[str, nn.Module], claim: Callable[[str, list[torch.Tensor]], None]) -> None:
        self._blocks = blocks
        self._claim = claim
        self._handles: list = []

    def __enter__(self) -> ClaimedInputs:
        for fqn, module in self._blocks.items():
            self._handles.append(module.register_forward_pre_hook(
                lambda _module, args, kwargs, fqn=fqn: self._claim(fqn, tensor_leaves((args, kwargs))),
                with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
