"""Run one training step of a model on fake tensors, with the counters of :mod:`.measure` on: the
model and its loss, or a whole training step around the model (a LightningModule's
``training_step``), forward and backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten

from stratagem.advisor.profile.attention import CudaAttention, unpacked_sequences
from stratagem.advisor.profile.autocast import CudaAutocast
from stratagem.advisor.profile.block_reuse import BlockReuse, tensor_bytes
from stratagem.advisor.profile.block_inputs import BlockInputs
from stratagem.advisor.profile.compiled import measure_compiled
from stratagem.advisor.profile.counts import RunRecord
from stratagem.advisor.profile.fused import FusedKernels
from stratagem.advisor.profile.fusion import FusionTracker
from stratagem.advisor.profile.measure import CostCounter, SavedTensorCounter
from stratagem.advisor.profile.own_checkpoints import ClaimedInputs
from stratagem.errors import UsageError
from stratagem.plan.tp_styles import is_sequence_norm


Step = Callable[..., torch.Tensor]
"""``step(model, *args, **kwargs) -> loss``: what one training step runs on its inputs, calling the
model (or a child of it) inside; the fake step runs backward from the loss it returns."""


class _StepCall(nn.Module):
    """The step as one module call, ``model`` its child: ``functional_call`` swaps the fake state
    in, and the module tracker names the model's modules from here, whether the step calls the
    model itself or one of its children (a LightningModule's ``self.model(...)``). The call runs
    the step's forward under autocast in ``autocast_dtype`` (none where None), then its backward,
    so that the fake state is still swapped in when a model that checkpoints its own blocks (a
    Hugging Face model after ``gradient_checkpointing_enable()``) recomputes them in backward:
    after ``functional_call`` returned, the recompute ran on the module's own parameters (fp32,
    or meta) and checkpointing refused it."""

    def __init__(self, model: nn.Module, step: Step, autocast_dtype: torch.dtype | None) -> None:
        super().__init__()
        self.model = model
        self._step = step
        self._autocast_dtype = autocast_dtype

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        with torch.autocast("cpu", dtype=self._autocast_dtype, enabled=self._autocast_dtype is not None):
            loss = self._step(self.model, *args, **kwargs)
        _check_differentiable(loss)
        loss.backward()
        return loss


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

    def returns_loss(self) -> bool:
        """Whether the outermost output recorded holds a scalar that needs a gradient: the model's
        forward computes the loss (a Hugging Face model given its labels), so the loss runs inside
        the root FSDP unit's forward rather than after it (``RankView.loss_in_forward``)."""
        if not self._outputs:
            return False
        output = self._outputs[min(self._outputs)]
        return any(isinstance(leaf, torch.Tensor) and leaf.dim() == 0 and leaf.requires_grad
                   for leaf in (*tree_flatten(output)[0], getattr(output, "loss", None)))


def _sequence_norms(model: nn.Module, blocks: tuple[str, ...], root: str) -> frozenset[str]:
    """The module tracker's names (under ``root``) of the blocks' sequence norms."""
    return frozenset(f"{root}.{fqn}.{name}" for fqn in blocks
                     for name, sub in model.get_submodule(fqn).named_modules() if name and is_sequence_norm(sub))


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
    kernels: str = "gpu",
) -> RunRecord:
    """One ``step`` of ``model`` on ``args``/``kwargs``, forward and backward, with the model's
    parameters and buffers replaced by the fake tensors in ``state``; must run inside the
    FakeTensorMode that made them. With ``reuse_identical_blocks`` each group of identical blocks
    is measured once. ``seq_len`` and ``batch_size`` identify attention-score tensors
    (``[b, heads, s, s]``). ``kernels``: count what a GPU runs (``"gpu"``: fused kernels, one-byte
    dropout masks, CUDA's choice of attention kernel and its autocast's float32 list) or the CPU
    (``"cpu"``)."""
    record = RunRecord()
    root = f"{_StepCall.__name__}.model"  # the module tracker's name for the model (see _StepCall)
    block_of = {f"{root}.{fqn}": fqn for fqn in blocks}
    # tied names share a tensor: the first name owns it (written last)
    state_names = {StorageWeakRef(tensor.untyped_storage()): name for name, tensor in reversed(state.items())}
    gradient_shapes = {(tuple(t.shape), t.dtype) for t in state.values() if t.requires_grad}
    counter = CostCounter(block_of=block_of, record=record, state_names=state_names,
                          gradient_shapes=gradient_shapes, has_blocks=bool(blocks), seq_len=seq_len,
                          batch_size=batch_size, gpu_kernels=kernels == "gpu", model_name=root,
                          sequence_norms=_sequence_norms(model, blocks, root))
    saved = counter.saved = SavedTensorCounter(counter, record, set(state_names))
    hooks = torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack)
    reuse = BlockReuse(model, blocks, record, reuse=reuse_identical_blocks, on_start=counter.policies.start,
                       saved=saved)
    attention = CudaAttention()
    # entered last, handled first: CUDA's autocast casts an rms_norm's input before its fused kernel counts it
    on_gpu = (FusedKernels(counter), attention, CudaAutocast()) if kernels == "gpu" else ()
    inputs = BlockInputs(model, blocks, counter)
    call = _StepCall(model, step, autocast_dtype)
    claimed = ClaimedInputs(inputs.modules, saved.claim)
    with reuse, _ModelOutput(model, blocks) as output, inputs, claimed, contextlib.ExitStack() as modes:
        for mode in (counter, hooks, *on_gpu, unpacked_sequences()):
            modes.enter_context(mode)
        torch.func.functional_call(call, {f"model.{k}": v for k, v in state.items()}, args, kwargs, strict=False)
    counter.rebuilt.settle()
    counter.held.finish()
    record.block_inputs = inputs.calls
    stood_in = tuple(f"{fqn}." for fqn in record.measured_as)  # blocks reuse ran no backward through
    record.unused_params = tuple(name for name, t in state.items()
                                 if t.requires_grad and t.grad is None and not name.startswith(stood_in))
    if kernels == "gpu":  # torch.compile runs on GPUs only (the search offers it nowhere else)
        measure_compiled(inputs.modules, inputs.calls, state, record, autocast_dtype=autocast_dtype)
    record.output_bytes, record.loss_in_forward = output.bytes(), output.returns_loss()
    record.math_attention_reasons = attention.math_reasons
    for block, policies in counter.policies.counts.items():
        record.segments[block].policies = policies
    _add_fused(record, counter.fusion)
    return record


def _check_differentiable(loss: Any) -> None:
    """A :class:`UsageError` unless ``loss`` is a tensor backward can start from."""
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return
    what = (f"a {loss.dtype} tensor that needs no gradient" if isinstance(loss, torch.Tensor)
            else f"{type(loss).__name__} {loss!r}"[:80])
    raise UsageError(f"the step's loss is {what}: no trainable parameter reaches it, so there is nothing to "
                     "train\nHINT: check that some parameters require grad (not all frozen) and that the "
                     "output the loss reads is differentiable (not argmax, not integers, not detached)")


def _add_fused(record: RunRecord, fusion: FusionTracker) -> None:
    """Each segment's bytes and kernels fused: a compiled block's as counted on the graphs inductor
    lowers (:mod:`~stratagem.advisor.profile.compiled_kernels`), else on the eager step's operators
    (:mod:`~stratagem.advisor.profile.fusion`: where the compiled trace failed, and outside the blocks)."""
    for counts in record.segments.values():
        if counts.compiled:
            counts.fwd_fused_op_bytes, counts.fwd_fused_ops = counts.compiled.forward
            counts.bwd_fused_op_bytes, counts.bwd_fused_ops = counts.compiled.backward
    for (seg, is_bw), (moved, groups) in fusion.fused().items():
        counts = record.segments[seg]
        if counts.compiled:
            continue
        if is_bw:
            counts.bwd_fused_op_bytes += moved
            counts.bwd_fused_ops += groups
        else:
            counts.fwd_fused_op_bytes += moved
            counts.fwd_fused_ops += groups
