"""What a segment's backward holds at once beyond what its forward kept, measured in the profile's
fake step (:func:`~stratagem.advisor.profile.step.run_fake_step`).

A block's backward makes gradients of its activations (of its MLP's wide hidden layer, of the
attention's scores) while the tensors it saved are still there: each operator reads the gradient
of its output and a saved tensor and writes the gradient of its input, and only then are the
two freed. So the backward holds more than the block saved, most in the middle of its widest
part, though it frees its saved tensors as it goes. :class:`BackwardHeld` follows every storage
the backward's operators write, but parameters' gradients (the model states count those), and
the activations the forward kept, by weak references, which tell when autograd frees them (the
fake tensors' storages live as real ones do): per segment, the most alive at once while it runs
less what it kept and rebuilt is its ``bwd_held_bytes`` (docs/cost-model.md, "The backward's
own gradients").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from stratagem.advisor.profile.block_reuse import tensor_leaves

if TYPE_CHECKING:
    from stratagem.advisor.profile.counts import RunRecord


class BackwardHeld:
    """Per segment, the most its backward held at once beyond what it kept and rebuilt (module
    docstring); :attr:`kept`: the activations the forward saved, by storage (segment, bytes), as
    :class:`~stratagem.advisor.profile.measure.SavedTensorCounter` counts them into it.

    A weight's gradient is written by an operator like an activation's (``mm`` writes a Linear's,
    transposed) and taken as ``.grad`` by the parameter's ``AccumulateGrad`` a node or two later
    (after autocast's cast back to the parameter's dtype), which the model states count. Shapes
    cannot tell the two apart (at 2 × 16 tokens a ``[32, 64]`` gradient has a Linear(64, 32)'s
    weight's shape), so each node's peak is kept with the storages alive at it, and those an
    ``AccumulateGrad`` took or a parameter-sized operator read by the backward's end are taken
    out of it."""

    def __init__(self, record: RunRecord) -> None:
        self._record = record
        self.kept: dict[StorageWeakRef, tuple[str, int]] = {}
        self._made: dict[StorageWeakRef, int] = {}  # storages the backward's operators wrote
        self._saved: dict[str, dict[StorageWeakRef, int]] | None = None  # kept, by segment, as backward starts
        self._accumulated: set[StorageWeakRef] = set()  # what AccumulateGrad took: parameters' gradients
        self._node: object | None = None  # the autograd node running
        self._peaks: list[tuple[str, int, dict[StorageWeakRef, int]]] = []  # each node's: segment, bytes, made then

    def op(self, segment: str, args: Any, out: Any, *, parameter_sized: bool) -> None:
        """Follow one operator dispatched in backward, in ``segment``: the storages it writes (not
        a view's, not a parameter-sized gradient's), then the bytes alive; inside a parameter's
        ``AccumulateGrad``, what it takes as the gradient."""
        if self._saved is None:
            self._saved = {}
            for ref, (owner, num_bytes) in self.kept.items():
                self._saved.setdefault(owner, {})[ref] = num_bytes
        node = torch._C._current_autograd_node()
        read, written = storages(args), storages(out)
        if node is not None and node.name().endswith("AccumulateGrad"):
            self._accumulated |= read.keys() | written.keys()
            return
        if parameter_sized:  # a gradient cast to its parameter's dtype, tied weights' summed: what it reads is too
            self._accumulated |= read.keys()
        else:
            follow_written(self._made, written, read)
        held = alive_bytes(self._made) + alive_bytes(self._saved.setdefault(segment, {}))
        if node is not self._node or not self._peaks:
            self._node = node
            self._peaks.append((segment, -1, {}))
        if held > self._peaks[-1][1]:
            self._peaks[-1] = (segment, held, dict(self._made))

    def finish(self) -> None:
        """Set each segment's ``bwd_held_bytes``: the most it held at once, parameters' gradients
        aside, less what it kept (those the step followed by storage) and rebuilt."""
        kept: dict[str, int] = {}
        for owner, num_bytes in self.kept.values():
            kept[owner] = kept.get(owner, 0) + num_bytes
        peaks: dict[str, int] = {}
        for segment, held, made in self._peaks:
            gradients = sum(num_bytes for ref, num_bytes in made.items() if ref in self._accumulated)
            peaks[segment] = max(peaks.get(segment, 0), held - gradients)
        for segment, peak in peaks.items():
            counts = self._record.segments[segment]
            counts.bwd_held_bytes = max(0, peak - kept.get(segment, 0) - counts.rebuilt_bytes)


def storages(tree: Any) -> dict[StorageWeakRef, int]:
    """The storages of ``tree``'s tensors, by weak reference, with their bytes."""
    return {StorageWeakRef(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensor_leaves(tree)}


def follow_written(followed: dict[StorageWeakRef, int], written: dict[StorageWeakRef, int],
                   read: dict[StorageWeakRef, int]) -> bool:
    """Follow the storages an operator ``written`` that it did not ``read`` (a view's, one written
    in place), in ``followed``; whether there were any. One followed already that equals a new one
    is a freed storage's, whose address the new one took: it is replaced, lest it be dropped as
    freed with the new one's bytes."""
    new = {ref: num_bytes for ref, num_bytes in written.items() if ref not in read}
    for ref in new:
        followed.pop(ref, None)
    followed.update(new)
    return bool(new)


def alive_bytes(followed: dict[StorageWeakRef, int]) -> int:
    """Bytes of the ``followed`` storages still alive, those freed forgotten."""
    for ref in [ref for ref in followed if ref.expired()]:
        del followed[ref]
    return sum(followed.values())
