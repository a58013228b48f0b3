"""What a segment's forward holds at once, measured in the profile's fake step
(:func:`~stratagem.advisor.profile.step.run_fake_step`).

A block's forward makes tensors it does not save and frees them only when nothing reads them
any more: a ResNet bottleneck's last ReLU runs while the output of its convolution branch, its
shortcut's and their sum are all alive, none of them kept for backward. Under full checkpointing
the backward runs each block's forward again, and at that rerun's fullest the block holds what it
saves again and those tensors beside the gradient of its output, waiting for the rerun to end.
:class:`ForwardHeld` follows, per segment, every storage its forward's operators write (not a
view's, not a parameter's copy, which the model states and autocast's cache count) and every one
it saves, by weak references, which tell when the fake tensors' storages are freed as real ones
would be; the most alive at once is the segment's ``fwd_peak_bytes``, and what exceeds what the
segment saved its :func:`forward_held_bytes` (docs/cost-model.md, "A full checkpoint's rerun").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stratagem.advisor.profile.backward_held import alive_bytes, follow_written, storages

if TYPE_CHECKING:
    from torch.multiprocessing.reductions import StorageWeakRef

    from stratagem.advisor.profile.counts import RunRecord, SegmentCounts


class ForwardHeld:
    """Per segment, the most its forward held at once: what its operators wrote and what it
    saved, still alive (module docstring)."""

    def __init__(self, record: RunRecord, *, outside: tuple[str, ...]) -> None:
        self._record = record
        self._outside = outside  # segments that are not blocks, which no checkpoint reruns
        self._followed: dict[str, dict[StorageWeakRef, int]] = {}  # per segment: written or saved, with bytes

    def op(self, segment: str, args: Any, out: Any, *, parameter_sized: bool) -> None:
        """Follow one operator dispatched in ``segment``'s forward: the storages it writes (not a
        view's, not a parameter's copy: ``parameter_sized``), then, where it wrote one, the bytes
        alive (no fuller moment comes between two writes)."""
        if parameter_sized or segment in self._outside:
            return
        followed = self._followed.setdefault(segment, {})
        if not follow_written(followed, storages(out), storages(args)):
            return
        counts = self._record.segments[segment]
        counts.fwd_peak_bytes = max(counts.fwd_peak_bytes, alive_bytes(followed))

    def saved(self, segment: str, ref: StorageWeakRef, num_bytes: int) -> None:
        """Follow a storage ``segment`` saved for backward (its input's too), at the bytes it
        counted as saved (a dropout mask at CUDA's byte an element)."""
        follow_written(self._followed.setdefault(segment, {}), {ref: num_bytes}, {})


def forward_held_bytes(counts: SegmentCounts) -> int:
    """The most a segment's forward held at once beyond what it saved for backward."""
    return max(0, counts.fwd_peak_bytes - counts.saved_bytes)
