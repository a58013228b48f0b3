"""Reference models: GPT-2, Llama, Mixtral, ViT and ResNet, by name through :func:`get_preset`.

Compact, readable implementations whose parameter counts equal the published models, plus tiny
variants that train on a CPU. All transformers share one :class:`TransformerConfig` and one
pre-norm :class:`Block`.
"""

from __future__ import annotations

from stratagem.models.config import TransformerConfig
from stratagem.models.feed_forward import FeedForward
from stratagem.models.moe import MoEFeedForward
from stratagem.models.presets import PRESETS, Preset, get_preset
from stratagem.models.resnet import Bottleneck, ResNet
from stratagem.models.transformer import Attention, Block, Transformer
from stratagem.models.vit import ViT

__all__ = [
    "PRESETS",
    "Attention",
    "Block",
    "Bottleneck",
    "FeedForward",
    "MoEFeedForward",
    "Preset",
    "ResNet",
    "Transformer",
    "TransformerConfig",
    "ViT",
    "get_preset",
]
