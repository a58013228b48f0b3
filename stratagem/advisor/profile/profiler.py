"""``profile_model``: measure what a model costs per block, on fake tensors.

``profile_model`` runs one forward and backward step on ``FakeTensorMode`` (CPU): no weight or
activation is ever allocated, so a 70B model profiles in seconds on a laptop. The profile keeps,
per segment (the embedding, every block, the head with the loss), the parameters, forward and
backward FLOPs, bytes saved for backward and the bytes flowing in and out. Later parts read it:
the cost models scale it by micro-batch size and divide it by parallel degrees, the plugins take
its blocks as FSDP, checkpoint and pipeline units.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.utils._pytree import tree_flatten, tree_map

from stratagem.advisor.profile.attention import math_attention_note
from stratagem.advisor.profile.convolutions import memory_format
from stratagem.advisor.profile.counts import RunRecord, SegmentCounts
from stratagem.advisor.profile.kernel_fallbacks import KernelFallbacks
from stratagem.advisor.profile.fake_tensor_log import quiet_fake_tensor_log
from stratagem.advisor.profile.forward_held import forward_held_bytes
from stratagem.advisor.profile.measure import EMBED, HEAD
from stratagem.advisor.profile.step import Step, run_fake_step
from stratagem.advisor.profile.value_reads import ValueReads
from stratagem.plan.precision import Precision, get_precision, in_compute_dtype, torch_dtype
from stratagem.advisor.profile.model_profile import KERNELS, AttentionCall, ModelProfile, SegmentProfile, policy_field
from stratagem.advisor.profile.structure import (
    attention_heads,
    class_wrap_extra,
    find_blocks,
    linear_layers,
    pp_tied_params,
    pp_unavailable,
)
from stratagem.advisor.profile.tp_layout import LinearCallRecorder, SplitKept, find_tp_layout, split_fields
from stratagem.advisor.profile.vocab_layout import VocabCallRecorder, find_vocab_layout, vocab_segment_fields
from stratagem.errors import UsageError
from stratagem.units import format_list
from stratagem.plan.stages import removal_convention

__all__ = ["ModelProfile", "SegmentProfile", "input_shape", "profile_model"]


def profile_model(
    model: nn.Module,
    example_inputs: Sequence[Any] | Mapping[str, Any],
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    step_fn: Step | None = None,
    precision: str = "bf16-mixed",
    name: str | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    reuse_identical_blocks: bool = True,
    kernels: str = "gpu",
) -> ModelProfile:
    """Profile one training step of ``model`` on ``example_inputs`` without allocating anything.

    ``model`` may live on any device, meta included; it is not modified. ``example_inputs`` is a
    tuple of positional arguments or a dict of keyword arguments; only their shapes and dtypes
    matter. ``loss_fn(output) -> scalar`` seeds the backward pass; without it a scalar output
    (or an output's ``.loss``) is used, else the sum of the outputs (the profile says so).
    ``step_fn(model, *inputs) -> scalar`` (``**inputs`` for a dict) runs a whole training step
    instead, e.g. a LightningModule's ``training_step`` on a batch: ``example_inputs`` are then the
    step's, it calls the model (or a child) itself, and what it computes after the last block
    (the loss) counts in the head, before the first block in the embedding. ``batch_size``
    defaults to the first input's leading dimension; ``seq_len`` to its second when that input
    holds integer token ids (give both when the step's inputs are not the model's).
    ``reuse_identical_blocks=False`` measures every block instead of one per group of identical
    blocks (slower; the same numbers). ``kernels``: count what a GPU's kernels do (``"gpu"``, the
    default) or what CPU ranks run (``"cpu"``; :mod:`~stratagem.advisor.profile.measure`). A
    ``*-mixed`` precision's step is measured twice: under autocast, and with parameters in the
    compute dtype as FSDP2 runs it (:attr:`ModelProfile.in_compute_dtype`); a step that cannot run
    under autocast (:class:`AutocastRefused`) is measured the second way only, and says why
    (:attr:`ModelProfile.autocast_refused`).
    """
    if loss_fn is not None and step_fn is not None:
        raise UsageError("profile_model takes loss_fn or step_fn, not both\nHINT: compute the loss inside step_fn")
    if kernels not in KERNELS:
        raise UsageError(f"kernels={kernels!r} is not one of {', '.join(map(repr, KERNELS))}")
    options = dict(loss_fn=loss_fn, step_fn=step_fn, name=name, batch_size=batch_size, seq_len=seq_len,
                   reuse_identical_blocks=reuse_identical_blocks, kernels=kernels)
    try:
        profile = _profile_step(model, example_inputs, precision=precision, **options)
    except AutocastRefused as refused:
        if in_compute_dtype(precision) == precision:
            raise
        variant = _profile_step(model, example_inputs, precision=in_compute_dtype(precision), **options)
        note = f"measured in {variant.precision}, as FSDP's mixed precision runs it: {refused.reason}"
        return replace(variant, precision=precision, in_compute_dtype=variant, autocast_refused=refused.reason,
                       notes=(*variant.notes, note))
    if in_compute_dtype(precision) == precision:
        return profile
    variant = _profile_step(model, example_inputs, precision=in_compute_dtype(precision), **options)
    return replace(profile, in_compute_dtype=variant, profile_seconds=profile.profile_seconds + variant.profile_seconds)


class AutocastRefused(UsageError):
    """The model's step cannot run under autocast; ``reason`` says why, for the plans left out."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def _profile_step(
    model: nn.Module,
    example_inputs: Sequence[Any] | Mapping[str, Any],
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    step_fn: Step | None,
    precision: str,
    name: str | None,
    batch_size: int | None,
    seq_len: int | None,
    reuse_identical_blocks: bool,
    kernels: str,
) -> ModelProfile:
    """One step of ``model`` in ``precision`` on fake tensors (:func:`profile_model`)."""
    started = time.perf_counter()
    prec = get_precision(precision)
    structure = find_blocks(model)
    args, kwargs = _split_inputs(example_inputs)
    batch_size, seq_len = _batch_shape(args, kwargs, batch_size, seq_len)
    notes: list[str] = []
    # Inputs made under a FakeTensorMode (a factory's, see model_source) keep their mode, so
    # tensors a loss function closes over stay compatible with the step's.
    fake_mode = detect_fake_mode(tree_flatten((args, kwargs))[0]) or FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        state = _fake_state(model, prec)
        args, kwargs = tree_map(functools.partial(_fake_like, floating=_input_dtype(prec)), (args, kwargs))
        with LinearCallRecorder(model, structure.blocks) as calls, VocabCallRecorder(model, structure.blocks) as vocab_calls, \
                KernelFallbacks(model) as fallbacks, ValueReads() as value_reads, _model_errors(name or type(model).__name__):
            record = run_fake_step(model, state, args, kwargs, blocks=structure.blocks,
                                   step=_resolve_step(loss_fn, step_fn, notes),
                                   autocast_dtype=torch_dtype(prec.compute_dtype) if prec.autocast else None,
                                   seq_len=seq_len, batch_size=batch_size,
                                   reuse_identical_blocks=reuse_identical_blocks, kernels=kernels)
        if record.math_attention_reasons:
            notes.append(math_attention_note(record.math_attention_reasons))
        notes += [note for note in (record.compiled_note, record.cache_note, fallbacks.note(), value_reads.note()) if note]
        heads, kv_heads = attention_heads(model)
        tp = find_tp_layout(model, structure.container, calls, state, record.block_inputs, kv_heads=kv_heads,
                            autocast_dtype=torch_dtype(prec.compute_dtype) if prec.autocast else None,
                            gpu_kernels=kernels == "gpu")
        vocab = _vocab_layout(model, vocab_calls, (args, kwargs), state, notes) if tp.layout else ()
    return ModelProfile(
        name=name or type(model).__name__, precision=prec.name, kernels=kernels, batch_size=batch_size,
        seq_len=seq_len, block_container=structure.container, num_heads=heads, num_kv_heads=kv_heads,
        tp_layout=tp.layout + vocab, tp_unavailable=tp.unavailable, pp_unavailable=pp_unavailable(model, structure),
        pp_traced=removal_convention(model, block_container=structure.container) is None,
        pp_tied_params=pp_tied_params(model, structure), ddp_unavailable=ddp_refusal(record.unused_params),
        class_wrap_extra=class_wrap_extra(model, structure),
        sp_unavailable=sp_refusal(record.block_inputs) or tp.sp_unavailable,
        block_sequence=block_sequence(record.block_inputs), loss_in_forward=record.loss_in_forward,
        notes=tuple(notes), profile_seconds=time.perf_counter() - started,
        **_assemble(model, structure.blocks, record, prec, notes, calls, (vocab, vocab_calls), tp.kept),
    )


def block_sequence(block_inputs: dict[str, tuple[tuple, dict]]) -> int | None:
    """The length of the sequence sequence parallelism splits over the TP ranks: dimension 1 of the
    blocks' first activation, ``[batch, sequence, width]``; None where it is not 3-D."""
    first = _first_activation(block_inputs)
    return first.size(1) if first is not None and first.dim() >= 3 else None


def sp_refusal(block_inputs: dict[str, tuple[tuple, dict]]) -> str | None:
    """Why sequence parallelism cannot split the blocks' inputs, or None: it shards their dimension
    1, the sequence of ``[batch, sequence, width]`` activations, which a 2-D input lacks."""
    first = _first_activation(block_inputs)
    if first is None or first.dim() >= 3:
        return None
    return f"the blocks' inputs ({list(first.shape)}) have no sequence dimension for it to split"


def _first_activation(block_inputs: dict[str, tuple[tuple, dict]]) -> torch.Tensor | None:
    """The blocks' first floating-point input (the residual stream), or None."""
    return next((leaf for args, kwargs in block_inputs.values() for leaf in tree_flatten((args, kwargs))[0]
                 if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()), None)


def ddp_refusal(unused: tuple[str, ...]) -> str | None:
    """Why DDP cannot train a model whose step gives the parameters ``unused`` no gradient, or None:
    DDP waits for every parameter's gradient before it reduces, and fails the next step without
    them (its find_unused_parameters walks the autograd graph each step, and stratagem leaves it
    off); FSDP reduces what it has."""
    if not unused:
        return None
    return (f"{format_list(unused)} get no gradient in a step, and DDP waits for every parameter's "
            "(FSDP's plans, zero 2 or 3, take them)")


def _vocab_layout(model: nn.Module, calls: VocabCallRecorder, inputs: Any, state: dict[str, torch.Tensor],
                  notes: list[str]) -> tuple[tuple[str, str], ...]:
    """The vocabulary pairs of the TP layout; a note saying what the vocabulary split leaves out,
    for a model with an input embedding."""
    layout, unsplit = find_vocab_layout(model, calls, inputs, state)
    if unsplit and layout:
        notes.append(f"tensor parallelism splits the vocabulary only partly: {unsplit}")
    elif unsplit and not unsplit.startswith("no Embedding"):
        notes.append(f"tensor parallelism keeps the vocabulary whole on every rank: {unsplit}")
    return layout


# What each of fake tensors' data-dependent errors means for the model's forward.
_DATA_DEPENDENT = {
    DynamicOutputShapeException: "an output whose shape depends on the data, such as nonzero, a "
                                 "boolean mask's selection or unique",
    DataDependentOutputException: "a Python value read from a tensor, such as .item() or an if on one",
}


def _where(err: BaseException) -> str:
    """", at FILE:LINE in FUNCTION" (what :func:`_model_errors` says of a failure): the innermost
    frame of ``err``'s traceback outside torch, this package and contextlib (the model's code, or a
    library's it calls), a package's file from the package's folder on; "" if every frame is theirs."""
    ours = tuple(os.path.join(folder, "") for folder in (Path(torch.__file__).parent, Path(__file__).parents[2]))
    frames = [frame for frame in traceback.extract_tb(err.__traceback__)
              if not frame.filename.startswith(ours) and frame.filename != contextlib.__file__]
    if not frames:
        return ""
    path = Path(frames[-1].filename)
    short = next((path.relative_to(folder) for folder in map(Path, sys.path)
                  if folder.name in ("site-packages", "dist-packages") and path.is_relative_to(folder)), path)
    return f", at {short}:{frames[-1].lineno} in {frames[-1].name}"


@contextlib.contextmanager
def _model_errors(name: str) -> Iterator[None]:
    """A model that fails on its example inputs is the user's to fix: say so without a traceback."""
    try:
        with quiet_fake_tensor_log():
            yield
    except UsageError:
        raise
    except (DynamicOutputShapeException, DataDependentOutputException) as err:
        op = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UsageError(f"{name}'s forward depends on its tensors' values ({op}: "
                         f"{_DATA_DEPENDENT[type(err)]}{_where(err)}), which profiling on fake tensors cannot see"
                         "\nHINT: give every shape and branch of forward from the inputs' shapes alone: "
                         "route tokens to experts by sorting them (argsort) and splitting them by counts "
                         "that fake tensors take as balanced, as stratagem.models.moe.MoEFeedForward does "
                         "(balanced_counts), or at a fixed capacity per expert, rather than by boolean "
                         "masks or nonzero; read values (.item(), an if on a tensor) outside forward") from err
    except Exception as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        if _float32_in_grouped_mm(err):
            reason = ("its mixture-of-experts layers call torch._grouped_mm, whose kernel takes no float32 "
                      "weights and which autocast does not cast for (pytorch/pytorch#174763)")
            raise AutocastRefused(f"{name}: {reason} ({first_line}); a GPU run with float32 weights fails "
                                  "alike\nHINT: --precision bf16-true (the weights in bfloat16), or experts "
                                  "that call torch.bmm, which autocast casts (Hugging Face: the config's "
                                  "experts_implementation 'batched_mm', which gathers each token's experts' "
                                  "weights: far more memory)", reason) from err
        if "SparseTensorImpl" in first_line:
            raise UsageError(f"{name} makes sparse gradients (nn.Embedding or nn.EmbeddingBag with sparse=True), "
                             f"which the profile's fake tensors cannot hold ({first_line})\nHINT: profile it "
                             "with sparse=False: its dense gradients are what FSDP's plans train") from err
        raise UsageError(f"{name} failed on its example inputs (fake tensors){_where(err)}: {type(err).__name__}: "
                         f"{first_line}\nHINT: check that the inputs fit the model (batch size, "
                         "sequence length, image size) by running one real batch through it") from err


def _float32_in_grouped_mm(err: BaseException) -> bool:
    """Whether ``err`` is torch's grouped GEMM refusing float32 inputs (its check of their dtypes)."""
    return ("float32" in str(err).lower() or "Float" in str(err)) and any(
        "grouped_mm" in frame.name for frame in traceback.extract_tb(err.__traceback__))


def _split_inputs(example_inputs: Sequence[Any] | Mapping[str, Any]) -> tuple[tuple, dict]:
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    return tuple(example_inputs), {}


def input_shape(example_inputs: Sequence[Any] | Mapping[str, Any]) -> tuple[int, int | None]:
    """The batch size and sequence length :func:`profile_model` reads from ``example_inputs``."""
    args, kwargs = _split_inputs(example_inputs)
    return _batch_shape(args, kwargs, None, None)


def _batch_shape(args: tuple, kwargs: dict, batch_size: int | None, seq_len: int | None) -> tuple[int, int | None]:
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not tensors:
        raise UsageError("example_inputs hold no tensor with a batch dimension; "
                         "HINT: pass the model's inputs for one batch, e.g. (tokens,) or {'input_ids': ids}")
    first = tensors[0]
    if batch_size is None:
        batch_size = int(first.shape[0])
    if seq_len is None and first.dim() == 2 and not first.is_floating_point():
        seq_len = int(first.shape[1])
    return batch_size, seq_len


def _fake_like(value: Any, *, floating: torch.dtype | None) -> Any:
    """A fake CPU tensor with ``value``'s shape, dtype and channels-last layout, if it has one
    (values never matter here), a floating one in ``floating`` when given; a fake tensor (a
    factory's) itself, cast likewise."""
    if not isinstance(value, torch.Tensor):
        return value
    dtype = floating if floating is not None and value.is_floating_point() else value.dtype
    if isinstance(value, FakeTensor):
        return value if value.dtype == dtype else value.to(dtype)
    return torch.empty(value.shape, dtype=dtype, device="cpu", requires_grad=value.requires_grad,
                       memory_format=memory_format(value))


def _input_dtype(prec: Precision) -> torch.dtype | None:
    """The dtype floating inputs reach a model whose parameters are in 16 bits without autocast:
    theirs (FSDP2's mixed precision casts forward inputs; the strategies cast bf16-true's)."""
    return None if prec.param_dtype == "float32" else torch_dtype(prec.param_dtype)


def _fake_state(model: nn.Module, prec: Precision) -> dict[str, torch.Tensor]:
    """Fake parameters (leaves, in the precision's parameter dtype, channels-last where the model's
    are) and buffers for every name, tied names sharing one tensor."""
    made: dict[int, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) not in made:
            dtype = torch_dtype(prec.param_dtype) if param.is_floating_point() else param.dtype
            made[id(param)] = torch.empty(param.shape, dtype=dtype, device="cpu", requires_grad=param.requires_grad,
                                          memory_format=memory_format(param))
        state[name] = made[id(param)]
    for name, buf in model.named_buffers(remove_duplicate=False):
        if id(buf) not in made:
            made[id(buf)] = torch.empty(buf.shape, dtype=buf.dtype, device="cpu")
        state[name] = made[id(buf)]
    return state


def _resolve_step(loss_fn: Callable | None, step_fn: Step | None, notes: list[str]) -> Step:
    """The step the fake run calls: ``step_fn``, its loss checked, else the model then the loss."""
    if step_fn is None:
        loss = _resolve_loss(loss_fn, notes)
        return lambda model, *args, **kwargs: loss(model(*args, **kwargs))

    def step(model: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = step_fn(model, *args, **kwargs)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            what = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise UsageError(f"step_fn returned {what}, not a scalar loss\n"
                             "HINT: return the loss the step's backward starts from")
        return loss

    return step


def _resolve_loss(loss_fn: Callable | None, notes: list[str]) -> Callable[[Any], torch.Tensor]:
    if loss_fn is not None:
        return loss_fn

    def default_loss(output: Any) -> torch.Tensor:
        loss = getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor) and loss.dim() == 0:
            return loss
        if isinstance(output, torch.Tensor) and output.dim() == 0:
            return output
        notes.append("no loss function given: backward was seeded with the sum of the outputs, "
                     "so the loss's own cost is not included")
        leaves = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        return sum(t.float().sum() for t in leaves)

    return default_loss


def _assemble(model: nn.Module, blocks: tuple[str, ...], record: RunRecord, prec: Precision,
              notes: list[str], calls: LinearCallRecorder,
              vocab: tuple[tuple[tuple[str, str], ...], VocabCallRecorder],
              tp_kept: dict[str, SplitKept]) -> dict[str, Any]:
    """Turn the raw run record into the embed/blocks/head segment profiles (each block's Linears
    with the rows ``calls`` saw them multiply; what the vocabulary split divides, ``vocab``: its
    layout pairs and their calls; what a TP split keeps whole, ``tp_kept``, by block)."""
    owner = _state_owners(model, blocks, record, notes)
    split = vocab_segment_fields(model, *vocab, owner, record.segments[HEAD].by_width)
    sizes = _state_sizes(model, prec)
    by_segment: dict[str, list[str]] = {}
    for state_name, seg in owner.items():
        by_segment.setdefault(seg, []).append(state_name)

    def make(seg: str, kind: str, counts: SegmentCounts, **extra: Any) -> SegmentProfile:
        names = by_segment.get(seg, [])
        params = [sizes[n] for n in names if sizes[n][2]]
        buffers = [sizes[n] for n in names if not sizes[n][2]]
        return SegmentProfile(
            name=seg, kind=kind,
            num_params=sum(n for n, _, _ in params), num_tensors=len(params),
            largest_tensor_params=max((n for n, _, _ in params), default=0),
            param_bytes=sum(b for _, b, _ in params),
            buffer_bytes=sum(b for _, b, _ in buffers),
            fwd_flops=counts.fwd_flops, bwd_flops=counts.bwd_flops,
            saved_bytes=counts.saved_bytes, saved_param_copy_bytes=counts.saved_param_copy_bytes,
            forward_param_copy_bytes=counts.forward_param_copy_bytes, rebuilt_bytes=counts.rebuilt_bytes,
            bwd_held_bytes=counts.bwd_held_bytes, fwd_held_bytes=forward_held_bytes(counts),
            attention_fwd_flops=counts.attention_fwd_flops, attention_saved_bytes=counts.attention_saved_bytes,
            input_bytes=counts.input_bytes, input_saved_bytes=counts.input_saved_bytes,
            input_elements=counts.input_elements, output_bytes=counts.output_bytes, fwd_ops=counts.fwd_ops,
            bwd_ops=counts.bwd_ops, fwd_op_bytes=counts.fwd_op_bytes, bwd_op_bytes=counts.bwd_op_bytes,
            fwd_unaligned_flops=counts.fwd_unaligned_flops, bwd_unaligned_flops=counts.bwd_unaligned_flops,
            fwd_param_op_bytes=counts.fwd_param_op_bytes, bwd_param_op_bytes=counts.bwd_param_op_bytes,
            bwd_largest_output_bytes=counts.bwd_largest_output_bytes, fwd_fused_op_bytes=counts.fwd_fused_op_bytes,
            bwd_fused_op_bytes=counts.bwd_fused_op_bytes,
            fwd_fused_ops=counts.fwd_fused_ops, bwd_fused_ops=counts.bwd_fused_ops, sp_norm_ops=counts.sp_norm_ops,
            compiled_saved_bytes=counts.compiled.saved_bytes if counts.compiled else 0,
            convs=tuple(counts.convs), batch_norms=tuple(counts.batch_norms), fused_attention=_attention_calls(counts), **_policy_fields(counts), **extra,
        )

    block_profiles = []
    for fqn in blocks:
        rep = record.measured_as.get(fqn)
        module = model.get_submodule(fqn)
        counts, kept = record.segments[rep or fqn], tp_kept.get(rep or fqn, SplitKept())
        block_profiles.append(make(fqn, type(module).__name__, counts,
                                   linears=linear_layers(module, calls.rows(rep or fqn)), measured_as=rep,
                                   **split_fields(kept, counts)))
    embed_counts = record.segments[EMBED]
    embed_counts.output_bytes = block_profiles[0].input_bytes if block_profiles else record.output_bytes
    head_counts = record.segments[HEAD]
    head_counts.input_bytes = block_profiles[-1].output_bytes if block_profiles else 0
    head_counts.output_bytes = record.output_bytes if block_profiles else 0
    return {
        "embed": make(EMBED, EMBED, embed_counts, **split.get(EMBED, {})),
        "blocks": tuple(block_profiles),
        "head": make(HEAD, HEAD, head_counts, **split.get(HEAD, {})),
    }


def _policy_fields(counts: SegmentCounts) -> dict[str, int]:
    """A block's :class:`SegmentProfile` fields per selective checkpointing policy: what it keeps
    (its input, which the checkpoint holds, and the kept outputs) and what it recomputes."""
    values = {}
    for policy, measured in counts.policies.items():
        for quantity, value in asdict(measured).items():
            values[policy_field(policy, quantity)] = value + (counts.input_bytes if quantity == "kept_bytes" else 0)
    return values


def _attention_calls(counts: SegmentCounts) -> tuple[AttentionCall, ...]:
    """A segment's fused attention calls, one per shape, in the order they first ran."""
    return tuple(AttentionCall(seq_q=seq_q, seq_kv=seq_kv, head_dim=head_dim, causal=causal, fwd_flops=fwd,
                               bwd_flops=bwd, kv_group=kv_group)
                 for (seq_q, seq_kv, head_dim, causal, kv_group), (fwd, bwd) in counts.fused_attention.items())


def _state_owners(model: nn.Module, blocks: tuple[str, ...], record: RunRecord, notes: list[str]) -> dict[str, str]:
    """Segment owning each unique parameter/buffer: its block, else the first segment to use it."""
    owners: dict[str, str] = {}
    seen: set[int] = set()
    unused = 0
    prefixes = tuple((f"{b}.", b) for b in blocks)
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        block = next((b for prefix, b in prefixes if name.startswith(prefix)), None)
        if block is not None:
            owners[name] = block
        elif name in record.param_segment:
            owners[name] = record.param_segment[name]
        else:
            owners[name] = EMBED
            unused += tensor.numel()
    if unused:
        notes.append(f"{unused:,} parameter/buffer elements outside the blocks were never used in the "
                     "profiled step; they are counted with the embedding")
    return owners


def _state_sizes(model: nn.Module, prec: Precision) -> dict[str, tuple[int, int, bool]]:
    """(elements, bytes in the profiled dtype, is-parameter) per state name."""
    sizes: dict[str, tuple[int, int, bool]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        dtype = torch_dtype(prec.param_dtype) if p.is_floating_point() else p.dtype
        sizes[name] = (p.numel(), p.numel() * dtype.itemsize, True)
    for name, b in model.named_buffers(remove_duplicate=False):
        sizes[name] = (b.numel(), b.numel() * b.element_size(), False)
    return sizes
