"""Tensor and sequence parallelism from the Plan's ``tp_layout``, with DTensor's ``parallelize_module``.

The layout is applied as given, never discovered here: each ``(pattern, style)`` pair names
modules by FQN relative to the model root, ``*`` standing for a block index
(``"layers.*.attention.wq"``). Every pattern must match at least one module, and every match must
lie inside ``plan.block_container``: the embedding, the final norm and the output head stay
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
=====================  ==========================================================================

Sequence-parallel layouts between blocks: the first block takes the embedding's replicated plain
tensor and keeps its own sequence shard (``Replicate → Shard(1)``, a local slice, no
communication); blocks hand each other plain local shards ``[b, s / tp, dim]``, which the
residual adds work on; the last block's output is all-gathered back into a replicated plain
tensor for the final norm and the head. The sequence length must divide by ``tp``. A
sequence-parallel norm must read the block's residual stream and feed only colwise linears, as in
a pre-norm transformer block.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from stratagem.plan import Plan
from stratagem.errors import UsageError
from stratagem.plugins.blocks import find_blocks

__all__ = ["apply_tensor_parallel", "check_tp_layout_given", "match_tp_layout", "unmatched_tp_patterns"]

log = logging.getLogger(__name__)

_NORMS = (nn.LayerNorm, nn.RMSNorm)


def apply_tensor_parallel(module: nn.Module, plan: Plan, tp_mesh: DeviceMesh | None) -> None:
    """Shard ``module``'s linears (and, with ``plan.sequence_parallel``, run its block norms on
    sequence shards) over the 1-D ``tp_mesh`` (None at ``tp = 1``) as ``plan.tp_layout`` says,
    in place.

    Raises :class:`UsageError` (before changing anything) for an empty layout, a pattern that
    matches no module, a match outside the blocks or of the wrong kind, or a width the TP degree
    does not divide.
    """
    if plan.tp == 1:
        log.info("tensor parallel: degree 1, nothing to shard")
        return
    styles = match_tp_layout(module, plan)
    sequence = plan.sequence_parallel
    for fqn, style in styles.items():
        if style == "colwise":
            parallelize_module(module.get_submodule(fqn), tp_mesh, ColwiseParallel())
        elif style == "rowwise":
            output = Shard(1) if sequence else Replicate()
            parallelize_module(module.get_submodule(fqn), tp_mesh, RowwiseParallel(output_layouts=output))
        elif sequence:
            _apply_sequence_parallel_norm(module.get_submodule(fqn), tp_mesh)
    if sequence:
        _shard_sequence_between_blocks(find_blocks(module, plan), tp_mesh, tp=plan.tp)
    norms = sum(style == "sequence_parallel" for style in styles.values())
    log.info("tensor parallel over %d ranks: %d linears sharded; %d norms %s", plan.tp, len(styles) - norms,
             norms, "on sequence shards" if sequence else "replicated (plan.sequence_parallel is False)")


def match_tp_layout(module: nn.Module, plan: Plan) -> dict[str, str]:
    """Each module FQN ``plan.tp_layout`` names, with its style, in model order.

    Raises :class:`UsageError` when the layout is empty (with ``tp > 1``), when a pattern matches
    no module, or a match lies outside ``plan.block_container``, is not a Linear (colwise,
    rowwise) or norm (sequence_parallel), or has a width ``plan.tp`` does not divide.
    """
    check_tp_layout_given(plan)
    find_blocks(module, plan)  # raises unless plan.block_container names the blocks
    names = [name for name, _ in module.named_modules()]
    styles: dict[str, str] = {}
    for pattern, style in plan.tp_layout:
        regex = _pattern_regex(pattern)
        matched = [name for name in names if regex.fullmatch(name)]
        if not matched:
            raise UsageError(f"tp_layout pattern {pattern!r} ({style}) matches no module of "
                             f"{type(module).__name__}\nHINT: patterns are FQNs from the model root "
                             f"with '*' for a block index; block 0 has: {_block_zero_names(module, plan)}")
        for name in matched:
            _check_match(module.get_submodule(name), name, style, plan)
            styles[name] = style
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
    if not name.startswith(f"{plan.block_container}."):
        raise UsageError(f"tp_layout puts {name!r} ({style}) outside the blocks ({plan.block_container!r}); "
                         "the embedding, final norm and output head stay replicated\n"
                         "HINT: name only modules inside the blocks")
    kind = _NORMS if style == "sequence_parallel" else nn.Linear
    if not isinstance(sub, kind):
        wanted = "a LayerNorm or RMSNorm" if style == "sequence_parallel" else "a Linear"
        raise UsageError(f"tp_layout marks {name!r} {style}, which needs {wanted}, but it is a "
                         f"{type(sub).__name__}\nHINT: fix the pattern or the style")
    width = {"colwise": "out_features", "rowwise": "in_features"}.get(style)
    if width and getattr(sub, width) % plan.tp:
        raise UsageError(f"tp={plan.tp} does not divide {name}.{width} ({getattr(sub, width)}), which "
                         f"{style} splits\nHINT: pick a tp that divides it")


def _apply_sequence_parallel_norm(norm: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Run ``norm`` on its rank's sequence shard, then all-gather its output into a replicated
    DTensor (backward: reduce-scatter of the colwise consumers' partial gradients)."""
    parallelize_module(norm, tp_mesh, SequenceParallel())
    parallelize_module(norm, tp_mesh, PrepareModuleOutput(
        output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=False))


def _shard_sequence_between_blocks(blocks: list[nn.Module], tp_mesh: DeviceMesh, *, tp: int) -> None:
    """The first block slices the replicated residual stream into sequence shards; the last one
    all-gathers them back. The rotary tables (second argument) pass through untouched."""
    blocks[0].register_forward_pre_hook(_sequence_divides(tp))
    parallelize_module(blocks[0], tp_mesh, PrepareModuleInput(
        input_layouts=(Replicate(), None), desired_input_layouts=(Shard(1), None), use_local_output=True))
    parallelize_module(blocks[-1], tp_mesh, PrepareModuleOutput(
        output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True))


def _sequence_divides(tp: int) -> Callable[[nn.Module, tuple], None]:
    def check(_: nn.Module, args: tuple) -> None:
        x: Tensor = args[0]
        if x.size(1) % tp:
            raise UsageError(f"sequence parallelism splits the sequence over tp={tp} ranks, but the "
                             f"sequence length is {x.size(1)}\nHINT: use a sequence length divisible by {tp}")
    return check
