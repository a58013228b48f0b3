"""How a model's pipeline stages are built, by removal or by tracing, and what traced stages
cannot take.

The advisor reads this to offer only pipeline plans the engine runs, and the plugins read it to
build the stages, so neither re-derives the other's decision. It imports torch only to recognize
a model, so the advisor's search stays torch-free. A model class declares its own convention as a
class attribute ``pipeline_removal`` (the reference :class:`~stratagem.models.Transformer` does);
:mod:`stratagem.plugins.pipeline` says what each way of building does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

__all__ = ["HF_DECODERS", "TIED_OFFLOAD", "TRACED_STAGE_LIMITS", "RemovalConvention", "removal_convention",
           "tied_copies_allow", "tied_weights", "traced_stages_allow"]


@dataclass(frozen=True)
class RemovalConvention:
    """How a model's stages are built by removal: the modules that run before the blocks
    (``embed``) and after them (``head``), by FQN, and what replaces them on a stage that does
    not run them: None (the model's forward skips a None module) or ``nn.Identity`` (the
    forward calls it unconditionally, and identity is what the stage needs). ``hf_output``: the
    forward returns a Hugging Face ``ModelOutput``; the stage returns its ``logits`` (hidden
    states on stages without the head) and runs without a KV cache."""

    embed: tuple[str, ...]
    head: tuple[str, ...]
    identity: bool = False
    hf_output: bool = False


_SEQUENTIAL = RemovalConvention(embed=(), head=())
# Hugging Face decoders whose forward (read for transformers 5.x) is embed_tokens → layers →
# norm → lm_head with nothing else on the hidden states between them; others (Gemma scales the
# embeddings, GPT-2 adds position embeddings) would be split wrongly, so they are traced.
HF_DECODERS = ("llama", "mistral", "qwen2", "qwen3")
_HF_DECODER = RemovalConvention(embed=("model.embed_tokens",), head=("model.norm", "lm_head"),
                                identity=True, hf_output=True)


def removal_convention(module: nn.Module, *, block_container: str | None) -> RemovalConvention | None:
    """How ``module``'s stages (split at the children of ``block_container``) are built by
    removal, or None when they are traced."""
    from torch import nn

    declared = getattr(type(module), "pipeline_removal", None)
    if isinstance(declared, RemovalConvention):
        return declared
    if isinstance(module, nn.Sequential) and block_container == "":
        return _SEQUENTIAL
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    if model_type in HF_DECODERS and block_container == "model.layers" and hasattr(module, "lm_head"):
        return _HF_DECODER
    return None


def tied_weights(module: nn.Module, *, block_container: str | None) -> tuple[tuple[tuple[str, ...], ...], str | None]:
    """The parameters ``module`` ties between what runs before its blocks and what runs after
    them on stages built by removal (GPT-2's embedding and head: ``("tok_embeddings.weight",
    "output.weight")``), by their names, of which the first and last stage each hold a copy kept
    equal (:class:`~stratagem.plugins.pipeline.Pipeline`, as Megatron-LM keeps its embedding's);
    and why stages cannot keep the model's shared parameters, or None: one shared between blocks,
    or between a block and anything else, would be split, and so would a tie between traced
    stages (where tracing puts what lies outside the blocks is the trace's to say)."""
    convention = removal_convention(module, block_container=block_container)
    prefix = f"{block_container}." if block_container else ""

    def part(name: str) -> str:
        if block_container is not None and name.startswith(prefix):
            return prefix + name[len(prefix):].split(".", 1)[0]  # the block
        for side in ("embed", "head"):
            if convention is not None and any(name.startswith(f"{fqn}.") for fqn in getattr(convention, side)):
                return side
        return name

    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    parts = [(tuple(group), {part(n) for n in group}) for group in names.values() if len(group) > 1]
    tied = tuple(group for group, where in parts if where == {"embed", "head"})
    split = next((group for group, where in parts if len(where) > 1 and where != {"embed", "head"}), None)
    if split:
        return tied, f"{' and '.join(split)} are one shared parameter (tied weights) that stages would split"
    return tied, None


TIED_OFFLOAD = ("CPU offload of a pipeline's tied weights (the first and last stage's copies are summed on "
                "the device)")
"""Why a pipeline plan with offloaded parameters cannot train a model with tied weights."""


def tied_copies_allow(*, pp: int, offload: str) -> bool:
    """Whether a plan's ``pp`` and ``offload`` let the first and last stage keep tied copies
    (see :data:`TIED_OFFLOAD`)."""
    return pp == 1 or offload != "params"


TRACED_STAGE_LIMITS = ("traced pipeline stages take neither tensor parallelism nor per-block activation "
                       "checkpointing or compilation")
"""Why a traced stage refuses a plan: it calls no submodule ``forward``."""


def traced_stages_allow(*, tp: int, activation_checkpointing: str, compile: bool = False) -> bool:
    """Whether traced stages take a plan's ``tp``, ``activation_checkpointing`` and ``compile``
    (see :data:`TRACED_STAGE_LIMITS`)."""
    return tp == 1 and activation_checkpointing == "none" and not compile
