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

__all__ = ["HF_DECODERS", "TRACED_STAGE_LIMITS", "RemovalConvention", "removal_convention", "traced_stages_allow"]


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


TRACED_STAGE_LIMITS = ("traced pipeline stages take neither tensor parallelism nor per-block activation "
                       "checkpointing or compilation")
"""Why a traced stage refuses a plan: it calls no submodule ``forward``."""


def traced_stages_allow(*, tp: int, activation_checkpointing: str, compile: bool = False) -> bool:
    """Whether traced stages take a plan's ``tp``, ``activation_checkpointing`` and ``compile``
    (see :data:`TRACED_STAGE_LIMITS`)."""
    return tp == 1 and activation_checkpointing == "none" and not compile
