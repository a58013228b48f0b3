"""Blocks in the profile's fake step: each block's input and output bytes, and identical blocks
measured once (:func:`~stratagem.advisor.profile.step.run_fake_step`).

Blocks identical to one already measured (same class, same parameter shapes, same repr) and
called with inputs of the same shapes are not run again: their forward is replaced by a cheap
stand-in that returns outputs of the recorded shapes, and they inherit the measured costs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

if TYPE_CHECKING:
    from stratagem.advisor.profile.counts import RunRecord


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """The tensors among the leaves of a (nested) structure."""
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def tensor_bytes(tree: Any) -> int:
    """Bytes of every tensor leaf in a (nested) structure of tensors."""
    return sum(t.numel() * t.element_size() for t in tensor_leaves(tree))


def _differentiable(tree: Any) -> list[torch.Tensor]:
    """The tensors of ``tree`` that carry gradients (hidden states, not masks or RoPE tables);
    all of its tensors when none does."""
    tensors = tensor_leaves(tree)
    return [t for t in tensors if t.requires_grad] or tensors


def _leaf_meta(tree: Any) -> tuple:
    leaves, _ = tree_flatten(tree)
    return tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t) for t in leaves)


def block_signature(block: nn.Module) -> tuple:
    """Blocks with equal signatures compute the same thing on the same input shapes."""
    return (
        type(block),
        tuple((n, tuple(p.shape), p.dtype) for n, p in block.named_parameters()),
        tuple((n, tuple(b.shape), b.dtype) for n, b in block.named_buffers()),
        repr(block),
    )


class SavedTensors(Protocol):
    """What the step's saved-tensor count tells of a block's inputs and outputs (measure.SavedTensorCounter)."""

    def counted(self, tree: Any) -> bool: ...

    def kept_in(self, segment: str, tree: Any) -> bool: ...

    def mark_counted(self, tree: Any) -> None: ...


class BlockReuse:
    """Record each block's input and output bytes and call ``on_start(fqn)`` as each call of a
    block begins; with ``reuse``, measure the first of each group of identical blocks and stand
    in for the others called alike. A stand-in inherits what its block saved, so its block must
    have come in alike: with inputs of the same shapes, and, where ``saved`` tells, with the
    inputs that carry gradients already counted as saved by what ran before (a convolutional
    block's, which the block before saved as its output, a bottleneck's last ReLU) or not (a
    transformer block's, or the first block's); otherwise it is measured for real, and stands
    for the blocks called like it after. A stand-in's outputs are new tensors, where those the
    block saved itself (its hidden state after a last ReLU; an attention map it returns beside
    the hidden state) would be counted: ``saved`` marks those the measured block saved counted,
    lest the next block count one again as its input."""

    def __init__(self, model: nn.Module, blocks: tuple[str, ...], record: RunRecord, *, reuse: bool,
                 on_start: Callable[[str], None] = lambda fqn: None, saved: SavedTensors | None = None) -> None:
        self._record = record
        self._reuse = reuse
        self._on_start = on_start
        self._saved = saved
        self._saved_outputs: dict[str, list[int]] = {}  # measured block -> the leaves of its output it saved
        self._modules = {fqn: model.get_submodule(fqn) for fqn in blocks}
        self._entries: dict[str, tuple] = {}  # block -> how its first call came in: (input meta, inputs counted)
        self._outputs: dict[str, Any] = {}  # measured block -> its first call's output
        self._handles: list = []

    def __enter__(self) -> BlockReuse:
        kinds: dict[tuple, list[str]] = {}  # signature -> the blocks of it measured for real, in order
        for fqn, module in self._modules.items():
            self._handles.append(module.register_forward_hook(self._output_hook(fqn), with_kwargs=True))
            self._handles.append(module.register_forward_pre_hook(
                lambda _module, args, kwargs, fqn=fqn: self._start(fqn, args, kwargs), with_kwargs=True))
            measured = kinds.setdefault(block_signature(module), [])
            if self._reuse and measured:
                module.forward = self._stand_in(fqn, module, measured)
            else:
                measured.append(fqn)
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        for module in self._modules.values():
            module.__dict__.pop("forward", None)

    def _start(self, fqn: str, args: tuple, kwargs: dict) -> None:
        counted = self._saved is not None and self._saved.counted(_differentiable((args, kwargs)))  # not RoPE tables
        self._entries.setdefault(fqn, (_leaf_meta((args, kwargs)), counted))
        self._on_start(fqn)

    def _output_hook(self, fqn: str) -> Callable:
        def hook(module, args, kwargs, output):
            counts = self._record.segments[fqn]
            inputs = _differentiable((args, kwargs))
            counts.input_bytes = tensor_bytes(inputs)
            counts.input_elements = sum(t.numel() for t in inputs)
            if self._saved is not None:
                counts.input_saved_bytes = tensor_bytes([t for t in inputs if self._saved.kept_in(fqn, t)])
            counts.output_bytes = tensor_bytes(output)
            if fqn not in self._record.measured_as and fqn not in self._outputs:  # a rerun in backward: not again
                self._outputs[fqn] = output
                if self._saved is not None:
                    self._saved_outputs[fqn] = [i for i, leaf in enumerate(tree_flatten(output)[0])
                                                if isinstance(leaf, torch.Tensor) and self._saved.kept_in(fqn, leaf)]
        return hook

    def _stand_in(self, fqn: str, module: nn.Module, measured: list[str]) -> Callable:
        real_forward = type(module).forward.__get__(module)

        def forward(*args, **kwargs):
            entry = self._entries[fqn]
            representative = None if fqn in measured else next(
                (rep for rep in measured if rep in self._outputs and self._entries[rep] == entry), None)
            if representative is None:  # called otherwise than any measured (or a rerun of one): measured for real
                if fqn not in measured:
                    measured.append(fqn)
                return real_forward(*args, **kwargs)
            self._record.measured_as[fqn] = representative
            outputs = _outputs_like(self._outputs[representative], args, kwargs)
            if self._saved is not None:
                leaves = tree_flatten(outputs)[0]
                self._saved.mark_counted([leaves[i] for i in self._saved_outputs.get(representative, ())])
            return outputs

        return forward


def _outputs_like(template: Any, args: tuple, kwargs: dict) -> Any:
    """Outputs shaped like ``template`` that depend on the inputs (so backward flows through)
    while computing and saving nothing worth counting."""
    leaves, spec = tree_flatten(template)
    inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    source = next((t for t in inputs if t.requires_grad), inputs[0] if inputs else None)
    out = []
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif source is not None and source.shape == leaf.shape and source.dtype == leaf.dtype:
            out.append(source.clone())
        elif source is not None and leaf.is_floating_point():
            out.append(source.new_zeros(leaf.shape, dtype=leaf.dtype) + source.sum().to(leaf.dtype) * 0)
        else:
            out.append(torch.empty_like(leaf))
    return tree_unflatten(out, spec)
