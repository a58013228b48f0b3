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
    return sum(t.numel() * t.element_size() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor))


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


class SavedOutputs(Protocol):
    """What the step's saved-tensor count tells of a block's output (measure.SavedTensorCounter)."""

    def kept_in(self, segment: str, tree: Any) -> bool: ...

    def mark_counted(self, tree: Any) -> None: ...


class BlockReuse:
    """Record each block's input and output bytes and call ``on_start(fqn)`` as each call of a
    block begins; with ``reuse``, measure the first of each group of identical blocks and stand
    in for the others. A stand-in's output is a new tensor, where the block's own would be what the
    block saved where it saves its output (a bottleneck's last ReLU): ``saved`` marks it counted
    then, lest the next block count again, as its input, what the stand-in's inherited count holds."""

    def __init__(self, model: nn.Module, blocks: tuple[str, ...], record: RunRecord, *, reuse: bool,
                 on_start: Callable[[str], None] = lambda fqn: None, saved: SavedOutputs | None = None) -> None:
        self._record = record
        self._reuse = reuse
        self._on_start = on_start
        self._saved = saved
        self._saves_output: set[str] = set()  # representatives that save their own output
        self._modules = {fqn: model.get_submodule(fqn) for fqn in blocks}
        self._seen: dict[tuple, str] = {}  # signature -> representative FQN
        self._calls: dict[str, tuple[tuple, Any]] = {}  # representative -> (input meta, output)
        self._handles: list = []

    def __enter__(self) -> BlockReuse:
        for fqn, module in self._modules.items():
            self._handles.append(module.register_forward_hook(self._output_hook(fqn), with_kwargs=True))
            self._handles.append(module.register_forward_pre_hook(lambda *_, fqn=fqn: self._on_start(fqn)))
            signature = block_signature(module)
            representative = self._seen.setdefault(signature, fqn)
            if self._reuse and representative != fqn:
                module.forward = self._stand_in(fqn, module, representative)
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        for module in self._modules.values():
            module.__dict__.pop("forward", None)

    def _output_hook(self, fqn: str) -> Callable:
        def hook(module, args, kwargs, output):
            counts = self._record.segments[fqn]
            counts.input_bytes = tensor_bytes(_differentiable((args, kwargs)))
            counts.output_bytes = tensor_bytes(output)
            if fqn not in self._record.measured_as and fqn not in self._calls:  # a rerun in backward: not again
                self._calls[fqn] = (_leaf_meta((args, kwargs)), output)
                if self._saved is not None and self._saved.kept_in(fqn, output):
                    self._saves_output.add(fqn)
        return hook

    def _stand_in(self, fqn: str, module: nn.Module, representative: str) -> Callable:
        real_forward = type(module).forward.__get__(module)

        def forward(*args, **kwargs):
            meta, rep_output = self._calls.get(representative, (None, None))
            if meta != _leaf_meta((args, kwargs)):
                return real_forward(*args, **kwargs)  # other input shapes: measure it for real
            self._record.measured_as[fqn] = representative
            outputs = _outputs_like(rep_output, args, kwargs)
            if representative in self._saves_output:
                self._saved.mark_counted(outputs)
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
