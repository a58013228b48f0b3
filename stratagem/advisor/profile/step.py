"""Run one training step of a model on fake tensors, with the counters of :mod:`.measure` on.

Blocks identical to one already measured (same class, same parameter shapes, same repr) and
called with inputs of the same shapes are not run again: their forward is replaced by a cheap
stand-in that returns outputs of the recorded shapes, and they inherit the measured costs. An
80-layer model therefore costs about one layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten, tree_unflatten

from stratagem.advisor.profile.fused import FusedKernels
from stratagem.advisor.profile.measure import CostCounter, RunRecord, SavedTensorCounter, tensor_bytes


def _differentiable(tree: Any) -> list[torch.Tensor]:
    """The tensors of ``tree`` that carry gradients (hidden states, not masks or RoPE tables);
    all of its tensors when none does."""
    tensors = [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]
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


class _BlockReuse:
    """Record each block's input and output bytes; with ``reuse``, measure the first of each
    group of identical blocks and stand in for the others."""

    def __init__(self, model: nn.Module, blocks: tuple[str, ...], record: RunRecord, *, reuse: bool) -> None:
        self._record = record
        self._reuse = reuse
        self._modules = {fqn: model.get_submodule(fqn) for fqn in blocks}
        self._seen: dict[tuple, str] = {}  # signature -> representative FQN
        self._calls: dict[str, tuple[tuple, Any]] = {}  # representative -> (input meta, output)
        self._handles: list = []

    def __enter__(self) -> _BlockReuse:
        for fqn, module in self._modules.items():
            self._handles.append(module.register_forward_hook(self._output_hook(fqn), with_kwargs=True))
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
            if fqn not in self._record.measured_as:
                self._calls[fqn] = (_leaf_meta((args, kwargs)), output)
        return hook

    def _stand_in(self, fqn: str, module: nn.Module, representative: str) -> Callable:
        real_forward = type(module).forward.__get__(module)

        def forward(*args, **kwargs):
            meta, rep_output = self._calls.get(representative, (None, None))
            if meta != _leaf_meta((args, kwargs)):
                return real_forward(*args, **kwargs)  # other input shapes: measure it for real
            self._record.measured_as[fqn] = representative
            return _outputs_like(rep_output, args, kwargs)

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


Step = Callable[..., torch.Tensor]
"""``step(model, *args, **kwargs) -> loss``: what one training step runs on its inputs, calling the
model (or a child of it) inside; the fake step runs backward from the loss it returns."""


class _StepCall(nn.Module):
    """The step as one module call, ``model`` its child: ``functional_call`` swaps the fake state
    in, and the module tracker names the model's modules from here, whether the step calls the
    model itself or one of its children (a LightningModule's ``self.model(...)``)."""

    def __init__(self, model: nn.Module, step: Step) -> None:
        super().__init__()
        self.model = model
        self._step = step

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._step(self.model, *args, **kwargs)


class _ModelOutput:
    """The output of the model's forward in a step: the last output of the outermost module called
    among ``model`` and the modules holding its blocks' container (a step may skip the model's own
    forward and call a child)."""

    def __init__(self, model: nn.Module, blocks: tuple[str, ...]) -> None:
        parts = blocks[0].split(".")[:-2] if blocks else []  # above the container: model.layers.0 -> model
        self._modules = [model.get_submodule(".".join(parts[:depth])) for depth in range(len(parts) + 1)]
        self._outputs: dict[int, Any] = {}
        self._handles: list = []

    def __enter__(self) -> _ModelOutput:
        for depth, module in enumerate(self._modules):
            self._handles.append(module.register_forward_hook(
                lambda _module, _args, output, depth=depth: self._outputs.__setitem__(depth, output)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()

    def bytes(self) -> int:
        """Bytes of the outermost output recorded (0 when none of the modules ran)."""
        return tensor_bytes(self._outputs[min(self._outputs)]) if self._outputs else 0


def run_fake_step(
    model: nn.Module,
    state: dict[str, torch.Tensor],
    args: tuple,
    kwargs: dict,
    *,
    blocks: tuple[str, ...],
    step: Step,
    autocast_dtype: torch.dtype | None,
    seq_len: int | None = None,
    batch_size: int | None = None,
    reuse_identical_blocks: bool = True,
) -> RunRecord:
    """One ``step`` of ``model`` on ``args``/``kwargs``, forward and backward, with the model's
    parameters and buffers replaced by the fake tensors in ``state``; must run inside the
    FakeTensorMode that made them. With ``reuse_identical_blocks`` each group of identical blocks
    is measured once. ``seq_len`` and ``batch_size`` identify attention-score tensors
    (``[b, heads, s, s]``)."""
    record = RunRecord()
    root = f"{_StepCall.__name__}.model"  # the module tracker's name for the model (see _StepCall)
    block_of = {f"{root}.{fqn}": fqn for fqn in blocks}
    state_names: dict[StorageWeakRef, str] = {}
    for name, tensor in state.items():  # tied names share a tensor: the first name owns it
        state_names.setdefault(StorageWeakRef(tensor.untyped_storage()), name)
    gradient_shapes = {(tuple(t.shape), t.dtype) for t in state.values() if t.requires_grad}
    counter = CostCounter(block_of=block_of, record=record, state_names=state_names,
                          gradient_shapes=gradient_shapes, has_blocks=bool(blocks), seq_len=seq_len,
                          batch_size=batch_size)
    saved = counter.saved = SavedTensorCounter(counter, record, set(state_names))
    autocast = torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None)
    hooks = torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack)
    call = _StepCall(model, step)
    with _BlockReuse(model, blocks, record, reuse=reuse_identical_blocks), _ModelOutput(model, blocks) as output:
        with counter, hooks, FusedKernels(counter):
            with autocast:
                loss = torch.func.functional_call(call, {f"model.{k}": v for k, v in state.items()}, args, kwargs,
                                                  strict=False)
            loss.backward()
    record.output_bytes = output.bytes()
    return record
