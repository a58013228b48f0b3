"""Tensor and sequence parallelism from the Plan's ``tp_layout``, with DTensor's ``parallelize_module``.

The layout is applied as given, never discovered here: each ``(pattern, style)`` pair names
modules by FQN relative to the model root, ``*`` standing for a block index
(``"layers.*.attention.wq"``). Every pattern must match at least one module (a pipeline stage may
lack the embedding or the head its vocabulary styles name). The block styles split modules inside
``plan.block_container``; the vocabulary styles split the input embedding and the output head
outside it; whatever the layout does not name (the final norm, position embeddings) stays
replicated (plain tensors, the same on every TP rank).

=====================  ==========================================================================
style                  applied as
=====================  ==========================================================================
``colwise``            ``ColwiseParallel``: a Linear's outputs split over the TP ranks (for
                       attention, whole heads: the reference attention reads its local head count
                       from the projected width)
``rowwise``            ``RowwiseParallel``: a Linear's inputs split; the partial results are
                       all-reduced into a replicated output, or reduce-scattered into sequence
                       shards (``Shard(1)``) with sequence parallelism
``sequence_parallel``  with ``plan.sequence_parallel``: ``SequenceParallel`` runs the norm on its
                       rank's sequence shard, then its output is all-gathered into a replicated
                       DTensor for the colwise linears that read it (so backward reduce-scatters
                       their partial gradients); without it the entry is ignored (logged)
``vocab_embedding``    ``RowwiseParallel`` on an Embedding: its table split by rows (the
                       vocabulary), each rank looking up the ids its rows hold, the lookups
                       all-reduced into a replicated plain tensor; its gradient kept as the
                       table's shard (DTensor computes it whole, docs/design.md)
``vocab_head``         ``ColwiseParallel`` on the output Linear with a replicated output: its
                       weight split by vocabulary, the logits all-gathered into a plain tensor,
                       so the loss sees them whole; backward all-reduces its input's gradient
``vocab_loss``         the same split, the logits left a DTensor on their vocabulary shards
                       (``Shard(-1)``): the loss and its backward must run under
                       :func:`vocab_parallel_loss` (torch's ``loss_parallel``), whose
                       cross-entropy reduces each position's maximum, sum of exponentials and
                       target logit over the TP ranks; the loss comes out a replicated DTensor
=====================  ==========================================================================

The vocabulary need not divide by ``tp``: DTensor shards it unevenly (``torch.chunk``'s sizes).
An embedding and a head that share their weight (tied, GPT-2) are split alike, ``Shard(0)``, and
tied again after ``parallelize_module`` made each its own parameter; a layout that splits one of
them and not the other is refused.

Sequence-parallel layouts between blocks: the first block takes the embedding's replicated plain
tensor and keeps its own sequence shard (``Replicate → Shard(1)``, a local slice, no
communication); blocks hand each other plain local shards ``[b, s / tp, dim]``, which the
residual adds work on; the last block's output is all-gathered back into a replicated plain
tensor for the final norm and the head. The vocabulary styles keep these edges: the split
embedding's output is all-reduced, not reduce-scattered, and the head reads the whole sequence,
as torchtitan's layout does not (docs/design.md says why). The sequence length must divide by
``tp``. A sequence-parallel norm must read the block's residual stream and feed only colwise
linears, as in a pre-norm transformer block: a Linear inside the blocks that the layout leaves
whole (an MoE router) refuses the norm's DTensor with a :class:`UsageError` when it is called.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from stratagem.plan import VOCAB_STYLES, Plan
from stratagem.plan.tp_styles import is_sequence_norm
from stratagem.errors import UsageError
from stratagem.plugins.blocks import find_blocks

__all__ = ["apply_tensor_parallel", "check_tp_layout_given", "match_tp_layout", "reduce_norm_grads_once",
           "reduce_partial_grads",
           "unmatched_tp_patterns", "vocab_parallel_loss"]

log = logging.getLogger(__name__)



def _instance_of(kind: type[nn.Module]) -> Callable[[nn.Module], bool]:
    return lambda module: isinstance(module, kind)


# What each style splits, and how a wrong match is named.
_KINDS: dict[str, tuple[Callable[[nn.Module], bool], str]] = {
    "colwise": (_instance_of(nn.Linear), "a Linear"), "rowwise": (_instance_of(nn.Linear), "a Linear"),
    "sequence_parallel": (is_sequence_norm, "a LayerNorm or RMSNorm"),
    "vocab_embedding": (_instance_of(nn.Embedding), "an Embedding"), "vocab_head": (_instance_of(nn.Linear), "a Linear"),
    "vocab_loss": (_instance_of(nn.Linear), "a Linear"),
}


def apply_tensor_parallel(module: nn.Module, plan: Plan, tp_mesh: DeviceMesh | None) -> None:
    """Shard ``module``'s linears, and its input embedding and output head by vocabulary (and, with
    ``plan.sequence_parallel``, run its block norms on sequence shards) over the 1-D ``tp_mesh``
    (None at ``tp = 1``) as ``plan.tp_layout`` says, in place. With ``pp > 1`` ``module`` is a
    pipeline stage, which may lack the embedding or the head.

    Raises :class:`UsageError` (before changing anything) for an empty layout, a pattern that
    matches no module, a match on the wrong side of the blocks or of the wrong kind, a width the
    TP degree does not divide, or a shared weight split one way and not the other.
    """
    if plan.tp == 1:
        log.info("tensor parallel: degree 1, nothing to shard")
        return
    styles = match_tp_layout(module, plan, stage=plan.pp > 1)
    tied = _tied_heads(module, styles)
    sequence = plan.sequence_parallel
    for fqn, style in styles.items():
        sub = module.get_submodule(fqn)
        if style == "colwise":
            parallelize_module(sub, tp_mesh, ColwiseParallel())
        elif style == "rowwise":
            output = Shard(1) if sequence else Replicate()
            parallelize_module(sub, tp_mesh, RowwiseParallel(output_layouts=output))
        elif style == "vocab_embedding":
            _split_vocab_embedding(sub, tp_mesh)
        elif style == "vocab_head":
            parallelize_module(sub, tp_mesh, ColwiseParallel(output_layouts=Replicate(), use_local_output=True))
        elif style == "vocab_loss":
            parallelize_module(sub, tp_mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
        elif sequence:
            _apply_sequence_parallel_norm(sub, tp_mesh)
    for head, embedding in tied.items():
        module.get_submodule(head).weight = module.get_submodule(embedding).weight
    if sequence:
        blocks = find_blocks(module, plan)
        _shard_sequence_between_blocks(blocks, tp_mesh, tp=plan.tp)
        _refuse_gathered_input_to_whole_linears(module, blocks, styles, plan)
    counts = {kind: sum(style in kinds for style in styles.values()) for kind, kinds in
              (("linears", ("colwise", "rowwise")), ("norms", ("sequence_parallel",)), ("vocab", VOCAB_STYLES))}
    log.info("tensor parallel over %d ranks: %d linears sharded; %d norms %s; %d modules split by vocabulary%s",
             plan.tp, counts["linears"], counts["norms"],
             "on sequence shards" if sequence else "replicated (plan.sequence_parallel is False)",
             counts["vocab"], " (a tied weight)" if tied else "")


def match_tp_layout(module: nn.Module, plan: Plan, *, stage: bool = False) -> dict[str, str]:
    """Each module FQN ``plan.tp_layout`` names, with its style, in model order. ``stage``:
    ``module`` is one pipeline stage of a model checked whole, so a vocabulary style may match
    nothing there (or the placeholder that stands for a module the stage does not run).

    Raises :class:`UsageError` when the layout is empty (with ``tp > 1``), when a pattern matches
    no module, or a match lies on the wrong side of ``plan.block_container`` (block styles inside,
    vocabulary styles outside), is not the kind of module its style splits, has a width
    ``plan.tp`` does not divide, or shares its weight with a module not split the same way.
    """
    check_tp_layout_given(plan)
    find_blocks(module, plan)  # raises unless plan.block_container names the blocks
    names = [name for name, _ in module.named_modules()]
    styles: dict[str, str] = {}
    for pattern, style in plan.tp_layout:
        regex = _pattern_regex(pattern)
        matched = [name for name in names if regex.fullmatch(name)]
        if stage and style in VOCAB_STYLES:
            matched = [name for name in matched if _KINDS[style][0](module.get_submodule(name))]
            if not matched:
                continue
        if not matched:
            raise UsageError(f"tp_layout pattern {pattern!r} ({style}) matches no module of "
                             f"{type(module).__name__}\nHINT: patterns are FQNs from the model root "
                             f"with '*' for a block index; block 0 has: {_block_zero_names(module, plan)}")
        for name in matched:
            _check_match(module.get_submodule(name), name, style, plan)
            styles[name] = style
    _check_shared_weights(module, styles)
    return {name: styles[name] for name in names if name in styles}


def unmatched_tp_patterns(module: nn.Module, plan: Plan) -> list[str]:
    """The ``plan.tp_layout`` patterns that match no module of ``module``, in layout order."""
    names = [name for name, _ in module.named_modules()]
    return [pattern for pattern, _ in plan.tp_layout
            if not any(_pattern_regex(pattern).fullmatch(name) for name in names)]


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """A layout pattern as a regex: an FQN with ``*`` for a block index."""
    return re.compile(re.escape(pattern).replace(r"\*", r"\d+"))


def check_tp_layout_given(plan: Plan) -> None:
    """Raise :class:`UsageError` when ``plan`` has ``tp > 1`` and an empty ``tp_layout``."""
    if plan.tp > 1 and not plan.tp_layout:
        raise UsageError(f"plan {plan.name} has tp={plan.tp} but an empty tp_layout, so nothing says "
                         "which modules to shard\nHINT: take the plan from the advisor, which fills "
                         "tp_layout for the model, or write the pairs yourself, e.g. "
                         "('layers.*.attention.wq', 'colwise'), ('layers.*.attention.wo', 'rowwise')")


def _block_zero_names(module: nn.Module, plan: Plan) -> str:
    prefix = f"{plan.block_container}.0"
    inner = [f"{prefix}.{name}" for name, _ in module.get_submodule(prefix).named_modules() if name]
    return ", ".join(inner) or "no submodules"


def _check_match(sub: nn.Module, name: str, style: str, plan: Plan) -> None:
    inside = name.startswith(f"{plan.block_container}.")
    if style in VOCAB_STYLES and inside:
        raise UsageError(f"tp_layout marks {name!r} {style}, inside the blocks ({plan.block_container!r}); "
                         "the vocabulary styles split the input embedding and the output head\n"
                         "HINT: use colwise or rowwise inside the blocks")
    if style not in VOCAB_STYLES and not inside:
        raise UsageError(f"tp_layout puts {name!r} ({style}) outside the blocks ({plan.block_container!r}); "
                         "outside them only the input embedding and the output head split, by vocabulary\n"
                         "HINT: name modules inside the blocks, or use vocab_embedding / vocab_head")
    kind, wanted = _KINDS[style]
    if not kind(sub):
        raise UsageError(f"tp_layout marks {name!r} {style}, which needs {wanted}, but it is a "
                         f"{type(sub).__name__}\nHINT: fix the pattern or the style")
    if style == "vocab_embedding" and (sub.max_norm is not None or sub.sparse):
        raise UsageError(f"tp_layout splits the Embedding {name!r} by vocabulary, but it "
                         f"{'renormalizes its rows (max_norm)' if sub.max_norm is not None else 'has sparse gradients'}, "
                         "which DTensor does not shard\nHINT: leave it out of tp_layout")
    width = {"colwise": "out_features", "rowwise": "in_features"}.get(style)
    if width and getattr(sub, width) % plan.tp:
        raise UsageError(f"tp={plan.tp} does not divide {name}.{width} ({getattr(sub, width)}), which "
                         f"{style} splits\nHINT: pick a tp that divides it")


def _check_shared_weights(module: nn.Module, styles: dict[str, str]) -> None:
    """Refuse a weight shared by a module the layout splits by vocabulary and one it does not: a
    tied embedding and head are both split, or neither."""
    users: dict[int, list[str]] = {}
    for name, sub in module.named_modules():
        weight = sub._parameters.get("weight")
        if weight is not None:
            users.setdefault(id(weight), []).append(name)
    for names in users.values():
        split = {styles.get(name) in VOCAB_STYLES for name in names}
        if len(names) > 1 and True in split and split != {True}:
            raise UsageError(f"{', '.join(map(repr, names))} share one weight (tied), and tp_layout splits "
                             f"them differently ({', '.join(styles.get(n, 'replicated') for n in names)})\n"
                             "HINT: split a tied embedding and head both by vocabulary (vocab_embedding, "
                             "vocab_head), or leave both out")


def _tied_heads(module: nn.Module, styles: dict[str, str]) -> dict[str, str]:
    """``{head: embedding}`` for each vocabulary-split head whose weight is a split embedding's."""
    embeddings = {id(module.get_submodule(name).weight): name for name, style in styles.items()
                  if style == "vocab_embedding"}
    return {name: embeddings[id(module.get_submodule(name).weight)] for name, style in styles.items()
            if style in ("vocab_head", "vocab_loss") and id(module.get_submodule(name).weight) in embeddings}


def vocab_parallel_loss(plan: Plan) -> AbstractContextManager:
    """The context the loss and its backward run in under ``plan``: torch's ``loss_parallel`` where
    its layout leaves the logits on vocabulary shards (``vocab_loss``), else nothing. A loss over
    the logits (cross-entropy, or ``nll_loss`` of ``log_softmax``) then runs on the shards; the
    loss is a replicated DTensor (``.full_tensor()`` for its value)."""
    if plan.tp > 1 and "vocab_loss" in plan.vocab_tp_styles:
        return loss_parallel()
    return contextlib.nullcontext()


def _split_vocab_embedding(embedding: nn.Embedding, tp_mesh: DeviceMesh) -> None:
    """Split ``embedding``'s table by rows over ``tp_mesh``; its replicated lookups all-reduced.
    DTensor (torch 2.13) computes the table's gradient whole on every rank (its
    ``embedding_dense_backward`` has no vocabulary-sharded strategy); the hook keeps this rank's
    rows of it, as FSDP does for the parameters it shards, so the gradient held is the shard."""
    parallelize_module(embedding, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    placements = embedding.weight.placements  # not the weight: FSDP replaces it, the hook goes with it
    embedding.weight.register_hook(lambda grad: grad.redistribute(placements=placements))


def _apply_sequence_parallel_norm(norm: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Run ``norm`` on its rank's sequence shard, then all-gather its output into a replicated
    DTensor (backward: reduce-scatter of the colwise consumers' partial gradients)."""
    parallelize_module(norm, tp_mesh, SequenceParallel())
    parallelize_module(norm, tp_mesh, PrepareModuleOutput(
        output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=False))


def _shard_sequence_between_blocks(blocks: list[nn.Module], tp_mesh: DeviceMesh, *, tp: int) -> None:
    """The first block slices the replicated residual stream (its first positional input) into
    sequence shards; the last one all-gathers them back. Its other inputs (rotary tables, masks,
    Hugging Face's keyword arguments) pass through untouched."""
    blocks[0].register_forward_pre_hook(_slice_sequence(tp_mesh, tp=tp))
    parallelize_module(blocks[-1], tp_mesh, PrepareModuleOutput(
        output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True))


def _refuse_gathered_input_to_whole_linears(module: nn.Module, blocks: list[nn.Module], styles: dict[str, str],
                                            plan: Plan) -> None:
    """A pre-hook on each Linear inside the blocks that the layout leaves whole, refusing the
    all-gathered DTensor a sequence-parallel norm hands its readers: only colwise Linears take it
    (an MoE router reading the norm fails inside DTensor otherwise). The profile finds such
    readers and the search leaves SP out for them (``ModelProfile.sp_unavailable``); this catches
    a plan pinned by hand."""
    split = {id(module.get_submodule(name)) for name in styles}
    names = {id(sub): name for name, sub in module.named_modules()}
    for block in blocks:
        for sub in block.modules():
            if isinstance(sub, nn.Linear) and id(sub) not in split:
                sub.register_forward_pre_hook(_whole_linear_guard(names[id(sub)], plan))


def _whole_linear_guard(name: str, plan: Plan) -> Callable[[nn.Module, tuple], None]:
    def hook(_: nn.Module, args: tuple) -> None:
        if any(isinstance(arg, DTensor) for arg in args):
            raise UsageError(f"plan {plan.name}: sequence parallelism hands {name} a norm's all-gathered "
                             "output, which only Linears split by column (colwise) can take, and the layout "
                             f"leaves {name} whole (a router, or a Linear beside the split ones)\n"
                             "HINT: train this model without sequence_parallel (the advisor leaves it out, and "
                             "`stratagem advise` notes why)")
    return hook


def _slice_sequence(tp_mesh: DeviceMesh, *, tp: int) -> Callable[[nn.Module, tuple], tuple]:
    """A pre-hook that hands the block its rank's sequence shard of its first input (``Replicate →
    Shard(1)``: a local slice; backward all-gathers the gradient)."""
    def hook(_: nn.Module, args: tuple) -> tuple:
        x: Tensor = args[0]
        if x.size(1) % tp:
            raise UsageError(f"sequence parallelism splits the sequence over tp={tp} ranks, but the "
                             f"sequence length is {x.size(1)}\nHINT: use a sequence length divisible by {tp}")
        shard = DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False).redistribute(tp_mesh, [Shard(1)])
        return (shard.to_local(), *args[1:])
    return hook


def reduce_norm_grads_once(optimizer: torch.optim.Optimizer, plan: Plan) -> None:
    """Where ``plan.sums_norm_grads_at_step`` (SP without FSDP), sum the sequence-parallel norms'
    gradients over the TP ranks in one all-reduce before each ``optimizer.step()`` (a step pre-hook).

    A norm run on sequence shards leaves its weight's gradient ``Partial`` (each rank's tokens'
    share), and DTensor would all-reduce it again for every optimizer operator that reads it
    (AdamW: three per weight per step). Megatron-LM sums these gradients once per step, coalesced
    (``finalize_model_grads``); so does this hook. FSDP reduces them with the rest of a unit."""
    if plan.sums_norm_grads_at_step and not getattr(optimizer, "_stratagem_norm_grads", False):
        optimizer.register_step_pre_hook(_reduce_partial_grads)
        optimizer._stratagem_norm_grads = True  # type: ignore[attr-defined]  # registered once


def _reduce_partial_grads(optimizer: torch.optim.Optimizer, *_: object) -> None:
    reduce_partial_grads(param for group in optimizer.param_groups for param in group["params"])


def reduce_partial_grads(params: Iterable[nn.Parameter]) -> None:
    """Replace each summed-but-unreduced gradient on a 1-D mesh among ``params`` by its sum, one
    all-reduce per mesh and dtype (a sequence-parallel norm's, before anything reads it)."""
    groups: dict[tuple[DeviceMesh, torch.dtype], list[nn.Parameter]] = {}
    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor) and grad.device_mesh.ndim == 1 and grad.placements == (Partial("sum"),):
            groups.setdefault((grad.device_mesh, grad.dtype), []).append(param)
    for (mesh, _), params in groups.items():
        flat = torch.cat([param.grad.to_local().reshape(-1) for param in params])
        dist.all_reduce(flat, group=mesh.get_group())
        for param, summed in zip(params, flat.split([param.grad.to_local().numel() for param in params])):
            param.grad = DTensor.from_local(summed.view_as(param.grad.to_local()), mesh, (Replicate(),),
                                            run_check=False)
