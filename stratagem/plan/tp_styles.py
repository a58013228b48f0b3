"""The tensor-parallel layout's vocabulary (``Plan.tp_layout``): its styles, the check of a layout,
and what a layout splits inside the blocks and outside them (docs/design.md, "Tensor parallelism
and checkpointing")."""

from __future__ import annotations

import functools
from typing import Any

from stratagem.errors import UsageError
from stratagem.plan.checks import check_choice, shown

# Inside the blocks — colwise: split a Linear's outputs; rowwise: split its inputs and all-reduce
# (or, with sequence parallelism, reduce-scatter) the result; sequence_parallel: a norm run on
# sequence shards. Hugging Face's ``base_model_tp_plan`` names them so.
BLOCK_STYLES = ("colwise", "rowwise", "sequence_parallel")
# Outside the blocks — vocab_embedding: the input Embedding's table split by vocabulary rows, the
# lookups all-reduced (Hugging Face's ``embedding_rowwise``); vocab_head: the output head's
# Linear split by vocabulary (its outputs), the logits gathered (``colwise_gather_output``);
# vocab_loss: the head split so, its logits left on their vocabulary shards for a loss that runs
# on them (torch's ``loss_parallel``: Megatron-LM's vocabulary-parallel cross-entropy).
VOCAB_STYLES = ("vocab_embedding", "vocab_head", "vocab_loss")
TP_STYLES = (*BLOCK_STYLES, *VOCAB_STYLES)


def is_sequence_norm(module: object) -> bool:
    """Whether ``module`` is a norm the ``sequence_parallel`` style runs on sequence shards: one
    over each token's features alone, torch's ``LayerNorm`` and ``RMSNorm`` and the classes models
    name so (Hugging Face's ``LlamaRMSNorm``, ``T5LayerNorm``)."""
    return type(module).__name__.endswith(("LayerNorm", "RMSNorm"))


@functools.lru_cache(maxsize=64)
def check_tp_layout(layout: Any) -> None:
    """``layout`` is a tuple of ``(pattern, style)`` string pairs with known styles (once per layout:
    the search shares one across plans; ``check_tp_layout.__wrapped__`` checks a list)."""
    if not isinstance(layout, (tuple, list)):
        raise UsageError(f"Plan.tp_layout must be a list of [pattern, style] pairs, got {shown(layout)}")
    for pair in layout:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(s, str) for s in pair)):
            raise UsageError(f"Plan.tp_layout entry {shown(pair)} is not a [pattern, style] pair of strings")
        check_choice(f"Plan.tp_layout style of {pair[0]!r}", pair[1], TP_STYLES)


@functools.lru_cache(maxsize=256)
def block_styles(layout: tuple[tuple[str, str], ...], container: str | None) -> dict[str, str]:
    """``layout``'s styles by module name inside a block (``layers.*.attention.wq`` → ``attention.wq``)."""
    prefix = f"{container}.*."
    return {pattern[len(prefix):]: style for pattern, style in layout if pattern.startswith(prefix)}


@functools.lru_cache(maxsize=256)
def vocab_styles(layout: tuple[tuple[str, str], ...]) -> frozenset[str]:
    """The :data:`VOCAB_STYLES` ``layout`` applies: whether it splits the input embedding and the
    output head by vocabulary, and the loss with the head (``vocab_loss``, which splits the head as
    ``vocab_head`` does: both are named)."""
    styles = frozenset(style for _, style in layout if style in VOCAB_STYLES)
    return styles | {"vocab_head"} if "vocab_loss" in styles else styles
